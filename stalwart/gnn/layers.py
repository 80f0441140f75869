"""Stale GNN layers: each layer is a graph task (Gather over an interval block) followed by a
tensor task (ApplyVertex, and ApplyEdge for GAT) that takes its weights as an argument, so the
engine can run it on a stashed weight version.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from stalwart.gnn.adjacency import IntervalBlock


class StaleGCNConv(nn.Module):
    """A GCN layer ``A_hat H W + b`` split into Gather (``A_hat H``) and ApplyVertex (``. W + b``).

    Initialised like PyG's ``GCNConv`` (glorot weight, zero bias); ``weight`` is stored
    ``[in, out]``.

    Args:
        in_channels: input width.
        out_channels: output width.

    Example:
        >>> conv = StaleGCNConv(4, 2)
        >>> gathered = conv.gather(block, rows)           # graph task
        >>> out = conv.apply_vertex(block, gathered, dict(conv.named_parameters()))  # tensor task
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        # Glorot over PyG's [out, in] layout, stored transposed for ``rows @ weight``.
        bound = math.sqrt(6.0 / (in_channels + out_channels))
        weight = torch.empty(out_channels, in_channels).uniform_(-bound, bound)
        self.weight = nn.Parameter(weight.T.contiguous())
        self.bias = nn.Parameter(torch.zeros(out_channels))

    @property
    def out_channels(self) -> int:
        return self.weight.shape[1]

    def gather(
        self, block: IntervalBlock, rows: torch.Tensor, *, whole: bool = False
    ) -> torch.Tensor:
        """Gather; ``rows`` are the block's neighbours' rows, or every vertex's with ``whole``."""
        return block.aggregate(rows, whole=whole)

    def apply_vertex(
        self, block: IntervalBlock, gathered: torch.Tensor, params: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        return gathered @ params["weight"] + params["bias"]


class StaleGATConv(nn.Module):
    """A single-head GAT layer: Gather collects the neighbours' rows, ApplyVertex projects them,
    ApplyEdge scores every edge (``LeakyReLU(a_src . h_j + a_dst . h_i)``, softmax over a
    vertex's in-edges) and the weighted rows are summed into each vertex.

    Args:
        in_channels: input width.
        out_channels: output width.
        negative_slope: LeakyReLU slope of the attention scores.

    Example:
        >>> conv = StaleGATConv(4, 2)
        >>> out = conv.apply_vertex(block, conv.gather(block, rows), dict(conv.named_parameters()))
    """

    def __init__(self, in_channels: int, out_channels: int, negative_slope: float = 0.2) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_channels, out_channels))
        self.att_src = nn.Parameter(torch.empty(out_channels))
        self.att_dst = nn.Parameter(torch.empty(out_channels))
        self.bias = nn.Parameter(torch.zeros(out_channels))
        self.negative_slope = negative_slope
        nn.init.uniform_(self.weight, -1, 1)
        self.weight.data *= math.sqrt(6.0 / (in_channels + out_channels))
        for att in (self.att_src, self.att_dst):
            nn.init.uniform_(
                att, -math.sqrt(6.0 / (out_channels + 1)), math.sqrt(6.0 / (out_channels + 1))
            )

    @property
    def out_channels(self) -> int:
        return self.weight.shape[1]

    def gather(
        self, block: IntervalBlock, rows: torch.Tensor, *, whole: bool = False
    ) -> torch.Tensor:
        """Gather; ``rows`` are the block's neighbours' rows, or every vertex's with ``whole``."""
        return rows[block.neighbors] if whole else rows

    def apply_vertex(
        self, block: IntervalBlock, gathered: torch.Tensor, params: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        h = gathered @ params["weight"]
        score_src = h @ params["att_src"]
        score_dst = (h @ params["att_dst"])[block.self_position]
        logits = F.leaky_relu(
            score_src[block.edge_src] + score_dst[block.edge_dst], self.negative_slope
        )
        n = block.nodes.numel()
        peak = torch.full((n,), -torch.inf, dtype=h.dtype).scatter_reduce(
            0, block.edge_dst, logits.detach(), "amax"
        )
        weights = torch.exp(logits - peak[block.edge_dst])
        total = torch.zeros(n, dtype=h.dtype).index_add(0, block.edge_dst, weights)
        alpha = weights / total[block.edge_dst]
        out = torch.zeros(n, h.shape[1], dtype=h.dtype)
        out = out.index_add(0, block.edge_dst, alpha[:, None] * h[block.edge_src])
        return out + params["bias"]


class StaleGNN(nn.Module):
    """A stack of stale layers with ReLU and dropout between them (the model the engine runs).

    Args:
        layers: the stale layers, first to last.
        dropout: dropout probability on every layer's input rows (training only).

    Example:
        >>> gnn = StaleGNN([StaleGCNConv(1433, 16), StaleGCNConv(16, 7)], dropout=0.5)
        >>> logits = gnn.full_forward(full_block, x)      # exact full-graph inference
    """

    def __init__(self, layers: Sequence[nn.Module], dropout: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.dropout = dropout

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_params(
        self, params: Mapping[str, torch.Tensor], layer: int
    ) -> dict[str, torch.Tensor]:
        """The entries of a full parameter dict that belong to ``layer`` (1-based)."""
        prefix = f"layers.{layer - 1}."
        return {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}

    def activate(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        return out if layer == self.num_layers else F.relu(out)

    def full_forward(self, block: IntervalBlock, x: torch.Tensor) -> torch.Tensor:
        """Exact full-graph forward with the current parameters (no dropout): evaluation."""
        params = dict(self.named_parameters())
        h = x
        for index, layer in enumerate(self.layers, start=1):
            gathered = layer.gather(block, h)
            h = self.activate(
                index, layer.apply_vertex(block, gathered, self.layer_params(params, index))
            )
        return h
