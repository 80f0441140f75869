"""What happens to DeepSpeed's pipeline communication when a stage's process dies.

Three CPU processes form DeepSpeed's pipeline grid (``PipelineParallelGrid``, 3 stages, gloo)
and its p2p layer (``deepspeed.runtime.pipe.p2p``) passes a tensor down the pipeline. Then the
middle stage is SIGKILLed and the survivors try, in turn:

1. DeepSpeed's p2p send/recv to the dead stage (stage 0 sends, stage 2 receives);
2. a torch group of the two survivors (``dist.new_group([0, 2])``);
3. a DeepSpeed pipeline grid of the two survivors, as a rebuilt engine would need;
4. what stalwart's workers do: leave the old group and form a two-rank group against a new
   prefix of the same TCPStore, then all-reduce.

Before the kill each rank reports which of the PipelineModule's layers it built: only its own
stage's, so the dead stage's layers (and optimizer state) exist nowhere else.

Each step's outcome and time are printed. The store is hosted by this (parent) process, not a
trainer, as in stalwart.

    python benchmarks/deepspeed_p2p_after_kill.py [--timeout 10]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import time
from datetime import timedelta

WORLD = 3


def _report(queue, rank: int, step: str, started: float, outcome: str) -> None:
    queue.put({"rank": rank, "step": step, "ms": round(1000 * (time.perf_counter() - started), 1),
               "outcome": outcome[:160]})  # fmt: skip


def _attempt(queue, rank: int, step: str, fn) -> bool:
    started = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # the point is to see which error, and how soon
        _report(queue, rank, step, started, f"{type(exc).__name__}: {exc}")
        return False
    _report(queue, rank, step, started, "ok")
    return True


def worker(rank: int, port: int, timeout: float, queue) -> None:
    os.environ.update(LOCAL_RANK="0", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    started = time.perf_counter()
    import deepspeed
    import deepspeed.ops
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe import p2p
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid

    _report(queue, rank, "import deepspeed", started, "ok")
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT compile on CPU
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("g0", store), rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=timeout))  # fmt: skip
    deepspeed.init_distributed(dist_backend="gloo")
    grid = PipelineParallelGrid(topology=PipeDataParallelTopology(num_pp=WORLD, num_dp=1))
    p2p.init_process_groups(grid)
    specs = [LayerSpec(torch.nn.Linear, 4, 4) for _ in range(2 * WORLD)]
    module = PipelineModule(layers=specs, topology=grid._topo, partition_method="uniform")
    held = [i for i in range(len(specs)) if module._local_start <= i < module._local_stop]
    queue.put({"rank": rank, "step": "PipelineModule layers built on this rank", "ms": 0.0,
               "outcome": f"{held} of {len(specs)} (no replica of another stage)"})  # fmt: skip
    x = torch.zeros(4)

    def forward_pass() -> None:
        if rank > 0:
            p2p.recv(x, rank - 1)
        if rank < WORLD - 1:
            p2p.send(x + 1, rank + 1)

    _attempt(queue, rank, "p2p pass, all alive", forward_pass)
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)  # let the kill land
    if rank == 0:
        _attempt(queue, rank, "p2p send to the dead stage", lambda: p2p.send(x, 1))
    else:
        _attempt(queue, rank, "p2p recv from the dead stage", lambda: p2p.recv(x, 1))
    _attempt(queue, rank, "dist.new_group([0, 2]) of the survivors",
             lambda: dist.new_group([0, 2]))  # fmt: skip
    two_stages = PipeDataParallelTopology(num_pp=WORLD - 1, num_dp=1)
    _attempt(queue, rank, "DeepSpeed grid of the 2 survivors (same default group)",
             lambda: PipelineParallelGrid(topology=two_stages))  # fmt: skip

    def reform() -> None:
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.PrefixStore("g1", store),
                                rank=0 if rank == 0 else 1, world_size=2)  # fmt: skip
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == 2

    _attempt(queue, rank, "stalwart: new 2-rank group on a new store prefix + all-reduce", reform)
    queue.put({"rank": rank, "step": "done"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=10.0, help="default group timeout (s)")
    args = parser.parse_args()
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, store.port, args.timeout, queue))
             for r in range(WORLD)]  # fmt: skip
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120 + 4 * args.timeout
    done = 0
    try:
        while done < WORLD - 1 and time.monotonic() < deadline:
            try:
                msg = queue.get(timeout=1.0)
            except Exception:
                if all(not p.is_alive() for p in procs):
                    break
                continue
            if msg["step"] == "done":
                done += 1
                continue
            print(f"rank {msg['rank']}  {msg['step']:<62} {msg['ms']:>9.1f} ms  {msg['outcome']}",
                  flush=True)  # fmt: skip
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    print(f"exit codes: {[p.exitcode for p in procs]} (rank 1 was SIGKILLed: -9)")
    sys.exit(0 if done == WORLD - 1 else 1)


if __name__ == "__main__":
    main()
