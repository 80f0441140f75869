"""What a parameter-server run is: mode, workers, length, failure schedule; validated up front."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field

from stalwart.errors import ConfigurationError

MODES = ("checkpoint-sync", "checkpoint-async", "chain-sync", "chain-async", "stateless")
TARGETS = ("ps", "head", "secondary")


@dataclass(frozen=True)
class KillEvent:
    """SIGKILL ``targets`` at a point of the run, and start a replacement ``downtime`` seconds
    later. The point is either a gradient count or a time; give exactly one.

    Args:
        at_gradient: the trigger in gradients produced by all workers together: the same amount
            of work in every mode (tests use it: it does not depend on the machine's speed).
        downtime: seconds between the kill and the restart.
        targets: ``("ps",)`` for checkpoint/stateless modes; ``("head",)`` or
            ``("head", "secondary")`` (a double kill) for chain replication.
        at_seconds: the trigger in seconds since the workers started: the same point on an
            accuracy-vs-time plot in every mode (the experiment uses it; modes produce gradients
            at different rates, so a gradient count would kill a faster mode earlier).

    Example:
        >>> KillEvent(at_gradient=100, downtime=2.0)
        KillEvent(at_gradient=100, downtime=2.0, targets=('ps',), at_seconds=None)
        >>> KillEvent(at_seconds=5.0, downtime=2.0).at_seconds
        5.0
    """

    at_gradient: int | None = None
    downtime: float = 2.0
    targets: tuple[str, ...] = ("ps",)
    at_seconds: float | None = None

    @property
    def position(self) -> float:
        """Where the event sits in its schedule (gradients or seconds)."""
        return float(self.at_gradient if self.at_gradient is not None else self.at_seconds or 0)


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
        backlog_threshold: an asynchronous apply of more pending gradients than this is a
            backlog, merged as the mean of the workers' local trajectories (see
            :func:`stalwart.ps.update.backlog_scale`); 0 means 2 * workers.
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
        self._validate_types()
        for name in ("lr", "duration", "store_patience"):
            # NaN passes every comparison below unnoticed (lr=nan trained NaN weights) and an
            # infinite duration or patience never ends.
            if not math.isfinite(getattr(self, name)):
                raise ConfigurationError(f"{name}={getattr(self, name)}: must be a finite number.")
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
        if self.backlog_threshold < 0:
            raise ConfigurationError(
                f"backlog_threshold={self.backlog_threshold}: must be >= 0 gradients (0 means "
                "2 * workers); a negative one would count every asynchronous apply as a backlog."
            )
        self._validate_kills()

    def _validate_types(self) -> None:
        """Counts must be whole numbers and rates real numbers (not bools, not strings): a
        count of 2.5 steps or lr=True trained without a word, lr="0.1" failed with a TypeError."""
        for name in COUNT_FIELDS:
            _require_count(name, getattr(self, name))
        for name in ("lr", "duration", "store_patience"):
            _require_real(name, getattr(self, name))
        for event in self.kills:
            if event.at_gradient is not None:
                _require_count(f"{event}: at_gradient", event.at_gradient)
            for name in ("downtime", "at_seconds"):
                if getattr(event, name) is not None:
                    _require_real(f"{event}: {name}", getattr(event, name))

    def _validate_kills(self) -> None:
        by_time = [event.at_seconds is not None for event in self.kills]
        if any(by_time) and not all(by_time):
            raise ConfigurationError(
                "kill events: schedule all of them by at_gradient or all by at_seconds."
            )
        previous = 0.0
        # Earliest wall-clock time a timed kill can fire: a kill waits until the PS is back from
        # the previous one, so an earlier outage can push it past the end of the run.
        earliest = 0.0
        for number, event in enumerate(self.kills):
            if (event.at_gradient is None) == (event.at_seconds is None):
                raise ConfigurationError(
                    f"{event}: give exactly one of at_gradient (a gradient count) or at_seconds."
                )
            self._validate_event(event)
            if event.at_gradient is not None and not 0 < event.at_gradient < self.total_gradients:
                raise ConfigurationError(
                    f"kill at gradient {event.at_gradient} is beyond the run: {self.workers} "
                    f"worker(s) x {self.steps} steps produce {self.total_gradients} gradients; "
                    f"schedule kills between 1 and {self.total_gradients - 1}, or lengthen the run."
                )
            if event.at_seconds is not None and (
                event.at_seconds <= 0 or (self.duration and event.at_seconds >= self.duration)
            ):
                raise ConfigurationError(
                    f"kill at {round(event.at_seconds, 3)} s is outside the run (duration "
                    f"{self.duration or 'unbounded'} s): schedule it after 0 s and before the "
                    "end, or lengthen the run."
                )
            if event.position <= previous:
                raise ConfigurationError(
                    "kill events must be in strictly increasing order of their trigger."
                )
            if event.downtime < 0:
                raise ConfigurationError(f"downtime {event.downtime}: must be >= 0 seconds.")
            if event.at_seconds is not None:
                fires = max(event.at_seconds, earliest)
                if self.duration and fires >= self.duration:
                    down_from = self.kills[number - 1].at_seconds
                    raise ConfigurationError(
                        f"the kill at {round(event.at_seconds, 3)} s can never fire: the PS "
                        f"killed at {round(down_from, 3)} s is down until at least "
                        f"{round(earliest, 3)} s, and the run ends at {self.duration:g} s. "
                        "Schedule it earlier, shorten the downtimes, or lengthen the run."
                    )
                earliest = fires + event.downtime
            previous = event.position

    def _validate_event(self, event: KillEvent) -> None:
        """The checks of one kill event that do not depend on the others."""
        for name in ("downtime", "at_seconds"):
            value = getattr(event, name)
            if value is not None and not math.isfinite(value):
                raise ConfigurationError(
                    f"{event}: {name}={value} must be a finite number of seconds."
                )
        allowed = ("head", "secondary") if self.mode.startswith("chain") else ("ps",)
        # A repeated target would restart (and add to the chain) one replica per name.
        if (
            not event.targets
            or any(t not in allowed for t in event.targets)
            or len(set(event.targets)) != len(event.targets)
        ):
            raise ConfigurationError(
                f"kill targets {event.targets} for mode {self.mode}: use {allowed}, each at "
                "most once."
            )
        if "secondary" in event.targets and "head" not in event.targets:
            raise ConfigurationError("a secondary kill is only supported together with the head.")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PSConfig:
        data = json.loads(text)
        data["kills"] = [
            KillEvent(k["at_gradient"], k["downtime"], tuple(k["targets"]), k.get("at_seconds"))
            for k in data["kills"]
        ]
        return cls(**data)


#: The PSConfig fields that count something: whole numbers only.
COUNT_FIELDS = (
    "workers", "steps", "batch_size", "hidden", "checkpoint_every", "replicate_every",
    "replicas", "backlog_threshold", "seed",
)  # fmt: skip


def _require_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigurationError(f"{name}={value!r}: must be a finite whole number (an int).")


def _require_real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigurationError(f"{name}={value!r}: must be a number (an int or a float).")
