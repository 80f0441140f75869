"""The Joint Invariant policy on synthetic (M, C) sequences."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stalwart
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
    taken = run_policy(policy, [0.3] * 50, [10.0] * 50)  # M/C = 0.03 < aim * eps
    assert all(taken)


def test_checkpoints_the_invariants_share_cannot_pay_are_taken_by_coverage():
    # M/C = 0.05: within eps (Flor takes every epoch), over the invariant's half of it.
    policy = JointInvariantPolicy(epsilon=1 / 15)
    taken = run_policy(policy, [0.5] * 50, [10.0] * 50)
    assert max(gaps_after(taken, 0)) == policy.coverage_period(0.5, 10.0) == 2
    assert policy.overhead == pytest.approx(0.5 / 10 * 2 / 3, rel=0.05)  # 2 epochs of 3
    flor = JointInvariantPolicy(epsilon=1 / 15, aim=1.0)
    assert all(run_policy(flor, [0.5] * 50, [10.0] * 50))


@pytest.mark.parametrize("ratio", [0.1, 0.2, 0.5, 1.0, 3.0])
def test_steady_expensive_checkpoints_get_a_period_of_about_ratio_over_epsilon(ratio):
    epsilon, epochs = 1 / 15, 600
    # Flor's policy (the whole budget to the invariant): a period of about r / eps.
    flor = JointInvariantPolicy(epsilon=epsilon, aim=1.0)
    gaps = gaps_after(run_policy(flor, [ratio * 2.0] * epochs, [2.0] * epochs), 0)
    expected = ratio / epsilon
    assert abs(sum(gaps) / len(gaps) - expected) <= 0.1 * expected + 1
    assert max(gaps) <= expected + 1
    # By default the invariant's half never pays for them: coverage's period, one epoch more.
    policy = JointInvariantPolicy(epsilon=epsilon)
    gaps = gaps_after(run_policy(policy, [ratio * 2.0] * epochs, [2.0] * epochs), 0)
    assert set(gaps) == {math.ceil(ratio / epsilon) + 1}
    assert policy.overhead <= epsilon


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


def gaps_after(taken: list[bool], start: int) -> list[int]:
    epochs = [i for i, t in enumerate(taken) if t and i >= start]
    return [b - a for a, b in zip(epochs, epochs[1:], strict=False)]


def test_one_expensive_epoch_charged_to_a_checkpoint_does_not_stop_checkpointing():
    """The issue's case: a noisy epoch (73 ms of 'interference') charged to one checkpoint put
    the record over budget by its own count, and no checkpoint followed for the rest of the run.
    Coverage keeps the period at ceil(r / eps) + 1 epochs, r the typical cost ratio."""
    epsilon, compute, cost = 1 / 15, 0.23, 0.03  # r = 0.13: a period of about 2
    policy = JointInvariantPolicy(epsilon=epsilon)
    taken, spike_at = [], None
    for epoch in range(60):
        estimate = policy.typical_cost if policy.checkpoints else cost
        decision = policy.decide(compute_time=compute, materialize_cost=estimate)
        if decision.checkpoint:
            policy.checkpointed(cost)
            if spike_at is None and epoch >= 10:
                spike_at = epoch
                policy.charge(20 * compute)  # the next epoch ran 20x slower with a writer alive
        taken.append(decision.checkpoint)
    assert spike_at is not None
    # The spike leaves the record far over budget for the rest of the run: the cumulative
    # check alone would take nothing more (which is what the record used to do).
    assert policy.total_materialize > epsilon * policy.total_compute
    period = policy.coverage_period(cost, compute)
    assert period == math.ceil(cost / compute / epsilon) + 1 == 3
    gaps = gaps_after(taken, spike_at)
    assert gaps and max(gaps) <= period
    assert (len(taken) - 1) - max(i for i, t in enumerate(taken) if t) <= period
    assert policy.typical_cost == pytest.approx(cost)  # the spike no longer sets the price


def test_a_record_whose_first_checkpoint_was_slow_keeps_checkpointing(tmp_path, monkeypatch):
    """The same through the real Recorder and real checkpoint files; one snapshot takes 20
    epochs' time (e.g. the machine stalled). On an injected clock: epochs of exactly 20 ms and
    writes that cost exactly 2 ms (a real epoch's sleep and a real write's fsyncs on a loaded
    machine made the typical cost, and so the period, anything: CI saw a gap of 6 vs period 4)."""
    import stalwart.hindsight.recorder as recorder_module
    from stalwart.hindsight.materializer import InlineMaterializer
    from stalwart.hindsight.recorder import Recorder

    now = [0.0]
    monkeypatch.setattr(recorder_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    class FixedCost(InlineMaterializer):
        """Writes the real, durable file; prices it, and says it cost, 2 ms."""

        COST = 0.002

        def probe_cost(self, nbytes, directory):
            return self.COST

        def submit(self, job):
            super().submit(job)
            return self.COST

    epoch_seconds, epochs = 0.02, 40
    recorder = Recorder(tmp_path / "runs", materializer=FixedCost())
    recorder.begin(hparams={}, fingerprints={}, config={"max_epochs": epochs})
    recorder.train_started()
    stalled = []

    def snapshot():
        if not stalled:
            stalled.append(True)
            now[0] += 20 * epoch_seconds
        return {"w": torch.zeros(16)}

    for epoch in range(epochs):
        recorder.epoch_started()
        now[0] += epoch_seconds
        recorder.batch_ended()
        recorder.epoch_ended(epoch, state_bytes=lambda: 64)
        recorder.materialize_due(snapshot, step=epoch)
    recorder.finish("completed")

    run = stalwart.hindsight.open(tmp_path / "runs").run()
    decisions = run.decisions()
    taken = decisions.checkpoint.astype(bool).tolist()
    first = taken.index(True)
    assert decisions.measured_cost[first] >= 20 * epoch_seconds  # the stall was charged
    period = math.ceil(FixedCost.COST / epoch_seconds / recorder.policy.epsilon) + 1
    assert period == 3
    gaps = gaps_after(taken, first)
    assert len(gaps) >= 3, taken
    # Charged by the cumulative budget alone, the stall (20 epochs of time) would buy no other
    # checkpoint for 20 / epsilon = 300 epochs; priced at the stall, coverage's period would be
    # ceil(20 / epsilon) + 1. Coverage at the typical cost keeps taking them every `period`.
    assert max(gaps) <= period, (gaps, period)
    assert (len(taken) - 1) - max(i for i, t in enumerate(taken) if t) <= period, taken
    assert [c.epoch for c in run.checkpoints()] == [i for i, t in enumerate(taken) if t]


def test_a_few_dear_recent_costs_do_not_stretch_coverage_past_the_runs_own_median():
    """1 MB in 0.1 s epochs, measured: a checkpoint cost ~4.6 ms (r just under eps) through
    most of a run and ~7.8 ms (just over) for its last few, so the period from the recent costs
    alone went to 3 epochs where the run's costs as a whole give 2."""
    epsilon, compute = 1 / 15, 0.107
    costs = [0.0046] * 30 + [0.0078] * 10
    policy = JointInvariantPolicy(epsilon=epsilon)
    taken = run_policy(policy, costs, [compute] * len(costs))
    assert policy.coverage_period(0.0078, compute) == 3  # what the recent costs alone give
    run_wide = math.ceil(statistics.median(costs) / compute / epsilon) + 1
    assert run_wide == 2
    assert max(gaps_after(taken, 0)) <= run_wide
    assert policy.overhead <= epsilon


