"""`make demo`: record real training runs with HindsightCallback and show what was recorded.

Two workloads on scikit-learn's digits (ships offline):
  1. a small model: checkpoints are cheap, so the policy takes one every epoch;
  2. a wide model with short epochs (~100 MB of state): checkpointing every epoch would blow the
     overhead budget, so the policy spaces checkpoints out.
For each, the same seeded training also runs without the callback to measure the wall-clock
overhead of recording side by side.
Then a CNN on the same digits trains with ShrinkCheckpoint (and one restore from a shrunken
checkpoint halfway): the demo prints each checkpoint's compression ratio and the final accuracy
next to the uncompressed run's, and plots the ratio per checkpoint.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import lightning as L
import torch
from digits import DigitsClassifier, DigitsDataModule
from digits_cnn import DigitsCNN, DigitsCNNDataModule
from probes import GradNormProbe, WeightNormProbe

import stalwart

HERE = Path(__file__).resolve().parent


def make_trainer(epochs: int, callbacks: list) -> stalwart.Trainer:
    return stalwart.Trainer(
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,  # the same for plain and recorded fits: it costs time
        deterministic=True,
    )


def fit(model_kwargs: dict, data_kwargs: dict, epochs: int, callbacks: list) -> float:
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(epochs, callbacks)
    model, data = DigitsClassifier(**model_kwargs), DigitsDataModule(**data_kwargs)
    start = time.perf_counter()
    trainer.fit(model, data)
    return time.perf_counter() - start


def replay_probes(root: Path, model_kwargs: dict, data_kwargs: dict, epochs: int, train_s: float):
    """Add two log statements after the fact and replay only what they need."""
    trainer = make_trainer(epochs, [stalwart.HindsightCallback(dirpath=root)])
    for title, probe, wanted, name in [
        ("outer-loop probe (weight norm and LR at each epoch end)", WeightNormProbe(), None,
         "weight_norm"),
        ("inner-loop probe (gradient norm per batch), epochs 4-7, 2 workers", GradNormProbe(),
         range(4, 8), "grad_norm"),
    ]:  # fmt: skip
        L.seed_everything(0, verbose=False)
        model, data = DigitsClassifier(**model_kwargs), DigitsDataModule(**data_kwargs)
        workers = 1 if wanted is None else 2
        result = trainer.replay(model, data, probe=probe, epochs=wanted, workers=workers)
        per_epoch = result.metrics(name).groupby("epoch").value.mean()
        print(f"\nreplayed {title}:")
        print(f"  {name} by epoch: {', '.join(f'{e}: {v:.3f}' for e, v in per_epoch.items())}")
        print(
            f"  {result.batches_executed} training batches executed, {result.seconds:.2f}s "
            f"({result.seconds / train_s:.0%} of the {train_s:.2f}s training), "
            f"deferred check: {len(result.mismatches)} mismatch(es)"
        )


def workload(
    title: str, root: Path, model_kwargs: dict, data_kwargs: dict, epochs: int, reps: int = 3
) -> float:
    print(f"\n=== {title} ===")
    # Plain and recorded fits alternate, so a machine that slows down mid-demo slows both.
    plains, recordeds, policy_figures = [], [], []
    # Which goes first alternates too: a fit right after another one runs on warmer caches.
    for rep in range(reps):
        for with_record in (rep % 2 == 1, rep % 2 == 0):
            if not with_record:
                plains.append(fit(model_kwargs, data_kwargs, epochs, []))
                continue
            callback = stalwart.HindsightCallback(dirpath=root)
            recordeds.append(fit(model_kwargs, data_kwargs, epochs, [callback]))
            policy_figures.append(callback.policy.overhead)
    ratios = sorted(r / p - 1 for p, r in zip(plains, recordeds, strict=True))
    plain, recorded = statistics.median(plains), statistics.median(recordeds)
    run = stalwart.hindsight.open(root).run()
    decisions = run.decisions()
    checkpoints = run.checkpoints()
    size = checkpoints[-1].nbytes / 2**20 if checkpoints else 0.0
    print(f"run {run.name} recorded in {root}/ (store: {root / 'hindsight.db'})")
    print(f"metrics logged: {', '.join(run.metric_names())}")
    names = [str(c.path.relative_to(root)) for c in checkpoints]
    print(f"checkpoints ({size:.1f} MB each): {names}")
    print(
        "policy decisions per epoch (seconds): M_est = the cost the policy decided on, main = "
        "main-thread cost of the checkpoint taken, background = what background writes took from "
        "training (their measured slowdown of the epochs they ran in; a writer thread's CPU "
        "time until four clean epochs exist), "
        "C = compute"
    )
    table = decisions.rename(
        columns={"materialize_cost": "M_est", "measured_cost": "main", "interference": "background"}
    ).assign(C=decisions.compute_time, ckpt=decisions.checkpoint.map({1: "yes", 0: "-"}))
    columns = ["epoch", "n", "k", "M_est", "main", "background", "C", "threshold", "ckpt"]
    print(table[columns].to_string(index=False, float_format=lambda v: f"{v:.4f}", na_rep="-"))
    print(
        f"wall clock, {reps} interleaved fits each: plain {plain:.2f}s, recorded {recorded:.2f}s "
        f"(medians) -> overhead {statistics.median(ratios):+.1%} (per pair {ratios[0]:+.1%} .. "
        f"{ratios[-1]:+.1%}); the record's own figure: {statistics.median(policy_figures):.2%} "
        f"of training compute (checkpoints, start/finish and log capture; budget "
        f"{run.config['epsilon']:.2%})"
    )
    val = run.metrics("val_acc").groupby("epoch").value.mean()
    print(f"val_acc by epoch (from the store): {', '.join(f'{v:.3f}' for v in val)}")
    return recorded


def held_out_accuracy(model: DigitsCNN, data: DigitsCNNDataModule) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for loader in (data.val_dataloader(), data.test_dataloader()):
            for x, y in loader:
                correct += int((model(x).argmax(-1) == y).sum())
                total += y.numel()
    return correct / total


def shrink_workload(root: Path, epochs: int = 15) -> None:
    print("\n=== 3. shrunken checkpoints (ShrinkCheckpoint), digits CNN ===")
    quiet = {"logger": False, "enable_model_summary": False, "enable_progress_bar": False}
    L.seed_everything(0, verbose=False)
    data = DigitsCNNDataModule()
    plain = DigitsCNN(max_epochs=epochs)
    plain_dir = root / "torch_save"
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=plain_dir, save_top_k=-1)
    L.Trainer(max_epochs=epochs, callbacks=[checkpoint], **quiet).fit(plain, data)
    plain_bytes = sum(p.stat().st_size for p in plain_dir.glob("*.ckpt"))
    L.seed_everything(0, verbose=False)
    reports = []
    resume_from = None
    for end in (epochs // 2, epochs):  # stop halfway; a new Trainer resumes from the file
        callback = stalwart.ShrinkCheckpoint(dirpath=root / "shrunk")
        model = DigitsCNN(max_epochs=epochs)
        trainer = L.Trainer(max_epochs=end, callbacks=[callback], **quiet)
        trainer.fit(model, data, ckpt_path=resume_from)
        reports += callback.reports
        resume_from = callback.last_model_path or callback._last_checkpoint_saved
    print(f"{'epoch':>5} {'kind':8} {'weights':>8} {'whole':>6} {'degr.':>7} {'s':>5}  config")
    for epoch, r in enumerate(reports):
        degradation = "-" if r.degradation is None else f"{r.degradation:+.3f}"
        config = "lossless" if r.config is None else r.config.describe()
        print(f"{epoch:5d} {r.kind:8} {r.ratio:7.1f}x {r.total_ratio:5.1f}x {degradation:>7} "
              f"{r.seconds:5.2f}  {config}")  # fmt: skip
    weights = sum(r.weight_bytes for r in reports) / sum(r.weight_stored for r in reports)
    # What the disk holds: every file in the folder, not the reports' own byte counts.
    whole = sum(p.stat().st_size for p in (root / "shrunk").iterdir() if p.is_file())
    moments = sorted({r.optimizer.setting.describe() for r in reports if r.optimizer})
    print(f"weights {weights:.1f}x smaller over {len(reports)} checkpoints; whole checkpoint "
          f"folders (AdamW state included: {'; '.join(moments) or 'lossless'}) "
          f"{plain_bytes / 1e6:.1f} MB with torch.save vs {whole / 1e6:.2f} MB shrunken "
          f"({plain_bytes / whole:.1f}x)")  # fmt: skip
    before, after = held_out_accuracy(plain, data), held_out_accuracy(model, data)
    print(f"held-out accuracy: uncompressed {before:.4f}, trained through a restore from a "
          f"shrunken checkpoint {after:.4f} ({(after - before) / before:+.2%})")  # fmt: skip
    figure = root / "ratios.png"
    plot_ratios(reports, figure)
    print(f"compression ratio per checkpoint: {figure}; inspect: stalwart shrink inspect "
          f"{root / 'shrunk'}")  # fmt: skip


def plot_ratios(reports: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    colours = ["tab:orange" if r.kind == "keyframe" else "tab:blue" for r in reports]
    ax.bar(range(len(reports)), [r.ratio for r in reports], color=colours)
    ax.set_xlabel("checkpoint (orange: keyframe, blue: delta)")
    ax.set_ylabel("weights: raw / stored")
    ax.set_title("ShrinkCheckpoint compression per checkpoint, digits CNN")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=HERE.parent / "demo_runs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.root.exists():
        shutil.rmtree(args.root)  # the demo's own output folder, recreated each time
    small = ({"width": 256}, {"batch_size": 32})
    recorded = workload(
        "1. small state, every epoch affordable", args.root / "small", *small, epochs=12
    )
    replay_probes(args.root / "small", *small, epochs=12, train_s=recorded)
    workload(
        "2. large state, short epochs: the policy spaces checkpoints out",
        args.root / "large",
        {"width": 2048, "depth": 4},
        {"batch_size": 64, "train_size": 512},
        epochs=12,
    )
    shrink_workload(args.root / "shrink")
    print(f"\nQuery later: stalwart runs {args.root / 'small'}")


if __name__ == "__main__":
    main()
