"""The preemption simulator reproduces the shape of thesis Table 3.3, and its CLI."""

from __future__ import annotations

import pytest

from stalwart.cli import main
from stalwart.errors import ConfigurationError
from stalwart.pipeline.simulator import SimulationSettings, read_trace, replay_trace, sweep

PROBABILITIES = (0.01, 0.05, 0.10, 0.25, 0.50)


@pytest.fixture(scope="module")
def rows():
    rows = sweep(PROBABILITIES, SimulationSettings(runs=40))
    return {(r.strategy, r.probability): r for r in rows}


@pytest.mark.timeout(120)
def test_value_stays_above_on_demand_while_fatal_failures_grow(rows):
    bamboo = [rows[("bamboo", p)] for p in PROBABILITIES]
    demand = rows[("on-demand", 0.01)]
    assert all(r.value > demand.value for r in bamboo)
    # Roughly flat: within a factor of two from the calmest to the stormiest market ...
    assert min(r.value for r in bamboo) > 0.5 * max(r.value for r in bamboo)
    # ... while preemptions and fatal failures grow with p.
    assert [r.preemptions for r in bamboo] == sorted(r.preemptions for r in bamboo)
    assert bamboo[-1].fatal_failures > bamboo[0].fatal_failures
    # Fewer nodes and a lower bill as p grows (cost follows the cluster size).
    assert bamboo[-1].nodes < bamboo[0].nodes and bamboo[-1].cost < bamboo[0].cost


@pytest.mark.timeout(120)
def test_checkpoint_restart_useful_time_falls_far_below(rows):
    for p in (0.10, 0.25, 0.50):
        ours, theirs = rows[("bamboo", p)], rows[("checkpoint", p)]
        assert ours.useful_share > theirs.useful_share + 0.3
        assert theirs.fatal_failures > 10 * max(ours.fatal_failures, 1)
    assert (
        rows[("checkpoint", 0.25)].useful_share < 0.3 < 0.75 < rows[("bamboo", 0.25)].useful_share
    )


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
    assert result["bamboo"].throughput > result["checkpoint"].throughput > 0
    path.write_text("0,explode,1")
    with pytest.raises(ConfigurationError, match="add|remove"):
        read_trace(path)


def test_simulate_cli_prints_table_and_writes_png(tmp_path, capsys):
    out = tmp_path / "value.png"
    code = main(["simulate", "--runs", "5", "--probabilities", "0.05,0.5", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "bamboo" in text and "checkpoint" in text and "on-demand" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["simulate", "--probabilities", "1.5"]) == 2
    assert main(["simulate", "--runs", "0"]) == 2
