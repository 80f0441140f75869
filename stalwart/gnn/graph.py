"""The graph as the engine sees it: features, labels, masks, intervals and their blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stalwart.errors import ConfigurationError
from stalwart.gnn.adjacency import IntervalBlock, gcn_adjacency, interval_blocks
from stalwart.gnn.intervals import Intervals, partition_intervals


@dataclass(frozen=True)
class IntervalGraph:
    """A node-classification graph split into intervals.

    Build it with :meth:`build`, which checks its input.

    Example:
        >>> g = IntervalGraph.build(x, y, edge_index, train, val, test, num_intervals=8)
        >>> len(g.blocks), g.full_block.nodes.numel() == g.num_nodes
        (8, True)
    """

    x: torch.Tensor
    y: torch.Tensor
    edge_index: torch.Tensor
    train_mask: torch.Tensor
    val_mask: torch.Tensor
    test_mask: torch.Tensor
    intervals: Intervals
    blocks: list[IntervalBlock]
    full_block: IntervalBlock

    @property
    def num_nodes(self) -> int:
        return int(self.x.shape[0])

    @property
    def num_features(self) -> int:
        return int(self.x.shape[1])

    @property
    def num_classes(self) -> int:
        return int(self.y.max()) + 1

    @classmethod
    def build(
        cls,
        x: torch.Tensor | None,
        y: torch.Tensor | None,
        edge_index: torch.Tensor | None,
        train_mask: torch.Tensor | None,
        val_mask: torch.Tensor | None,
        test_mask: torch.Tensor | None,
        num_intervals: int,
        dtype: torch.dtype = torch.float32,
    ) -> IntervalGraph:
        """Check the graph and split it into ``num_intervals`` intervals.

        Args:
            x: ``[N, F]`` vertex features.
            y: ``[N]`` integer class labels.
            edge_index: ``[2, E]`` edges (source, target).
            train_mask: ``[N]`` bool, vertices whose loss trains the model.
            val_mask: ``[N]`` bool.
            test_mask: ``[N]`` bool.
            num_intervals: 1 <= num_intervals <= N.
            dtype: floating dtype of features and rows.
        """
        named = {"x": x, "y": y, "edge_index": edge_index, "train_mask": train_mask,
                 "val_mask": val_mask, "test_mask": test_mask}  # fmt: skip
        missing = [name for name, value in named.items() if value is None]
        if missing:
            raise ConfigurationError(
                f"the graph has no {', '.join(missing)}: node classification needs vertex "
                "features x, labels y, edge_index and train/val/test masks (e.g. a PyG "
                "Planetoid dataset, or set data.train_mask = ... before passing it)."
            )
        if x.dim() != 2 or not x.is_floating_point():
            raise ConfigurationError(
                "x must be a float [num_nodes, num_features] tensor, "
                f"got {tuple(x.shape)} {x.dtype}."
            )
        num_nodes = x.shape[0]
        if y.shape != (num_nodes,) or y.is_floating_point():
            raise ConfigurationError(
                f"y must be integer class labels of shape [{num_nodes}], "
                f"got {tuple(y.shape)} {y.dtype}."
            )
        if edge_index.dim() != 2 or edge_index.shape[0] != 2:
            raise ConfigurationError(
                f"edge_index must be [2, num_edges], got {tuple(edge_index.shape)}."
            )
        if edge_index.numel() and (edge_index.min() < 0 or edge_index.max() >= num_nodes):
            raise ConfigurationError(f"edge_index refers to vertices outside 0..{num_nodes - 1}.")
        for name in ("train_mask", "val_mask", "test_mask"):
            mask = named[name]
            if mask.shape != (num_nodes,) or mask.dtype != torch.bool:
                raise ConfigurationError(
                    f"{name} must be a bool tensor of shape [{num_nodes}], "
                    f"got {tuple(mask.shape)} {mask.dtype}."
                )
            if not bool(mask.any()):
                raise ConfigurationError(f"{name} selects no vertex: mark at least one.")
        if bool((y[train_mask] < 0).any()):
            raise ConfigurationError("y has negative labels on training vertices.")
        edge_index = edge_index.long()
        intervals = partition_intervals(edge_index, num_nodes, num_intervals)
        adjacency = gcn_adjacency(edge_index, num_nodes, dtype)
        whole = Intervals(torch.zeros(num_nodes, dtype=torch.long))
        return cls(
            x=x.to(dtype), y=y.long(), edge_index=edge_index, train_mask=train_mask,
            val_mask=val_mask, test_mask=test_mask, intervals=intervals,
            blocks=interval_blocks(adjacency, intervals),
            full_block=interval_blocks(adjacency, whole)[0],
        )  # fmt: skip
