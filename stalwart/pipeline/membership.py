"""The store protocol of one worker: step commits, liveness, and the rendezvous after a failure.

Everything the workers must agree on goes through the run's store (see
:mod:`stalwart.pipeline.keys`), never through the process groups, which a failure breaks:

- a step is *committed* once every member has set ``done``; a member reported ``dead`` before
  it was done, an ``abort`` of the generation, or the failure timeout aborts it instead
  (:class:`~stalwart.pipeline.links.PeerFailure`);
- after a failure every survivor joins the next generation's rendezvous, proposes a new
  :class:`~stalwart.pipeline.placement.Layout` (:func:`~stalwart.pipeline.placement.plan_layout`)
  and adopts the first proposal stored (compare-and-set), so all reach the same decision.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch.distributed import Store

from stalwart.pipeline import keys
from stalwart.pipeline.job import PipelineJob
from stalwart.pipeline.links import PeerFailure
from stalwart.pipeline.placement import Layout, LayoutRecovery, plan_layout
from stalwart.pipeline.stage_files import latest_checkpoint

#: one slice of idle work while waiting; False once there is none (see ``frc_filler``)
Fill = Callable[[], bool]


@dataclass(frozen=True)
class MembershipDecision:
    """What the survivors of a generation agreed on.

    Attributes:
        kind: ``"failover"``, ``"reconfigure"``, ``"fallback"`` or ``"suspend"``.
        resume: the step to (re-)run (a checkpoint's step after a fallback).
        layout: the new layout (None when suspended).
        previous: the layout before the failure.
    """

    kind: str
    resume: int
    layout: Layout | None
    previous: Layout


class Membership:
    """This rank's view of the generation it is in, and the store protocol around it.

    Args:
        job: the run (timeouts, D, redundancy, checkpoint directory).
        rank: this node's launch rank.
        store: the run's store.
    """

    def __init__(self, job: PipelineJob, rank: int, store: Store) -> None:
        self.job, self.rank, self.store = job, rank, store
        self.gen = 0
        self.layout = Layout.initial(
            job.num_stages, job.num_pipelines, range(job.num_nodes),
            redundancy=job.redundancy != "none",
        )  # fmt: skip

    @property
    def members(self) -> list[int]:
        return self.layout.members

    def dead(self, ranks: Sequence[int] | None = None) -> list[int]:
        """The ranks (default: the members) reported dead."""
        ranks = self.members if ranks is None else ranks
        return [m for m in ranks if self.store.check([keys.dead(m)])]

    def commit(self, step: int, fill: Fill | None) -> None:
        """Return once all members finished ``step``; raise PeerFailure if it is aborted."""
        self.store.set(keys.done(self.gen, step, self.rank), "1")
        deadline = time.monotonic() + self.job.failure_timeout
        while True:
            # Read deaths before completions: a dead rank cannot finish later, so "dead and
            # not done" is final and every survivor reaches the same verdict.
            dead = self.dead()
            done = [m for m in self.members if self.store.check([keys.done(self.gen, step, m)])]
            if len(done) == len(self.members):
                # Committed, whatever happens next: an abort seen now comes from the next step
                # (a faster rank already in it), and failing this step here would leave this
                # rank one optimizer step behind the others.
                return
            if self.store.check([keys.abort(self.gen)]):
                raise PeerFailure(f"generation {self.gen} aborted by a peer")
            if any(m not in done for m in dead):
                raise PeerFailure(f"rank(s) {dead} died before finishing step {step}")
            if time.monotonic() > deadline:
                raise PeerFailure(f"step {step} not finished by all within the failure timeout")
            # Waiting for the slowest stage is bubble too. FRC still queued once every stage
            # is done is dropped: after the commit no failure can need it.
            if fill is None or not fill():
                time.sleep(0.002)

    def await_peers(self, step: int, stage: int, peers: Sequence[int], fill: Fill | None) -> None:
        """Announce this rank at the all-reduce of ``stage`` and wait for ``peers``; raise
        PeerFailure if the generation is aborted (another pipeline fails over) meanwhile."""
        self.store.set(keys.ready(self.gen, step, stage, self.rank), "1")
        while not self.store.check([keys.ready(self.gen, step, stage, m) for m in peers]):
            if self.store.check([keys.abort(self.gen)]):
                raise PeerFailure(f"generation {self.gen} aborted: another pipeline fails over")
            dead = self.dead()
            if dead:
                raise PeerFailure(f"rank(s) {dead} died before the all-reduce")
            if fill is None or not fill():
                time.sleep(0.002)

    def await_step(self, step: int, on_sync: Callable[[int], None]) -> bool:
        """Driven mode: wait (idle) until the driver puts ``step``'s batch in the store (True)
        or says stop (False). Meanwhile call ``on_sync(step)`` once if the driver asks for the
        stage files, and notice ranks reported dead, so a node lost between steps is failed over
        before the next one."""
        served = False
        while True:
            if self.store.check([keys.STOP]):
                return False
            dead = self.dead()
            if dead:
                raise PeerFailure(f"rank(s) {dead} left between steps")
            if not served and self.store.check([keys.sync(step)]):
                on_sync(step)
                served = True
            if self.store.check([keys.batch(step)]):
                return True
            time.sleep(0.002)

    def wait_on_standby(self) -> None:
        """No pipeline for this node: wait, alive, until the run ends. (Bringing a standby node
        into a pipeline — copying a stage's layers to it — is not implemented.)"""
        self.store.set(keys.standby(self.rank), str(self.gen))
        while not self.store.check([keys.STOP]):
            ended = [
                self.store.check([keys.finished(m)])
                or self.store.check([keys.dead(m)])
                or self.store.check([keys.standby(m)])
                for m in self.members
            ]
            if all(ended):
                return
            time.sleep(0.01)

    # ----------------------------------------------------------------- rendezvous
    def rendezvous(self, step: int, reason: str) -> MembershipDecision:
        """Leave this generation, form the next one and adopt the survivors' decision."""
        started = time.monotonic()
        previous = self.layout
        self.store.set(keys.abort(self.gen), str(self.rank))
        self.store.set(keys.report(self.gen, self.rank), reason[:300])
        self.gen += 1
        joined = self._gather(previous.members)
        proposal = self._propose(step, joined)
        decision = json.loads(self.store.compare_set(keys.members(self.gen), "", proposal))
        if decision["kind"] == "suspend":
            return MembershipDecision("suspend", decision["resume"], None, previous)
        layout = Layout.from_dict(decision["layout"])
        if self.rank == min(layout.members):
            self._record_event(decision, layout, started)
        self.layout = layout
        return MembershipDecision(decision["kind"], decision["resume"], layout, previous)

    def _gather(self, old: list[int]) -> list[int]:
        """Join generation ``self.gen``; wait until every old member joined or is dead."""
        self.store.set(keys.join(self.gen, self.rank), "1")
        deadline = time.monotonic() + self.job.failure_timeout
        while True:
            joined = [m for m in old if self.store.check([keys.join(self.gen, m)])]
            dead = self.dead(old)
            if set(joined) | set(dead) >= set(old) or time.monotonic() > deadline:
                return joined
            time.sleep(0.005)

    def _propose(self, step: int, joined: list[int]) -> str:
        """This rank's proposal (JSON) for the new generation."""
        standby = [r for r in self.layout.standby if not self.store.check([keys.dead(r)])]
        recovery = plan_layout(
            self.layout, joined + standby, self.job.num_pipelines,
            redundancy=self.job.redundancy != "none",
        )  # fmt: skip
        resume, kind = step, recovery.kind
        if kind == "fallback":
            directory = self.job.checkpoint_dir
            ckpt = latest_checkpoint(directory, self.job.num_stages) if directory else None
            if ckpt is None:
                kind, recovery = "suspend", LayoutRecovery("suspend", None, recovery.lost)
            else:
                resume = ckpt
        layout = recovery.layout.to_dict() if recovery.layout is not None else None
        return json.dumps(
            {"kind": kind, "resume": resume, "step": step, "lost": list(recovery.lost),
             "reason": recovery.reason, "layout": layout}
        )  # fmt: skip

    def _record_event(self, decision: dict, layout: Layout, started: float) -> None:
        event = {k: v for k, v in decision.items() if k != "layout"}
        event.update(
            members=layout.members, standby=list(layout.standby),
            pipelines=len(layout.pipelines), gen=self.gen,
            seconds=round(time.monotonic() - started, 4),
        )  # fmt: skip
        n = self.store.add(keys.EVENTS, 1)
        self.store.set(keys.event(n), json.dumps(event))