@pytest.fixture
def asking(monkeypatch) -> SimpleNamespace:
    """The record's adapters with a policy that wants every epoch in ``wanted`` (all by default)
    and a veto that notes what it hears, ``asked``: ``(epoch, policy_says)``; the Lightning one
    forces epoch ``force``."""
    from dataclasses import replace

    from stalwart import HindsightCallback
    from stalwart.algorithms import Hindsight

    spy = SimpleNamespace(wanted=range(100), asked=[], force=None)
    decide = JointInvariantPolicy.decide

    def patched(*args, **kwargs):
        decision = decide(*args, **kwargs)
        return replace(decision, checkpoint=decision.epoch in spy.wanted)

    monkeypatch.setattr(JointInvariantPolicy, "decide", patched)

    class Lightning(HindsightCallback):
        def should_checkpoint(self, trainer, policy_says: bool) -> bool:
            spy.asked.append((trainer.current_epoch, policy_says))
            return policy_says or trainer.current_epoch == spy.force

    class Composer(Hindsight):
        def should_checkpoint(self, state, policy_says: bool) -> bool:
            spy.asked.append((int(state.timestamp.epoch) - 1, policy_says))
            return policy_says

    spy.Lightning, spy.Composer = Lightning, Composer
    return spy


def _checkpointed(root) -> list[int]:
    """The epochs a record checkpointed (``init.ckpt`` apart)."""
    return [c.epoch for c in stalwart.hindsight.open(root).run().checkpoints() if c.epoch >= 0]


