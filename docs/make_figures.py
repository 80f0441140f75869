"""Regenerate the PNG figures of the user guide (a few minutes on 2 CPU cores).

    .venv/bin/python docs/make_figures.py            # all figures into docs/figures/
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import lightning as L
import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

from demo import plot_ratios  # noqa: E402
from digits import DigitsClassifier, DigitsDataModule  # noqa: E402
from digits_cnn import DigitsCNN, DigitsCNNDataModule  # noqa: E402
from probes import GradNormProbe  # noqa: E402

import stalwart  # noqa: E402
from stalwart.hindsight.figure import plot_metric  # noqa: E402
from stalwart.hindsight.store import HindsightStore  # noqa: E402

FIGURES = HERE / "figures"
QUIET = {"logger": False, "enable_model_summary": False, "enable_progress_bar": False}


def hindsight_period(root: Path) -> None:
    """The period the adaptive policy chooses on a large-state workload."""
    L.seed_everything(0, verbose=False)
    trainer = stalwart.Trainer(
        max_epochs=25, callbacks=[stalwart.HindsightCallback(dirpath=root)],
        enable_checkpointing=False, **QUIET,
    )  # fmt: skip
    trainer.fit(DigitsClassifier(width=2048, depth=4), DigitsDataModule(64, train_size=512))
    with HindsightStore(root) as store:
        decisions = store.run().decisions()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    taken = decisions[decisions.checkpoint.astype(bool)].epoch.to_numpy()
    gaps = [int(b - a) for a, b in zip([-1, *taken[:-1]], taken, strict=True)]
    ax.bar(taken, gaps, color="tab:blue")
    ax.set_xlim(-1, int(decisions.epoch.max()) + 1)
    ax.set_xlabel("epoch a checkpoint was taken at")
    ax.set_ylabel("epochs since the previous one")
    ax.set_title("HindsightCallback: adaptive checkpoint period (271 MB state, 6.7% budget)")
    fig.tight_layout()
    fig.savefig(FIGURES / "hindsight_period.png", dpi=120)
    plt.close(fig)


def hindsight_replay(root: Path) -> None:
    """A probe added after the fact: values recorded by a replay vs the original record."""
    L.seed_everything(0, verbose=False)
    model_args, data_args = {"width": 128}, {"batch_size": 64}
    trainer = stalwart.Trainer(
        max_epochs=10, callbacks=[stalwart.HindsightCallback(dirpath=root)],
        enable_checkpointing=False, **QUIET,
    )  # fmt: skip
    trainer.fit(DigitsClassifier(**model_args), DigitsDataModule(**data_args))
    trainer.replay(
        DigitsClassifier(**model_args), DigitsDataModule(**data_args), probe=GradNormProbe(),
        epochs=range(3, 8),
    )  # fmt: skip
    with HindsightStore(root) as store:
        plot_metric(store.run(), "train_loss", FIGURES / "hindsight_replay.png")


def shrink_ratios(root: Path) -> None:
    L.seed_everything(0, verbose=False)
    callback = stalwart.ShrinkCheckpoint(dirpath=root)
    L.Trainer(max_epochs=15, callbacks=[callback], **QUIET).fit(
        DigitsCNN(max_epochs=15), DigitsCNNDataModule()
    )
    plot_ratios(callback.reports, FIGURES / "shrink_ratios.png")


def main() -> None:
    torch.set_num_threads(1)
    FIGURES.mkdir(exist_ok=True)
    for make in (hindsight_period, hindsight_replay, shrink_ratios):
        with tempfile.TemporaryDirectory() as tmp:
            make(Path(tmp))
            print(f"{make.__name__}: done", flush=True)


if __name__ == "__main__":
    main()
