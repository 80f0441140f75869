"""Placement, recovery decisions and the reconfiguration policy, as pure data."""

from __future__ import annotations

from stalwart.pipeline.placement import (
    Placement,
    plan_cluster,
    plan_recovery,
    should_reconfigure,
)


def test_initial_placement_replicates_successor_and_wraps():
    p = Placement.initial(4, [0, 1, 2, 3])
    assert p.owner == (0, 1, 2, 3)
    assert p.replica == (3, 0, 1, 2)  # stage n's replica on node n - 1; stage 0's on the last
    assert p.replicas_of(3) == [0]


def test_failover_promotes_shadow_and_drops_lost_replicas():
    rec = plan_recovery(Placement.initial(4, [0, 1, 2, 3]), alive=[0, 1, 3])
    assert rec.kind == "failover" and rec.lost == (2,)
    assert rec.placement.owner == (0, 1, 1, 3)
    # Stage 2 was promoted (no replica left), stage 3's replica lived on the lost node.
    assert rec.placement.replica == (3, 0, None, None)
    assert rec.placement.fatal_if_lost(1) and rec.placement.fatal_if_lost(3)
    assert not rec.placement.fatal_if_lost(0)


def test_wraparound_failover_runs_last_then_first_stage():
    rec = plan_recovery(Placement.initial(4, [0, 1, 2, 3]), alive=[1, 2, 3])
    assert rec.placement.owner == (3, 1, 2, 3)
    assert rec.placement.stages_of(3) == [3, 0]


def test_consecutive_losses_fall_back_to_symmetric_placement():
    rec = plan_recovery(Placement.initial(4, [0, 1, 2, 3]), alive=[0, 3])
    assert rec.kind == "fallback" and "stage 2" in rec.reason
    assert rec.placement.owner == (0, 0, 3, 3)
    assert rec.placement.replica == (3, 3, 0, 0)


def test_nonconsecutive_double_loss_is_a_failover():
    rec = plan_recovery(Placement.initial(4, [0, 1, 2, 3]), alive=[0, 2])
    assert rec.kind == "failover"
    assert rec.placement.owner == (0, 0, 2, 2)


def test_suspend_when_too_few_nodes():
    rec = plan_recovery(Placement.initial(4, [0, 1, 2, 3]), alive=[0], min_nodes=2)
    assert rec.kind == "suspend" and rec.placement is None


def test_cluster_policy_symmetric_pipelines_standby_and_cap():
    assert plan_cluster(4, 3, nodes=12) == plan_cluster(4, 3, nodes=12)
    full = plan_cluster(4, 3, nodes=12)
    assert (full.pipelines, full.active, full.standby, full.suspend) == (3, 12, 0, False)
    # 10 nodes: two symmetric pipelines, two nodes on standby (never a depth-2 third pipeline).
    ten = plan_cluster(4, 3, nodes=10)
    assert (ten.pipelines, ten.active, ten.standby) == (2, 8, 2)
    # More nodes than P x D: the extra ones are not used (never exceed P x D).
    many = plan_cluster(4, 3, nodes=20)
    assert many.active + many.standby == 12
    assert plan_cluster(4, 3, nodes=3).suspend


def test_reconfiguration_triggers():
    p = Placement.initial(4, [0, 1, 2, 3])
    assert not should_reconfigure(p, standby=0, num_stages=4, failures_pending=False)
    assert should_reconfigure(p, standby=0, num_stages=4, failures_pending=True)
    degraded = plan_recovery(p, alive=[0, 1, 3]).placement
    assert should_reconfigure(degraded, standby=1, num_stages=4, failures_pending=False)
    assert not should_reconfigure(degraded, standby=0, num_stages=4, failures_pending=False)
