"""Versioned ghost buffers: the latest rows (and gradients) of every vertex, with their epochs.

Dorylus' Scatter pushes an interval's layer output to its neighbours' ghost buffers; Gather
reads whatever is there, which under asynchrony may come from an earlier (or later) epoch. Each
row therefore carries the epoch that produced it, so that staleness can be bounded and logged.
Epoch ``-1`` marks the initial zero rows nobody has produced yet.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from stalwart.gnn.adjacency import IntervalBlock

NEVER = -1


class VersionedGhostBuffer:
    """Per layer, every vertex's latest output row and the epoch that produced it.

    Layers are numbered from 1 (layer 0 is the input features, which never go stale); the
    engine also keeps the last layer's outputs here so they can be inspected.

    Args:
        num_nodes: number of vertices.
        widths: output width of each buffered layer, ``widths[l - 1]`` for layer ``l``.
        dtype: row dtype.

    Example:
        >>> buf = VersionedGhostBuffer(3, [2])
        >>> buf.write(1, torch.tensor([0, 2]), torch.ones(2, 2), epoch=4)
        >>> buf.read(1, torch.tensor([0, 1]))[1].tolist()
        [4, -1]
    """

    def __init__(
        self, num_nodes: int, widths: Sequence[int], dtype: torch.dtype = torch.float32
    ) -> None:
        self._rows = [torch.zeros(num_nodes, w, dtype=dtype) for w in widths]
        self._epochs = [torch.full((num_nodes,), NEVER, dtype=torch.long) for _ in widths]
        self._lock = threading.Lock()

    def write(self, layer: int, nodes: torch.Tensor, rows: torch.Tensor, epoch: int) -> None:
        """Scatter: ``rows`` become the latest values of ``nodes`` at ``layer``."""
        with self._lock:
            self._rows[layer - 1].index_copy_(0, nodes, rows.detach())
            self._epochs[layer - 1].index_fill_(0, nodes, epoch)

    def read(self, layer: int, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather: a copy of the latest rows of ``nodes`` at ``layer`` and their epochs."""
        with self._lock:
            return self._rows[layer - 1][nodes], self._epochs[layer - 1][nodes]

    def state_dict(self) -> dict:
        with self._lock:
            return {
                "rows": [r.clone() for r in self._rows],
                "epochs": [e.clone() for e in self._epochs],
            }

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self._rows = [r.clone() for r in state["rows"]]
            self._epochs = [e.clone() for e in state["epochs"]]


class GradientGhostBuffer:
    """Per hidden layer, each interval's latest gradient contribution to its neighbours' rows.

    The backward Gather (thesis: the reverse-direction Scatter) of interval ``j`` at layer
    ``l + 1`` produces ``dLoss/dH_l`` for every vertex ``j`` reads; the backward of interval
    ``i`` at layer ``l`` needs the sum of those contributions over all ``j``. Contributions are
    kept per source and summed in source order, so the sum does not depend on thread timing.

    Args:
        blocks: the interval blocks (their ``neighbors`` say which rows a source touches).
        widths: width of each buffered layer, as for :class:`VersionedGhostBuffer`.
        dtype: gradient dtype.
    """

    def __init__(
        self,
        blocks: Sequence[IntervalBlock],
        widths: Sequence[int],
        dtype: torch.dtype = torch.float32,
    ) -> None:
        num_nodes = sum(b.nodes.numel() for b in blocks)
        owner = torch.empty(num_nodes, dtype=torch.long)
        local = torch.empty(num_nodes, dtype=torch.long)
        for block in blocks:
            owner[block.nodes] = block.index
            local[block.nodes] = torch.arange(block.nodes.numel())
        # routes[target][k] = (source, positions in source's neighbors, local rows in target)
        self._routes: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = [[] for _ in blocks]
        for source in blocks:
            owners = owner[source.neighbors]
            for target in torch.unique(owners).tolist():
                positions = torch.nonzero(owners == target).flatten()
                self._routes[target].append(
                    (source.index, positions, local[source.neighbors[positions]])
                )
        self._sizes = [b.nodes.numel() for b in blocks]
        self._widths = list(widths)
        self._dtype = dtype
        self._grads: list[dict[int, torch.Tensor]] = [{} for _ in widths]
        self._epochs = [torch.full((len(blocks),), NEVER, dtype=torch.long) for _ in widths]
        self._lock = threading.Lock()

    def scatter(self, layer: int, source: int, grads: torch.Tensor, epoch: int) -> None:
        """Interval ``source``'s contribution to ``dLoss/dH_layer`` of its neighbours."""
        with self._lock:
            self._grads[layer - 1][source] = grads.detach()
            self._epochs[layer - 1][source] = epoch

    def gather(self, layer: int, target: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``dLoss/dH_layer`` of ``target``'s rows, and the epoch of each source summed in."""
        out = torch.zeros(self._sizes[target], self._widths[layer - 1], dtype=self._dtype)
        with self._lock:
            sources = [src for src, _, _ in self._routes[target]]
            epochs = self._epochs[layer - 1][sources]
            grads = [self._grads[layer - 1].get(src) for src in sources]
        for (_, positions, rows), grad in zip(self._routes[target], grads, strict=True):
            if grad is not None:
                out.index_add_(0, rows, grad[positions])
        return out, epochs
