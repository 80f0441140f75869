"""Replay planning on synthetic records."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stalwart.errors import ConfigurationError, ReplayError
from stalwart.hindsight.plan import INNER, OUTER, plan_replay

ALL = set(range(-1, 20))  # init + a checkpoint after every one of 20 epochs


def test_outer_probe_memoizes_every_epoch_with_a_checkpoint():
    (segment,) = plan_replay(range(20), ALL, OUTER)
    assert segment.resume_from == -1 and segment.executed == []
    assert segment.memoized == frozenset(range(20))


def test_inner_probe_executes_exactly_the_requested_epochs():
    (segment,) = plan_replay(range(5, 9), ALL, INNER)
    assert segment.resume_from == 4
    assert segment.executed == [5, 6, 7, 8] and not segment.memoized


def test_missing_checkpoints_are_bridged_by_re_execution():
    sparse = {-1, 3, 7}
    (segment,) = plan_replay([9], sparse, OUTER)
    assert segment.resume_from == 7 and segment.executed == [8, 9]
    (segment,) = plan_replay([5, 6], sparse, INNER)
    assert segment.resume_from == 3 and segment.executed == [4, 5, 6]


def test_workers_split_into_contiguous_checkpoint_aligned_segments():
    segments = plan_replay(range(12), ALL, INNER, workers=3)
    assert [list(s.executed) for s in segments] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
    ]
    sparse = {-1, 5}
    segments = plan_replay(range(10), sparse, INNER, workers=2)
    assert [s.resume_from for s in segments] == [-1, 5]


def test_strong_init_pseudoresumes_from_the_start():
    (segment,) = plan_replay([7, 8], ALL, INNER, init="strong")
    assert segment.resume_from == -1
    assert segment.memoized == frozenset(range(7)) and segment.executed == [7, 8]


@given(
    st.sets(st.integers(0, 30), min_size=1),
    st.sets(st.integers(0, 30)),
    st.sampled_from([OUTER, INNER]),
    st.integers(1, 4),
    st.sampled_from(["weak", "strong"]),
)
def test_every_requested_epoch_is_covered_once_and_inner_ones_execute(
    requested, checkpoints, level, workers, init
):
    checkpoints = checkpoints | {-1}
    segments = plan_replay(requested, checkpoints, level, workers, init)
    covered = [e for s in segments for e in s.requested]
    assert sorted(covered) == sorted(requested)
    assert len(segments) <= workers
    for s in segments:
        assert s.resume_from in checkpoints
        assert set(s.requested) <= set(s.epochs)
        assert s.memoized <= checkpoints
        if level == INNER:
            assert not (s.requested & s.memoized)


def test_bad_plans_are_refused():
    with pytest.raises(ReplayError, match="no checkpoint before epoch 2"):
        plan_replay([2], {5}, INNER)
    with pytest.raises(ConfigurationError):
        plan_replay([], ALL, INNER)
    with pytest.raises(ConfigurationError):
        plan_replay([1], ALL, "middle")
    with pytest.raises(ConfigurationError):
        plan_replay([1], ALL, INNER, workers=0)
