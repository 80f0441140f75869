"""Redundant-pipeline overhead, side by side in one run.

1. Per-step time of redundancy ``none`` / ``lazy`` / ``eager`` on a balanced 4-stage
   character transformer LM (4 worker processes, CPU/gloo), interleaved round by round so
   machine noise hits all three alike. Reported: median step time and the overhead vs none.
2. How to keep a replica fresh, measured: the owner ships its updated shard (parameters and
   Adam's two moment tensors, 3N floats) vs the owner ships its reduced gradient (N floats)
   and the shadow applies the same Adam step. Both over gloo between two processes.

Run: ``.venv/bin/python benchmarks/pipeline_overhead.py`` (``--rounds 5 --steps 12``).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import statistics
import time

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from stalwart.pipeline.job import PipelineJob
from stalwart.pipeline.launch import launch

LM = "stalwart.pipeline.workloads:CharLM"


def step_times(args: argparse.Namespace) -> None:
    kwargs = {"dim": args.dim, "blocks": 6, "context": 64, "max_chars": 200_000}
    variants = ("none", "lazy", "eager")
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants if r % 2 == 0 else reversed(variants):
            job = PipelineJob(
                num_stages=4, num_microbatches=args.microbatches, steps=args.steps,
                redundancy=v, workload=LM, workload_kwargs=kwargs, batch_size=args.batch,
                partition="time", optimizer="adam", lr=1e-3,
            )  # fmt: skip
            result = launch(job, timeout=600)
            times[v] += result.step_seconds[2:]  # skip warm-up steps
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{v} {statistics.median(times[v]) * 1e3:.1f} ms" for v in variants))  # fmt: skip
    base = statistics.median(times["none"])
    print("\nper-step time, median over rounds (balanced 4-stage char LM, 4 processes, gloo):")
    for v in variants:
        med = statistics.median(times[v])
        print(f"  {v:<6} {med * 1e3:8.1f} ms   overhead vs none {med / base - 1:+.1%}")


def _sync_worker(rank: int, port: int, numel: int, reps: int, out) -> None:
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    pg = ProcessGroupGloo(PrefixStore("bench", store), rank, 2, datetime.timedelta(seconds=60))
    param = torch.nn.Parameter(torch.randn(numel))
    opt = torch.optim.Adam([param], lr=1e-3)
    param.grad = torch.randn(numel)
    opt.step()  # materialise the Adam state
    results = {}
    for mode in ("shard", "gradient", "shard", "gradient"):
        pg.barrier().wait()
        start = time.perf_counter()
        for _ in range(reps):
            if mode == "shard":  # owner ships params + both moments; the shadow copies them
                state = opt.state[param]
                flat = torch.cat([param.detach(), state["exp_avg"], state["exp_avg_sq"]])
                if rank == 0:
                    pg.send([flat], 1, 0).wait()
                else:
                    pg.recv([flat], 0, 0).wait()
                    with torch.no_grad():
                        param.copy_(flat[:numel])
                        state["exp_avg"].copy_(flat[numel : 2 * numel])
                        state["exp_avg_sq"].copy_(flat[2 * numel :])
            else:  # owner ships the gradient; the shadow runs the same optimizer step
                grad = param.grad.clone()
                if rank == 0:
                    pg.send([grad], 1, 0).wait()
                else:
                    pg.recv([grad], 0, 0).wait()
                    param.grad = grad
                    opt.step()
        results.setdefault(mode, []).append((time.perf_counter() - start) / reps)
    if rank == 1:
        out.put({k: min(v) for k, v in results.items()})


def replica_sync(args: argparse.Namespace) -> None:
    print("\nreplica freshness, per optimizer step (Adam), measured on the receiving side:")
    ctx = multiprocessing.get_context("fork")
    for numel in (100_000, 1_000_000, 4_000_000):
        master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        out = ctx.Queue()
        procs = [ctx.Process(target=_sync_worker, args=(r, master.port, numel, 5, out))
                 for r in range(2)]  # fmt: skip
        for p in procs:
            p.start()
        res = out.get(timeout=300)
        for p in procs:
            p.join()
        shard, grad = res["shard"] * 1e3, res["gradient"] * 1e3
        print(
            f"  {numel * 4 / 1e6:6.1f} MB shard: ship shard+Adam state {shard:7.2f} ms (3N "
            f"floats) | ship gradient, shadow steps {grad:7.2f} ms (N floats)"
            f" -> {shard / grad:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dim", type=int, default=96)
    args = parser.parse_args()
    print("machine: 2 CPU cores shared with other jobs; numbers are noisy, ratios matter.")
    replica_sync(args)
    step_times(args)


if __name__ == "__main__":
    main()
