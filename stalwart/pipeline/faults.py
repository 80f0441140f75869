"""Fault injection: kill (SIGKILL) or preempt (SIGTERM) rank r at step s in a phase.

A :class:`Fault` is checked by the worker before each instruction; when it matches, the worker
sends the signal to itself with ``os.kill`` — a real signal, delivered by the kernel, exactly as
an out-of-memory killer or a spot preemption would. The phase of an instruction: loading,
receiving/sending activations, forward and FRC are ``forward``; receiving/sending gradients and
backward are ``backward``; ``start`` fires before the step's first instruction.

Example:
    >>> Fault.parse("2:3:backward")
    Fault(rank=2, step=3, phase='backward', signal='SIGKILL', microbatch=0)
"""

from __future__ import annotations

import os
import signal as _signal
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from stalwart.errors import ConfigurationError
from stalwart.pipeline.schedule import Instruction, Op

PHASES = ("start", "forward", "backward")
SIGNALS = ("SIGKILL", "SIGTERM")
_BACKWARD_OPS = frozenset({Op.RECV_GRAD, Op.BACKWARD, Op.SEND_GRAD})


@dataclass(frozen=True)
class Fault:
    """Deliver ``signal`` to ``rank`` at ``step`` when it reaches ``phase``.

    Args:
        rank: the launch rank (node) to kill.
        step: the optimizer step (0-based) during which to kill it.
        phase: ``"start"``, ``"forward"`` or ``"backward"``.
        signal: ``"SIGKILL"`` (node gone) or ``"SIGTERM"`` (preemption notice; the node leaves).
        microbatch: fire at the first instruction of the phase whose micro-batch id is >= this.
    """

    rank: int
    step: int
    phase: str = "forward"
    signal: str = "SIGKILL"
    microbatch: int = 0

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ConfigurationError(f"fault phase {self.phase!r}: use one of {PHASES}.")
        if self.signal not in SIGNALS:
            raise ConfigurationError(f"fault signal {self.signal!r}: use one of {SIGNALS}.")
        if self.rank < 0 or self.step < 0 or self.microbatch < 0:
            raise ConfigurationError(f"fault {self}: rank, step and micro-batch must be >= 0.")

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``rank:step[:phase[:signal[:microbatch]]]``, e.g. ``2:3:backward:SIGTERM``."""
        parts = text.split(":")
        if len(parts) < 2:
            raise ConfigurationError(
                f"--fault {text!r}: write rank:step[:forward|backward|start[:SIGKILL|SIGTERM]]"
            )
        try:
            rank, step = int(parts[0]), int(parts[1])
            micro = int(parts[4]) if len(parts) > 4 else 0
        except ValueError:
            raise ConfigurationError(f"--fault {text!r}: rank, step must be integers") from None
        phase = parts[2] if len(parts) > 2 else "forward"
        sig = parts[3].upper() if len(parts) > 3 else "SIGKILL"
        return cls(rank, step, phase, sig, micro)

    def to_dict(self) -> dict:
        return asdict(self)

    def matches(self, rank: int, step: int, ins: Instruction | None) -> bool:
        if rank != self.rank or step != self.step:
            return False
        if ins is None:
            return self.phase == "start"
        phase = "backward" if ins.op in _BACKWARD_OPS else "forward"
        return phase == self.phase and ins.mb >= self.microbatch


class FaultInjector:
    """The worker-side trigger for a list of faults (each fires at most once per process)."""

    def __init__(self, rank: int, faults: Sequence[Fault]) -> None:
        self.rank = rank
        self.faults = [f for f in faults if f.rank == rank]

    def check(self, step: int, ins: Instruction | None) -> None:
        for fault in self.faults:
            if fault.matches(self.rank, step, ins):
                os.kill(os.getpid(), getattr(_signal, fault.signal))
