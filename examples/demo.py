"""`make demo`: record real training runs with HindsightCallback and show what was recorded.

Two workloads on scikit-learn's digits (ships offline):
  1. a small model: checkpoints are cheap, so the policy takes one every epoch;
  2. a wide model with short epochs (~100 MB of state): checkpointing every epoch would blow the
     overhead budget, so the policy spaces checkpoints out.
For each, the same seeded training also runs without the callback to measure the wall-clock
overhead of recording side by side.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import lightning as L
import torch
from digits import DigitsClassifier, DigitsDataModule
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
        enable_progress_bar=bool(callbacks),
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
    title: str, root: Path, model_kwargs: dict, data_kwargs: dict, epochs: int
) -> float:
    print(f"\n=== {title} ===")
    plain = fit(model_kwargs, data_kwargs, epochs, [])
    recorded = fit(model_kwargs, data_kwargs, epochs, [stalwart.HindsightCallback(dirpath=root)])
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
        "main-thread cost of the checkpoint taken, background = slowdown of the epoch's batches by "
        "background writes, C = compute"
    )
    table = decisions.rename(
        columns={"materialize_cost": "M_est", "measured_cost": "main", "interference": "background"}
    ).assign(C=decisions.compute_time, ckpt=decisions.checkpoint.map({1: "yes", 0: "-"}))
    columns = ["epoch", "n", "k", "M_est", "main", "background", "C", "threshold", "ckpt"]
    print(table[columns].to_string(index=False, float_format=lambda v: f"{v:.4f}", na_rep="-"))
    spent = table.main.fillna(0).sum() + table.background.sum()
    print(
        f"checkpoint cost: {spent / table.C.sum():.2%} of compute (budget "
        f"{run.config['epsilon']:.2%}); wall clock: plain {plain:.2f}s, recorded {recorded:.2f}s "
        f"-> overhead {recorded / plain - 1:+.1%} (one run each: noisy)"
    )
    val = run.metrics("val_acc").groupby("epoch").value.mean()
    print(f"val_acc by epoch (from the store): {', '.join(f'{v:.3f}' for v in val)}")
    return recorded


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
    print(f"\nQuery later: stalwart runs {args.root / 'small'}")


if __name__ == "__main__":
    main()
