"""Graphs for the gnn tests: Cora when the offline Planetoid copy exists, else a generated SBM."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

import torch

from stalwart.gnn import IntervalGraph, StaleGCNConv, StaleGNN
from stalwart.gnn.synthetic import stochastic_block_graph

#: The offline Planetoid copy (``<name>/raw``) the tests read: ``$STALWART_PLANETOID``, else
#: ``shared/data/planetoid`` next to the repository, where CI and the dev machines keep it.
OFFLINE_PLANETOID = Path(
    os.environ.get("STALWART_PLANETOID")
    or Path(__file__).resolve().parents[3] / "shared" / "data" / "planetoid"
)
HAVE_CORA = (OFFLINE_PLANETOID / "Cora" / "raw").is_dir()


@functools.cache
def planetoid_root() -> Path:
    """A writable copy of the offline raw files, to pass as ``root=`` (PyG writes ``processed/``
    next to ``raw/``, and the offline copy may be read-only)."""
    root = Path(tempfile.mkdtemp(prefix="stalwart-test-planetoid-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    for raw in OFFLINE_PLANETOID.glob("*/raw"):
        shutil.copytree(raw, root / raw.parent.name / "raw")
    return root


@functools.cache
def cora_or_sbm() -> dict[str, torch.Tensor]:
    """Cora's six tensors, or (no Planetoid copy on this machine) a 600-vertex SBM graph."""
    if HAVE_CORA:
        from stalwart.datamodules import load_planetoid

        data = load_planetoid("Cora", planetoid_root())
        keys = ("x", "y", "edge_index", "train_mask", "val_mask", "test_mask")
        return {k: getattr(data, k) for k in keys}
    return stochastic_block_graph(seed=0)


def sbm(num_nodes: int = 400, seed: int = 0) -> dict[str, torch.Tensor]:
    return stochastic_block_graph(num_nodes=num_nodes, seed=seed)


def interval_graph(tensors: dict, num_intervals: int, dtype=torch.float32) -> IntervalGraph:
    return IntervalGraph.build(**tensors, num_intervals=num_intervals, dtype=dtype)


def gcn(
    graph: IntervalGraph, hidden: int = 16, layers: int = 2, dropout: float = 0.0, seed: int = 0
) -> StaleGNN:
    torch.manual_seed(seed)
    widths = [graph.num_features] + [hidden] * (layers - 1) + [graph.num_classes]
    convs = [StaleGCNConv(a, b) for a, b in zip(widths, widths[1:], strict=False)]
    return StaleGNN(convs, dropout=dropout).to(graph.x.dtype)


def adam_update(model: StaleGNN, lr: float = 0.01, weight_decay: float = 5e-4):
    """The WU callback: Adam on ``model`` with the summed gradient."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)

    def update(epoch: int, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name, param in model.named_parameters():
            param.grad = grads[name]
        optimizer.step()
        optimizer.zero_grad()
        return dict(model.named_parameters())

    return update


def frozen_update(model: StaleGNN):
    """A WU that changes nothing (forward-only experiments)."""
    return lambda epoch, grads: dict(model.named_parameters())
