"""Framework-neutral core of asynchronous bounded-staleness GNN training (Dorylus, thesis ch. 2).

Plain torch: vertex intervals, versioned ghost buffers that remember the epoch that produced
each row, the staleness gate, reference-counted weight stashing, worker pools for graph and
tensor tasks, and the engine that pipelines them. The Lightning adapter is
:mod:`stalwart.datamodules`.
"""

from stalwart.gnn.adjacency import IntervalBlock, gcn_adjacency, interval_blocks
from stalwart.gnn.engine import EpochResult, StaleGatherEngine
from stalwart.gnn.gate import StalenessGate, parse_staleness
from stalwart.gnn.ghost_buffer import GradientGhostBuffer, VersionedGhostBuffer
from stalwart.gnn.graph import IntervalGraph
from stalwart.gnn.intervals import Intervals, partition_intervals
from stalwart.gnn.layers import StaleGATConv, StaleGCNConv, StaleGNN
from stalwart.gnn.record import StalenessRecord
from stalwart.gnn.scheduler import InlinePools, Straggler, WorkerPools
from stalwart.gnn.stash import WeightStash

__all__ = [
    "EpochResult",
    "GradientGhostBuffer",
    "InlinePools",
    "IntervalBlock",
    "IntervalGraph",
    "Intervals",
    "StaleGATConv",
    "StaleGCNConv",
    "StaleGNN",
    "StaleGatherEngine",
    "StalenessGate",
    "StalenessRecord",
    "Straggler",
    "VersionedGhostBuffer",
    "WeightStash",
    "WorkerPools",
    "gcn_adjacency",
    "interval_blocks",
    "parse_staleness",
    "partition_intervals",
]
