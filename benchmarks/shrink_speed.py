"""How fast is the shrink codec, and what does it cost a training run?

Part 1 (codec): 100M fp32 parameters (ten 2500x4000 matrices with layer-like spreads) encoded
at one configuration — sketch, k-means, assignment, delta, entropy coding, file write — as a
keyframe and as a delta on it, then decoded, for each entropy coder side by side. With
``--whole`` (the default) each checkpoint also carries the Adam state of those parameters (two
moments + step, ~1.2 GB in all with the weights), stored as ``compress_optimizer="auto"`` stores
it when its continuation check accepts the first rung (sparse first moment, factored second), and
then losslessly (byte-grouped) for the floor; decode returns weights and optimizer state.
Targets: whole checkpoint (~1.2 GB) encode <= 40 s, decode <= 15 s on a 2-core CPU.

Part 2 (overhead): the stdlib character transformer, first trained briefly without
ShrinkCheckpoint (the plain batch time), then with it, saving one checkpoint per ~60 s of training
(the step count comes from the plain batch time) for 10 checkpoints by default: a ~10-minute run,
the first checkpoint's full search included and amortised over no more than that. Printed from
that one run: compression seconds (search included) / training seconds, and the median batch time
outside and inside the gradient window against plain training. Target: <= 2%, throughput outside
the window unchanged. The PASS/FAIL line is the measured in-run share, never an extrapolation.
With ``--background`` (``ShrinkCheckpoint(background=True)``) the share is what training paid:
the seconds it waited in saves, plus how much slower its batches ran beside a save than alone.

    .venv/bin/python benchmarks/shrink_speed.py --skip-overhead --coders auto   # codec only
    .venv/bin/python benchmarks/shrink_speed.py --skip-codec      # overhead only (~12 min)
    .venv/bin/python benchmarks/shrink_speed.py --skip-codec --background   # saves beside training
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


def adam_state(weights: dict[str, torch.Tensor], generator: torch.Generator) -> dict:
    """An Adam ``state_dict()`` for ``weights`` late in training: a signed first moment around
    the gradient scale, a positive second moment spanning octaves, as a trained Adam's are."""
    state = {}
    for index, weight in enumerate(weights.values()):
        grad_scale = 1e-3 * torch.rand(weight.shape[0], 1, generator=generator)
        state[index] = {
            "step": torch.tensor(1000.0),
            "exp_avg": grad_scale * torch.randn(weight.shape, generator=generator),
            "exp_avg_sq": (grad_scale * torch.randn(weight.shape, generator=generator)) ** 2,
        }
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
             "amsgrad": False, "params": list(range(len(weights)))}  # fmt: skip
    return {"state": state, "param_groups": [group]}


