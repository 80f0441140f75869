"""What the parameter server trains: the core's only view of a model and its data.

A :class:`PSWorkload` says how to build the model whose parameters the flat weight vector fills,
which batches a worker trains on, the loss of a batch, and (in the runner) how good a set of
committed weights is. The runner pickles it (cloudpickle) into the run directory and every
worker process loads it, so a workload carries its own data or knows how to load it.

:class:`DigitsWorkload` is the paper's CNN on scikit-learn digits (the default); the Lightning
adapter (:mod:`stalwart.loops.parameter_server`) wraps a user's LightningModule.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from stalwart.flat import flatten
from stalwart.ps.model import DigitsCNN, load_digits_split


class PSWorkload(abc.ABC):
    """The model and data of a parameter-server run.

    Example:
        >>> workload = DigitsWorkload(hidden=32)
        >>> weights = workload.initial_weights(seed=0)
        >>> x, y = next(workload.batches(worker=0, seed=0))
        >>> workload.loss(workload.model(), (x, y)).shape
        torch.Size([])
    """

    @abc.abstractmethod
    def model(self) -> nn.Module:
        """A fresh model; the PS's flat weight vector is its ``parameters()`` in order."""

    @abc.abstractmethod
    def batches(self, worker: int, seed: int) -> Iterator[Any]:
        """Worker ``worker``'s endless stream of training batches (its own shuffle order)."""

    @abc.abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The scalar training loss of ``batch`` (a worker back-propagates it)."""

    def evaluate(self, model: nn.Module) -> float | None:
        """A score of ``model`` (higher is better; the experiment's test accuracy), or None."""
        return None

    def initial_weights(self, seed: int) -> torch.Tensor:
        """The weights every run with ``seed`` starts from, as a flat float32 vector."""
        torch.manual_seed(seed)
        return flatten(self.model().parameters())


class DigitsWorkload(PSWorkload):
    """The paper's CNN (:class:`~stalwart.ps.model.DigitsCNN`) on scikit-learn digits: 1437
    training images shuffled per worker, scored by accuracy on 360 held-out images.

    Args:
        hidden: units of the CNN's dense layer.
        batch_size: images per gradient.

    Example:
        >>> DigitsWorkload(hidden=32).evaluate(DigitsCNN(32)) < 0.5
        True
    """

    def __init__(self, hidden: int = 512, batch_size: int = 32) -> None:
        self.hidden = hidden
        self.batch_size = batch_size
        # Loaded here, in the runner: workers unpickle the tensors and never import sklearn.
        self.x_train, self.y_train, self.x_test, self.y_test = load_digits_split()

    def model(self) -> nn.Module:
        return DigitsCNN(self.hidden)

    def batches(self, worker: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(seed * 1000 + worker)
        while True:
            order = torch.randperm(len(self.x_train), generator=generator)
            for start in range(0, len(order) - self.batch_size + 1, self.batch_size):
                take = order[start : start + self.batch_size]
                yield self.x_train[take], self.y_train[take]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module) -> float:
        model.eval()
        with torch.no_grad():
            return float((model(self.x_test).argmax(1) == self.y_test).float().mean())
