"""What a parameter-server run is: mode, workers, length, failure schedule; validated up front."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from stalwart.errors import ConfigurationError

MODES = ("checkpoint-sync", "checkpoint-async", "chain-sync", "chain-async", "stateless")
TARGETS = ("ps", "head", "secondary")


@dataclass(frozen=True)
class KillEvent:
    """SIGKILL ``targets`` once the workers have produced ``at_gradient`` gradients in total, and
    start a replacement ``downtime`` seconds later.

    Args:
        at_gradient: the trigger, in gradients produced by all workers together (mode-independent).
        downtime: seconds between the kill and the restart.
        targets: ``("ps",)`` for checkpoint/stateless modes; ``("head",)`` or
            ``("head", "secondary")`` (a double kill) for chain replication.

    Example:
        >>> KillEvent(at_gradient=100, downtime=2.0)
        KillEvent(at_gradient=100, downtime=2.0, targets=('ps',))
    """

    at_gradient: int
    downtime: float = 2.0
    targets: tuple[str, ...] = ("ps",)


@dataclass
class PSConfig:
    """One parameter-server training run.

    Args:
        mode: one of ``checkpoint-sync``, ``checkpoint-async``, ``chain-sync``, ``chain-async``,
            ``stateless``.
        workers: number of worker processes (N >= 1).
        steps: gradients each worker computes.
        batch_size: images per gradient.
        lr: SGD learning rate.
        hidden: dense-layer width of the CNN (the paper: 512).
        checkpoint_every: checkpoint modes save the weights every this many updates.
        replicate_every: chain modes forward the weights to the successor every this many updates.
        replicas: chain length (>= 3).
        backlog_threshold: an asynchronous apply of more pending gradients than this is one
            large-batch step (see :func:`stalwart.ps.update.backlog_scale`); 0 means 2 * workers.
        kills: the failure schedule.
        duration: if > 0, stop the workers after this many seconds of training (``steps`` is
            then only a cap); compares modes at equal wall-clock time, as the paper does.
        seed: initial weights and data order.
        store_address: ``host:port`` of a running TCPStore server, ``redis://host:port`` for Redis,
            or None to start the embedded store in its own process.
        store_patience: seconds a process keeps retrying an unreachable store before it gives up.
        keep_gradients: keep every gradient in the store after it is applied, so the weights can be
            verified by replaying the audit log (tests; costs memory).
        run_dir: where checkpoints, logs and reports go.

    Example:
        >>> PSConfig(mode="stateless", workers=2, steps=50, run_dir="/tmp/ps").validate()
    """

    mode: str = "stateless"
    workers: int = 2
    steps: int = 200
    batch_size: int = 32
    lr: float = 0.1
    hidden: int = 512
    checkpoint_every: int = 50
    replicate_every: int = 10
    replicas: int = 3
    backlog_threshold: int = 0
    kills: list[KillEvent] = field(default_factory=list)
    duration: float = 0.0
    seed: int = 0
    store_address: str | None = None
    store_patience: float = 10.0
    keep_gradients: bool = False
    run_dir: str = "ps-run"

    @property
    def threshold(self) -> int:
        return self.backlog_threshold or 2 * self.workers

    @property
    def total_gradients(self) -> int:
        return self.workers * self.steps

    def validate(self) -> None:
        """Raise :class:`ConfigurationError` with what to change if the run cannot work."""
        if self.mode not in MODES:
            raise ConfigurationError(f"mode {self.mode!r}: choose one of {', '.join(MODES)}.")
        if self.workers < 1:
            raise ConfigurationError(
                f"workers={self.workers}: a parameter-server run needs at least one worker."
            )
        if self.steps < 1 or self.batch_size < 1 or self.lr <= 0 or self.hidden < 1:
            raise ConfigurationError("steps, batch_size, lr and hidden must all be positive.")
        if self.checkpoint_every < 1 or self.replicate_every < 1:
            raise ConfigurationError("checkpoint_every and replicate_every must be >= 1 update.")
        if self.mode.startswith("chain") and self.replicas < 3:
            raise ConfigurationError(
                f"replicas={self.replicas}: chain replication needs a chain of at least 3 "
                "(head, secondary, tertiary)."
            )
        if self.duration < 0:
            raise ConfigurationError(f"duration {self.duration}: must be >= 0 seconds.")
        if self.store_patience <= 0:
            raise ConfigurationError("store_patience must be positive (seconds).")
        previous = 0
        for event in self.kills:
            if not 0 < event.at_gradient < self.total_gradients:
                raise ConfigurationError(
                    f"kill at gradient {event.at_gradient} is beyond the run: {self.workers} "
                    f"worker(s) x {self.steps} steps produce {self.total_gradients} gradients; "
                    f"schedule kills between 1 and {self.total_gradients - 1}, or lengthen the run."
                )
            if event.at_gradient <= previous:
                raise ConfigurationError(
                    "kill events must be in strictly increasing order of at_gradient."
                )
            if event.downtime < 0:
                raise ConfigurationError(f"downtime {event.downtime}: must be >= 0 seconds.")
            allowed = ("head", "secondary") if self.mode.startswith("chain") else ("ps",)
            if not event.targets or any(t not in allowed for t in event.targets):
                raise ConfigurationError(
                    f"kill targets {event.targets} for mode {self.mode}: use {allowed}."
                )
            if "secondary" in event.targets and "head" not in event.targets:
                raise ConfigurationError(
                    "a secondary kill is only supported together with the head."
                )
            previous = event.at_gradient

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PSConfig:
        data = json.loads(text)
        data["kills"] = [
            KillEvent(k["at_gradient"], k["downtime"], tuple(k["targets"])) for k in data["kills"]
        ]
        return cls(**data)
