"""The Joint Invariant policy on synthetic (M, C) sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.errors import ConfigurationError
from stalwart.hindsight.policy import JointInvariantPolicy


def run_policy(policy: JointInvariantPolicy, costs, computes) -> list[bool]:
    taken = []
    for cost, compute in zip(costs, computes, strict=True):
        decision = policy.decide(compute_time=compute, materialize_cost=cost)
        if decision.checkpoint:
            policy.checkpointed(cost)
        taken.append(decision.checkpoint)
    return taken


def test_cheap_checkpoints_are_taken_every_epoch():
    policy = JointInvariantPolicy(epsilon=1 / 15)
    taken = run_policy(policy, [0.5] * 50, [10.0] * 50)  # M/C = 0.05 < eps
    assert all(taken)


@pytest.mark.parametrize("ratio", [0.1, 0.2, 0.5, 1.0, 3.0])
def test_steady_expensive_checkpoints_get_a_period_of_about_ratio_over_epsilon(ratio):
    epsilon = 1 / 15
    policy = JointInvariantPolicy(epsilon=epsilon)
    epochs = 600
    taken = run_policy(policy, [ratio * 2.0] * epochs, [2.0] * epochs)
    checkpoint_epochs = [i for i, t in enumerate(taken) if t]
    gaps = [b - a for a, b in zip(checkpoint_epochs, checkpoint_epochs[1:], strict=False)]
    expected = ratio / epsilon
    mean_gap = sum(gaps) / len(gaps)
    assert abs(mean_gap - expected) <= 0.1 * expected + 1
    assert max(gaps) <= expected + 1


def test_ratio_above_restore_bound_uses_the_replay_latency_invariant():
    # With a large eps the replay-latency half (1/(1+c)) binds instead.
    policy = JointInvariantPolicy(epsilon=0.9, restore_ratio=1.38)
    assert policy.budget == pytest.approx(1 / 2.38)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.0, 50.0), st.floats(0.01, 20.0)),
        min_size=1,
        max_size=80,
    ),
    st.floats(0.01, 0.5),
)
def test_cumulative_overhead_never_exceeds_epsilon(sequence, epsilon):
    policy = JointInvariantPolicy(epsilon=epsilon)
    spent = compute = 0.0
    for cost, epoch_compute in sequence:
        compute += epoch_compute
        decision = policy.decide(compute_time=epoch_compute, materialize_cost=cost)
        if decision.checkpoint:
            policy.checkpointed(cost)
            spent += cost
        assert spent <= epsilon * compute + 1e-9
    assert policy.overhead == pytest.approx(spent / compute)


def test_decision_records_n_k_and_threshold():
    policy = JointInvariantPolicy(epsilon=0.1)
    first = policy.decide(compute_time=1.0, materialize_cost=0.05)
    assert (first.n, first.k, first.checkpoint) == (1, 0, True)
    assert first.threshold == pytest.approx(0.1)
    policy.checkpointed(0.05)
    second = policy.decide(compute_time=1.0, materialize_cost=0.15)
    assert (second.n, second.k, second.checkpoint) == (2, 1, False)  # 0.15 >= 2/2 * 0.1


def test_state_dict_round_trip_continues_identically():
    costs, computes = [0.3] * 40, [1.0] * 40
    whole = JointInvariantPolicy(epsilon=0.1)
    expected = run_policy(whole, costs, computes)
    first = JointInvariantPolicy(epsilon=0.1)
    head = run_policy(first, costs[:17], computes[:17])
    resumed = JointInvariantPolicy(epsilon=0.1)
    resumed.load_state_dict(first.state_dict())
    assert head + run_policy(resumed, costs[17:], computes[17:]) == expected


@pytest.mark.parametrize("epsilon", [0, 1, -0.1, 1.5, "x", float("nan")])
def test_epsilon_outside_zero_one_is_rejected(epsilon):
    with pytest.raises(ConfigurationError, match="epsilon"):
        JointInvariantPolicy(epsilon=epsilon)
