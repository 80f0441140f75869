"""The digits workload for MosaicML Composer: a small MLP classifier on scikit-learn's digits.

``make_trainer(**overrides)`` builds the whole run, applying ``overrides`` last: the factory that
:func:`stalwart.algorithms.replay` calls with ``load_path``, ``max_duration`` and ``save_folder``.

Run it: ``python examples/composer_digits.py`` records 6 epochs into ``runs-composer`` and replays
a weight-norm probe over epochs 3..5 in two workers.
"""

from __future__ import annotations

from typing import Any

import torch
from composer import Callback, Logger, State, Trainer
from composer.models import ComposerClassifier
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def digits_loaders(batch_size: int = 128) -> tuple[DataLoader, DataLoader]:
    """Digits split 1437 train / 360 eval, features scaled to [0, 1]; the train loader shuffles
    and drops the last, short batch (Composer warns about a batch smaller than a microbatch)."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    train = DataLoader(
        TensorDataset(x[:1437], y[:1437]), batch_size=batch_size, shuffle=True, drop_last=True
    )
    evaluation = DataLoader(TensorDataset(x[1437:], y[1437:]), batch_size=360)
    return train, evaluation


def digits_model(width: int = 32) -> ComposerClassifier:
    """An MLP with dropout (so the RNG matters to every batch), as a ComposerClassifier."""
    module = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Dropout(0.2), nn.Linear(width, 10))
    return ComposerClassifier(module, num_classes=10)


def make_trainer(
    *, width: int = 32, epochs: int = 6, algorithms: list | None = None, **overrides: Any
) -> Trainer:
    """A seeded digits run: SGD with momentum, a step LR schedule, evaluation every epoch."""
    torch.manual_seed(0)  # the model's initial weights
    model = digits_model(width)
    train, evaluation = digits_loaders()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    args: dict[str, Any] = {
        "model": model,
        "train_dataloader": train,
        "eval_dataloader": evaluation,
        "eval_interval": "1ep",
        "optimizers": optimizer,
        "schedulers": scheduler,
        "step_schedulers_every_batch": False,
        "max_duration": f"{epochs}ep",
        "seed": 17,
        "algorithms": algorithms or [],
        "progress_bar": False,
        "log_to_console": False,
        "device": "cpu",
    }
    return Trainer(**{**args, **overrides})


class WeightNormProbe(Callback):
    """A probe: the L2 norm of every weight after each training batch."""

    def batch_end(self, state: State, logger: Logger) -> None:
        with torch.no_grad():
            norm = torch.linalg.vector_norm(
                torch.stack([p.norm() for p in state.model.parameters()])
            )
        logger.log_metrics({"probe/weight_norm": float(norm)})


def main() -> None:
    from stalwart.algorithms import Hindsight, replay

    def factory(**overrides: Any) -> Trainer:
        return make_trainer(algorithms=[Hindsight("runs-composer")], **overrides)

    factory().fit()
    result = replay(factory, probe=WeightNormProbe(), epochs=range(3, 6), workers=2)
    print(result.metrics("probe/weight_norm").groupby("epoch").value.last())


if __name__ == "__main__":
    main()
