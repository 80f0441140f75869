"""Schedules, the redundancy transform and the failover merge, as pure data (no processes)."""

from __future__ import annotations

import itertools

import pytest

from stalwart.errors import ConfigurationError
from stalwart.pipeline.placement import Placement, plan_recovery
from stalwart.pipeline.schedule import (
    SCHEDULES,
    Instruction,
    Op,
    add_eager_frc,
    check_streams,
    merge_streams,
    one_f_one_b,
    timeline,
)


def I(op, stage, mb):  # noqa: E743 - short name keeps the expected lists readable
    return Instruction(op, stage, mb)


def rank_programs(base, placement):
    progs = {}
    for rank in placement.ranks:
        own = placement.stages_of(rank)
        prog = list(base[own[0]])
        for stage in own[1:]:
            prog = merge_streams(prog, base[stage], base)
        progs[rank] = prog
    return progs


def test_one_f_one_b_shape():
    streams = one_f_one_b(4, 4)
    first = [i for i in streams[0] if i.op in (Op.FORWARD, Op.BACKWARD)]
    # Stage 0 warms up with P - 1 = 3 forwards, then alternates one forward, one backward.
    assert [i.op for i in first[:5]] == [Op.FORWARD] * 4 + [Op.BACKWARD]
    last = [i.op for i in streams[3] if i.op in (Op.FORWARD, Op.BACKWARD)]
    assert last == [Op.FORWARD, Op.BACKWARD] * 4
    # The last stage loads labels; stage 0 loads inputs.
    assert I(Op.LOAD, 3, 0) in streams[3] and I(Op.LOAD, 0, 0) in streams[0]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedules_run_and_receive_before_computing(name):
    for p, m in itertools.product(range(1, 7), range(1, 7)):
        streams = SCHEDULES[name](p, m)
        assert check_streams(dict(enumerate(streams)), p, m).ok
        for prog in streams:
            for idx, ins in enumerate(prog):
                if ins.op is Op.RECV_ACT:  # the receive of a buffer precedes its forward
                    assert prog.index(I(Op.FORWARD, ins.stage, ins.mb)) > idx


def test_bad_schedule_arguments():
    with pytest.raises(ConfigurationError, match="at least 1 stage"):
        one_f_one_b(0, 4)
    with pytest.raises(ConfigurationError, match="micro-batch"):
        one_f_one_b(4, 0)


def test_merge_drops_mutual_messages_and_keeps_external_ones():
    base = one_f_one_b(4, 4)
    merged = merge_streams(base[1], base[2], base)
    comm = [i for i in merged if i.is_comm]
    # Messages between stage 1 and stage 2 are gone ...
    assert not [i for i in comm if {i.stage, i.peer_stage()} == {1, 2}]
    # ... and every external message of both streams is kept, in each stream's own order.
    for stage in (1, 2):
        external = [i for i in base[stage] if i.is_comm and i.peer_stage() not in (1, 2)]
        assert [i for i in comm if i.stage == stage] == external
    # Each stage's computation keeps its order.
    for stage in (1, 2):
        comp = [i for i in base[stage] if not i.is_comm]
        assert [i for i in merged if not i.is_comm and i.stage == stage] == comp


def test_merge_tie_rules_victim_comm_first_backward_before_forward():
    base = one_f_one_b(4, 4)
    when = timeline(base)
    merged = merge_streams(base[1], base[2], base)
    for a, b in itertools.pairwise(merged):
        if when[a] != when[b] or a.stage == b.stage:
            continue
        # Same tick, different streams: the victim's (stage 2) external message comes first,
        # communication precedes computation, backward precedes forward.
        if a.is_comm and b.is_comm:
            assert a.stage == 2
        if b.is_comm:
            assert a.is_comm
        if Op.BACKWARD in (a.op, b.op) and Op.FORWARD in (a.op, b.op):
            assert a.op is Op.BACKWARD


def test_merge_wraparound_victim_upstream_of_shadow():
    # Stage 0's node is lost; its replica lives on the last node, which now runs both.
    base = one_f_one_b(4, 4)
    merged = merge_streams(base[3], base[0], base)
    assert check_streams({1: base[1], 2: base[2], 3: merged}, 4, 4).ok


def test_every_failover_and_fallback_placement_runs_to_completion():
    """All sets of lost nodes for P <= 5, then one more failure after a failover."""
    checked = 0
    for name, make in SCHEDULES.items():
        for p, m in itertools.product(range(2, 6), (1, 3, 5)):
            base = make(p, m)
            start = Placement.initial(p, list(range(p)))
            for k in range(1, p):
                for lost in itertools.combinations(range(p), k):
                    rec = plan_recovery(start, [r for r in range(p) if r not in lost])
                    result = check_streams(rank_programs(base, rec.placement), p, m)
                    assert result.ok, (name, p, m, lost, result.reason)
                    checked += 1
                    if rec.kind != "failover":
                        continue
                    for second in rec.placement.ranks:
                        alive = [r for r in rec.placement.ranks if r != second]
                        rec2 = plan_recovery(rec.placement, alive)
                        if rec2.kind == "suspend":  # nobody left
                            assert not alive
                            continue
                        result = check_streams(rank_programs(base, rec2.placement), p, m)
                        assert result.ok, (name, p, m, lost, second, result.reason)
                        checked += 1
    assert checked > 500


def test_check_streams_detects_deadlock_and_missing_work():
    base = one_f_one_b(3, 2)
    swapped = list(base[1])
    swapped.insert(0, swapped.pop(swapped.index(I(Op.RECV_GRAD, 1, 0))))
    result = check_streams({0: base[0], 1: swapped, 2: base[2]}, 3, 2)
    assert not result.ok and "deadlock" in result.reason
    short = [i for i in base[2] if i != I(Op.BACKWARD, 2, 1)]
    result = check_streams({0: base[0], 1: base[1], 2: short}, 3, 2)
    assert not result.ok


def test_eager_frc_sits_after_the_send_to_the_successor():
    base = one_f_one_b(4, 4)
    prog = add_eager_frc(base[1], last_own_stage=1, replica_stages=[2])
    for k in range(4):
        send = prog.index(I(Op.SEND_ACT, 1, k))
        assert prog[send + 1] == I(Op.FRC, 2, k)
    # The wrap-around holder of stage 0 loads input itself, before waiting for its activation.
    last = add_eager_frc(base[3], last_own_stage=3, replica_stages=[0])
    for k in range(4):
        assert last.index(I(Op.FRC, 0, k)) + 1 == last.index(I(Op.RECV_ACT, 3, k))
    # FRC instructions do not change the communication.
    assert [i for i in prog if i.is_comm] == [i for i in base[1] if i.is_comm]
