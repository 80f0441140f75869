"""A real, small workload that ships offline: scikit-learn's handwritten digits (8x8, 1797 images).

Used by the demo, the tests and the benchmarks. ``width`` scales the model, so the same workload
can have a small checkpoint or hundreds of megabytes of state.
"""

from __future__ import annotations

import lightning as L
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class DigitsDataModule(L.LightningDataModule):
    """Digits split 1437 train / 360 validation, features scaled to [0, 1]."""

    def __init__(self, batch_size: int = 64, train_size: int = 1437) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.train_size = train_size

    def setup(self, stage: str | None = None) -> None:
        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        x, y = x[order], y[order]
        self.train = TensorDataset(x[: self.train_size], y[: self.train_size])
        self.val = TensorDataset(x[1437:], y[1437:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=256)


class DigitsClassifier(L.LightningModule):
    """An MLP with dropout, SGD with momentum and a step LR schedule: every kind of state."""

    def __init__(self, width: int = 128, depth: int = 1, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU(), nn.Dropout(0.2)]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, 10))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return [optimizer], [scheduler]
