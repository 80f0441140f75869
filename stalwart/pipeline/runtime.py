"""The worker: interprets its instruction list, keeps replicas fresh, survives lost peers.

One process per node. Each worker owns one or more stages of its pipeline and holds replicas of
its ring successor's stages. Per step it runs its program (see :mod:`stalwart.pipeline.schedule`
and :mod:`stalwart.pipeline.interpreter`) once per data shard of its pipeline, with eager FRC run
on otherwise idle CPU (a SCHED_IDLE thread, or layer by layer while it waits; see
:mod:`stalwart.pipeline.redundancy`); sums each owned stage's gradient over the D pipelines and
sends it to the replica holder (:mod:`stalwart.pipeline.gradients`); commits the step through
the store; pauses the FRC; and then both owner and shadow apply the optimizer — so the replica
equals the owner bit for bit.

On a lost peer (a send/recv raises, or the agent reports a death) the worker reports it in the
store, drops its process groups — closing their sockets wakes every rank blocked on it — and
joins the rendezvous of the next generation on a fresh ``PrefixStore``
(:mod:`stalwart.pipeline.membership`). The survivors agree on a new
:class:`~stalwart.pipeline.placement.Layout` and the pipeline that lost a node re-runs the
interrupted step (communication comes before computation, so the step is re-runnable): the
shadow now also runs the victim's merged stream, reusing the eager-FRC outputs and saved
intermediates of that step for the victim's forward and backward (lazy BRC). Whole pipelines
keep the gradients they finished and only re-join the all-reduce. A pipeline with a stage that
has no live copy is dropped (its shards go to the others); when no pipeline is whole, the
survivors load the last complete checkpoint (:mod:`stalwart.pipeline.stage_files`) instead.

Run as ``python -m stalwart.pipeline.runtime --job JOB.json --rank R --port PORT``; the
launcher (:mod:`stalwart.pipeline.launch`) or a node agent (:mod:`stalwart.pipeline.node`)
does that. The exit code is 0 when the node finished or was sent away by the survivors, and
:data:`SUSPENDED` when the job is suspended (no node left to continue).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import torch
from torch.distributed import PrefixStore, Store, TCPStore

from stalwart.pipeline import keys
from stalwart.pipeline.faults import Fault, FaultInjector
from stalwart.pipeline.gradients import GradientSync
from stalwart.pipeline.held_stages import HeldStages
from stalwart.pipeline.interpreter import StepInterpreter
from stalwart.pipeline.job import PipelineJob
from stalwart.pipeline.links import PeerFailure, PeerLinks
from stalwart.pipeline.membership import Membership
from stalwart.pipeline.microbatches import MicroBatches
from stalwart.pipeline.op_profile import OpProfile
from stalwart.pipeline.placement import Layout, Placement
from stalwart.pipeline.redundancy import EagerFRC, frc_filler
from stalwart.pipeline.schedule import SCHEDULES, Instruction, Op, node_stream
from stalwart.pipeline.workloads import load_workload

#: exit code of a worker whose job is suspended (too few nodes left, no checkpoint to go on from)
SUSPENDED = 3


class NodeLeaves(Exception):
    """The survivors' decision sends this node away; ``exit_code`` is what its process returns.

    Internal control flow: :meth:`StageWorker.train` catches it and returns the code.
    """

    def __init__(self, exit_code: int) -> None:
        super().__init__(exit_code)
        self.exit_code = exit_code


def worker_device(job: PipelineJob, rank: int) -> torch.device:
    """The CPU, or with ``device="cuda"`` this process's GPU (by ``LOCAL_RANK``)."""
    if job.device != "cuda":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


