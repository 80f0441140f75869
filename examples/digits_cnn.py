"""A small CNN on scikit-learn's handwritten digits: a real image workload that ships offline.

The 1797 8x8 digit images come with scikit-learn, so nothing is downloaded. The CNN has ~284k
parameters (with the defaults), enough that checkpoint compression ratios mean something, and a
15-epoch fit takes a few seconds on one CPU thread.

Run it directly for a quick check::

    python examples/digits_cnn.py --epochs 15
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch

try:
    from digits import DigitsDataModule
except ImportError:  # imported as examples.digits_cnn, e.g. from a YAML class_path
    from examples.digits import DigitsDataModule
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from stalwart.errors import ConfigurationError


class DigitsCNNDataModule(DigitsDataModule):
    """Digits as 1x8x8 images, standardised, split train / validation / test by a seed.

    The mean and standard deviation come from the training split only (one scalar each, so the
    image keeps its spatial structure). The split is a fixed permutation drawn from ``seed``.

    Args:
        batch_size: training batch size.
        val_fraction: fraction of the 1797 images held out for validation.
        seed: seed of the permutation that decides the split.
        test_fraction: fraction held out for testing.

    Example::

        dm = DigitsCNNDataModule(batch_size=64, val_fraction=0.2, seed=0)
        dm.setup()
        x, y = next(iter(dm.train_dataloader()))  # x: (64, 1, 8, 8)
    """

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.2,
        seed: int = 0,
        test_fraction: float = 0.1,
    ) -> None:
        held_out = val_fraction + test_fraction
        if not (0 < val_fraction < 1 and 0 <= test_fraction < 1 and held_out < 1):
            raise ConfigurationError(
                f"val_fraction={val_fraction} and test_fraction={test_fraction} must be in [0, 1) "
                "and leave some images for training; use e.g. val_fraction=0.2, test_fraction=0.1"
            )
        super().__init__(batch_size=batch_size)
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.seed = seed

    def setup(self, stage: str | None = None) -> None:
        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)
        y = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.seed))
        x, y = x[order], y[order]
        n_val = round(len(x) * self.val_fraction)
        n_test = round(len(x) * self.test_fraction)
        n_train = len(x) - n_val - n_test
        # Statistics from the training images only, so validation stays unseen.
        mean, std = x[:n_train].mean(), x[:n_train].std()
        x = (x - mean) / std
        self.train = TensorDataset(x[:n_train], y[:n_train])
        self.val = TensorDataset(x[n_train : n_train + n_val], y[n_train : n_train + n_val])
        self.test = TensorDataset(x[n_train + n_val :], y[n_train + n_val :])

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test, batch_size=256)


class DigitsCNN(L.LightningModule):
    """Two 3x3 convolutions and an MLP head; AdamW with cosine decay.

    Shapes: 1x8x8 -> conv(channels) -> conv(2*channels) -> maxpool -> 2*channels x 4 x 4
    -> Linear(hidden) -> Linear(10). With the defaults: 283,786 parameters.

    Args:
        channels: channels of the first convolution (the second has twice as many).
        hidden: width of the hidden linear layer.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        max_epochs: length of the cosine learning-rate schedule.

    Example::

        model = DigitsCNN(channels=32, hidden=256)
        L.Trainer(max_epochs=15).fit(model, DigitsCNNDataModule())
    """

    def __init__(
        self,
        channels: int = 32,
        hidden: int = 256,
        lr: float = 2e-3,
        weight_decay: float = 1e-4,
        max_epochs: int = 15,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.head = nn.Sequential(
            nn.Dropout(0.25),
            nn.Linear(2 * channels * 16, hidden),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(hidden, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def _evaluate(self, batch, prefix: str) -> None:
        x, y = batch
        logits = self(x)
        self.log(f"{prefix}_loss", nn.functional.cross_entropy(logits, y), prog_bar=True)
        self.log(f"{prefix}_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=max(1, self.hparams.max_epochs)
        )
        return [optimizer], [scheduler]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    L.seed_everything(args.seed)
    model = DigitsCNN(max_epochs=args.epochs)
    datamodule = DigitsCNNDataModule(seed=args.seed)
    trainer = L.Trainer(
        max_epochs=args.epochs, logger=False, enable_checkpointing=False, enable_model_summary=False
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule)
    elapsed = time.perf_counter() - start
    metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params={n_params} fit_seconds={elapsed:.1f} {metrics}")
    trainer.test(model, datamodule, verbose=True)


if __name__ == "__main__":
    main()
