"""Figures of a recorded run: a metric's recorded and replayed series."""

from __future__ import annotations

import os
from pathlib import Path

from stalwart.hindsight.store import Run


def plot_metric(run: Run, name: str, path: str | os.PathLike) -> Path:
    """Write a PNG of every value logged under ``name``: the record as a line, each replay as
    markers over it (where a replay reproduced the record, the markers sit on the line).

    Example::

        plot_metric(stalwart.hindsight.open("runs").run(), "val_loss", "val_loss.png")
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = run.metrics(name)
    figure, axes = plt.subplots(figsize=(8, 4.5))
    recorded = frame[frame.source == "record"]
    if not recorded.empty:
        axes.plot(recorded.step, recorded.value, label="recorded", color="tab:blue", lw=1.5)
    markers = iter("ox^sv*")
    for replay_id, replayed in frame[frame.source == "replay"].groupby("replay_id", sort=False):
        axes.plot(replayed.step, replayed.value, next(markers, "."), ms=4, ls="none",
                  label=f"replay {replay_id}")  # fmt: skip
    axes.set_xlabel("global step")
    axes.set_ylabel(name)
    axes.set_title(f"{run.name}: {name}")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