def codec(params: int, coders: list[str], threads: int, whole: bool) -> None:
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    per = params // 10
    rows = max(1, round((per * 0.625) ** 0.5))  # 2500 x 4000 at 10M
    shape = (rows, per // rows)
    weights = {
        f"layer{i}.weight": torch.randn(shape, generator=generator) * (0.02 * (1 + i % 3))
        for i in range(10)
    }
    # The next checkpoint: a small step, as between two epochs late in training.
    moved = {k: v + 0.002 * torch.randn(v.shape, generator=generator) for k, v in weights.items()}
    variants = [("weights", None)]
    if whole:
        optimizer = {"optimizer": adam_state(weights, generator)}
        shapes = [{i: w.shape for i, w in enumerate(weights.values())}]
        variants = [("+Adam auto", "auto"), ("+Adam lossless", "lossless")]
    n = sum(w.numel() for w in weights.values())
    print(f"codec: {n / 1e6:.0f}M fp32 parameters ({len(weights)} x {shape[0]}x{shape[1]}), "
          f"config {CONFIG}, {threads} threads")  # fmt: skip
    print(
        f"{'coder':11} {'checkpoint':15} {'MB':>6} {'kf enc s':>9} {'kf ratio':>9} "
        f"{'delta enc s':>12} {'delta ratio':>12} {'kf dec s':>9} {'chain dec s':>12}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for coder in coders:
            for label, mode in variants:
                kwargs = {}
                if mode is not None:
                    # The check "auto" runs is training (Part 2 times it); here it accepts the
                    # first rung, so the codec's own cost of the most compressed form is timed.
                    kwargs = dict(extra=optimizer, compress_optimizer=mode, parameter_shapes=shapes,
                                  continue_training=lambda weights, states: 1.0)  # fmt: skip
                name = f"{coder}-{mode}"
                start = time.perf_counter()
                key = shrink.save(weights, Path(tmp) / f"{name}-0", config=CONFIG, coder=coder,
                                  **kwargs)  # fmt: skip
                key_s = time.perf_counter() - start
                start = time.perf_counter()
                delta = shrink.save(moved, Path(tmp) / f"{name}-1", config=CONFIG, coder=coder,
                                    previous=key, **kwargs)  # fmt: skip
                delta_s = time.perf_counter() - start
                start = time.perf_counter()
                shrink.load_with_extra(key.path)
                key_dec = time.perf_counter() - start
                start = time.perf_counter()
                shrink.load_with_extra(delta.path)  # decodes the keyframe, then the delta
                chain_dec = time.perf_counter() - start
                print(f"{coder:11} {label:15} {key.total_bytes / 1e6:6.0f} {key_s:9.1f} "
                      f"{key.total_bytes / key.total_stored:8.1f}x {delta_s:12.1f} "
                      f"{delta.total_bytes / delta.total_stored:11.1f}x {key_dec:9.1f} "
                      f"{chain_dec:12.1f}", flush=True)  # fmt: skip
                for path in Path(tmp).glob(f"{name}-*"):
                    path.unlink()
    if whole:
        print("targets (whole checkpoint, ~1.2 GB at 100M): encode <= 40 s, decode <= 15 s")


def overhead(
    seconds_per_checkpoint: float,
    checkpoints: int,
    calibration_steps: int,
    background: bool = False,
    threads: int = 1,
) -> None:
    import lightning as L
    from char_lm import CharTransformer, StdlibTextDataModule
    from lightning.pytorch.callbacks import Callback

    from stalwart import ShrinkCheckpoint

    torch.set_num_threads(threads)

    class BatchTimer(Callback):
        """Per-batch training time; split by whether ShrinkCheckpoint's gradient window was open,
        and summed per epoch (an epoch ends before its checkpoint is taken)."""

        def __init__(self, shrink_callback=None) -> None:
            self.shrink = shrink_callback
            self.inside: list[float] = []
            self.outside: list[float] = []
            self.epochs: list[float] = []
            # (seconds, inside the window, beside a background save) of every batch
            self.batches: list[tuple[float, bool, bool]] = []

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self.epochs.append(0.0)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            elapsed = time.perf_counter() - self._start
            self.epochs[-1] += elapsed
            inside = self.shrink is not None and self.shrink._in_window(trainer)
            (self.inside if inside else self.outside).append(elapsed)
            busy = self.shrink is not None and self.shrink.io.writer.busy()
            self.batches.append((elapsed, inside, busy))

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
    mode = "background=True" if background else "defaults"
    print(f"\nchar transformer, {threads} torch thread(s): plain median batch "
          f"{plain_batch * 1e3:.1f} ms -> one checkpoint every {steps} steps "
          f"(~{seconds_per_checkpoint:.0f} s of training), {checkpoints} checkpoints, "
          f"ShrinkCheckpoint {mode} (tau 0.05)")  # fmt: skip
    L.seed_everything(0)
    dm = StdlibTextDataModule(batches_per_epoch=steps)
    held = [0.0, 0.0]  # seconds training waited in saves; of which the fit's end (teardown)
    with tempfile.TemporaryDirectory() as tmp:
        callback = ShrinkCheckpoint(dirpath=tmp, every_n_epochs=1, background=background)
        timer = BatchTimer(callback)
        io = callback.io
        save_checkpoint, teardown = io.save_checkpoint, io.teardown

        def timed_save(*args, **kwargs):
            start = time.perf_counter()
            save_checkpoint(*args, **kwargs)
            held[0] += time.perf_counter() - start

        def timed_teardown():
            start = time.perf_counter()
            teardown()
            held[0] += time.perf_counter() - start
            held[1] += time.perf_counter() - start

        io.save_checkpoint, io.teardown = timed_save, timed_teardown
        trainer(checkpoints, [timer, callback]).fit(CharTransformer(vocab_size=dm.vocab_size), dm)
        reports = callback.reports
    train_s = sum(timer.epochs)
    compress = [r.seconds for r in reports]
    for epoch, (r, t) in enumerate(zip(reports, timer.epochs, strict=True)):
        check = r.optimizer.seconds if r.optimizer is not None else 0.0
        how = "reused" if r.optimizer is not None and r.optimizer.reused else "checked"
        print(f"  checkpoint {epoch}: train {t:6.1f} s  compress {r.seconds:5.2f} s "
              f"(search {r.search_seconds:5.2f} s, {r.evaluations} scored + {r.screenings} "
              f"screened; optimizer {how} {check:4.2f} s)  "
              f"{r.kind:8} weights {r.ratio:5.1f}x whole {r.total_ratio:5.1f}x  "
              f"{r.config}")  # fmt: skip
    outside, inside = median(timer.outside), median(timer.inside)
    print(f"median batch: {plain_batch * 1e3:.1f} ms plain, {outside * 1e3:.1f} ms with "
          f"ShrinkCheckpoint outside the gradient window ({outside / plain_batch:.3f}x), "
          f"{inside * 1e3:.1f} ms inside it ({inside / plain_batch:.3f}x)")  # fmt: skip
    share = sum(compress) / train_s
    print(f"compression {sum(compress):.2f} s / training {train_s:.1f} s in this run of "
          f"{len(compress)} checkpoints = {share:.2%} (first checkpoint's full search "
          "included)")  # fmt: skip
    if background:
        # What training paid: the time it waited in saves (each fork, the last save at the end
        # of the fit) and how much slower its batches ran beside a save than alone, batch by
        # batch in this same run (the sum of each beside-batch's excess over the alone median:
        # noise of either sign at this size, it came out -0.9 to +2.5 s in 12-save runs).
        alone = {
            window: median([t for t, into, busy in timer.batches if not busy and into == window])
            for window in (False, True)
        }
        beside = [(t, inside) for t, inside, busy in timer.batches if busy]
        slower = sum(t - alone[inside] for t, inside in beside)
        paid = held[0] + slower
        print(f"background: the saves ran {sum(compress):.2f} s beside training; training "
              f"waited {held[0]:.2f} s (forks, and {held[1]:.2f} s for the last save at the end "
              f"of the fit); {len(beside)} batches ran beside a save, median "
              f"{median([t for t, _ in beside]) * 1e3:.1f} ms against "
              f"{alone[False] * 1e3:.1f} ms alone: {slower:+.2f} s")  # fmt: skip
        print(f"training paid {paid:.2f} s / {train_s:.1f} s = {paid / train_s:.2%} for the "
              f"saves (the saves' own seconds: {share:.2%})")  # fmt: skip
        share = paid / train_s
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
    what = "training time paid for background saves" if background else "compression time"
    print(
        f"{verdict}: {what}, search included, {share:.2%} of training time over a "
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
    parser.add_argument(
        "--weights-only", action="store_true", help="codec: the weights alone, no Adam state"
    )
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument(
        "--background", action="store_true",
        help="overhead: ShrinkCheckpoint(background=True); the figure is what training paid",
    )  # fmt: skip
    parser.add_argument(
        "--train-threads", type=int, default=1, help="overhead: torch threads of training"
    )
    parser.add_argument(
        "--throughput-ab", type=int, default=0, metavar="BLOCKS",
        help="only alternate plain and ShrinkCheckpoint training BLOCKS times (batch-time A/B)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.throughput_ab:
        throughput_ab(150, args.throughput_ab)
        return
    if not args.skip_codec:
        codec(args.params, args.coders.split(","), args.threads, not args.weights_only)
    if not args.skip_overhead:
        overhead(
            args.seconds_per_checkpoint,
            args.checkpoints,
            args.calibration_steps,
            args.background,
            args.train_threads,
        )


if __name__ == "__main__":
    main()
