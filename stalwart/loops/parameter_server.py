"""Lightning adapter of the parameter-server core: train a LightningModule with N worker
processes and a parameter server that may be SIGKILLed (see :mod:`stalwart.ps`).

The user keeps the model code: each worker process runs the module's ``training_step`` on
batches of its ``train_dataloader`` (or the datamodule's), passed through the batch transfer hooks
as Lightning's fit passes them, to produce gradients; the parameter server applies them with SGD
(the paper's setting; ``configure_optimizers`` is not called, so manual optimization is refused).
Only parameters travel through the PS: buffers (BatchNorm's running statistics) stay per worker
and are merged into the module at the end. The core is unchanged: this module only maps a
LightningModule onto :class:`stalwart.ps.PSWorkload`.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

from stalwart import durable
from stalwart.errors import ConfigurationError
from stalwart.flat import flatten, unflatten_into
from stalwart.ps.config import PSConfig
from stalwart.ps.result import PSRunResult
from stalwart.ps.runner import run_training
from stalwart.ps.worker import buffers_path
from stalwart.ps.workload import PSWorkload

#: The hooks through which Lightning hands a batch to ``training_step``, in its order.
BATCH_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
#: LightningModule hooks that Lightning's fit calls and a PS run does not: the workers run only
#: ``training_step`` (with the batch hooks and ``configure_model``) and the PS applies plain SGD.
#: A module that overrides any of them is told so once, before the run starts.
UNCALLED_HOOKS = (
    "configure_optimizers", "configure_gradient_clipping", "optimizer_step",
    "optimizer_zero_grad", "lr_scheduler_step", "on_before_optimizer_step", "on_before_zero_grad",
    "backward", "on_before_backward", "on_after_backward", "validation_step", "val_dataloader",
    "test_step", "test_dataloader", "predict_step", "predict_dataloader", "prepare_data", "setup",
    "teardown", "configure_callbacks", "on_fit_start", "on_fit_end", "on_train_start",
    "on_train_end", "on_train_epoch_start", "on_train_epoch_end", "on_train_batch_start",
    "on_train_batch_end", "on_validation_epoch_start", "on_validation_epoch_end",
    "on_save_checkpoint", "on_load_checkpoint",
)  # fmt: skip


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

    def transfer(self, model: L.LightningModule, batch: Any) -> Any:
        """``batch`` as Lightning's fit hands it to ``training_step``: through the batch hooks in
        :data:`BATCH_HOOKS` order, with ``dataloader_idx=0``, to the worker's device (the CPU).

        As in Lightning, each hook runs once: the datamodule's if it overrides it, else the
        module's (whose defaults pass the batch through and move it to the device).
        """
        for name in BATCH_HOOKS:
            owner = model
            if self.datamodule is not None and is_overridden(name, self.datamodule):
                owner = self.datamodule
            hook = getattr(owner, name)
            if name == "transfer_batch_to_device":
                batch = hook(batch, torch.device("cpu"), 0)
            else:
                batch = hook(batch, 0)
        return batch

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        batch = self.transfer(model, batch)
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
        return score(model, self.metric)


def score(model: torch.nn.Module, metric: Callable[[Any], float]) -> float:
    """``metric`` of ``model`` in eval mode without autograd; the model's mode is kept."""
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return float(metric(model))
    finally:
        model.train(training)


def prepare_module(model: L.LightningModule, lr: float = PSConfig.lr) -> None:
    """Get ``model`` ready to train through the PS, or say why it cannot be, before the run
    writes a file or starts a process; warn about what the PS run does differently from
    Lightning's fit (hooks it does not call, float32 weights). ``lr`` is the PS's SGD rate.

    Raises:
        ConfigurationError: manual optimization, or a module without parameters.
    """
    if not model.automatic_optimization:
        raise ConfigurationError(
            f"{type(model).__name__} sets automatic_optimization = False; the parameter server "
            "applies plain SGD (lr) to the gradient of the loss training_step returns, and no "
            "Lightning Trainer runs in the workers to give training_step its optimizers. Return "
            "the loss from training_step with automatic optimization to use "
            "ParameterServerTrainer."
        )
    # Lightning's fit calls this hook too: a module may build its layers there (it must be
    # idempotent), and the run's initial weights are read from them.
    model.configure_model()
    if sum(p.numel() for p in model.parameters()) == 0:
        raise ConfigurationError(
            f"{type(model).__name__} has no parameters (after configure_model()): nothing for "
            "the parameter server to train. Build the layers in __init__ or configure_model."
        )
    if next(model.buffers(), None) is not None:
        warnings.warn(
            "ParameterServerTrainer: the model's buffers (e.g. BatchNorm running statistics) do "
            "not travel through the parameter server: each worker updates its own, the accuracy "
            "timeline scores the initial ones, and fit loads the workers' final ones, merged.",
            stacklevel=3,
        )
    _warn_about_uncalled_hooks(model, lr)
    _warn_about_precision(model)


