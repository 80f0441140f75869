"""Properties of the preemption simulator that follow from its model: with no preemptions it is
the healthy cluster minus the redundancy overhead, more preemptions never buy throughput, every
allocated node is billed, redundancy overtakes checkpoint/restart as preemptions grow, a 1F1B
step takes as many slots as the runtime's own schedule, and a seed fixes the result.

How close the defaults come to the thesis' Table 3.3 is not asserted here: it depends on inputs
the thesis does not print, and ``benchmarks/pipeline_simulator_vs_thesis.py`` prints it.
"""

from __future__ import annotations

import math
import random

import pytest

from stalwart.cli import main
from stalwart.errors import ConfigurationError
from stalwart.pipeline.schedule import one_f_one_b, timeline
from stalwart.pipeline.simulator import (
    MarketProcess,
    SimulationSettings,
    TraceMarket,
    _Bamboo,
    _throughput,
    read_trace,
    replay_trace,
    simulate,
    sweep,
)

PROBABILITIES = (0.0, 0.01, 0.05, 0.10, 0.25, 0.50)
SPOT = ("bamboo", "checkpoint")


@pytest.fixture(scope="module")
def rows():
    # Checkpoint/restart runs at high p never finish and run to max_hours (slow), so fewer.
    bamboo = sweep(PROBABILITIES, SimulationSettings(runs=100), strategies=("bamboo",))
    slow = SimulationSettings(runs=30, max_hours=60)
    checkpoint = sweep(PROBABILITIES, slow, strategies=("checkpoint",))
    return {(r.strategy, r.probability): r for r in bamboo + checkpoint}


def test_without_preemptions_throughput_is_the_healthy_cluster_minus_the_redundancy_overhead():
    s = SimulationSettings(runs=3, work_hours=2.0)
    rows = simulate(0.0, s)
    bamboo, checkpoint, demand = rows["bamboo"], rows["checkpoint"], rows["on-demand"]
    healthy = s.num_pipelines * s.pipeline_throughput  # D pipelines of the on-demand depth
    assert checkpoint.throughput == pytest.approx(healthy)
    assert demand.throughput == pytest.approx(healthy)
    # The redundant pipelines are deeper but not faster: each step pays eager FRC.
    assert bamboo.throughput == pytest.approx(healthy / (1 + s.rc_overhead))
    assert bamboo.hours == pytest.approx(s.work_hours * (1 + s.rc_overhead))
    assert checkpoint.hours == pytest.approx(s.work_hours)
    bamboo_nodes = s.num_stages * s.num_pipelines
    demand_nodes = s.demand_stages * s.num_pipelines
    assert bamboo.nodes == pytest.approx(bamboo_nodes)
    assert bamboo.cost == pytest.approx(bamboo_nodes * s.spot_price)
    assert checkpoint.nodes == pytest.approx(demand_nodes) == demand.nodes
    assert checkpoint.cost == pytest.approx(demand_nodes * s.spot_price)
    assert demand.cost == pytest.approx(demand_nodes * s.demand_price)
    assert demand.value == pytest.approx(1.10, abs=0.01)  # 108 samples/s for $97.92/h
    for row in rows.values():
        assert row.value == pytest.approx(row.throughput / row.cost)
        assert row.preemptions == row.fatal_failures == row.reconfigurations == 0
        assert row.useful_share == pytest.approx(1.0) and row.paused_share == 0


@pytest.mark.timeout(120)
def test_more_preemptions_never_raise_throughput_nodes_or_cost(rows):
    for strategy in SPOT:
        ordered = [rows[(strategy, p)] for p in PROBABILITIES]
        for calmer, rougher in zip(ordered, ordered[1:], strict=False):
            p = rougher.probability
            assert rougher.preemptions > calmer.preemptions, (strategy, p)
            assert rougher.fatal_failures >= calmer.fatal_failures, (strategy, p)
            assert rougher.throughput <= calmer.throughput, (strategy, p)
            assert rougher.useful_share <= calmer.useful_share, (strategy, p)
            assert rougher.nodes < calmer.nodes and rougher.cost < calmer.cost, (strategy, p)
        # Each live node is preempted at the market's rate, -ln(1 - p) per node-hour.
        for row in ordered[1:]:
            rate = row.preemptions / (row.nodes * row.hours)
            assert rate == pytest.approx(-math.log1p(-row.probability), rel=0.1), row


