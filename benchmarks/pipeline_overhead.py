"""Redundant-pipeline overhead, side by side in one run.

1. Per-step time of redundancy ``none`` / ``lazy`` / ``eager`` on a balanced 4-stage character
   transformer LM (embedding + 8 blocks + head, split 2 blocks per stage by parameter count;
   4 worker processes, CPU/gloo), for each number of micro-batches M (default 2, 4, 8), the
   variants interleaved round by round so machine noise hits all alike. Printed per M: median
   step time and overhead vs none; the 1F1B bubble fraction (P-1)/(M+P-1); and, measured from
   the workers' per-instruction CPU clocks, the CPU work ratio FRC / (forward + backward) and
   the CPU utilisation of the none run. From those two follows the floor for eager on this
   machine: FRC cannot hide in idle cores that do not exist, so eager's step is at least
   (CPU work of none + FRC) / cores.
2. ``--breakdown``: CPU and wall milliseconds per instruction kind and stage, per variant.
3. ``--stages 2``: the same with P = 2, which on a 2-core machine gives every stage a core of its
   own — the setting the thesis' overhead numbers come from (one GPU per stage).
4. ``--replica-sync``: how to keep a replica fresh, measured: the owner ships its updated shard
   (parameters and Adam's two moment tensors, 3N floats) vs the owner ships its reduced gradient
   (N floats) and the shadow applies the same Adam step. Both over gloo between two processes.

Run: ``python benchmarks/pipeline_overhead.py`` (``--microbatches 2,4,8 --rounds 3 --steps 8``).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import statistics
import time
from collections import defaultdict

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from stalwart.pipeline.job import PipelineJob
from stalwart.pipeline.launch import PipelineRunResult, launch

LM = "stalwart.pipeline.workloads:CharLM"
# name -> job fields. "eager" runs FRC on idle CPU and drops what is left at the commit (no
# failure can use it then); "eager-all" finishes every FRC each step (the thesis' schedule).
# Both run FRC in a SCHED_IDLE thread per stage (the default); the "-wait" twins run it in the
# stage's own thread while that thread waits (the fallback without SCHED_IDLE).
VARIANTS = {
    "none": {"redundancy": "none"},
    "lazy": {"redundancy": "lazy"},
    **{
        name + suffix: {"redundancy": "eager", "frc_policy": policy, "frc_executor": executor}
        for suffix, executor in (("", "idle_thread"), ("-wait", "main_thread"))
        for name, policy in (("eager", "bubble"), ("eager-all", "complete"))
    },
}
WARMUP = 2  # steps not timed
COMPUTE = ("Forward", "Backward")


def _per_rank(result: PipelineRunResult, steps: range) -> dict[int, dict[str, list[float]]]:
    """rank -> op -> [cpu s, wall s, run-queue s] per step, averaged over ``steps``."""
    out: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0] * 3))
    for (step, rank), ops in result.profile.items():
        if step in steps:
            for op, (cpu, wall, _, *runq) in ops.items():
                for i, value in enumerate((cpu, wall, sum(runq))):
                    out[rank][op][i] += value / len(steps)
    return out


def step_times(args: argparse.Namespace) -> None:
    kwargs = {"dim": args.dim, "blocks": 8, "context": 64, "max_chars": 200_000}
    cores = len(os.sched_getaffinity(0))
    for m in args.microbatches:
        base = dict(
            num_stages=args.stages, num_microbatches=m, steps=args.steps, workload=LM,
            workload_kwargs=kwargs, batch_size=args.batch, partition="parameters",
            optimizer="adam", lr=1e-3, profile=True,
        )  # fmt: skip
        bounds = PipelineJob(**base).validate().bounds
        times: dict[str, list[float]] = {v: [] for v in args.variants}
        profiles: dict[str, list] = {v: [] for v in args.variants}
        for r in range(args.rounds):
            for v in args.variants if r % 2 == 0 else reversed(args.variants):
                job = PipelineJob(**base, **VARIANTS[v], bounds=bounds)
                result = launch(job, timeout=900)
                times[v] += result.step_seconds[WARMUP:]
                profiles[v].append(_per_rank(result, range(WARMUP, args.steps)))
        none = statistics.median(times["none"])
        bubble = (args.stages - 1) / (m + args.stages - 1)
        print(f"\nM={m} micro-batches, stage layers {bounds}, 1F1B bubble (P-1)/(M+P-1) "
              f"= {bubble:.0%}")  # fmt: skip
        for v in args.variants:
            med = statistics.median(times[v])
            line = f"  {v:<14} {med * 1e3:8.1f} ms/step   overhead vs none {med / none - 1:+6.1%}"
            if v.startswith("eager"):
                done, posted = _cpu_totals(profiles[v])["frc_tasks"]
                line += f"   FRC done before the commit: {done / posted:.0%} of {posted:.0f}"
                line += f"   pause {_slowest_wall(profiles[v], 'FRCPause') * 1e3:.1f} ms"
            print(line)
            blocked, queued = _blocked(profiles[v], COMPUTE), _blocked(profiles[v], COMPUTE, 2)
            print(
                f"  {'':<14} forward+backward of all stages' main threads: asleep (GIL waits) "
                f"{blocked * 1e3:.1f} ms/step, on a run queue {queued * 1e3:.1f} ms/step"
            )
        work = _cpu_totals(profiles["none"])
        work.pop("frc_tasks")
        if "eager-all" not in profiles:
            continue
        frc = _cpu_totals(profiles["eager-all"])["ForwardRedundant"]
        compute = sum(work[op] for op in COMPUTE)
        utilisation = sum(work.values()) / (cores * none)
        floor = (sum(work.values()) + frc) / cores / none - 1
        print(
            f"  measured: FRC CPU / (forward + backward) CPU = {frc / compute:.0%}; the none run "
            f"keeps {utilisation:.0%} of {cores} cores busy -> floor for eager-all on this "
            f"machine {max(0.0, floor):+.1%}"
        )
        if args.breakdown:
            for v in args.variants:
                _print_breakdown(v, profiles[v])


def _cpu_totals(profiles: list) -> dict:
    """op -> CPU seconds per step summed over ranks, median over rounds; ``frc_tasks`` ->
    (FRC finished, FRC posted) per step summed over ranks."""
    per_round = []
    for prof in profiles:
        totals: dict = defaultdict(float)
        for ops in prof.values():
            for op, (cpu, wall, _) in ops.items():
                if op == "frc_tasks":  # counts, not seconds: [finished, posted]
                    totals["frc_done"] += cpu
                    totals["frc_posted"] += wall
                else:
                    totals[op] += cpu
        per_round.append(totals)
    ops = {op for totals in per_round for op in totals}
    out = {op: statistics.median(t.get(op, 0.0) for t in per_round) for op in ops}
    out["frc_tasks"] = (out.pop("frc_done", 0.0), out.pop("frc_posted", 0.0))
    return out


def _blocked(profiles: list, ops: tuple[str, ...], field: int | None = None) -> float:
    """Seconds per step the stages' main threads spent in ``ops`` blocked (wall - CPU - run
    queue), or with ``field`` that field (2: run queue), summed over stages, median over
    rounds."""

    def part(cpu: float, wall: float, runq: float) -> float:
        return (cpu, wall, runq)[field] if field is not None else wall - cpu - runq

    return statistics.median(
        sum(part(*stage[op]) for stage in prof.values() for op in ops if op in stage)
        for prof in profiles
    )


def _slowest_wall(profiles: list, op: str) -> float:
    """Wall seconds per step spent in ``op`` by the stage that spends the most, median over
    rounds (for ``FRCPause``: how long a stage waits at the commit for the idle thread's layer
    in flight — the priority inversion the SCHED_IDLE executor could cause)."""
    return statistics.median(
        max((ops[op][1] for ops in prof.values() if op in ops), default=0.0) for prof in profiles
    )


def _print_breakdown(variant: str, profiles: list) -> None:
    print(f"    {variant}: per stage, ms per step as cpu/wall/run queue (rest of wall: blocked)")
    prof = profiles[-1]
    for rank in sorted(prof):
        ops = sorted(prof[rank].items(), key=lambda kv: -kv[1][1])
        timed = [(op, c, w, q) for op, (c, w, q) in ops if op != "frc_tasks" and w > 5e-4]
        cells = "  ".join(
            f"{op} {c * 1e3:.1f}/{w * 1e3:.1f}/{q * 1e3:.1f}" for op, c, w, q in timed
        )
        print(f"      stage {rank}: {cells}")


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


def replica_sync() -> None:
    print("\nreplica freshness, per optimizer step (Adam), measured on the receiving side:")
    ctx = multiprocessing.get_context("fork")
    for numel in (100_000, 1_000_000, 4_000_000):
        out = ctx.Queue()
        master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        procs = [ctx.Process(target=_sync_worker, args=(r, master.port, numel, 5, out))
                 for r in range(2)]  # fmt: skip
        for p in procs:
            p.start()
        res = out.get(timeout=300)
        for p in procs:
            p.join(timeout=60)
        shard, grad = res["shard"] * 1e3, res["gradient"] * 1e3
        print(
            f"  {numel * 4 / 1e6:6.1f} MB shard: ship shard+Adam state {shard:7.2f} ms (3N "
            f"floats) | ship gradient, shadow steps {grad:7.2f} ms (N floats)"
            f" -> {shard / grad:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--microbatches", default="2,4,8", type=lambda t: [int(v) for v in t.split(",")],
        help="comma-separated numbers of micro-batches per step (one table each)",
    )  # fmt: skip
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), type=lambda t: t.split(","),
        help=f"comma-separated subset of {', '.join(VARIANTS)}",
    )  # fmt: skip
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--stages", type=int, default=4,
        help="P (4: the target setting; 2 on a 2-core machine gives each stage its own core)",
    )  # fmt: skip
    parser.add_argument("--dim", type=int, default=96)
    parser.add_argument("--breakdown", action="store_true", help="per-op per-stage times")
    parser.add_argument("--replica-sync", action="store_true", help="shard vs gradient sync")
    args = parser.parse_args()
    unknown = set(args.variants) - set(VARIANTS)
    if unknown or "none" not in args.variants:
        parser.error(f"--variants must include none (unknown: {sorted(unknown)})")
    cores = len(os.sched_getaffinity(0))
    print(f"machine: {cores} CPU cores for {args.stages} stage processes; load average "
          f"{os.getloadavg()[0]:.2f} at start")  # fmt: skip
    if args.replica_sync:
        replica_sync()
    step_times(args)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
