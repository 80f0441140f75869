"""stalwart: training that is cheap to debug and cheap to recover, for Lightning and Composer."""

from stalwart import hindsight
from stalwart.callbacks import HindsightCallback
from stalwart.errors import (
    ConfigurationError,
    CorruptCheckpointError,
    RunDirectoryError,
    RunNotFoundError,
    StalwartError,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigurationError",
    "CorruptCheckpointError",
    "HindsightCallback",
    "RunDirectoryError",
    "RunNotFoundError",
    "StalwartError",
    "hindsight",
]
