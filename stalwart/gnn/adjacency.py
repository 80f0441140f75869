"""The normalised adjacency and its per-interval row blocks (what a graph task touches)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stalwart.gnn.intervals import Intervals


def gcn_adjacency(
    edge_index: torch.Tensor, num_nodes: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``D^-1/2 (A + I) D^-1/2`` as a coalesced sparse COO matrix indexed ``[target, source]``.

    Matches PyG's ``gcn_norm`` (existing self loops replaced by weight-1 loops, degree counted
    at the target, duplicate edges summed), so one row of it is exactly what ``GCNConv``
    aggregates into that vertex.
    """
    src, dst = edge_index[0], edge_index[1]
    keep = src != dst
    loops = torch.arange(num_nodes)
    src = torch.cat([src[keep], loops])
    dst = torch.cat([dst[keep], loops])
    weight = torch.ones(src.numel(), dtype=dtype)
    degree = torch.zeros(num_nodes, dtype=dtype).index_add_(0, dst, weight)
    inv_sqrt = degree.pow(-0.5)
    values = inv_sqrt[src] * weight * inv_sqrt[dst]
    matrix = torch.sparse_coo_tensor(torch.stack([dst, src]), values, (num_nodes, num_nodes))
    return matrix.coalesce()


@dataclass(frozen=True)
class IntervalBlock:
    """The rows of the adjacency that belong to one interval, over the columns it touches.

    Args:
        index: the interval id.
        nodes: ``[n]`` global ids of the interval's vertices (the block's rows).
        neighbors: ``[m]`` sorted global ids of every vertex a row reads (own vertices included,
            through the self loops).
        adjacency: sparse ``[n, m]`` normalised weights.
        whole_adjacency: the same entries as a sparse ``[n, N]`` matrix over global columns.
        edge_dst: ``[nnz]`` local row of each entry.
        edge_src: ``[nnz]`` position in ``neighbors`` of each entry.
        self_position: ``[n]`` position of each own vertex in ``neighbors``.
    """

    index: int
    nodes: torch.Tensor
    neighbors: torch.Tensor
    adjacency: torch.Tensor
    whole_adjacency: torch.Tensor
    edge_dst: torch.Tensor
    edge_src: torch.Tensor
    self_position: torch.Tensor

    def aggregate(self, rows: torch.Tensor, *, whole: bool = False) -> torch.Tensor:
        """``A[nodes, neighbors] @ rows`` (the Gather of a GCN layer); with ``whole``, ``rows``
        holds every vertex's row (indexed by global id) and nothing needs gathering first."""
        return torch.sparse.mm(self.whole_adjacency if whole else self.adjacency, rows)


def interval_blocks(adjacency: torch.Tensor, intervals: Intervals) -> list[IntervalBlock]:
    """One :class:`IntervalBlock` per interval of ``intervals`` over ``adjacency``."""
    rows, cols = adjacency.indices()
    values = adjacency.values()
    local = torch.empty(intervals.num_nodes, dtype=torch.long)
    owner = intervals.assignment[rows]
    blocks = []
    for index in range(intervals.num_intervals):
        nodes = intervals.members(index)
        local[nodes] = torch.arange(nodes.numel())
        mine = owner == index
        row, col = rows[mine], cols[mine]
        neighbors = torch.unique(col)
        edge_dst, edge_src = local[row], torch.searchsorted(neighbors, col)
        block = torch.sparse_coo_tensor(
            torch.stack([edge_dst, edge_src]), values[mine], (nodes.numel(), neighbors.numel())
        ).coalesce()
        blocks.append(
            IntervalBlock(
                index=index,
                nodes=nodes,
                neighbors=neighbors,
                adjacency=block,
                whole_adjacency=torch.sparse_coo_tensor(
                    torch.stack([edge_dst, col]), values[mine], (nodes.numel(), intervals.num_nodes)
                ).coalesce(),
                edge_dst=block.indices()[0],
                edge_src=block.indices()[1],
                self_position=torch.searchsorted(neighbors, nodes),
            )  # fmt: skip
        )
    return blocks
