"""Must-show 2: sync mode is plain full-graph PyG GCN training, and nothing travels more than
L hops even with stale Gather."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from stalwart.gnn import StaleGatherEngine
from tests.gnn.graphs import adam_update, cora_or_sbm, frozen_update, gcn, interval_graph, sbm

torch_geometric = pytest.importorskip("torch_geometric")


@pytest.mark.parametrize("workers", [0, 2])
def test_sync_equals_full_graph_pyg_gcnconv(workers):
    from torch_geometric.nn import GCNConv

    dtype = torch.float64
    tensors = cora_or_sbm()
    graph = interval_graph(tensors, num_intervals=8, dtype=dtype)
    model = gcn(graph, hidden=16, seed=0)
    # Plain PyG, starting from the same weights (GCNConv stores lin.weight as [out, in]; its
    # reset draws differently from ours, so the seed alone does not line them up).
    conv1 = GCNConv(graph.num_features, 16).to(dtype)
    conv2 = GCNConv(16, graph.num_classes).to(dtype)
    with torch.no_grad():
        for conv, ours in zip((conv1, conv2), model.layers, strict=True):
            conv.lin.weight.copy_(ours.weight.T)
            conv.bias.copy_(ours.bias)
    reference = torch.optim.Adam(
        [*conv1.parameters(), *conv2.parameters()], lr=0.01, weight_decay=5e-4
    )
    x, edge_index, y, train = graph.x, graph.edge_index, graph.y, graph.train_mask
    engine = StaleGatherEngine(graph, model, "sync", adam_update(model), workers=workers)
    try:
        for epoch in range(8):
            ours = engine.run_epoch(epoch, 7).loss
            logits = conv2(F.relu(conv1(x, edge_index)), edge_index)
            loss = F.cross_entropy(logits[train], y[train])
            reference.zero_grad()
            loss.backward()
            reference.step()
            assert ours == pytest.approx(float(loss), rel=1e-12, abs=1e-13)
    finally:
        engine.close()
    for conv, ours in zip((conv1, conv2), model.layers, strict=True):
        torch.testing.assert_close(ours.weight, conv.lin.weight.T, rtol=0, atol=1e-12)
        torch.testing.assert_close(ours.bias, conv.bias, rtol=0, atol=1e-12)
    # The stale rows were never stale: every read in sync mode is of this epoch.
    assert all(r[6] == 0 for r in engine.record.reads)


def hops_from(edge_index: torch.Tensor, num_nodes: int, source: int) -> torch.Tensor:
    """Hop distance of every vertex from ``source`` (inf where unreachable), by frontier BFS."""
    adjacency = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)
    adjacency[edge_index[1], edge_index[0]] = True
    adjacency |= adjacency.T.clone()
    distance = torch.full((num_nodes,), float("inf"))
    frontier = torch.zeros(num_nodes, dtype=torch.bool)
    frontier[source] = True
    hop = 0
    while frontier.any():
        distance[frontier] = hop
        frontier = adjacency[frontier].any(0) & torch.isinf(distance)
        hop += 1
    return distance


def outputs_under_stale_schedule(tensors: dict, layers: int, target: int) -> list[torch.Tensor]:
    graph = interval_graph(tensors, num_intervals=6, dtype=torch.float64)
    model = gcn(graph, layers=layers, seed=1)
    engine = StaleGatherEngine(graph, model, 2, frozen_update(model), workers=0, seed=5)
    outputs = []
    for epoch in range(8):
        engine.run_epoch(epoch, 7)
        rows, produced = engine.buffer.read(layers, torch.tensor([target]))
        outputs.append(rows.clone())
    assert sum(r[6] for r in engine.record.reads if r[3] == "act") > 0  # it was stale
    return outputs


@pytest.mark.parametrize("layers", [2, 3])
def test_perturbing_features_beyond_l_hops_changes_nothing(layers):
    tensors = sbm(num_nodes=300, seed=2)
    num_nodes = tensors["x"].shape[0]
    distance = hops_from(tensors["edge_index"], num_nodes, source=0)
    far, near = distance > layers, (distance == layers)
    assert far.sum() > 10 and near.any()
    baseline = outputs_under_stale_schedule(tensors, layers, target=0)
    noise = torch.randn(tensors["x"].shape, generator=torch.Generator().manual_seed(9)) * 10
    perturbed_far = {**tensors, "x": torch.where(far[:, None], tensors["x"] + noise, tensors["x"])}
    for before, after in zip(
        baseline, outputs_under_stale_schedule(perturbed_far, layers, 0), strict=True
    ):
        assert torch.equal(before, after)
    # Control: the same perturbation exactly L hops away does reach the vertex.
    perturbed_near = {
        **tensors,
        "x": torch.where(near[:, None], tensors["x"] + noise, tensors["x"]),
    }
    changed = outputs_under_stale_schedule(perturbed_near, layers, 0)
    assert not torch.equal(baseline[-1], changed[-1])
