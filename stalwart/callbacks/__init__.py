"""Lightning callbacks."""

from stalwart.callbacks.hindsight import HindsightCallback

__all__ = ["HindsightCallback"]