def test_the_runs_last_epoch_is_not_checkpointed_unless_the_adapter_forces_it(tmp_path, asking):
    """No replay starts from the state after the last epoch (replaying it starts from the
    checkpoint before), and the fit would wait for its write: the record does not take it, in
    Lightning (``max_epochs`` or ``max_steps``) and in Composer; ``should_checkpoint`` still can."""
    import lightning as L
    from composer_digits import make_trainer
    from digits import DigitsClassifier, DigitsDataModule

    from tests.helpers import QUIET

    def lightning_fit(root, **limits):
        callback = asking.Lightning(root, materializer="inline")
        trainer = L.Trainer(callbacks=[callback], **limits, **QUIET)
        trainer.fit(DigitsClassifier(width=8), DigitsDataModule(batch_size=500))

    lightning_fit(tmp_path / "epochs", max_epochs=3)
    batches = 3  # the digits training set (1437) in batches of 500
    lightning_fit(tmp_path / "steps", max_epochs=-1, max_steps=3 * batches)
    composer = asking.Composer(tmp_path / "composer", materializer="inline")
    make_trainer(epochs=3, algorithms=[composer]).fit()
    # Each fit: the record wants epoch 0 and is told not to want epoch 2 (the last).
    asked = asking.asked
    assert [asked[i] for i in (0, 2, 3, 5, 6, 8)] == [(0, True), (2, False)] * 3
    for side in ("epochs", "steps", "composer"):
        assert 2 not in _checkpointed(tmp_path / side) and 0 in _checkpointed(tmp_path / side)
    asking.force = 2
    lightning_fit(tmp_path / "forced", max_epochs=3)
    assert 2 in _checkpointed(tmp_path / "forced")


def test_an_early_stop_drops_the_last_epochs_checkpoint_even_when_requested_after_the_decision(
    tmp_path, asking
):
    """``EarlyStopping`` requests its stop in a later ``on_train_epoch_end`` than the record's
    decision: the checkpoint decided for that epoch is dropped at the epoch boundary (a stop
    requested earlier but held back by ``min_epochs`` is known at the decision and the veto hears
    False); a checkpoint ``should_checkpoint`` forced against the policy is still written.
    Composer's ``EarlyStopper`` stops before the record's event, so there it is known at once."""
    import lightning as L
    from composer.callbacks import EarlyStopper
    from composer_digits import make_trainer
    from digits import DigitsClassifier, DigitsDataModule
    from lightning.pytorch.callbacks import EarlyStopping

    from tests.helpers import QUIET

    def fit(name, stopper, **limits) -> tuple[list[int], list[tuple[int, int]]]:
        asking.asked.clear()
        callbacks = [asking.Lightning(tmp_path / name, materializer="inline"), stopper]
        trainer = L.Trainer(callbacks=callbacks, max_epochs=5, **limits, **QUIET)
        trainer.fit(DigitsClassifier(width=8), DigitsDataModule(batch_size=500))
        assert trainer.current_epoch == 2  # stopped after epoch 1
        decisions = stalwart.hindsight.open(tmp_path / name).run().decisions()
        rows = list(zip(decisions.epoch.tolist(), decisions.checkpoint.tolist(), strict=True))
        return _checkpointed(tmp_path / name), rows

    def no_improvement_after_epoch_0():  # min_delta beyond any change: epoch 1 stops the fit
        return EarlyStopping(monitor="val_loss", patience=1, min_delta=1e9)

    # The stop is requested after the record's hook: the veto heard True, nothing is written.
    taken, rows = fit("late", no_improvement_after_epoch_0())
    assert asking.asked == [(0, True), (1, True)]
    assert taken == [0] and rows == [(0, 1), (1, 0)]
    # Requested at epoch 0, held back by min_epochs=2: known at epoch 1's decision.
    taken, rows = fit("held", EarlyStopping("val_loss", stopping_threshold=1e9), min_epochs=2)
    assert asking.asked == [(0, True), (1, False)]
    assert taken == [0] and rows == [(0, 1), (1, 0)]
    # Forced against the policy (which wants only epoch 0): written although the fit stops.
    asking.wanted, asking.force = [0], 1
    taken, rows = fit("forced", no_improvement_after_epoch_0())
    assert asking.asked == [(0, True), (1, False)]
    assert taken == [0, 1] and rows == [(0, 1), (1, 1)]

    asking.wanted = range(100)
    asking.asked.clear()
    stopper = EarlyStopper("MulticlassAccuracy", "eval", min_delta=1e9, patience=0)
    algorithm = asking.Composer(tmp_path / "composer", materializer="inline")
    make_trainer(epochs=5, algorithms=[algorithm], callbacks=[stopper]).fit()
    assert asking.asked == [(0, True), (1, False)]
    assert _checkpointed(tmp_path / "composer") == [0]