@pytest.mark.timeout(120)
def test_every_allocated_node_is_billed_so_value_falls_less_than_throughput(rows):
    s = SimulationSettings()
    for (strategy, p), row in rows.items():
        price = s.demand_price if strategy == "on-demand" else s.spot_price
        assert row.cost == pytest.approx(row.nodes * price), (strategy, p)
    calm, rough = rows[("bamboo", 0.01)], rows[("bamboo", 0.50)]
    assert rough.nodes < 0.7 * calm.nodes and rough.cost < 0.7 * calm.cost
    value_drop = 1 - rough.value / calm.value
    throughput_drop = 1 - rough.throughput / calm.throughput
    assert 0 < value_drop < throughput_drop, (value_drop, throughput_drop)


@pytest.mark.timeout(120)
def test_redundancy_beats_checkpoint_restart_beyond_a_preemption_rate(rows):
    def ours(p):
        return rows[("bamboo", p)]

    def theirs(p):
        return rows[("checkpoint", p)]

    # No preemptions: restarts cost nothing, and redundancy is pure overhead.
    assert theirs(0.0).throughput > ours(0.0).throughput and theirs(0.0).value > ours(0.0).value
    crossover = next(p for p in PROBABILITIES if ours(p).value > theirs(p).value)
    assert 0 < crossover <= 0.10
    for p in PROBABILITIES[PROBABILITIES.index(crossover) :]:
        assert ours(p).value > theirs(p).value, p
        assert ours(p).throughput > theirs(p).throughput, p
        assert ours(p).useful_share > theirs(p).useful_share, p
    for p in PROBABILITIES[1:]:
        # Shadows absorb most preemptions; for checkpoint/restart nearly each one is a restart.
        assert ours(p).fatal_failures < 0.01 * ours(p).preemptions, p
        if p >= 0.10:
            assert theirs(p).fatal_failures > 0.9 * theirs(p).preemptions, p
            assert ours(p).useful_share > theirs(p).useful_share + 0.5, p
        # With the thesis' prices, redundant spot pipelines are worth more than on-demand ones.
        assert ours(p).value > rows[("on-demand", p)].value, p
    assert ours(0.50).fatal_failures > 0.5 > ours(0.01).fatal_failures


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_a_1f1b_step_takes_the_slots_of_the_runtime_schedule(stages):
    # Throughput model vs the runtime's 1F1B instruction streams (unit-time forward and
    # backward): fewer pipelines run more micro-batches each and fill their bubble better.
    def ticks(microbatches: int) -> int:
        return max(timeline(one_f_one_b(stages, microbatches)).values()) + 1

    s = SimulationSettings(num_pipelines=4, num_microbatches=4)
    full = _throughput(s, stages, 4, 1.0)
    assert full == pytest.approx(4.0)
    for pipelines in (2, 1):
        per_pipeline = s.num_microbatches * 4 // pipelines
        expected = ticks(s.num_microbatches) / ticks(per_pipeline)
        assert _throughput(s, stages, pipelines, 1.0) / full == pytest.approx(expected)
        assert pipelines / 4 < expected < 1
    assert _throughput(s, stages, 0, 1.0) == 0


def test_a_seed_fixes_the_result():
    s = SimulationSettings(runs=5, work_hours=2.0)
    first = simulate(0.25, s)
    assert simulate(0.25, s) == first
    other = simulate(0.25, SimulationSettings(runs=5, work_hours=2.0, seed=1))
    assert other["bamboo"] != first["bamboo"] and other["checkpoint"] != first["checkpoint"]


def _bamboo(num_pipelines: int) -> _Bamboo:
    s = SimulationSettings(num_pipelines=num_pipelines, recovery_seconds=36, reconfig_seconds=72)
    sim = _Bamboo(TraceMarket([]), s, random.Random(0), target=1e12)
    sim.standby = [sim.cluster.add() for _ in range(s.num_stages * num_pipelines)]
    sim.rebuild(0.0, restart=True)
    sim.run.samples = 100.0  # progress since the last checkpoint (at 0)
    return sim


