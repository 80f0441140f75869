"""What hindsight's checkpoint writers cost GPU training (needs a CUDA device; docs/gpu.md).

Part 1 (``--submit``): the main-thread cost of submitting one checkpoint of a state already on the
GPU, nothing else queued on the device: the fork materializer (pinned host copy, then fork) and
the inline one, 3 reps each, for 10 MB / 100 MB / 1 GB; and the pinned copy alone.

Part 2 (default): the user's wall clock. An MLP (``--width`` x ``--layers``, Adam, batch
``--batch``) trains ``--steps`` steps and checkpoints its whole state (weights + Adam) every
``--every`` steps through each writer, plain training interleaved with them, ``--reps`` reps;
the wall clock includes waiting for the last write. Medians and ranges. Writers: a pinned copy
then a fork; a pinned copy written by the writer thread; the default, which probes both before
its first checkpoint and keeps the cheaper (its estimate and choice are printed); inline.

    python benchmarks/gpu_checkpoint_cost.py --submit
    python benchmarks/gpu_checkpoint_cost.py   # part 2 with its defaults (a 384 MB state)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from stalwart.hindsight.materializer import (
    ForkMaterializer,
    InlineMaterializer,
    WriteJob,
    host_snapshot,
    tensor_bytes,
)

WRITERS = {
    "fork": lambda: ForkMaterializer(small_bytes=0),
    "copy": lambda: ForkMaterializer(small_bytes=1 << 62),  # pinned copy + the writer thread
    "measured": ForkMaterializer,  # the default: its probe picks one of the two
    "inline": InlineMaterializer,
}


def submit_costs() -> None:
    for mb in (10, 100, 1000):
        state = {f"w{i}": torch.randn(mb * (1 << 20) // 40, device="cuda") for i in range(10)}
        line = [f"{mb:5d} MB"]
        for name, make in WRITERS.items():
            costs = []
            with tempfile.TemporaryDirectory() as directory:
                writer = make()
                for rep in range(3):
                    torch.cuda.synchronize()
                    costs.append(writer.submit(WriteJob(state, Path(directory) / f"{rep}.ckpt")))
                    for tensor in state.values():  # the next step changes the weights
                        tensor.add_(1e-3)
                writer.close()
            line.append(f"{name} submit {statistics.median(costs) * 1e3:7.1f} ms")
        start = time.perf_counter()
        host_snapshot(state)
        line.append(f"pinned copy alone {(time.perf_counter() - start) * 1e3:.1f} ms")
        print("  ".join(line), flush=True)


def training_wall_clock(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    model = torch.nn.Sequential(*layers).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    inputs = torch.randn(args.batch, args.width, device="cuda")

    def step() -> None:
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        optimizer.step()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    state_mb = tensor_bytes({"m": model.state_dict(), "o": optimizer.state_dict()}) / 2**20
    walls: dict[str, list[float]] = {"plain": [], **{name: [] for name in WRITERS}}
    probes: list[str] = []  # the measured writer's estimate per checkpoint and its choice
    for _ in range(args.reps):
        for name in walls:
            with tempfile.TemporaryDirectory() as directory:
                writer = WRITERS[name]() if name in WRITERS else None
                torch.cuda.synchronize()
                start = time.perf_counter()
                for index in range(args.steps):
                    step()
                    if writer is not None and (index + 1) % args.every == 0:
                        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                        if name == "measured" and writer.small_bytes is None:  # as the recorder
                            cost = writer.probe_cost(tensor_bytes(state), Path(directory))
                            chose = "copy" if writer.small_bytes else "fork"
                            probes.append(f"{cost * 1e3:.0f} ms, {chose}")
                        writer.submit(WriteJob(state, Path(directory) / f"{index}.ckpt"))
                torch.cuda.synchronize()
                if writer is not None:
                    writer.close()
                walls[name].append(time.perf_counter() - start)
    plain = statistics.median(walls["plain"])
    print(f"state {state_mb:.0f} MB, {args.steps} steps ({plain / args.steps * 1e3:.0f} ms each), "
          f"a checkpoint every {args.every}, {args.reps} interleaved reps")  # fmt: skip
    checkpoints = args.steps // args.every
    for name, values in walls.items():
        median = statistics.median(values)
        per_checkpoint = (median - plain) / checkpoints * 1e3 if name != "plain" else 0.0
        print(
            f"  {name:8s} {median:6.2f} s  {100 * (median / plain - 1):+6.1f}%  "
            f"[{min(values):.2f}, {max(values):.2f}]  {per_checkpoint:6.0f} ms/checkpoint"
        )
    print(f"  the measured writer's probe (estimate per checkpoint, choice): {probes}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--submit", action="store_true", help="part 1 instead of part 2")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA device (torch sees none)")
    if args.submit:
        submit_costs()
    else:
        training_wall_clock(args)


if __name__ == "__main__":
    main()