class StageWorker:
    """One pipeline node: the training loop, its step, and recovery. See the module docstring.

    Args:
        job: the (validated) run.
        rank: this node's launch rank.
        store: the run's store (prefixed with :data:`~stalwart.pipeline.keys.RUN_PREFIX`).
        faults: faults to inject into this process.
    """

    def __init__(self, job: PipelineJob, rank: int, store: Store, faults: list[Fault]) -> None:
        self.job, self.rank, self.store = job, rank, store
        self.injector = FaultInjector(rank, faults)
        self.device = worker_device(job, rank)
        workload = load_workload(job.workload, job.workload_kwargs)
        self.membership = Membership(job, rank, store)
        self.stages = HeldStages(job, workload, self.device)
        self.stages.build(self._held_stages(), checkpoint=None)
        self.batches = MicroBatches(job, workload, store, self.device)
        self.links = PeerLinks(store, self.device, job.failure_timeout, ranks=job.num_nodes)
        self.profile = OpProfile(run_queue=job.profile)
        self.base = SCHEDULES[job.schedule](job.num_stages, job.num_microbatches)
        self.interpreter = StepInterpreter(
            rank, self.stages, self.batches, self.links, self.profile, self.injector, store,
            self._new_frc(),
        )  # fmt: skip
        self.gradients = GradientSync(
            rank, self.stages, self.links, self.membership, self.interpreter
        )
        self._step = 0
        self._done_shards: set[int] = set()  # shards whose backward this rank finished this step
        self._interrupted = False  # a program was cut short by a failure
        self._program: tuple[object, list[Instruction]] = (None, [])
        self._started = 0.0

    # ----------------------------------------------------------------- placement
    @property
    def frc(self) -> EagerFRC:
        return self.interpreter.frc

    @property
    def placement(self) -> Placement:
        """This rank's pipeline."""
        layout = self.membership.layout
        index = layout.pipeline_of(self.rank)
        if index is None:
            raise RuntimeError(f"rank {self.rank} is on standby: it has no pipeline")
        return layout.pipelines[index]

    @property
    def shards(self) -> tuple[int, ...]:
        """The data shards this rank's pipeline trains each step."""
        layout = self.membership.layout
        index = layout.pipeline_of(self.rank)
        return () if index is None else layout.shards[index]

    def _held_stages(self) -> list[int]:
        return self.placement.stages_of(self.rank) + self.placement.replicas_of(self.rank)

    def _new_frc(self) -> EagerFRC:
        executor = self.job.frc_executor
        if self.job.redundancy != "eager" or self.device.type != "cpu":
            # Nothing to run (no idle thread needed), or on a GPU: FRC is launched from the main
            # thread and overlaps through the device's streams.
            executor = "main_thread"
        return EagerFRC(self.stages.modules, self._frc_input, executor)

    def _frc_input(self, stage: int, mb: int) -> torch.Tensor:
        if stage != 0:
            raise RuntimeError(f"FRC of stage {stage} has no input (its predecessor's is gone)")
        return self.batches.get(self._step, mb)[0]

    def program(self, shards: Sequence[int]) -> list[Instruction]:
        """This rank's instruction list for the current placement, one pass per data shard
        (micro-batch ``k`` of shard ``j`` is global micro-batch ``j * M + k``). Built once per
        generation: a merged stream costs a symbolic run of the whole schedule."""
        placement = self.placement
        key = (self.membership.gen, placement)
        if self._program[0] != key:
            own, replicas = placement.stages_of(self.rank), placement.replicas_of(self.rank)
            eager = self.job.redundancy == "eager"
            self._program = (key, node_stream(self.base, own, replicas, eager))
        one, m = self._program[1], self.job.num_microbatches
        return [Instruction(i.op, i.stage, j * m + i.mb) for j in shards for i in one]

    # ----------------------------------------------------------------- one step
    def run_step(self, step: int) -> None:
        """Execute this rank's program for the shards of ``step`` it has not finished, reduce
        the gradients across pipelines and send them to the replica holders."""
        todo = [j for j in self.shards if j not in self._done_shards]
        if todo and self.gradients.local:
            self.gradients.restore_local()
        if todo:
            self.store.add(keys.programs(self.rank), 1)
        self._step = step
        self.injector.check(step, None)
        self.profile.restart()
        self._interrupted = bool(todo)  # until the program completes
        self.frc.resume()  # paused since the last commit or failure
        losses = self.interpreter.run(step, self.placement.owner, self.program(todo))
        # The program is finished once its messages are delivered. A failure seen at the
        # all-reduce makes this rank drop its links; a neighbour still receiving our last
        # gradient would be cut short and re-run shards the rest of its (whole) pipeline
        # keeps: their programs would differ until the failure timeout.
        self.links.wait_sends()
        self.profile.tick("WaitSends")
        self._done_shards |= set(todo)
        self._interrupted = False
        m = self.job.num_microbatches
        for j in todo if losses else ():
            mean = sum(losses[j * m + k] for k in range(m)) / m
            self.store.set(keys.shard_loss(step, j), repr(mean))
        self.gradients.reduce(step, self.placement)
        self.profile.tick("AllReduce")
        self.gradients.exchange_replicas(self.placement)
        self.profile.tick("ReplicaGrads")
        if self.job.frc_policy == "complete":
            # What did not fit into idle time, run here at normal priority before "done" (the
            # idle thread, paused by finish(), could be starved by the other stages).
            self.frc.finish()
            self.profile.tick(Op.FRC.value)
        self.links.wait_sends()
        self.profile.tick("WaitSends")

    def _run_and_commit(self, step: int) -> None:
        if not self.links.connected:
            self.links.connect(self.membership.gen, self.membership.members, self.rank)
        self._started = time.perf_counter()
        self.profile.reset()
        self.frc.completed = self.frc.posted = 0
        self.frc.thread_clock = [0.0, 0.0, 0, 0.0]
        self.run_step(step)
        self.membership.commit(step, frc_filler(self.frc, self.profile, "Commit"))
        self.profile.tick("Commit")

    def _apply_step(self, step: int) -> None:
        """The step committed: optimizer steps, then what the launcher reads."""
        frc_done = self.frc.completed
        # Owned stages first: meanwhile the idle thread may finish its FRC layer in flight.
        # The replicas' weights must not change under it: pause it, then step.
        replicas = self.placement.replicas_of(self.rank)
        self.stages.optimizer_step([s for s in self.stages.modules if s not in replicas])
        self.profile.tick("OptimizerStep")
        self.frc.pause()
        self.profile.tick("FRCPause")
        self.stages.optimizer_step(replicas)
        self._done_shards, self.gradients.local = set(), {}
        self.frc.forget()
        self.profile.tick("OptimizerStep")
        if self.job.profile:
            self._publish_profile(step, frc_done)
        if self.rank == self.membership.layout.pipelines[0].owner[self.job.num_stages - 1]:
            self._publish_loss(step)
        if self.job.verify_replicas:
            publish_digests(self.store, self.stages, self.membership.layout, self.rank, step)

    # ----------------------------------------------------------------- what others read
    def _publish_profile(self, step: int, frc_done: int) -> None:
        if self.frc.thread_clock[2]:  # the idle thread's FRC: not in our ticks
            self.profile.add(Op.FRC.value, self.frc.thread_clock)
        self.profile.entries["frc_tasks"] = [frc_done, self.frc.posted, 0]
        self.store.set(keys.profile(step, self.rank), json.dumps(self.profile.entries))

    def _publish_loss(self, step: int) -> None:
        d = self.job.num_pipelines
        loss = sum(float(self.store.get(keys.shard_loss(step, j))) for j in range(d)) / d
        self.store.set(keys.step_time(step), repr(time.perf_counter() - self._started))
        self.store.set(keys.loss(step), repr(loss))

    def _checkpoint(self, step: int) -> None:
        if self.job.checkpoint_dir is None or self.membership.layout.pipeline_of(self.rank) != 0:
            return  # pipelines hold identical weights: the first one writes them
        self.stages.save(step, self.placement.stages_of(self.rank))

    # ----------------------------------------------------------------- main loop
    def train(self) -> int:
        """Run steps until ``job.steps`` (or, driven, until the driver says stop), failing
        over, reconfiguring or falling back whenever a peer is lost. Returns the process's
        exit code (see the module docstring)."""
        try:
            self._train()
        except NodeLeaves as leaving:
            return leaving.exit_code
        self.store.set(keys.finished(self.rank), "1")
        return 0

    def _train(self) -> None:
        if self.membership.layout.pipeline_of(self.rank) is None:
            self.membership.wait_on_standby()
            return
        self._checkpoint(0)
        step = 0
        driven = self.job.batches_from_store
        while driven or step < self.job.steps:
            try:
                if driven and not self.membership.await_step(step, self._checkpoint):
                    break
                self._run_and_commit(step)
            except PeerFailure as exc:
                # Only the message outlives this block: the exception's traceback holds frames
                # that hold the broken groups, whose sockets must close (see links.drop).
                reason = str(exc)
                self.frc.pause()  # recovery works on the FRC queue and cache itself
            else:
                self._apply_step(step)
                step += 1
                if self.job.checkpoint_every and step % self.job.checkpoint_every == 0:
                    self._checkpoint(step)
                continue
            self.links.drop()
            resume = self._recover(step, reason)
            if resume is None:  # on standby now
                self.membership.wait_on_standby()
                return
            step = resume
        if not driven and (self.job.checkpoint_every == 0 or step % self.job.checkpoint_every):
            self._checkpoint(step)  # the final weights, for whoever launched us

    # ----------------------------------------------------------------- recovery
    def _recover(self, step: int, reason: str) -> int | None:
        """Agree on the next generation and adapt to it; the step to (re-)run, or None on
        standby. Raises NodeLeaves if this node is sent away or the job is suspended."""
        decision = self.membership.rendezvous(step, reason)
        if decision.kind == "suspend" or decision.layout is None:
            self.store.set(keys.left(self.rank), "suspend")
            raise NodeLeaves(SUSPENDED)
        if self.rank not in decision.layout.members:
            if self.rank in decision.layout.standby:
                return None
            self.store.set(keys.left(self.rank), decision.kind)
            raise NodeLeaves(0)
        previous = decision.previous
        before = None
        if (index := previous.pipeline_of(self.rank)) is not None:
            before = previous.pipelines[index]
        if decision.kind == "fallback":
            self.stages.build(self._held_stages(), checkpoint=decision.resume)
            self.frc.close()
            self.interpreter.frc = self._new_frc()
            changed = True
        else:
            own = self.placement.stages_of(self.rank)
            keep = set(own) | set(self.placement.replicas_of(self.rank))
            self.stages.keep(keep)
            # The victim's stages are ours now: finish their queued FRC (that forward is needed
            # for the re-run anyway) and keep the FRC cached for stages still held.
            self.frc.forget(keep)
            self.frc.finish(own)
            # A program cut short left a partial gradient sum: that is redone as well.
            changed = before != self.placement or self._interrupted
        if changed:  # this pipeline lost a node: it re-runs the step from the start
            self.stages.zero_grads()
            self._done_shards, self.gradients.local = set(), {}
        self._interrupted = False
        # else: the pipeline is whole; it keeps the gradients of the shards it finished and
        # only (re-)joins the all-reduce (and trains any shards a dropped pipeline left it).
        return decision.resume