def test_policy_failover_then_consecutive_loss_reconfigures_from_other_pipelines():
    sim = _bamboo(num_pipelines=2)
    first = sim.pipelines[0]
    consecutive_zones = [sim.cluster.zone[n] for n in first]
    assert all(a != b for a, b in zip(consecutive_zones, consecutive_zones[1:], strict=False))
    sim.preempt({first[3]})  # its shadow (stage 2) takes over: a pause, no reconfiguration
    assert sim.holes[0] == {3} and sim.run.reconfigurations == 0
    assert sim.run.paused_until == pytest.approx(36 / 3600)
    healthy = _throughput(sim.s, 12, 2, sim.per_pipeline)
    assert sim.rate() == pytest.approx(healthy / sim.s.failover_slowdown)
    assert sim.s.failover_slowdown == pytest.approx(1.43, abs=0.01)  # Table 3.5: 1.7151 / 1.1977
    sim.preempt({first[4]})  # consecutive: stage 4's layers survive only in pipeline 1
    assert sim.run.fatal == 0 and sim.run.reconfigurations == 1
    assert len(sim.pipelines) == 1 and len(sim.standby) == 10  # symmetric: 22 nodes -> 1 x 12
    assert sim.run.samples == 100.0
    sim.standby += [sim.cluster.add() for _ in range(2)]
    sim.step_boundary()  # 24 nodes: a new pipeline can be formed
    assert len(sim.pipelines) == 2 and sim.run.reconfigurations == 2


def test_policy_consecutive_loss_in_the_last_pipeline_is_fatal():
    sim = _bamboo(num_pipelines=1)
    sim.standby = [sim.cluster.add()]
    sim.preempt({sim.pipelines[0][6]})
    sim.step_boundary()  # one pipeline with a hole is one loss from fatal: refill at once
    assert sim.holes == [set()] and sim.run.reconfigurations == 1 and not sim.standby
    pl = sim.pipelines[0]
    sim.preempt({pl[11], pl[0]})  # the last stage holds stage 0's replica: both copies gone
    assert sim.run.fatal == 1 and sim.run.samples == 0.0  # rolled back to the checkpoint
    assert sim.pipelines == [] and len(sim.standby) == 10  # suspended until nodes return


def test_market_preempts_each_node_with_probability_p():
    s = SimulationSettings(bulk_mean=3.0, zones=3)
    rng = random.Random(1)
    market = MarketProcess(0.25, s, rng, target=0)
    now, lost = 0.0, 0
    while now < 2000:
        now, kind, k = market.next_event(now, alive=40)
        lost += k if kind == "remove-bulk" else 0
    # 40 nodes, P(preempted within an hour) = 0.25 -> rate -ln(0.75) per node-hour.
    assert lost / (2000 * 40) == pytest.approx(0.2877, rel=0.05)


def test_trace_replay(tmp_path):
    lines = ["time_hours,event,node,zone"]
    lines += [f"0,add,{n},{n % 3}" for n in range(48)]
    lines += ["1.0,remove,5,2", "2.5,remove,17,2", "2.5,remove,18,0", "3,add,100,1"]
    path = tmp_path / "trace.csv"
    path.write_text("\n".join(lines))
    events = read_trace(path)
    assert len(events) == 52
    result = replay_trace(events, SimulationSettings(work_hours=4))
    assert result["bamboo"].preemptions == 3
    assert result["checkpoint"].preemptions == 3
    assert result["bamboo"].fatal_failures == 0 and result["checkpoint"].fatal_failures == 3
    assert result["bamboo"].useful_share > result["checkpoint"].useful_share
    path.write_text("0,explode,1")
    with pytest.raises(ConfigurationError, match="add|remove"):
        read_trace(path)


def test_simulate_cli_prints_table_progress_and_writes_png(tmp_path, capsys):
    from stalwart.cli import build_parser

    assert build_parser().parse_args(["simulate"]).runs == 1000
    out = tmp_path / "value.png"
    code = main(["simulate", "--runs", "4", "--probabilities", "0.05,0.5", "--out", str(out)])
    assert code == 0
    captured = capsys.readouterr()
    assert "SIMULATOR" in captured.out
    for column in ("thruput", "cost$/h", "value", "fatal", "useful"):
        assert column in captured.out
    for strategy in ("bamboo", "checkpoint", "on-demand"):
        assert sum(line.startswith(strategy) for line in captured.out.splitlines()) == 2
    assert "p=0.50 checkpoint     4/4 runs" in captured.err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["simulate", "--probabilities", "1.5"]) == 2
    assert main(["simulate", "--runs", "0"]) == 2
    assert main(["simulate", "--allocation-max", "1.5"]) == 2
