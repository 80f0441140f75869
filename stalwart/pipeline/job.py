"""The description of one redundant-pipeline training run, checked before any process starts.

Example:
    >>> job = PipelineJob(num_stages=4, num_microbatches=4, steps=6)
    >>> job.validate().bounds
    [[0, 2], [2, 4], [4, 6], [6, 9]]
"""

from __future__ import annotations

import importlib
import json
from dataclasses import asdict, dataclass, field, replace

import torch

from stalwart.errors import ConfigurationError
from stalwart.pipeline.partition import balanced_bounds, measured_costs, parameter_costs
from stalwart.pipeline.redundancy import EXECUTORS
from stalwart.pipeline.schedule import SCHEDULES
from stalwart.pipeline.workloads import load_workload

REDUNDANCY = ("eager", "lazy", "none")
DEVICES = ("cpu", "cuda")
FRC_POLICIES = ("bubble", "complete")
OPTIMIZERS = ("sgd", "adam")


@dataclass
class PipelineJob:
    """Everything the launcher and every worker need to know.

    Args:
        num_stages: pipeline depth P.
        num_microbatches: micro-batches per step M.
        steps: optimizer steps to run.
        redundancy: ``"eager"`` (eager FRC + lazy BRC), ``"lazy"`` (replicas kept fresh, all
            redundant computation after a failure) or ``"none"`` (no replicas: any loss is fatal).
        frc_policy: with eager redundancy, ``"bubble"`` runs FRC only while the node waits
            (receives, and the end-of-step wait for the slowest stage) and drops what is left
            once the step commits — after the commit no failure can use it, and a failure
            before it finishes the rest during recovery; ``"complete"`` finishes every FRC
            before the node reports the step done (the thesis' schedule, on a device with
            no spare compute to overlap it with).
        frc_executor: who runs eager FRC on a CPU. ``"idle_thread"`` (default): a thread per
            node in Linux's ``SCHED_IDLE`` class, which gets a core only when no normal thread
            of any stage wants it — when stages share cores, FRC then cannot slow the critical
            path (measured in docs/pipeline.md). ``"main_thread"``: the node's own thread
            runs FRC while it is blocked (the behaviour without ``SCHED_IDLE``, used on other
            OSes and on a GPU whatever is set here).
        num_nodes: worker processes; at least P, at most P x D (default P x D). Nodes beyond
            the last full pipeline wait on standby.
        num_pipelines: D data-parallel pipelines; the global batch is split into D shards and
            the gradients are summed across pipelines at the end of each step.
        failure_timeout: seconds a send/recv or the rendezvous waits for a silent peer.
        workload: ``package.module:Class`` of a
            :class:`~stalwart.pipeline.workloads.PipelineWorkload`.
        workload_kwargs: its keyword arguments.
        batch_size: global batch per step (split into M micro-batches).
        optimizer: ``"sgd"`` (momentum 0.9), ``"adam"``, or the import path of a
            ``torch.optim.Optimizer`` class (``"torch.optim.AdamW"``); ``lr`` its learning
            rate, ``optimizer_kwargs`` its other arguments. Every owner and shadow builds the
            same optimizer for its shard.
        schedule: ``"1f1b"`` or ``"gpipe"``.
        partition: balance stages by ``"parameters"`` or measured ``"time"``.
        checkpoint_every: steps between checkpoints (0: only the initial one).
        checkpoint_dir: where stage checkpoints go.
        verify_replicas: publish a SHA-256 of every owner and replica state after each step.
        profile: publish, per step and rank, the CPU and wall seconds spent in each kind of
            instruction (the breakdown ``benchmarks/pipeline_overhead.py`` prints).
        seed: model initialisation seed (the same on every worker).
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL with a GPU per worker; gloo staged
            through host memory with fewer GPUs than workers). See docs/gpu.md for what ran.
        batches_from_store: driven mode: the workers take each step's batch from the store
            (``batch/<step>``, put there by a driver such as the Lightning strategy) and run
            until the driver sets ``stop``; ``steps`` is then not used.
        bounds: stage layer bounds ``[[start, end), ...]``; computed by :meth:`validate`
            from ``partition`` unless given.
    """

    num_stages: int = 4
    num_microbatches: int = 4
    steps: int = 8
    redundancy: str = "eager"
    frc_policy: str = "bubble"
    frc_executor: str = "idle_thread"
    num_nodes: int | None = None
    num_pipelines: int = 1
    failure_timeout: float = 10.0
    workload: str = "stalwart.pipeline.workloads:DigitsMLP"
    workload_kwargs: dict = field(default_factory=dict)
    batch_size: int = 32
    optimizer: str = "adam"
    lr: float = 1e-2
    optimizer_kwargs: dict = field(default_factory=dict)
    schedule: str = "1f1b"
    partition: str = "parameters"
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    verify_replicas: bool = False
    profile: bool = False
    batches_from_store: bool = False
    device: str = "cpu"
    seed: int = 0
    bounds: list | None = None

    def validate(self) -> PipelineJob:
        """Check every field; return a copy with ``num_nodes`` and ``bounds`` filled in."""
        nodes = self._check_world()
        self._check_choices()
        return self._with_bounds(nodes)

    def _check_world(self) -> int:
        """Check the sizes and timeouts; the number of nodes."""
        if self.num_stages < 1:
            raise ConfigurationError(f"num_stages={self.num_stages}: use at least 1 stage.")
        if self.num_pipelines < 1:
            raise ConfigurationError(f"num_pipelines={self.num_pipelines}: use at least 1.")
        nodes = self.num_nodes
        if nodes is None:
            nodes = self.num_stages * self.num_pipelines
        if self.num_stages > nodes:
            raise ConfigurationError(
                f"num_stages={self.num_stages} is larger than the world size {nodes}: every "
                "stage needs its own node; lower num_stages or raise num_nodes."
            )
        if nodes > self.num_stages * self.num_pipelines:
            raise ConfigurationError(
                f"num_nodes={nodes} exceeds P x D = {self.num_stages * self.num_pipelines}."
            )
        if not self.failure_timeout > 0:
            raise ConfigurationError(
                f"failure_timeout={self.failure_timeout}: a peer must get a positive number of "
                "seconds to answer before it is declared lost (e.g. 10)."
            )
        if self.num_microbatches < 1 or self.steps < 1:
            raise ConfigurationError("num_microbatches and steps must be at least 1.")
        if self.batch_size % (self.num_microbatches * self.num_pipelines):
            raise ConfigurationError(
                f"batch_size={self.batch_size} must be a multiple of num_microbatches x "
                f"num_pipelines = {self.num_microbatches * self.num_pipelines}."
            )
        return nodes

    def _check_choices(self) -> None:
        """Check the fields that name one of a fixed set of options."""
        if self.redundancy not in REDUNDANCY:
            raise ConfigurationError(f"redundancy={self.redundancy!r}: use one of {REDUNDANCY}.")
        if self.frc_policy not in FRC_POLICIES:
            raise ConfigurationError(f"frc_policy={self.frc_policy!r}: use one of {FRC_POLICIES}.")
        if self.frc_executor not in EXECUTORS:
            raise ConfigurationError(f"frc_executor={self.frc_executor!r}: use one of {EXECUTORS}.")
        optimizer_spec(self)  # raises for an unknown optimizer
        if self.device not in DEVICES:
            raise ConfigurationError(f"device={self.device!r}: use one of {DEVICES}.")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigurationError(
                "device='cuda' but torch sees no CUDA device here; use device='cpu' (gloo)."
            )
        if self.schedule not in SCHEDULES:
            raise ConfigurationError(f"schedule={self.schedule!r}: use one of {list(SCHEDULES)}.")
        if self.checkpoint_every < 0:
            raise ConfigurationError("checkpoint_every must be >= 0.")

    def _with_bounds(self, nodes: int) -> PipelineJob:
        """A copy with ``num_nodes`` and checked (given) or computed stage ``bounds``."""
        workload = load_workload(self.workload, self.workload_kwargs)
        torch.manual_seed(self.seed)
        layers = workload.layers()
        if self.bounds is not None:  # given (e.g. a DeepSpeed PipelineModule's own parts)
            flat = [b for pair in self.bounds for b in pair]
            ends = [b[1] for b in self.bounds[:-1]] == [b[0] for b in self.bounds[1:]]
            if (
                len(self.bounds) != self.num_stages or flat[0] != 0 or flat[-1] != len(layers)
                or not ends or any(b[0] >= b[1] for b in self.bounds)
            ):  # fmt: skip
                raise ConfigurationError(
                    f"bounds {self.bounds}: give {self.num_stages} contiguous non-empty "
                    f"[start, end) ranges covering the {len(layers)} layers."
                )
            return replace(self, num_nodes=nodes)
        if self.partition == "parameters":
            costs = parameter_costs(layers)
        elif self.partition == "time":
            x, _ = workload.microbatch(0, 0, self.num_microbatches, self.batch_size)
            costs = measured_costs(layers, x)
        else:
            raise ConfigurationError(f"partition={self.partition!r}: use 'parameters' or 'time'.")
        bounds = [list(b) for b in balanced_bounds(costs, self.num_stages)]
        return replace(self, num_nodes=nodes, bounds=bounds)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PipelineJob:
        return cls(**json.loads(text))


def optimizer_spec(job: PipelineJob) -> tuple[type[torch.optim.Optimizer], dict]:
    """The optimizer class and keyword arguments every stage owner and shadow builds."""
    if job.optimizer == "sgd":
        return torch.optim.SGD, {"lr": job.lr, "momentum": 0.9, **job.optimizer_kwargs}
    if job.optimizer == "adam":
        return torch.optim.Adam, {"lr": job.lr, **job.optimizer_kwargs}
    module, _, name = job.optimizer.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigurationError(
            f"optimizer={job.optimizer!r}: use {OPTIMIZERS} or the import path of a "
            "torch.optim.Optimizer class, e.g. 'torch.optim.AdamW'."
        )
    return cls, {"lr": job.lr, **job.optimizer_kwargs}
