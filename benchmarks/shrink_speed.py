"""How fast is the shrink codec, and what does it cost a training run?

Part 1 (codec): 100M fp32 parameters (ten 10M-element tensors with layer-like spreads) encoded
at one configuration — sketch, k-means, assignment, delta, entropy coding, file write — as a
keyframe and as a delta on it, then decoded, for each entropy coder side by side.
Target: encode < 30 s, decode < 10 s on a 2-core CPU.

Part 2 (overhead): the stdlib character transformer trained with ShrinkCheckpoint; compression
time per checkpoint (search included) against training time, expressed at one checkpoint per
60 s of training. Target: <= 2%.

    .venv/bin/python benchmarks/shrink_speed.py            # both parts (~5-8 min)
    .venv/bin/python benchmarks/shrink_speed.py --params 10_000_000 --epochs 2   # quick
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
    print(f"{'coder':8} {'kf enc s':>9} {'kf ratio':>9} {'delta enc s':>12} {'delta ratio':>12} "
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
            print(f"{coder:8} {key_s:9.1f} {key.ratio:8.1f}x {delta_s:12.1f} {delta.ratio:11.1f}x "
                  f"{key_dec:9.1f} {chain_dec:12.1f}", flush=True)  # fmt: skip


def overhead(epochs: int, batches: int) -> None:
    import lightning as L
    from char_lm import CharTransformer, StdlibTextDataModule
    from lightning.pytorch.callbacks import Callback

    from stalwart import ShrinkCheckpoint

    torch.set_num_threads(1)

    class EpochTimer(Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self._start = time.perf_counter()

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            self.seconds.append(time.perf_counter() - self._start)

    class BatchTimer(Callback):
        """Per-batch time, split by whether ShrinkCheckpoint's gradient window was open."""

        def __init__(self, shrink_callback) -> None:
            self.shrink = shrink_callback
            self.inside: list[float] = []
            self.outside: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            elapsed = time.perf_counter() - self._start
            (self.inside if self.shrink._in_window(trainer) else self.outside).append(elapsed)

    L.seed_everything(0)
    dm = StdlibTextDataModule(batches_per_epoch=batches)
    dm.setup()
    model = CharTransformer(vocab_size=dm.vocab_size)
    timer = EpochTimer()
    with tempfile.TemporaryDirectory() as tmp:
        callback = ShrinkCheckpoint(dirpath=tmp, every_n_epochs=1)
        batches_timer = BatchTimer(callback)
        trainer = L.Trainer(
            max_epochs=epochs, callbacks=[timer, batches_timer, callback], logger=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=20,
        )  # fmt: skip
        trainer.fit(model, dm)
        reports = callback.reports
    # The epoch timer stops before the checkpoint is taken, so epoch time is training only.
    train_s = sum(timer.seconds)
    compress = [r.seconds for r in reports]
    print(f"\nchar transformer: {epochs} epochs x {batches} batches, {train_s:.1f} s training")
    for epoch, (r, t) in enumerate(zip(reports, timer.seconds, strict=False)):
        print(f"  epoch {epoch}: train {t:6.1f} s  compress {r.seconds:5.2f} s "
              f"(search {r.search_seconds:5.2f} s, {r.evaluations} evals)  "
              f"{r.kind:8} weights {r.ratio:5.1f}x  {r.config}")  # fmt: skip
    inside, outside = sorted(batches_timer.inside), sorted(batches_timer.outside)
    if inside and outside:
        median_in, median_out = inside[len(inside) // 2], outside[len(outside) // 2]
        print(f"median batch: {median_out * 1e3:.1f} ms outside the gradient window, "
              f"{median_in * 1e3:.1f} ms inside ({median_in / median_out:.3f}x)")  # fmt: skip
    steady = compress[1:] or compress
    steady_mean = sum(steady) / len(steady)
    print(f"compression per checkpoint: first {compress[0]:.2f} s (full search), then mean "
          f"{steady_mean:.2f} s (neighbourhood search)")  # fmt: skip
    for count in (len(compress), 60):
        # The full search runs once; amortise it over `count` checkpoints (60 = one hour).
        amortised = (compress[0] + steady_mean * (count - 1)) / count
        print(f"  over {count} checkpoints at one per 60 s of training: "
              f"{amortised:.2f} s each = {amortised / 60:.2%} (target <= 2%)")  # fmt: skip
    print(f"  at one checkpoint per epoch here: {sum(compress) / train_s:.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--coders", default="zstd,huffman,auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--skip-codec", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    args = parser.parse_args()
    if not args.skip_codec:
        codec(args.params, args.coders.split(","), args.threads)
    if not args.skip_overhead:
        overhead(args.epochs, args.batches)


if __name__ == "__main__":
    main()
