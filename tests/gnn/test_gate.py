"""Must-show 1: over whole runs the gate keeps every interval within S epochs of the slowest,
and every gathered row (and gradient) is no older than the rule allows."""

from __future__ import annotations

import pytest
import torch

from stalwart.errors import ConfigurationError
from stalwart.gnn import StaleGatherEngine, StalenessGate, Straggler, parse_staleness
from tests.gnn.graphs import adam_update, gcn, interval_graph, sbm

EPOCHS = 12


def run(staleness, workers: int, straggler: Straggler | None = None, layers: int = 2):
    graph = interval_graph(sbm(), num_intervals=6)
    model = gcn(graph, layers=layers, dropout=0.5)
    engine = StaleGatherEngine(
        graph, model, staleness, adam_update(model), workers=workers, straggler=straggler, seed=3
    )
    try:
        losses = [engine.run_epoch(e, EPOCHS - 1).loss for e in range(EPOCHS)]
    finally:
        engine.close()
    return engine, losses


def check_rules(engine: StaleGatherEngine, bound: int, sync: bool) -> None:
    gate_log = engine.gate.log
    starts = [(e, low) for _, e, event, low, _ in gate_log if event == "start"]
    assert len(starts) == EPOCHS * engine.gate.num_intervals
    # The gate: an interval starts epoch e only if e <= min_epoch + S ...
    assert all(e - low <= bound for e, low in starts)
    # ... so at every moment the fastest interval is at most S epochs ahead of the slowest.
    assert max(lead for *_, lead in gate_log) <= bound
    reads = engine.record.reads
    assert {r[3] for r in reads} == {"act", "grad"}
    for interval, epoch, layer, kind, oldest, newest, stale in reads:
        if sync:  # pipe: every Gather reads this epoch's values
            assert oldest == newest == epoch and stale == 0, (interval, epoch, layer, kind)
        else:  # bounded: a neighbour has finished at least epoch e - S - 1 (-1: initial zeros)
            assert oldest >= epoch - bound - 1, (interval, epoch, layer, kind, oldest)
            assert newest <= epoch + bound, (interval, epoch, layer, kind, newest)


@pytest.mark.parametrize("staleness", ["sync", 0, 1, 2])
def test_gate_and_read_ages_inline_schedules(staleness):
    engine, losses = run(staleness, workers=0)
    bound = 0 if staleness == "sync" else staleness
    check_rules(engine, bound, sync=staleness == "sync")
    assert losses[-1] < losses[0]
    reads = engine.record.reads
    if staleness != "sync":
        # The schedule really went stale (so the checks above had something to check) ...
        assert sum(r[6] for r in reads if r[3] == "act") > 0
        # ... and the gate was reached: some interval ran the full S epochs ahead.
        assert max(lead for *_, lead in engine.gate.log) == bound
        # With S >= 1 some rows were more than one epoch old (what s=0 can never produce).
        oldest_age = max(epoch - oldest for _, epoch, _, kind, oldest, _, _ in reads)
        assert oldest_age == 1 if bound == 0 else oldest_age > 1


@pytest.mark.parametrize("staleness", ["sync", 0, 1])
def test_gate_and_read_ages_with_threads_and_a_straggler(staleness):
    engine, _ = run(staleness, workers=2, straggler=Straggler(delay=0.002), layers=3)
    check_rules(engine, 0 if staleness == "sync" else staleness, sync=staleness == "sync")


def test_gate_unit_rules():
    gate = StalenessGate(3, 1)
    assert gate.may_start(0, 0) and not gate.may_start(0, 1)
    gate.start(0, 0)
    assert not gate.may_start(0, 0)  # busy
    gate.finish(0, 0)
    gate.start(0, 1)  # 1 <= min_epoch 0 + S 1
    gate.finish(0, 1)
    assert not gate.may_start(0, 2)  # would be 2 epochs ahead of intervals 1 and 2
    with pytest.raises(RuntimeError, match="gate violated"):
        gate.start(0, 2)
    for i in (1, 2):
        gate.start(i, 0)
        gate.finish(i, 0)
    assert gate.min_epoch == 1 and gate.may_start(0, 2)
    sync = StalenessGate(2, "sync")
    sync.start(0, 0)
    sync.finish(0, 0)
    assert not sync.may_start(0, 1)


@pytest.mark.parametrize("bad", [-1, "-2", "s=-1", 1.5, "fast", True])
def test_bad_staleness_is_a_configuration_error(bad):
    with pytest.raises(ConfigurationError, match="staleness"):
        parse_staleness(bad)


def test_staleness_spellings():
    assert parse_staleness("sync") is None and parse_staleness(None) is None
    assert parse_staleness("s=1") == 1 and parse_staleness("0") == 0 and parse_staleness(2) == 2
    assert torch.is_tensor(StalenessGate(2, 0).completed)