def publish_digests(store: Store, stages: HeldStages, layout: Layout, rank: int, step: int) -> None:
    """Publish the state digest of every stage ``rank`` holds after ``step``, in its role (an
    owner's only where there is another copy to compare it with)."""
    index = layout.pipeline_of(rank)
    placement = layout.pipelines[index]
    owner, replica = keys.role("owner", index), keys.role("replica", index)
    for s in placement.stages_of(rank):
        if placement.replica[s] is not None or len(layout.pipelines) > 1:
            store.set(keys.digest(step, s, owner), stages.digest(s))
    for s in placement.replicas_of(rank):
        store.set(keys.digest(step, s, replica), stages.digest(s))


def run_worker(
    job_json: str, rank: int, port: int, faults_json: str = "[]", host: str = "127.0.0.1"
) -> NoReturn:
    """Entry point of one worker process (forked or started with ``python -m``); ends the
    process with its exit code (see :func:`end_process`)."""
    torch.set_num_threads(1)

    job = PipelineJob.from_json(job_json)
    faults = [Fault(**f) for f in json.loads(faults_json)]
    timeout = datetime.timedelta(seconds=max(30.0, job.failure_timeout))
    store = PrefixStore(keys.RUN_PREFIX, TCPStore(host, port, is_master=False, timeout=timeout))

    def leave(signum: int, frame: object) -> None:
        # A preemption notice: this node leaves; the others carry on without it.
        store.set(keys.dead(rank), "preempted (SIGTERM)")
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    worker = StageWorker(job, rank, store, faults)
    try:
        code = worker.train()
    finally:
        worker.frc.close()
    end_process(code)  # while this frame still holds the worker


def end_process(code: int) -> NoReturn:
    """Flush and leave with ``code`` at once, the worker (and through it its gloo groups) still
    referenced by the caller, so no destructor of a group runs at the end.

    Returning would drop the worker and destroy its last generation's groups while the peers
    exit and close their ends; once in a fresh clone's ``make test`` a surviving rank of a
    kill test aborted right there in glibc (``free(): invalid pointer``, a use-after-free of
    the kind pytorch/gloo#320 describes in gloo's teardown). The process is done: its results
    are in the store, its files are closed, and the kernel closes the sockets at exit anyway,
    which wakes any peer still blocked on this rank as the destructors would.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> NoReturn:
    parser = argparse.ArgumentParser(description="one redundant-pipeline worker")
    parser.add_argument("--job", required=True, help="job JSON file")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--faults", default="[]", help="JSON list of Fault dicts")
    args = parser.parse_args(argv)
    run_worker(Path(args.job).read_text(), args.rank, args.port, args.faults, args.host)


if __name__ == "__main__":
    main()
