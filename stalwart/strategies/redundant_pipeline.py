"""``RedundantPipelineStrategy``: Lightning pipeline training that survives preemption.

A thin adapter over :mod:`stalwart.pipeline`. Lightning's own fit loop runs in the user's
process (the *driver*): its callbacks, ``self.log``, validation, ``ModelCheckpoint``,
``max_steps``/``max_epochs`` and early stopping all work as usual. What changes is who computes
a training step: at ``on_train_start`` the strategy forks one worker per pipeline stage (the
agent of :mod:`stalwart.pipeline.launch`, which hosts the rendezvous store); each training step
hands the batch to the workers through the store and waits for the step's loss. The workers run
the LightningModule's layers (``pipeline_layers()`` or an ``nn.Sequential`` attribute
``model``) with redundant computation and keep training through lost peers. Before validation,
before a checkpoint is saved and at the end of fit, the driver pulls the stage weights back into
the LightningModule, so ``validation_step`` and every callback see the trained model.

Why this shape: the driver is not a pipeline stage, so no stage's death can take Lightning's loop
with it, and Lightning's SIGTERM handling (which stops the whole run) lives only in the driver.
A worker that receives SIGTERM leaves — it reports itself in the store and exits — and the
others carry on. Validation runs on the full model in the driver, which needs the model to fit
in one process.

What the step does not use: the LightningModule's ``training_step``. The pipeline computes
``pipeline_loss(layers(x), y)`` (``pipeline_loss`` defaults to cross-entropy) on batches ``(x, y,
...)``, and the strategy logs each step's loss as ``train_loss`` (on step, in the progress bar),
which reaches the trainer's loggers every ``log_every_n_steps`` like any ``self.log`` value. The
module needs no ``training_step`` (the strategy lends Lightning's check a placeholder for the
length of ``fit`` and takes it back at teardown); one it has, kept for training under other
strategies, should log nothing: its ``self.log`` calls would never run, and the strategy warns when
it sees one. Log other per-step values from the module's (or a callback's) ``on_train_batch_end``,
where ``outputs["loss"]`` is the pipeline's loss. The optimizer is the one ``configure_optimizers``
returns (class and hyperparameters, one parameter group), rebuilt per stage on every owner and
shadow; learning-rate schedulers, gradient clipping and gradient accumulation are refused with a
clear error (the pipeline's micro-batches are its accumulation).

Example:
    >>> strategy = RedundantPipelineStrategy(num_stages=4, num_microbatches=4)
    >>> trainer = lightning.Trainer(strategy=strategy, accelerator="cpu", devices=1,
    ...                             max_epochs=2)                        # doctest: +SKIP
    >>> trainer.fit(module, train_loader, val_loader)                   # doctest: +SKIP
    >>> strategy.result.events                                          # doctest: +SKIP
"""

from __future__ import annotations

import copy
import dis
import inspect
import io
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import MethodType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.optim import Optimizer

from stalwart.errors import ConfigurationError
from stalwart.pipeline import keys
from stalwart.pipeline.faults import Fault
from stalwart.pipeline.job import REDUNDANCY, PipelineJob
from stalwart.pipeline.launch import PipelineAgent, PipelineRunResult, collect_result
from stalwart.pipeline.stage_files import latest_checkpoint, load_stage, stage_path
from stalwart.pipeline.workloads import IN_MEMORY, PipelineWorkload


class LightningPipelineWorkload(PipelineWorkload):
    """A LightningModule's layers and loss (the batches come from the driver, step by step)."""

    def __init__(self, module: pl.LightningModule) -> None:
        if hasattr(module, "pipeline_layers"):
            self._layers = list(module.pipeline_layers())
        elif isinstance(getattr(module, "model", None), nn.Sequential):
            self._layers = list(module.model)
        else:
            raise ConfigurationError(
                f"{type(module).__name__} has no layers to pipeline: define "
                "`pipeline_layers()` returning a list of modules, or an nn.Sequential `model`."
            )
        self.module = module

    def layers(self) -> list[nn.Module]:
        # Copies of the module's own current layers: every worker starts from the same weights.
        return [copy.deepcopy(layer) for layer in self._layers]

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if hasattr(self.module, "pipeline_loss"):
            return self.module.pipeline_loss(output, target)
        return super().loss(output, target)


