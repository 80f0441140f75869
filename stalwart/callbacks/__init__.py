"""Lightning callbacks."""

from stalwart.callbacks.hindsight import HindsightCallback
from stalwart.callbacks.shrink import ShrinkCheckpoint

__all__ = ["HindsightCallback", "ShrinkCheckpoint"]
