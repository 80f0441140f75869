"""GCN on Cora with Dorylus-style bounded-staleness Gather: sync, s=0 and s=1 through
``stalwart.Trainer``, with a plot of test accuracy against wall-clock time.

Run: ``.venv/bin/python examples/gnn_cora.py [--epochs 200] [--straggler 0.005]``
(``--out gnn_cora.png`` names the figure).
(the same run from YAML: ``stalwart fit --config examples/configs/gnn_cora.yaml``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning as L

from stalwart import Trainer
from stalwart.datamodules import StaleGatherDataModule, StaleGCN


class TestAccuracyClock(L.Callback):
    """Test accuracy after every epoch, against the training wall-clock time so far."""

    def __init__(self) -> None:
        self.points: list[tuple[float, float]] = []
        self._clock = 0.0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._started = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._clock += time.perf_counter() - self._started
        self.points.append((self._clock, float(pl_module._accuracy("test_mask"))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--straggler", type=float, default=0.005, help="extra s/task, 0: none")
    parser.add_argument("--out", default="gnn_cora.png")
    args = parser.parse_args()
    curves = {}
    for staleness in ("sync", 0, 1):
        L.seed_everything(0)
        clock = TestAccuracyClock()
        dm = StaleGatherDataModule("Cora", num_intervals=8, staleness=staleness,
                                   straggler_delay=args.straggler, fallback_sbm=True)  # fmt: skip
        trainer = Trainer(max_epochs=args.epochs, callbacks=[clock], logger=False,
                          enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False)  # fmt: skip
        trainer.fit(StaleGCN(hidden=16), dm)
        seconds, accuracy = clock.points[-1]
        name = "sync" if staleness == "sync" else f"s={staleness}"
        curves[name] = clock.points
        print(f"{name:>4}: test accuracy {accuracy:.3f} after {args.epochs} epochs, {seconds:.1f}s")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curves.items():
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, label=name)
    ax.set_xlabel("training wall-clock seconds")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0.3, 0.85)
    ax.set_title("GCN on Cora, bounded-staleness Gather")
    ax.legend()
    fig.tight_layout()
    out = Path(args.out)
    tmp = out.with_name(out.stem + ".tmp" + out.suffix)
    fig.savefig(tmp)
    tmp.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
