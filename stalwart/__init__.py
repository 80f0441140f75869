"""stalwart: training that is cheap to debug and cheap to recover, for Lightning and Composer."""

from stalwart import gnn, hindsight, shrink
from stalwart.callbacks import HindsightCallback, ShrinkCheckpoint
from stalwart.callbacks.replay import FunctionProbe
from stalwart.datamodules import StaleGAT, StaleGatherDataModule, StaleGCN, StaleGNNModule
from stalwart.errors import (
    ConfigurationError,
    CorruptCheckpointError,
    ReplayError,
    RunDirectoryError,
    RunNotFoundError,
    StalwartError,
)
from stalwart.loops import ParameterServerTrainer
from stalwart.plugins import ShrinkCheckpointIO
from stalwart.strategies import RedundantPipelineStrategy
from stalwart.trainer import Mismatch, ReplayResult, Trainer

__version__ = "0.1.0"

__all__ = [
    "ConfigurationError",
    "CorruptCheckpointError",
    "FunctionProbe",
    "HindsightCallback",
    "Mismatch",
    "ParameterServerTrainer",
    "RedundantPipelineStrategy",
    "ReplayResult",
    "ReplayError",
    "RunDirectoryError",
    "RunNotFoundError",
    "ShrinkCheckpoint",
    "ShrinkCheckpointIO",
    "StaleGAT",
    "StaleGCN",
    "StaleGNNModule",
    "StaleGatherDataModule",
    "StalwartError",
    "Trainer",
    "gnn",
    "hindsight",
    "shrink",
]
