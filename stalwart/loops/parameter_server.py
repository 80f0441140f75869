"""Lightning adapter of the parameter-server core: train a LightningModule with N worker
processes and a parameter server that may be SIGKILLed (see :mod:`stalwart.ps`).

The user keeps the model code: each worker process runs the module's ``training_step`` on
batches of its ``train_dataloader`` (or the datamodule's) to produce gradients; the parameter
server applies them with SGD (the paper's setting; ``configure_optimizers`` is not called). The
core is unchanged: this module only maps a LightningModule onto :class:`stalwart.ps.PSWorkload`.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import lightning as L
import torch

from stalwart.errors import ConfigurationError
from stalwart.flat import flatten, unflatten_into
from stalwart.ps.config import PSConfig
from stalwart.ps.result import PSRunResult
from stalwart.ps.runner import run_training
from stalwart.ps.workload import PSWorkload


class LightningPSWorkload(PSWorkload):
    """A LightningModule (and optionally a LightningDataModule) as a parameter-server workload.

    Args:
        module: the model; its current parameters are the run's initial weights.
        datamodule: where the training batches come from (else ``module.train_dataloader()``).
        metric: scores a module carrying committed weights (higher is better, e.g. validation
            accuracy); sampled by the runner for the accuracy-vs-time timeline. None: no timeline.

    Example:
        >>> workload = LightningPSWorkload(MyModule(), MyDataModule())  # doctest: +SKIP
    """

    def __init__(
        self,
        module: L.LightningModule,
        datamodule: L.LightningDataModule | None = None,
        metric: Callable[[L.LightningModule], float] | None = None,
    ) -> None:
        self.module = module
        self.datamodule = datamodule
        self.metric = metric
        self._batch_idx = 0

    def model(self) -> L.LightningModule:
        return copy.deepcopy(self.module)

    def initial_weights(self, seed: int) -> torch.Tensor:
        return flatten(self.module.parameters())

    def batches(self, worker: int, seed: int) -> Iterator[Any]:
        # A shuffling DataLoader draws its order from the global generator: one per worker.
        torch.manual_seed(seed * 1000 + worker)
        if self.datamodule is not None:
            self.datamodule.setup("fit")
            loader = self.datamodule.train_dataloader()
        else:
            loader = self.module.train_dataloader()
        while True:
            yielded = False
            for batch in loader:
                yielded = True
                yield batch
            if not yielded:
                raise ConfigurationError("the train dataloader is empty: nothing to train on.")

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        with warnings.catch_warnings():
            # No Lightning Trainer runs in a worker, so there is nowhere to log to.
            warnings.filterwarnings("ignore", message=".*self.log.*trainer.*")
            out = model.training_step(batch, self._batch_idx)
        self._batch_idx += 1
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise ConfigurationError(
                "training_step must return the loss (a tensor, or a dict with 'loss') for the "
                "parameter server to get a gradient; returning None to skip a batch is not "
                "supported."
            )
        return loss

    def evaluate(self, model: torch.nn.Module) -> float | None:
        if self.metric is None:
            return None
        model.eval()
        with torch.no_grad():
            return float(self.metric(model))


class ParameterServerTrainer:
    """Fit a LightningModule by data-parallel SGD through a parameter server that can fail.

    ``fit`` starts the store, the parameter server (or a replica chain) and ``config.workers``
    worker processes; each worker runs ``model.training_step`` on its own shuffle of the train
    dataloader and pushes the gradient. ``config.kills`` SIGKILLs the server during the run
    (``mode="stateless"``: no gradient is lost, the workers never wait). At the end ``model``
    holds the final committed weights.

    Args:
        config: the run (mode, workers, steps or duration, lr, kill schedule, run_dir, ...);
            ``hidden`` and ``batch_size`` are ignored (the model and its dataloader decide).
        metric: optional score of the committed weights (e.g. validation accuracy) sampled during
            the run for the accuracy-vs-time timeline of the result.
        **overrides: fields of :class:`~stalwart.ps.PSConfig` to set on ``config``.

    Example:
        >>> from stalwart import ParameterServerTrainer
        >>> from stalwart.ps import KillEvent
        >>> trainer = ParameterServerTrainer(mode="stateless", workers=2, steps=100,
        ...                                  kills=[KillEvent(at_gradient=80, downtime=1.0)],
        ...                                  run_dir="ps-run")  # doctest: +SKIP
        >>> result = trainer.fit(model, datamodule)  # doctest: +SKIP
        >>> result.lost, result.duplicates  # doctest: +SKIP
        (0, 0)
    """

    def __init__(
        self,
        config: PSConfig | None = None,
        metric: Callable[[L.LightningModule], float] | None = None,
        **overrides: Any,
    ) -> None:
        self.config = dataclasses.replace(config or PSConfig(), **overrides)
        self.config.validate()
        self.metric = metric

    def fit(
        self, model: L.LightningModule, datamodule: L.LightningDataModule | None = None
    ) -> PSRunResult:
        """Train ``model`` (in place) with the parameter server; what the run measured."""
        if datamodule is not None:
            datamodule.prepare_data()  # once, in this process, as Lightning does
        result = run_training(
            self.config, workload=LightningPSWorkload(model, datamodule, self.metric)
        )
        assert result.weights is not None
        unflatten_into(model.parameters(), result.weights)
        return result