def _warn_about_uncalled_hooks(model: L.LightningModule, lr: float) -> None:
    """One warning naming every overridden hook of :data:`UNCALLED_HOOKS`: code the user wrote
    for Lightning's fit would otherwise be skipped without a word."""
    uncalled = [name for name in UNCALLED_HOOKS if is_overridden(name, model)]
    if not uncalled:
        return
    if "configure_optimizers" in uncalled:
        # Named only, never called: the hook may have side effects (freezing a backbone for
        # fine-tuning, building layers) that would change what the PS run trains.
        uncalled[uncalled.index("configure_optimizers")] = (
            f"configure_optimizers (the parameter server applies plain SGD at lr={lr:g}, "
            "PSConfig.lr, to every parameter instead)"
        )
    warnings.warn(
        f"ParameterServerTrainer does not call these hooks of {type(model).__name__}: "
        f"{', '.join(uncalled)}. Its workers run only training_step (with the batch transfer "
        "hooks and configure_model), without a Lightning Trainer; to score held-out data "
        "during the run, pass metric=.",
        stacklevel=4,
    )


def _warn_about_precision(model: L.LightningModule) -> None:
    """The PS keeps and sends weights and gradients as float32 (the wire format): parameters
    of another dtype are trained at float32 precision, and come back rounded to it."""
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()} - {"float32"})
    if dtypes:
        warnings.warn(
            f"ParameterServerTrainer: {type(model).__name__} has {', '.join(dtypes)} "
            "parameters, but the parameter server keeps and sends weights and gradients as "
            "float32: they are trained at float32 precision and come back in their own dtype, "
            "holding float32 values. Convert the module with .float() to train what runs.",
            stacklevel=4,
        )


def load_worker_buffers(model: torch.nn.Module, run_dir: str, workers: int) -> bool:
    """Load the buffers the workers wrote at the end of the run into ``model``, merged; False
    (``model`` unchanged) if none wrote any.

    Each worker's BatchNorm statistics average its own recent batches, computed with weights
    close to the committed ones. Float buffers are averaged over the workers (statistics of more
    batches, less noise; with ``momentum=None`` the pooled cumulative average);
    ``num_batches_tracked`` is summed (the batches those statistics saw); any other buffer (an
    integer or bool a module keeps) is worker 0's, as DDP broadcasts rank 0's.
    """
    paths = [buffers_path(run_dir, w) for w in range(workers)]
    saved = [durable.load_torch(path) for path in paths if os.path.exists(path)]
    if not saved:
        return False
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            values = [buffers[name] for buffers in saved]
            if values[0].is_floating_point():
                # In float64, so a buffer no worker changed comes back bit for bit.
                buffer.copy_(torch.stack([v.double() for v in values]).mean(0))
            elif name.rsplit(".", 1)[-1] == "num_batches_tracked":
                buffer.copy_(torch.stack(values).sum(0))
            else:
                buffer.copy_(values[0])
    return True


class ParameterServerTrainer:
    """Fit a LightningModule by data-parallel SGD through a parameter server that can fail.

    ``fit`` starts the store, the parameter server (or a replica chain) and ``config.workers``
    worker processes; each worker runs ``model.training_step`` on its own shuffle of the train
    dataloader and pushes the gradient. ``config.kills`` SIGKILLs the server during the run
    (``mode="stateless"``: no gradient is lost, the workers never wait). At the end ``model``
    holds the final committed weights and the workers' buffers, merged
    (:func:`load_worker_buffers`). ``model.configure_model()`` is called first, as Lightning's
    fit calls it.

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
        fields = [f.name for f in dataclasses.fields(PSConfig)]
        unknown = [name for name in overrides if name not in fields]
        if unknown:
            raise ConfigurationError(
                f"ParameterServerTrainer got {', '.join(unknown)}, which it does not take: it is "
                "not a Lightning Trainer (no callbacks, loggers, clipping or epochs in its "
                f"workers). It takes config=, metric= and the fields of PSConfig: "
                f"{', '.join(fields)}."
            )
        self.config = dataclasses.replace(config or PSConfig(), **overrides)
        self.config.validate()
        self.metric = metric

    def fit(
        self, model: L.LightningModule, datamodule: L.LightningDataModule | None = None
    ) -> PSRunResult:
        """Train ``model`` (in place) with the parameter server; what the run measured.

        ``model`` ends with the committed weights and the workers' merged buffers
        (:func:`load_worker_buffers`); ``result.final_accuracy`` is then the metric of ``model``
        as returned, while the timeline before it scored the initial buffers.
        """
        prepare_module(model, self.config.lr)
        if datamodule is not None:
            datamodule.prepare_data()  # once, in this process, as Lightning does
        result = run_training(
            self.config, workload=LightningPSWorkload(model, datamodule, self.metric)
        )
        assert result.weights is not None
        unflatten_into(model.parameters(), result.weights)
        loaded = load_worker_buffers(model, result.config.run_dir, result.config.workers)
        if loaded and self.metric is not None:
            result.final_accuracy = score(model, self.metric)
        return result
