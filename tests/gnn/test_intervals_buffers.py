"""Intervals are equal-size and balanced; the ghost buffers keep rows, gradients and epochs."""

from __future__ import annotations

import torch

from stalwart.gnn import GradientGhostBuffer, VersionedGhostBuffer, gcn_adjacency, interval_blocks
from tests.gnn.graphs import cora_or_sbm, interval_graph


def test_intervals_equal_size_and_balanced_inter_interval_edges():
    tensors = cora_or_sbm()
    graph = interval_graph(tensors, num_intervals=8)
    sizes = graph.intervals.sizes()
    assert int(sizes.max() - sizes.min()) <= 1 and int(sizes.sum()) == graph.num_nodes
    crossing = graph.intervals.inter_interval_edges(graph.edge_index).float()
    assert crossing.max() / crossing.min() < 1.25
    # Every vertex in exactly one block, and the blocks tile the adjacency's rows.
    nodes = torch.cat([b.nodes for b in graph.blocks]).sort().values
    assert torch.equal(nodes, torch.arange(graph.num_nodes))
    assert sum(b.adjacency._nnz() for b in graph.blocks) == graph.full_block.adjacency._nnz()


def test_blocks_reproduce_the_full_adjacency_product():
    tensors = cora_or_sbm()
    graph = interval_graph(tensors, num_intervals=5, dtype=torch.float64)
    h = torch.randn(graph.num_nodes, 4, dtype=torch.float64)
    full = torch.sparse.mm(gcn_adjacency(graph.edge_index, graph.num_nodes, torch.float64), h)
    for block in graph.blocks:
        torch.testing.assert_close(block.aggregate(h[block.neighbors]), full[block.nodes])
        torch.testing.assert_close(block.aggregate(h, whole=True), full[block.nodes])


def test_gradient_buffer_sums_every_sources_contribution():
    tensors = cora_or_sbm()
    graph = interval_graph(tensors, num_intervals=4, dtype=torch.float64)
    grads = GradientGhostBuffer(graph.blocks, [3], torch.float64)
    upstream = torch.randn(graph.num_nodes, 3, dtype=torch.float64)
    for block in graph.blocks:  # dLoss/dH = A^T dZ, scattered by each source block
        grads.scatter(1, block.index, block.adjacency.t() @ upstream[block.nodes], epoch=7)
    adjacency = gcn_adjacency(graph.edge_index, graph.num_nodes, torch.float64)
    expected = adjacency.t() @ upstream
    for block in graph.blocks:
        got, epochs = grads.gather(1, block.index)
        torch.testing.assert_close(got, expected[block.nodes])
        assert (epochs == 7).all()


def test_versioned_buffer_keeps_producing_epochs():
    buffer = VersionedGhostBuffer(5, [2, 3])
    rows, epochs = buffer.read(2, torch.arange(5))
    assert (epochs == -1).all() and rows.abs().sum() == 0
    buffer.write(2, torch.tensor([1, 3]), torch.ones(2, 3), epoch=4)
    buffer.write(2, torch.tensor([3]), torch.full((1, 3), 2.0), epoch=5)
    rows, epochs = buffer.read(2, torch.tensor([1, 3, 4]))
    assert epochs.tolist() == [4, 5, -1] and rows[:, 0].tolist() == [1.0, 2.0, 0.0]
    restored = VersionedGhostBuffer(5, [2, 3])
    restored.load_state_dict(buffer.state_dict())
    assert restored.read(2, torch.tensor([3]))[1].tolist() == [5]
    assert interval_blocks  # re-exported for users building their own blocks
