"""Multi-process mode: partitions in separate processes over gloo, the gate through the store."""

from __future__ import annotations

import pytest
import torch

from stalwart.errors import ConfigurationError
from stalwart.gnn import StaleGatherEngine
from stalwart.gnn.distributed import run_partitions
from tests.gnn.graphs import adam_update, gcn, interval_graph, sbm

EPOCHS = 10


def test_sync_partitions_equal_single_process_full_graph_training():
    tensors = sbm(num_nodes=300, seed=6)
    out = run_partitions(tensors, world_size=2, staleness="sync", epochs=EPOCHS,
                         dtype=torch.float64, evaluate=False)  # fmt: skip
    graph = interval_graph(tensors, num_intervals=3, dtype=torch.float64)
    model = gcn(graph, hidden=16, seed=0)
    engine = StaleGatherEngine(graph, model, "sync", adam_update(model), workers=0)
    losses = [engine.run_epoch(e, EPOCHS - 1).loss for e in range(EPOCHS)]
    for rank in out:
        for name, param in model.named_parameters():
            torch.testing.assert_close(rank["params"][name], param.detach(), rtol=0, atol=1e-10)
    summed = [a + b for a, b in zip(out[0]["loss"], out[1]["loss"], strict=True)]
    assert summed == pytest.approx(losses, rel=1e-10)


def test_bounded_staleness_across_processes_with_a_straggler():
    bound = 1
    out = run_partitions(sbm(num_nodes=300, seed=6), world_size=2, staleness=bound, epochs=EPOCHS,
                         straggler_rank=1, straggler_delay=0.02, evaluate=False)  # fmt: skip
    for rank in out:
        assert len(rank["gate_log"]) == EPOCHS
        assert all(epoch - low <= bound for epoch, low in rank["gate_log"])
        for epoch, _, _, oldest, _ in rank["reads"]:
            assert oldest >= epoch - bound - 1
    # The fast process did run ahead on stale rows (and the straggler never had to wait as long).
    fast = out[0]
    assert max(epoch - oldest for epoch, _, kind, oldest, _ in fast["reads"] if kind == "act") == 2
    assert fast["waited"] > out[1]["waited"]
    # Every replica applied the same updates in the same order.
    for name, value in out[0]["params"].items():
        assert torch.equal(value, out[1]["params"][name])
    assert out[0]["test"][-1] > 0.5


def test_bad_world_size():
    with pytest.raises(ConfigurationError, match="needs >= 2"):
        run_partitions(sbm(num_nodes=60), world_size=1)
