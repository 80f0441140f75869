"""Placement, recovery decisions and the reconfiguration policy, as pure data."""

from __future__ import annotations

import itertools

from stalwart.pipeline.placement import (
    Layout,
    Placement,
    plan_cluster,
    plan_layout,
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


def test_layout_of_two_pipelines_and_of_too_few_nodes():
    two = Layout.initial(4, 2, range(8))
    assert [p.ranks for p in two.pipelines] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert two.shards == ((0,), (1,)) and two.standby == ()
    assert two.pipelines[1].replica == (7, 4, 5, 6)  # replicas stay inside their pipeline
    six = Layout.initial(4, 2, range(6))  # symmetric: one pipeline trains both shards
    assert [p.ranks for p in six.pipelines] == [[0, 1, 2, 3]]
    assert six.shards == ((0, 1),) and six.standby == (4, 5)


def test_failover_in_one_pipeline_leaves_the_other_untouched():
    two = Layout.initial(4, 2, range(8))
    rec = plan_layout(two, alive=[0, 1, 2, 3, 4, 5, 7], num_pipelines=2)
    assert rec.kind == "failover" and rec.lost == (6,)
    assert rec.layout.pipelines[0] == two.pipelines[0]
    assert rec.layout.pipelines[1].owner == (4, 5, 5, 7) and rec.layout.shards == two.shards


def test_a_pipeline_without_a_live_copy_is_dropped_to_standby():
    two = Layout.initial(4, 2, range(8))
    rec = plan_layout(two, alive=[0, 1, 2, 3, 4, 7], num_pipelines=2)
    assert rec.kind == "reconfigure" and rec.lost == (5, 6)
    assert rec.layout.pipelines == (two.pipelines[0],)
    assert rec.layout.shards == ((0, 1),) and rec.layout.standby == (4, 7)
    # No pipeline whole: re-form from the checkpoint on the survivors, standby included.
    rec = plan_layout(rec.layout, alive=[0, 3, 4, 7], num_pipelines=2)
    assert rec.kind == "fallback" and [p.ranks for p in rec.layout.pipelines] == [[0, 3, 4, 7]]
    assert plan_layout(rec.layout, alive=[], num_pipelines=2).kind == "suspend"


def test_every_loss_pattern_keeps_the_policy_invariants():
    """All 2^8 sets of survivors of a P=4, D=2 layout: depth P, each shard trained exactly once,
    only live nodes used, never more than P x D, a checkpoint only when no pipeline is whole."""
    two = Layout.initial(4, 2, range(8))
    for size in range(9):
        for alive in itertools.combinations(range(8), size):
            rec = plan_layout(two, alive=alive, num_pipelines=2)
            if rec.kind == "suspend":
                assert not alive
                continue
            layout = rec.layout
            used = layout.members + list(layout.standby)
            assert set(used) <= set(alive) and len(used) == len(set(used)) <= 8
            assert all(p.num_stages == 4 for p in layout.pipelines)
            assert sorted(j for shards in layout.shards for j in shards) == [0, 1]
            whole = [plan_recovery(p, alive).kind == "failover" for p in two.pipelines]
            assert (rec.kind == "fallback") == (not any(whole))
            if rec.kind == "fallback":
                assert set(used) == set(alive)
