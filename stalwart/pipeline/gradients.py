"""The end of a step's backward: sum gradients across pipelines, hand them to the shadows.

With D pipelines, each owned stage's gradient is summed over the D owners of that stage (one
all-reduce group per stage and generation). Each owner then sends its stage's gradient to the
replica holder, which applies the same optimizer step — cheaper than shipping weights and
optimizer state, and it keeps the replica equal to the owner bit for bit.
"""

from __future__ import annotations

import torch

from stalwart.pipeline.held_stages import HeldStages, has_parameters
from stalwart.pipeline.interpreter import StepInterpreter
from stalwart.pipeline.links import REPLICA, PeerLinks, tag
from stalwart.pipeline.membership import Membership
from stalwart.pipeline.placement import Placement
from stalwart.pipeline.redundancy import frc_filler


class GradientSync:
    """All-reduce across pipelines and owner-to-shadow gradients of one worker.

    Args:
        rank: this node.
        stages: the held stages (their ``.grad`` is read and set).
        links: the current generation's groups.
        membership: the store protocol (the all-reduce waits for its peers there).
        interpreter: receives with the FRC bubble filled.
    """

    def __init__(
        self, rank: int, stages: HeldStages, links: PeerLinks, membership: Membership,
        interpreter: StepInterpreter,
    ) -> None:  # fmt: skip
        self.rank, self.stages, self.links = rank, stages, links
        self.membership, self.interpreter = membership, interpreter
        # stage -> this pipeline's own gradient, kept until the step commits: a failed
        # all-reduce must not leave a sum across pipelines behind.
        self.local: dict[int, torch.Tensor] = {}

    def restore_local(self) -> None:
        """Put back the gradients from before the all-reduce (more shards to accumulate: a
        dropped pipeline's), not ones already summed across pipelines."""
        for stage, flat in self.local.items():
            self.stages.set_grad(stage, flat)
        self.local = {}

    def reduce(self, step: int, placement: Placement) -> None:
        """Sum each owned stage's gradient over the pipelines.

        Before reducing, each participant announces itself in the store and waits for the
        others (thesis §3.5): if another pipeline is failing over, the abort of this generation
        shows up there, this rank joins the rendezvous keeping its finished gradients, and
        reduces in the next generation once the failed pipeline has re-run its step.
        """
        layout = self.membership.layout
        if len(layout.pipelines) < 2:
            return
        for s in sorted(placement.stages_of(self.rank)):
            if not has_parameters(self.stages.modules[s]):
                continue
            peers = sorted(p.owner[s] for p in layout.pipelines)
            self.membership.await_peers(step, s, peers, frc_filler(self.interpreter.frc))
            local = self.local.setdefault(s, self.stages.flat_grad(s))
            summed = local.clone()  # a failed all-reduce leaves p.grad and the local copy intact
            self.links.allreduce(summed, s, peers, self.rank)
            self.stages.set_grad(s, summed)

    def exchange_replicas(self, placement: Placement) -> None:
        """Owners send their stage gradient to the replica holder; holders receive theirs."""
        for s in placement.stages_of(self.rank):
            holder = placement.replica[s]
            if holder is not None and self.stages.optimizers[s] is not None:
                self.links.isend(self.stages.flat_grad(s), holder, tag(REPLICA, s, 0))
        for s in placement.replicas_of(self.rank):
            if not has_parameters(self.stages.modules[s]):
                continue
            flat = torch.empty(self.stages.numel(s), device=self.stages.device)
            self.interpreter.recv(flat, placement.owner[s], tag(REPLICA, s, 0), "ReplicaGrads")
            self.stages.set_grad(s, flat)
