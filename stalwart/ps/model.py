"""The paper's small CNN on scikit-learn digits (ships offline), the default workload's model.

The parameter server moves weights and gradients as one flat float32 vector (:mod:`stalwart.flat`),
so a model is any ``nn.Module`` (see :mod:`stalwart.ps.workload`).
"""

from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Two conv layers (16 and 32 filters) with ReLU and max-pool, a ``hidden``-unit dense layer,
    25% dropout and 10 outputs: the paper's CNN, on 8x8 digits instead of 28x28 FashionMNIST.

    Args:
        hidden: units of the dense layer (the paper uses 512).

    Example:
        >>> DigitsCNN()(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """

    def __init__(self, hidden: int = 512) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 2 * 2, hidden), nn.ReLU(), nn.Dropout(0.25),
            nn.Linear(hidden, 10),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def load_digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits as ``(x_train, y_train, x_test, y_test)``: 1437 / 360 images, shape (n, 1, 8, 8)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    return x[:1437], y[:1437], x[1437:], y[1437:]
