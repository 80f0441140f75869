"""Vertex intervals: the unit of work (a "minibatch") of the Dorylus pipeline.

Dorylus splits a partition's vertices into intervals with the same number of vertices whose
vertices have similar numbers of inter-interval edges (thesis 2.4), so that no interval's graph
or tensor task is systematically heavier than another's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stalwart.errors import ConfigurationError


@dataclass(frozen=True)
class Intervals:
    """An assignment of every vertex to one interval.

    Args:
        assignment: ``[num_nodes]`` interval id of each vertex.

    Example:
        >>> ivs = partition_intervals(torch.tensor([[0, 1], [1, 0]]), 4, 2)
        >>> ivs.sizes().tolist()
        [2, 2]
    """

    assignment: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return int(self.assignment.numel())

    @property
    def num_intervals(self) -> int:
        return int(self.assignment.max()) + 1

    def members(self, interval: int) -> torch.Tensor:
        """Sorted vertex ids of ``interval``."""
        return torch.nonzero(self.assignment == interval).flatten()

    def sizes(self) -> torch.Tensor:
        return torch.bincount(self.assignment, minlength=self.num_intervals)

    def inter_interval_edges(self, edge_index: torch.Tensor) -> torch.Tensor:
        """Per interval, the number of edges into it whose source lies in another interval."""
        src, dst = self.assignment[edge_index[0]], self.assignment[edge_index[1]]
        crossing = dst[src != dst]
        return torch.bincount(crossing, minlength=self.num_intervals)


def partition_intervals(edge_index: torch.Tensor, num_nodes: int, num_intervals: int) -> Intervals:
    """Split ``num_nodes`` vertices into ``num_intervals`` equal-size intervals.

    Vertices are dealt to intervals in a snake order over decreasing degree (0, 1, .., K-1,
    K-1, .., 0, ...): sizes differ by at most one and each interval gets a similar share of
    high- and low-degree vertices, hence similar numbers of inter-interval edges.

    Args:
        edge_index: ``[2, E]`` edges (source, target).
        num_nodes: number of vertices.
        num_intervals: number of intervals, 1 <= num_intervals <= num_nodes.
    """
    if isinstance(num_intervals, bool) or not isinstance(num_intervals, int) or num_intervals < 1:
        raise ConfigurationError(
            f"num_intervals={num_intervals!r}: pass a whole number >= 1 (e.g. 8)."
        )
    if num_intervals > num_nodes:
        raise ConfigurationError(
            f"num_intervals={num_intervals} is more than the graph's {num_nodes} vertices: "
            f"an interval needs at least one vertex; pass num_intervals <= {num_nodes}."
        )
    degree = torch.bincount(edge_index.reshape(-1), minlength=num_nodes)
    order = torch.sort(degree, descending=True, stable=True).indices
    position = torch.arange(num_nodes)
    column, row = position % num_intervals, position // num_intervals
    snake = torch.where(row % 2 == 0, column, num_intervals - 1 - column)
    assignment = torch.empty(num_nodes, dtype=torch.long)
    assignment[order] = snake
    return Intervals(assignment)
