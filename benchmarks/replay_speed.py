"""Replay speed, side by side in one run: what a probe added after training costs.

1. Outer-loop probe (epoch-level hooks) replayed over every epoch vs retraining with the probe:
   memoized epochs restore their checkpoint and run only validation and the epoch-end hooks.
2. Inner-loop probe (a gradient norm per batch) replayed over >= 8 epochs with workers=2 vs
   workers=1 on this 2-core machine; the two replays' values must be identical.

Workload: scikit-learn's digits, an MLP trained for 20 epochs, recorded with HindsightCallback.
The default (width 128, batch 8) is bound by Lightning's per-batch Python work, which one more
thread does not speed up; ``--width 512 --batch-size 16`` is bound by matmuls, which the serial
replay already spreads over both cores with two threads, so two workers gain less there.

Run: ``.venv/bin/python benchmarks/replay_speed.py`` (``--quick`` for fewer epochs).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from digits import DigitsClassifier, DigitsDataModule  # noqa: E402

import stalwart  # noqa: E402


class EpochProbe(L.Callback):
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pl_module.log("w_norm", pl_module.net[0].weight.norm())


class GradProbe(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        pl_module.log("grad_norm", pl_module.net[0].weight.grad.norm())


WIDTH, BATCH = 128, 8


def workload():
    L.seed_everything(0, verbose=False)
    return DigitsClassifier(width=WIDTH, depth=2), DigitsDataModule(batch_size=BATCH)


def make_trainer(root: Path, epochs: int, probes=()) -> stalwart.Trainer:
    return stalwart.Trainer(
        max_epochs=epochs,
        callbacks=[stalwart.HindsightCallback(dirpath=root), *probes],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 epochs instead of 20")
    parser.add_argument("--width", type=int, default=128, help="MLP width (default 128)")
    parser.add_argument("--batch-size", type=int, default=8, help="batch size (default 8)")
    args = parser.parse_args()
    global WIDTH, BATCH
    WIDTH, BATCH = args.width, args.batch_size
    print(f"workload: digits MLP width {WIDTH}, depth 2, batch size {BATCH}; torch threads 2")
    epochs = 10 if args.quick else 20
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "runs"
        _, record_s = timed(lambda: make_trainer(root, epochs).fit(*workload()))
        run = stalwart.hindsight.open(root).run()
        print(f"recorded {epochs} epochs in {record_s:.2f}s, {len(run.checkpoints())} checkpoints")

        # 1. outer-loop probe: replay vs retraining with the probe from the start
        _, retrain_s = timed(
            lambda: make_trainer(Path(tmp) / "retrain", epochs, [EpochProbe()]).fit(*workload())
        )
        outer, outer_s = timed(
            lambda: make_trainer(root, epochs).replay(*workload(), probe=EpochProbe())
        )
        truth = stalwart.hindsight.open(Path(tmp) / "retrain").run().metrics("w_norm")
        same_outer = outer.metrics("w_norm").value.tolist() == truth.value.tolist()

        # 2. inner-loop probe over the last 8+ epochs: 2 workers vs 1
        span = range(epochs - max(8, epochs * 3 // 5), epochs)
        serial, serial_s = timed(
            lambda: make_trainer(root, epochs).replay(*workload(), probe=GradProbe(), epochs=span)
        )
        parallel, parallel_s = timed(
            lambda: make_trainer(root, epochs).replay(
                *workload(), probe=GradProbe(), epochs=span, workers=2
            )
        )
        same_inner = (
            serial.metrics("grad_norm").value.tolist()
            == parallel.metrics("grad_norm").value.tolist()
        )

    print()
    print(f"{'measurement':<48}{'seconds':>9}{'batches':>9}")
    print(f"{'retrain ' + str(epochs) + ' epochs with the outer probe':<48}{retrain_s:>9.2f}")
    print(f"{'outer-loop replay, ' + str(epochs) + ' epochs':<48}{outer_s:>9.2f}"
          f"{outer.batches_executed:>9}")  # fmt: skip
    print(f"{f'inner-loop replay, {len(span)} epochs, workers=1':<48}{serial_s:>9.2f}"
          f"{serial.batches_executed:>9}")  # fmt: skip
    print(f"{f'inner-loop replay, {len(span)} epochs, workers=2':<48}{parallel_s:>9.2f}"
          f"{parallel.batches_executed:>9}")  # fmt: skip
    print()
    print(f"outer replay speedup vs retraining: {retrain_s / outer_s:.1f}x (target >= 10x); "
          f"values equal the probed retraining: {same_outer}")  # fmt: skip
    print(f"inner replay workers=2 / workers=1: {parallel_s / serial_s:.2f}x (target <= 0.65x); "
          f"values identical: {same_inner}")  # fmt: skip
    print(f"series differing from the record: {len(serial.mismatches)} (workers=1), "
          f"{len(parallel.mismatches)} (workers=2)")  # fmt: skip


if __name__ == "__main__":
    main()