#: The warning for a ``training_step`` that logs: it never runs under this strategy.
UNCALLED_TRAINING_STEP = (
    "RedundantPipelineStrategy does not call {name}.training_step: the pipeline workers compute "
    "each step's loss as pipeline_loss(layers(x), y), so the values it logs with self.log never "
    "reach your loggers. The strategy logs the step's loss as 'train_loss' itself; log other "
    "per-step values from on_train_batch_end (of the module or a callback), where "
    "outputs['loss'] is that loss. A module trained only by this strategy needs no training_step."
)


def _computed_by_the_pipeline(module: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
    """The ``training_step`` lent to a module that has none, while the strategy trains it."""
    raise ConfigurationError(
        f"{type(module).__name__} has no training_step: RedundantPipelineStrategy's workers "
        "compute its steps. Define one to train it with another strategy."
    )


def _logs_in_training_step(module: pl.LightningModule) -> bool:
    """Whether the module's own ``training_step`` calls ``self.log`` or ``self.log_dict``.

    Read from the method's bytecode (the strategy never runs it): a load of the attribute
    ``log``/``log_dict`` right after a load of the method's first argument.
    """
    step = inspect.unwrap(type(module).training_step)
    code = getattr(step, "__code__", None)
    if code is None or not code.co_argcount:
        return False
    me = code.co_varnames[0]
    previous = None
    for ins in dis.get_instructions(code):
        if (
            ins.opname in ("LOAD_ATTR", "LOAD_METHOD")
            and ins.argval in ("log", "log_dict")
            and previous is not None
            and previous.opname.startswith("LOAD_FAST")
            and previous.argval == me
        ):
            return True
        previous = ins
    return False


def _optimizer_description(optimizer: Optimizer) -> tuple[str, dict]:
    """Import path and JSON-able hyperparameters of the driver's optimizer."""
    if len(optimizer.param_groups) != 1:
        raise ConfigurationError(
            "configure_optimizers returned an optimizer with several parameter groups: the "
            "pipeline rebuilds one optimizer per stage from the class and its defaults; use one "
            "parameter group."
        )
    cls = type(optimizer)
    try:
        kwargs = json.loads(json.dumps(optimizer.defaults))
    except TypeError:
        raise ConfigurationError(
            f"{cls.__name__}'s hyperparameters {optimizer.defaults} cannot be sent to the stage "
            "workers; use plain numbers."
        ) from None
    return f"{cls.__module__}.{cls.__qualname__}", kwargs


class RedundantPipelineStrategy(ParallelStrategy):
    """Pipeline-parallel training with redundant computation (Bamboo), for Lightning.

    Args:
        num_stages: pipeline depth P (one worker process per stage).
        num_microbatches: micro-batches per step M (a batch is split into M parts).
        redundancy: ``"eager"`` (eager FRC, lazy BRC), ``"lazy"`` or ``"none"``.
        num_pipelines: D data-parallel pipelines (P x D worker processes; the batch is split
            into D shards, the gradients are summed across pipelines).
        failure_timeout: seconds before a silent peer is declared lost.
        schedule: ``"1f1b"`` or ``"gpipe"``.
        checkpoint_every: steps between the pipeline's own checkpoints (the fallback when two
            consecutive stages are lost; 0 = only the initial one).
        faults: faults to inject (testing and demos).
        step_timeout: seconds the driver waits for one step (or one weight pull) before it
            declares the pipeline hung.

    Example:
        >>> RedundantPipelineStrategy(num_stages=4, num_microbatches=8, redundancy="lazy")
    """

    strategy_name = "redundant_pipeline"

    def __init__(
        self,
        num_stages: int = 4,
        num_microbatches: int = 4,
        redundancy: str = "eager",
        num_pipelines: int = 1,
        failure_timeout: float = 10.0,
        schedule: str = "1f1b",
        checkpoint_every: int = 0,
        faults: Sequence[Fault] = (),
        step_timeout: float = 600.0,
    ) -> None:
        super().__init__(
            parallel_devices=[torch.device("cpu")], cluster_environment=LightningEnvironment()
        )
        if redundancy not in REDUNDANCY:
            raise ConfigurationError(f"redundancy={redundancy!r}: use one of {REDUNDANCY}.")
        if not failure_timeout > 0:
            raise ConfigurationError(
                f"failure_timeout={failure_timeout}: give peers a positive number of seconds."
            )
        self.job = PipelineJob(
            num_stages=num_stages, num_microbatches=num_microbatches, redundancy=redundancy,
            num_pipelines=num_pipelines, failure_timeout=failure_timeout, schedule=schedule,
            checkpoint_every=checkpoint_every, verify_replicas=True, batches_from_store=True,
        )  # fmt: skip
        if min(num_pipelines, num_stages, num_microbatches) < 1:
            self.job.validate()  # raises the specific error before any process starts
        self.faults = list(faults)
        self.step_timeout = step_timeout
        self.result: PipelineRunResult | None = None
        self._agent: PipelineAgent | None = None
        self._workload: LightningPipelineWorkload | None = None
        self._step = 0  # pipeline steps run (the workers' step counter)
        self._weights_step = 0  # the step whose weights the LightningModule holds
        self._forgotten = 0  # batches before this step were deleted from the store
        self._started = 0.0
        self._lent_training_step: pl.LightningModule | None = None

    def connect(self, model: pl.LightningModule) -> None:
        """Attach the module; one without a ``training_step`` is lent a placeholder until
        teardown, since Lightning refuses such a module before any strategy hook runs."""
        if not is_overridden("training_step", model, pl.LightningModule):
            model.training_step = MethodType(_computed_by_the_pipeline, model)
            self._lent_training_step = model
        super().connect(model)

    # -- workers ----------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        return False  # one driver process: Lightning must not shard the dataloaders

    def worker_pid(self, rank: int) -> int:
        """The process id of a stage worker (to deliver a real signal to it)."""
        if self._agent is None:
            raise ConfigurationError("the pipeline workers start with training (on_train_start).")
        return self._agent.pid(rank)

    def on_train_start(self) -> None:
        module = self.lightning_module
        if _logs_in_training_step(module):
            rank_zero_warn(UNCALLED_TRAINING_STEP.format(name=type(module).__name__))
        self._workload = LightningPipelineWorkload(module)
        name = f"in-memory:{id(self._workload)}"
        optimizer, kwargs = _optimizer_description(self.optimizers[0])
        job = PipelineJob(
            **{**self.job.__dict__, "workload": name, "optimizer": optimizer,
               "lr": kwargs.pop("lr"), "optimizer_kwargs": kwargs},
        )  # fmt: skip
        IN_MEMORY[name] = self._workload
        try:
            self._agent = PipelineAgent(job, self.faults).__enter__()
        finally:
            IN_MEMORY.pop(name, None)  # the forked workers have their copy
        self._step = self._weights_step = self._forgotten = 0
        self._started = time.monotonic()

    def _wait(self, condition: Callable[[], bool], what: str) -> None:
        assert self._agent is not None
        self._agent.wait_until(condition, self.step_timeout, what)

    def _pull_weights(self) -> None:
        """Load the stages' current weights into the LightningModule (once per step)."""
        agent = self._agent
        if agent is None or self._weights_step == self._step:
            return
        step = self._step
        agent.store.set(keys.sync(step), "1")
        directory, P = agent.checkpoint_dir, agent.job.num_stages
        self._wait(
            lambda: all(stage_path(directory, step, s).exists() for s in range(P)),
            f"the stage weights of step {step}",
        )
        self._load_stage_files(directory, step, agent.job.bounds)
        self._weights_step = step

    def _load_stage_files(self, directory: Path, step: int, bounds: list) -> None:
        assert self._workload is not None
        layers = self._workload._layers
        for stage, (start, end) in enumerate(bounds):
            state = load_stage(stage_path(directory, step, stage))["module"]
            nn.Sequential(*layers[start:end]).load_state_dict(state)

    def _stop_workers(self) -> None:
        agent, self._agent = self._agent, None
        if agent is None:
            return
        try:
            agent.store.set(keys.STOP, "1")
            agent.wait_until(agent.poll, 60, "the workers' exit")
            job = PipelineJob(**{**agent.job.__dict__, "steps": self._step})
            self.result = collect_result(
                agent.store, job, agent.exit_codes, time.monotonic() - self._started
            )
        finally:
            agent.__exit__(None, None, None)

    # -- the training step --------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ConfigurationError(
                "accumulate_grad_batches must be 1: the pipeline's micro-batches already "
                "accumulate gradients within a step; raise num_microbatches instead."
            )
        if trainer.gradient_clip_val:
            raise ConfigurationError(
                "gradient_clip_val is not supported by the pipeline workers; remove it."
            )
        super().setup(trainer)
        if trainer.lr_scheduler_configs:
            raise ConfigurationError(
                "learning-rate schedulers are not supported by the pipeline workers (each stage "
                "owner and shadow builds its own optimizer); return only an optimizer."
            )

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One pipeline step on the batch: the workers compute it; the loss comes back."""
        batch = args[0] if args else kwargs["batch"]
        if not isinstance(batch, list | tuple) or len(batch) < 2:
            raise ConfigurationError(
                "a pipeline batch must be a sequence (inputs, targets, ...); got "
                f"{type(batch).__name__}."
            )
        agent = self._agent
        assert agent is not None
        step = self._step
        buffer = io.BytesIO()
        torch.save((batch[0], batch[1]), buffer)
        agent.store.set(keys.batch(step), buffer.getvalue())
        self._wait(lambda: agent.store.check([keys.loss(step)]), f"step {step}")
        loss = torch.tensor(float(agent.store.get(keys.loss(step))))
        self._step += 1
        self._forget_batches()
        # Lightning runs this as the module's training_step hook, so the value takes the path
        # of a user's self.log: callback_metrics, the progress bar and every logger.
        self.lightning_module.log("train_loss", loss, prog_bar=True)
        return loss

    def _forget_batches(self) -> None:
        """Drop the batches before the last complete checkpoint: a fallback never re-runs them."""
        agent = self._agent
        assert agent is not None
        oldest = latest_checkpoint(agent.checkpoint_dir, agent.job.num_stages) or 0
        for step in range(self._forgotten, oldest):
            agent.store.delete_key(keys.batch(step))
        self._forgotten = max(self._forgotten, oldest)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kw: Any) -> Any:
        """The workers ran the backward pass of the step."""
        return closure_loss

    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """Run the step (the closure calls :meth:`training_step`); the workers' owners and
        shadows have applied the optimizer to their shards — the driver's copy is not used."""
        return closure()

    # -- weights back into the LightningModule ---------------------------------------------
    def on_validation_start(self) -> None:
        self._pull_weights()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._pull_weights()
        return super().lightning_module_state_dict()

    def on_train_end(self) -> None:
        self._pull_weights()
        self._stop_workers()

    def on_exception(self, exception: BaseException) -> None:
        agent, self._agent = self._agent, None
        if agent is not None:
            agent.__exit__(None, None, None)

    def teardown(self) -> None:
        self.on_exception(RuntimeError("teardown"))
        module, self._lent_training_step = self._lent_training_step, None
        if module is not None:
            del module.training_step  # the user's module leaves fit as it came
        super().teardown()

    # -- ParallelStrategy ------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        self._launcher = None  # Lightning's loop runs here; the workers are forked at train start

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    def model_to_device(self) -> None:
        """The driver's copy stays on the CPU; the stages live in the workers."""

    def barrier(self, name: str | None = None) -> None:
        """Single driver process: nothing to wait for."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> Any:
        return tensor
