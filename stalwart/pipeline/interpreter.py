"""Runs a worker's instruction list for one step: one method per kind of instruction.

The list comes from :mod:`stalwart.pipeline.schedule` (a stage's 1F1B or GPipe stream, merged
with a victim's after a failover, with eager FRC marks). Buffers are keyed by (stage,
micro-batch); a forward whose input stage is local takes its predecessor's output directly, and
after a failover a forward the shadow already ran eagerly (FRC) is taken from the FRC cache with
its saved intermediates, so the shadow's backward (lazy BRC) costs no forward again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed import Store

from stalwart.pipeline import keys
from stalwart.pipeline.faults import FaultInjector
from stalwart.pipeline.held_stages import HeldStages
from stalwart.pipeline.links import ACT, GRAD, PeerLinks, tag
from stalwart.pipeline.microbatches import MicroBatches
from stalwart.pipeline.op_profile import OpProfile
from stalwart.pipeline.redundancy import EagerFRC, frc_filler
from stalwart.pipeline.schedule import Instruction, Op

Key = tuple[int, int]  # (stage, micro-batch)


@dataclass
class _Buffers:
    """What one step's instructions hand to each other."""

    inputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    grads: dict[Key, torch.Tensor] = field(default_factory=dict)
    labels: dict[int, torch.Tensor] = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)


class StepInterpreter:
    """Executes instruction lists of one worker (a dispatch table ``{Op: method}``).

    Args:
        rank: this node.
        stages: the held stages (modules run here).
        batches: micro-batches and boundary shapes.
        links: point-to-point messages.
        profile: the per-op time breakdown.
        injector: kills this process when a configured fault matches an instruction.
        store: the run's store (the FRC reuse counter).
        frc: the node's eager FRC; replaced by the worker after a fallback rebuild.
    """

    def __init__(
        self, rank: int, stages: HeldStages, batches: MicroBatches, links: PeerLinks,
        profile: OpProfile, injector: FaultInjector, store: Store, frc: EagerFRC,
    ) -> None:  # fmt: skip
        self.rank, self.stages, self.batches, self.links = rank, stages, batches, links
        self.profile, self.injector, self.store, self.frc = profile, injector, store, frc
        job = stages.job
        self.last = job.num_stages - 1
        self.scale = job.num_microbatches * job.num_pipelines  # micro-batches per global batch
        self._ops: dict[Op, Callable[[int, int], None]] = {
            Op.LOAD: self._load,
            Op.RECV_ACT: self._recv_activation,
            Op.FORWARD: self._forward,
            Op.SEND_ACT: self._send_activation,
            Op.RECV_GRAD: self._recv_gradient,
            Op.BACKWARD: self._backward,
            Op.SEND_GRAD: self._send_gradient,
            Op.FRC: self._post_frc,
        }
        self._step = 0
        self._owner: tuple[int, ...] = ()
        self._buf = _Buffers()

    def run(
        self, step: int, owner: tuple[int, ...], program: list[Instruction]
    ) -> dict[int, float]:
        """Execute ``program`` for ``step`` with stage owners ``owner``; the losses of the
        micro-batches whose loss this rank computed, by global micro-batch id."""
        self._step, self._owner, self._buf = step, owner, _Buffers()
        try:
            for ins in program:
                self.injector.check(step, ins)
                self._ops[ins.op](ins.stage, ins.mb)
                self.profile.tick(ins.op.value)
            return self._buf.losses
        finally:
            self._buf = _Buffers()  # a program cut short must not keep its tensors alive

    def recv(self, t: torch.Tensor, src: int, tg: int, label: str) -> None:
        """Receive; on a CPU the main-thread FRC executor works in the wait (charged to
        ``label`` until then). On a GPU, ``wait()`` only orders the compute stream after the
        receive: FRC overlaps through the streams instead and runs at the end-of-step wait."""
        fill = None
        if self.frc.pending and self.stages.device.type == "cpu":
            fill = frc_filler(self.frc, self.profile, label)
        self.links.recv(t, src, tg, fill)

    def _empty(self, boundary: int, mb: int) -> torch.Tensor:
        """A buffer for the output of stage ``boundary`` for micro-batch ``mb``."""
        shape, dtype = self.batches.boundary_meta(self._step, mb)[boundary]
        return torch.empty(shape, dtype=dtype, device=self.stages.device)

    # ----------------------------------------------------------------- one method per op
    def _load(self, s: int, k: int) -> None:
        x, y = self.batches.get(self._step, k)
        if s == 0:
            self._buf.inputs[(0, k)] = x
        if s == self.last:
            self._buf.labels[k] = y

    def _recv_activation(self, s: int, k: int) -> None:
        t = self._empty(s - 1, k)
        self.recv(t, self._owner[s - 1], tag(ACT, s, k), Op.RECV_ACT.value)
        self._buf.inputs[(s, k)] = t.requires_grad_(t.is_floating_point())

    def _forward(self, s: int, k: int) -> None:
        buf = self._buf
        cached = self.frc.take(s, k)
        if cached is not None:
            # Failover: the shadow already ran this forward eagerly (FRC) with the same
            # weights; reuse its output and saved intermediates.
            buf.inputs[(s, k)], out = cached
            self.store.add(keys.frc_reused(self.rank), 1)
        else:
            if s > 0 and (s - 1, k) in buf.outputs and self._owner[s - 1] == self.rank:
                buf.inputs[(s, k)] = buf.outputs[(s - 1, k)].detach().requires_grad_()
            out = self.stages.modules[s](buf.inputs[(s, k)])
        if s == self.last:
            # Scaled by the global number of micro-batches: summing the gradients of all
            # pipelines then gives the gradient of the whole batch.
            out = self.stages.workload.loss(out, buf.labels.pop(k)) / self.scale
            buf.losses[k] = out.item() * self.scale
        buf.outputs[(s, k)] = out

    def _send_activation(self, s: int, k: int) -> None:
        self.links.isend(self._buf.outputs[(s, k)].detach(), self._owner[s + 1], tag(ACT, s + 1, k))

    def _recv_gradient(self, s: int, k: int) -> None:
        t = self._empty(s, k)
        self.recv(t, self._owner[s + 1], tag(GRAD, s, k), Op.RECV_GRAD.value)
        self._buf.grads[(s, k)] = t

    def _backward(self, s: int, k: int) -> None:
        buf = self._buf
        out = buf.outputs.pop((s, k))
        if s == self.last:
            out.backward()
        else:
            g = buf.grads.pop((s, k), None)
            if g is None:  # the next stage is local: its input gradient is ours
                g = buf.inputs.pop((s + 1, k)).grad
            torch.autograd.backward(out, g)
        if s == 0:
            buf.inputs.pop((0, k), None)

    def _send_gradient(self, s: int, k: int) -> None:
        grad = self._buf.inputs.pop((s, k)).grad
        self.links.isend(grad, self._owner[s - 1], tag(GRAD, s - 1, k))

    def _post_frc(self, s: int, k: int) -> None:
        # Posted, not run: it runs on idle CPU (see EagerFRC). Stage 0's input is loaded
        # here, in this thread: the idle thread must not touch the batch cache.
        source = self.batches.get(self._step, k)[0] if s == 0 else self._buf.outputs.get((s - 1, k))
        self.frc.post(s, k, source)
