"""Lightning data modules (and the modules that train on them)."""

from stalwart.datamodules.stale_gather import (
    GatherRound,
    StaleGatherDataModule,
    default_planetoid_root,
    load_planetoid,
)
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
    "default_planetoid_root",
    "load_planetoid",
]
