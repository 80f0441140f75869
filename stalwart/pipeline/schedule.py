"""Pipeline schedules as data: one instruction list per stage, and the transforms on them.

A schedule is a plain list of :class:`Instruction` per stage. Micro-batch id == buffer id, so
an instruction names the buffer it reads and writes and a failed step can be re-run from the
same list. Within a step communication comes before the computation that needs it.

Transforms (pure functions, tested without processes):

* :func:`one_f_one_b` / :func:`gpipe` — the per-stage lists of a synchronous step.
* :func:`merge_streams` — the failover merge (thesis §3.5.2): the shadow runs the victim's
  stream merged into its own; messages between the two are dropped, the victim's external
  messages go first, and backward runs before forward so intermediates are freed early.
* :func:`add_eager_frc` — eager forward redundant computation placed right after the send to
  the successor, i.e. in the bubble where the stage would otherwise wait for its successor.
* :func:`check_streams` — executes a set of rank programs symbolically (non-blocking sends,
  blocking receives) and reports a deadlock or a broken data dependency.

Example:
    >>> streams = one_f_one_b(num_stages=4, num_microbatches=4)
    >>> merged = merge_streams(streams[1], streams[2], streams)   # stage 2's node is gone
    >>> check_streams({0: streams[0], 1: merged, 3: streams[3]}, 4, 4).ok
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from stalwart.errors import ConfigurationError


class Op(str, Enum):
    LOAD = "LoadMicroBatch"
    RECV_ACT = "RecvActivation"
    FORWARD = "Forward"
    SEND_ACT = "SendActivation"
    RECV_GRAD = "RecvGrad"
    BACKWARD = "Backward"
    SEND_GRAD = "SendGrad"
    FRC = "ForwardRedundant"


COMMUNICATION = frozenset({Op.RECV_ACT, Op.SEND_ACT, Op.RECV_GRAD, Op.SEND_GRAD})


@dataclass(frozen=True)
class Instruction:
    """One step of a stage's program.

    Args:
        op: what to do.
        stage: the pipeline stage whose layers (or whose buffers) the instruction uses.
        mb: micro-batch id, which is also the buffer id.
    """

    op: Op
    stage: int
    mb: int

    @property
    def is_comm(self) -> bool:
        return self.op in COMMUNICATION

    def peer_stage(self) -> int | None:
        """The stage at the other end of a message (``None`` for computation)."""
        if self.op in (Op.RECV_ACT, Op.SEND_GRAD):
            return self.stage - 1
        if self.op in (Op.SEND_ACT, Op.RECV_GRAD):
            return self.stage + 1
        return None

    def __repr__(self) -> str:
        return f"{self.op.value}({self.stage},{self.mb})"


def _validate(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ConfigurationError(f"num_stages={num_stages}: a pipeline needs at least 1 stage.")
    if num_microbatches < 1:
        raise ConfigurationError(
            f"num_microbatches={num_microbatches}: a step needs at least 1 micro-batch."
        )


def _forward(stage: int, mb: int, last: int) -> list[Instruction]:
    out = [Instruction(Op.LOAD if stage == 0 else Op.RECV_ACT, stage, mb)]
    if stage == last and stage != 0:
        out.append(Instruction(Op.LOAD, stage, mb))  # the last stage loads the labels
    out.append(Instruction(Op.FORWARD, stage, mb))
    if stage < last:
        out.append(Instruction(Op.SEND_ACT, stage, mb))
    return out


def _backward(stage: int, mb: int, last: int) -> list[Instruction]:
    out = [] if stage == last else [Instruction(Op.RECV_GRAD, stage, mb)]
    out.append(Instruction(Op.BACKWARD, stage, mb))
    if stage > 0:
        out.append(Instruction(Op.SEND_GRAD, stage, mb))
    return out


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Instruction]]:
    """PipeDream-flush 1F1B: stage n runs ``P - n - 1`` warm-up forwards, then alternates."""
    _validate(num_stages, num_microbatches)
    last = num_stages - 1
    streams = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        prog: list[Instruction] = []
        for mb in range(warmup):
            prog += _forward(stage, mb, last)
        for i in range(num_microbatches - warmup):
            prog += _forward(stage, warmup + i, last)
            prog += _backward(stage, i, last)
        for mb in range(num_microbatches - warmup, num_microbatches):
            prog += _backward(stage, mb, last)
        streams.append(prog)
    return streams


def gpipe(num_stages: int, num_microbatches: int) -> list[list[Instruction]]:
    """GPipe: all forwards, then all backwards (in reverse micro-batch order)."""
    _validate(num_stages, num_microbatches)
    last = num_stages - 1
    return [
        [i for mb in range(num_microbatches) for i in _forward(stage, mb, last)]
        + [i for mb in reversed(range(num_microbatches)) for i in _backward(stage, mb, last)]
        for stage in range(num_stages)
    ]


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


def _stages(stream: Iterable[Instruction]) -> set[int]:
    return {i.stage for i in stream if i.op is not Op.FRC}


def timeline(streams: Sequence[Sequence[Instruction]]) -> dict[Instruction, int]:
    """The tick at which each instruction of a full schedule runs, with unit-time compute.

    Each tick a stage runs its ready receives, at most one forward/backward and the sends
    after it; a message sent in tick t can be received from tick t + 1.
    """
    pc = [0] * len(streams)
    avail: set[tuple[Op, int, int]] = set()
    when: dict[Instruction, int] = {}
    tick = 0
    while any(pc[r] < len(p) for r, p in enumerate(streams)):
        posted: set[tuple[Op, int, int]] = set()
        progressed = False
        for r, prog in enumerate(streams):
            computed = False
            while pc[r] < len(prog):
                ins = prog[pc[r]]
                if ins.op is Op.RECV_ACT and (Op.SEND_ACT, ins.stage - 1, ins.mb) not in avail:
                    break
                if ins.op is Op.RECV_GRAD and (Op.SEND_GRAD, ins.stage + 1, ins.mb) not in avail:
                    break
                if ins.op in (Op.FORWARD, Op.BACKWARD):
                    if computed:
                        break
                    computed = True
                if ins.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    posted.add((ins.op, ins.stage, ins.mb))
                when[ins] = tick
                pc[r] += 1
                progressed = True
        if not progressed:
            raise ConfigurationError("the base schedule deadlocks; it cannot be merged")
        avail |= posted
        tick += 1
    return when


def merge_streams(
    shadow: Sequence[Instruction],
    victim: Sequence[Instruction],
    base: Sequence[Sequence[Instruction]],
) -> list[Instruction]:
    """Merge the victim's stream into its shadow's (thesis §3.5.2, Figure 3.10).

    Rules: messages that went between shadow and victim are dropped (they become local
    hand-offs); communication comes before computation; the victim's external messages come
    first; computation runs backward before forward (the later stage's backward first, since
    it feeds the earlier one). The two streams are interleaved in the order their instructions
    ran in the original pipeline (``base``'s :func:`timeline`), each keeping its own order, and
    the rules break ties. Aligning by time rather than by group index is what keeps the merge
    deadlock-free when the victim is *upstream* of its shadow — stage 0, whose shadow is the
    last stage.

    Args:
        shadow: the stream of the node that holds the victim's replica.
        victim: the stream of the node that is gone.
        base: the full original schedule (one stream per stage) both come from.
    """
    when = timeline(base)
    local = _stages(shadow) | _stages(victim)

    def keep(ins: Instruction) -> bool:
        return not ins.is_comm or ins.peer_stage() not in local

    def rank(ins: Instruction, is_victim: bool) -> tuple:
        if ins.is_comm:
            category = 0 if is_victim else 1
        elif ins.op is Op.LOAD:
            category = 2
        elif ins.op is Op.BACKWARD:
            return (when[ins], 3, -ins.stage)
        else:
            category = 4
        return (when[ins], category, ins.stage if category == 4 else 0)

    v = [i for i in victim if keep(i)]
    s = [i for i in shadow if keep(i)]
    merged: list[Instruction] = []
    while v or s:
        if v and (not s or rank(v[0], True) <= rank(s[0], False)):
            merged.append(v.pop(0))
        else:
            merged.append(s.pop(0))
    return _settle(merged)


def _settle(stream: list[Instruction]) -> list[Instruction]:
    """Move each local forward/backward after the local computation it now depends on.

    Zipping groups keeps each stage's own order, but a group of the later stage can reach a
    forward whose input the earlier stage computes one group later (and symmetrically for
    backward). Such an instruction is delayed until its producer has run; nothing is reordered
    otherwise.
    """
    stages = _stages(stream)
    done: set[tuple[Op, int, int]] = set()
    pending: list[Instruction] = []
    out: list[Instruction] = []

    def ready(ins: Instruction) -> bool:
        if ins.op is Op.FORWARD and ins.stage - 1 in stages:
            return (Op.FORWARD, ins.stage - 1, ins.mb) in done
        if ins.op is Op.BACKWARD and ins.stage + 1 in stages:
            return (Op.BACKWARD, ins.stage + 1, ins.mb) in done
        return True

    def emit(ins: Instruction) -> None:
        out.append(ins)
        done.add((ins.op, ins.stage, ins.mb))

    for ins in stream:
        blocked_stage = any(p.stage == ins.stage for p in pending)
        if blocked_stage or not ready(ins):
            pending.append(ins)
            continue
        emit(ins)
        progressed = True
        while progressed:
            progressed = False
            for p in list(pending):
                first_of_stage = next(q for q in pending if q.stage == p.stage) is p
                if first_of_stage and ready(p):
                    pending.remove(p)
                    emit(p)
                    progressed = True
                    break
    out += pending
    return out


def add_eager_frc(
    stream: Sequence[Instruction], last_own_stage: int, replica_stages: Sequence[int]
) -> list[Instruction]:
    """Insert forward redundant computation (FRC) for the replica stages.

    The node runs its successor's layers on its own output right after posting the send to
    the successor (the send is non-blocking, so the successor is not delayed) and before its
    next blocking wait — the bubble of thesis §3.5.2. The node holding stage 0's replica has no
    own output to feed it: it loads the input itself and runs FRC before it waits for its next
    activation.

    Args:
        stream: the node's (possibly merged) stream.
        last_own_stage: the highest stage the node owns.
        replica_stages: the stages whose replicas the node holds, in pipeline order.
    """
    if not replica_stages:
        return list(stream)
    out: list[Instruction] = []
    wraps = replica_stages[0] == 0
    seen: set[int] = set()
    for ins in stream:
        if wraps and ins.op in (Op.RECV_ACT, Op.LOAD) and ins.mb not in seen:
            seen.add(ins.mb)
            out += [Instruction(Op.FRC, s, ins.mb) for s in replica_stages]
        out.append(ins)
        if not wraps and ins.op is Op.SEND_ACT and ins.stage == last_own_stage:
            out += [Instruction(Op.FRC, s, ins.mb) for s in replica_stages]
    return out


def node_stream(
    base: Sequence[Sequence[Instruction]],
    own_stages: Sequence[int],
    replica_stages: Sequence[int],
    eager_frc: bool,
) -> list[Instruction]:
    """The stream of a node that owns ``own_stages`` (merged, in order) and holds the replicas
    of ``replica_stages``, with eager FRC marks if ``eager_frc``.

    Args:
        base: every stage's own stream (one schedule's output).
        own_stages: the stages the node owns, ascending (more than one after a failover).
        replica_stages: the stages whose replicas it holds.
        eager_frc: insert :func:`add_eager_frc` marks.
    """
    stream = list(base[own_stages[0]])
    for s in own_stages[1:]:
        stream = merge_streams(stream, base[s], base)
    if eager_frc:
        stream = add_eager_frc(stream, own_stages[-1], replica_stages)
    return stream


@dataclass
class StreamCheck:
    """Outcome of :func:`check_streams`."""

    ok: bool
    reason: str = ""
    executed: int = 0


def check_streams(
    programs: dict[int, Sequence[Instruction]], num_stages: int, num_microbatches: int
) -> StreamCheck:
    """Run rank programs symbolically and check they complete one step correctly.

    Sends never block (the runtime posts them with ``isend``); a receive blocks until the
    matching send has been posted. Checks every (stage, micro-batch) gets exactly one forward
    and one backward, each after its inputs exist, and that no rank waits forever.

    Args:
        programs: rank -> its instruction list; every stage must be owned by exactly one rank.
        num_stages: P.
        num_microbatches: M.
    """
    owner: dict[int, int] = {}
    for rank, prog in programs.items():
        for s in _stages(prog):
            if owner.setdefault(s, rank) != rank:
                return StreamCheck(False, f"stage {s} is run by ranks {owner[s]} and {rank}")
    if sorted(owner) != list(range(num_stages)):
        return StreamCheck(False, f"stages owned {sorted(owner)} != 0..{num_stages - 1}")
    run = _SymbolicRun(programs, owner, num_stages)
    failure = run.run()
    if failure is not None:
        return StreamCheck(False, failure, run.executed)
    for s in range(num_stages):
        for k in range(num_microbatches):
            for op in (Op.FORWARD, Op.BACKWARD):
                if (op, s, k) not in run.done:
                    return StreamCheck(False, f"{op.value}({s},{k}) never ran", run.executed)
    return StreamCheck(True, "", run.executed)


class _SymbolicRun:
    """Rank programs executed symbolically: the messages posted and the instructions done."""

    def __init__(
        self, programs: dict[int, Sequence[Instruction]], owner: dict[int, int], num_stages: int
    ) -> None:
        self.programs, self.owner, self.last = programs, owner, num_stages - 1
        self.mailbox: set[tuple[str, int, int]] = set()  # (kind, receiving stage, mb)
        self.done: set[tuple[Op, int, int]] = set()
        self.pc = dict.fromkeys(programs, 0)
        self.executed = 0

    def run(self) -> str | None:
        """Run every rank as far as it can until all finish; the first failure, if any."""
        while True:
            progressed = False
            for rank, prog in self.programs.items():
                moved = self._advance(rank, prog)
                if isinstance(moved, str):
                    return moved
                progressed |= moved
            if all(self.pc[r] == len(p) for r, p in self.programs.items()):
                return None
            if not progressed:
                stuck = {
                    r: prog[self.pc[r]] for r, prog in self.programs.items()
                    if self.pc[r] < len(prog)
                }  # fmt: skip
                return f"deadlock: ranks wait at {stuck}"

    def _advance(self, rank: int, prog: Sequence[Instruction]) -> bool | str:
        """Run ``rank`` until it blocks; whether it moved, or what went wrong."""
        moved = False
        while self.pc[rank] < len(prog):
            ins = prog[self.pc[rank]]
            result = self._step(rank, ins)
            if isinstance(result, str):
                return f"rank {rank}: {result}"
            if not result:
                break
            self.done.add((ins.op, ins.stage, ins.mb))
            self.pc[rank] += 1
            self.executed += 1
            moved = True
        return moved

    def _local(self, rank: int, stage: int) -> bool:
        return self.owner.get(stage) == rank

    def _step(self, rank: int, ins: Instruction) -> bool | str:
        """Whether ``ins`` can run now (False: it blocks), or why it is wrong."""
        s, k = ins.stage, ins.mb
        if ins.op is Op.RECV_ACT:
            return ("act", s, k) in self.mailbox
        if ins.op is Op.RECV_GRAD:
            return ("grad", s, k) in self.mailbox
        if ins.op is Op.SEND_ACT:
            if (Op.FORWARD, s, k) not in self.done:
                return f"{ins} before its forward"
            self.mailbox.add(("act", s + 1, k))
        elif ins.op is Op.SEND_GRAD:
            if (Op.BACKWARD, s, k) not in self.done:
                return f"{ins} before its backward"
            self.mailbox.add(("grad", s - 1, k))
        elif ins.op is Op.FORWARD:
            return self._forward(rank, ins)
        elif ins.op is Op.BACKWARD:
            return self._backward(rank, ins)
        return True

    def _forward(self, rank: int, ins: Instruction) -> bool | str:
        s, k = ins.stage, ins.mb
        if s == 0:
            have = (Op.LOAD, 0, k) in self.done
        elif self._local(rank, s - 1):
            have = (Op.FORWARD, s - 1, k) in self.done
        else:
            have = (Op.RECV_ACT, s, k) in self.done
        if not have:
            return f"{ins} without its input"
        if (Op.FORWARD, s, k) in self.done:
            return f"{ins} twice"
        return True

    def _backward(self, rank: int, ins: Instruction) -> bool | str:
        s, k = ins.stage, ins.mb
        if (Op.FORWARD, s, k) not in self.done:
            return f"{ins} before its forward"
        if s != self.last:
            src = Op.BACKWARD if self._local(rank, s + 1) else Op.RECV_GRAD
            if (src, s + 1 if src is Op.BACKWARD else s, k) not in self.done:
                return f"{ins} without its output gradient"
        if (Op.BACKWARD, s, k) in self.done:
            return f"{ins} twice"
        return True
