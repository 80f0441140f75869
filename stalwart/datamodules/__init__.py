"""Lightning data modules (and the modules that train on them)."""

from stalwart.datamodules.stale_gather import GatherRound, StaleGatherDataModule, load_planetoid
from stalwart.datamodules.stale_module import StaleGAT, StaleGCN, StaleGNNModule
from stalwart.gnn.layers import StaleGATConv, StaleGCNConv

__all__ = [
    "GatherRound",
    "StaleGAT",
    "StaleGATConv",
    "StaleGCN",
    "StaleGCNConv",
    "StaleGNNModule",
    "StaleGatherDataModule",
    "load_planetoid",
]
