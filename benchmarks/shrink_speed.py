"""How fast is the shrink codec, and what does it cost a training run?

Part 1 (codec): 100M fp32 parameters (ten 10M-element tensors with layer-like spreads) encoded
at one configuration — sketch, k-means, assignment, delta, entropy coding, file write — as a
keyframe and as a delta on it, then decoded, for each entropy coder side by side.
Target: encode < 30 s, decode < 10 s on a 2-core CPU.

Part 2 (overhead): the stdlib character transformer, first trained briefly without
ShrinkCheckpoint (the plain batch time), then with it, saving one checkpoint per ~60 s of training
(the step count comes from the plain batch time) for 10 checkpoints by default: a ~10-minute run,
the first checkpoint's full search included and amortised over no more than that. Printed from
that one run: compression seconds (search included) / training seconds, and the median batch time
outside and inside the gradient window against plain training. Target: <= 2%, throughput outside
the window unchanged. The PASS/FAIL line is the measured in-run share, never an extrapolation.

    .venv/bin/python benchmarks/shrink_speed.py --skip-overhead   # codec only (~3 min)
    .venv/bin/python benchmarks/shrink_speed.py --skip-codec      # overhead only (~12 min)
    .venv/bin/python benchmarks/shrink_speed.py --params 10_000_000 --checkpoints 2   # quick
    .venv/bin/python benchmarks/shrink_speed.py --throughput-ab 3   # batch time A/B (~4 min)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

import stalwart.shrink as shrink
from stalwart.shrink.partition import QuantConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

CONFIG = QuantConfig(bins=16, prune=0.1, prune_metric="magnitude", protect=0.005)


def codec(params: int, coders: list[str], threads: int) -> None:
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    per = params // 10
    weights = {
        f"layer{i}.weight": torch.randn(per, generator=generator) * (0.02 * (1 + i % 3))
        for i in range(10)
    }
    # The next checkpoint: a small step, as between two epochs late in training.
    moved = {k: v + 0.002 * torch.randn(v.shape, generator=generator) for k, v in weights.items()}
    print(f"codec: {params / 1e6:.0f}M fp32 parameters, config {CONFIG}, {threads} threads")
    print(f"{'coder':11} {'kf enc s':>9} {'kf ratio':>9} {'delta enc s':>12} {'delta ratio':>12} "
          f"{'kf dec s':>9} {'chain dec s':>12}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for coder in coders:
            start = time.perf_counter()
            key = shrink.save(weights, Path(tmp) / f"{coder}-0", config=CONFIG, coder=coder)
            key_s = time.perf_counter() - start
            start = time.perf_counter()
            delta = shrink.save(
                moved, Path(tmp) / f"{coder}-1", config=CONFIG, coder=coder, previous=key
            )
            delta_s = time.perf_counter() - start
            start = time.perf_counter()
            shrink.load(key.path)
            key_dec = time.perf_counter() - start
            start = time.perf_counter()
            shrink.load(delta.path)  # decodes the keyframe, then the delta
            chain_dec = time.perf_counter() - start
            print(f"{coder:11} {key_s:9.1f} {key.ratio:8.1f}x {delta_s:12.1f} {delta.ratio:11.1f}x "
                  f"{key_dec:9.1f} {chain_dec:12.1f}", flush=True)  # fmt: skip


def overhead(seconds_per_checkpoint: float, checkpoints: int, calibration_steps: int) -> None:
    import lightning as L
    from char_lm import CharTransformer, StdlibTextDataModule
    from lightning.pytorch.callbacks import Callback

    from stalwart import ShrinkCheckpoint

    torch.set_num_threads(1)

    class BatchTimer(Callback):
        """Per-batch training time; split by whether ShrinkCheckpoint's gradient window was open,
        and summed per epoch (an epoch ends before its checkpoint is taken)."""

        def __init__(self, shrink_callback=None) -> None:
            self.shrink = shrink_callback
            self.inside: list[float] = []
            self.outside: list[float] = []
            self.epochs: list[float] = []

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self.epochs.append(0.0)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            elapsed = time.perf_counter() - self._start
            self.epochs[-1] += elapsed
            inside = self.shrink is not None and self.shrink._in_window(trainer)
            (self.inside if inside else self.outside).append(elapsed)

    def trainer(epochs: int, callbacks: list) -> L.Trainer:
        return L.Trainer(
            max_epochs=epochs, callbacks=callbacks, logger=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
            enable_checkpointing=any(isinstance(c, ShrinkCheckpoint) for c in callbacks),
        )  # fmt: skip

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    # Plain training first (no ShrinkCheckpoint): its batch time sets how many steps make 60 s.
    L.seed_everything(0)
    dm = StdlibTextDataModule(batches_per_epoch=calibration_steps)
    dm.setup()
    plain = BatchTimer()
    trainer(1, [plain]).fit(CharTransformer(vocab_size=dm.vocab_size), dm)
    plain_batch = median(plain.outside[5:])  # the first steps warm up allocators
    steps = max(60, round(seconds_per_checkpoint / plain_batch))
    print(f"\nchar transformer: plain median batch {plain_batch * 1e3:.1f} ms -> one checkpoint "
          f"every {steps} steps (~{seconds_per_checkpoint:.0f} s of training), {checkpoints} "
          "checkpoints, ShrinkCheckpoint defaults (tau 0.05)")  # fmt: skip
    L.seed_everything(0)
    dm = StdlibTextDataModule(batches_per_epoch=steps)
    with tempfile.TemporaryDirectory() as tmp:
        callback = ShrinkCheckpoint(dirpath=tmp, every_n_epochs=1)
        timer = BatchTimer(callback)
        trainer(checkpoints, [timer, callback]).fit(CharTransformer(vocab_size=dm.vocab_size), dm)
        reports = callback.reports
    train_s = sum(timer.epochs)
    compress = [r.seconds for r in reports]
    for epoch, (r, t) in enumerate(zip(reports, timer.epochs, strict=True)):
        print(f"  checkpoint {epoch}: train {t:6.1f} s  compress {r.seconds:5.2f} s "
              f"(search {r.search_seconds:5.2f} s, {r.evaluations} scored + {r.screenings} "
              f"screened)  "
              f"{r.kind:8} weights {r.ratio:5.1f}x  {r.config}")  # fmt: skip
    outside, inside = median(timer.outside), median(timer.inside)
    print(f"median batch: {plain_batch * 1e3:.1f} ms plain, {outside * 1e3:.1f} ms with "
          f"ShrinkCheckpoint outside the gradient window ({outside / plain_batch:.3f}x), "
          f"{inside * 1e3:.1f} ms inside it ({inside / plain_batch:.3f}x)")  # fmt: skip
    share = sum(compress) / train_s
    print(f"compression {sum(compress):.2f} s / training {train_s:.1f} s in this run of "
          f"{len(compress)} checkpoints = {share:.2%} (first checkpoint's full search "
          "included)")  # fmt: skip
    steady = compress[1:]
    if steady:
        mean = sum(steady) / len(steady)
        hour = (compress[0] + mean * 59) / 60
        print(
            f"  first checkpoint {compress[0]:.2f} s (full search), then mean {mean:.2f} s "
            f"(neighbourhood): {mean / (train_s / len(compress)):.2%} per checkpoint in steady "
            f"state; extrapolated (not measured) to an hour, 60 checkpoints: "
            f"{hour / (train_s / len(compress)):.2%}"
        )
    verdict = "PASS" if share <= 0.02 else "FAIL"
    print(
        f"{verdict}: compression time, search included, {share:.2%} of training time over a "
        f"{train_s / 60:.0f}-minute run ({len(compress)} checkpoints, one per "
        f"~{seconds_per_checkpoint:.0f} s of training; target <= 2%)"
    )


def throughput_ab(steps: int, blocks: int) -> None:
    """Median batch time of plain training vs training with ShrinkCheckpoint outside its gradient
    window, in alternating blocks of one process, so that the machine's drift hits both alike."""
    import lightning as L
    from char_lm import CharTransformer, StdlibTextDataModule
    from lightning.pytorch.callbacks import Callback

    from stalwart import ShrinkCheckpoint

    torch.set_num_threads(1)

    class Outside(Callback):
        def __init__(self, shrink: ShrinkCheckpoint | None) -> None:
            self.shrink, self.seconds = shrink, []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if self.shrink is None or not self.shrink._in_window(trainer):
                self.seconds.append(time.perf_counter() - self._start)

    L.seed_everything(0)
    dm = StdlibTextDataModule(batches_per_epoch=steps)
    model = CharTransformer(vocab_size=dm.vocab_size)
    ratios = []
    print(f"\nthroughput A/B: {blocks} blocks of 2 epochs x {steps} batches each way, one model")
    with tempfile.TemporaryDirectory() as tmp:
        for block in range(blocks):
            medians = {}
            for kind in ("plain", "ShrinkCheckpoint"):
                shrink = None
                if kind == "ShrinkCheckpoint":
                    shrink = ShrinkCheckpoint(dirpath=f"{tmp}/{block}", every_n_epochs=1)
                timer = Outside(shrink)
                L.Trainer(
                    max_epochs=2, callbacks=[timer] + ([shrink] if shrink else []), logger=False,
                    enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                    num_sanity_val_steps=0, enable_checkpointing=shrink is not None,
                ).fit(model, dm)  # fmt: skip
                seconds = sorted(timer.seconds[5:])
                medians[kind] = seconds[len(seconds) // 2]
            ratios.append(medians["ShrinkCheckpoint"] / medians["plain"])
            print(f"  block {block}: median batch {medians['plain'] * 1e3:.1f} ms plain, "
                  f"{medians['ShrinkCheckpoint'] * 1e3:.1f} ms with ShrinkCheckpoint outside the "
                  f"gradient window ({ratios[-1]:.3f}x)", flush=True)  # fmt: skip
    print(f"throughput outside the window: {', '.join(f'{r:.3f}x' for r in ratios)} of plain")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--coders", default="auto,ans-grouped,ans,zstd,huffman")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--checkpoints", type=int, default=10)
    parser.add_argument("--seconds-per-checkpoint", type=float, default=60.0)
    parser.add_argument("--calibration-steps", type=int, default=40)
    parser.add_argument("--skip-codec", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument(
        "--throughput-ab", type=int, default=0, metavar="BLOCKS",
        help="only alternate plain and ShrinkCheckpoint training BLOCKS times (batch-time A/B)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.throughput_ab:
        throughput_ab(150, args.throughput_ab)
        return
    if not args.skip_codec:
        codec(args.params, args.coders.split(","), args.threads)
    if not args.skip_overhead:
        overhead(args.seconds_per_checkpoint, args.checkpoints, args.calibration_steps)


if __name__ == "__main__":
    main()
