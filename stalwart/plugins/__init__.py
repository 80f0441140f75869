"""Lightning plugins."""

from stalwart.plugins.shrink_io import ShrinkCheckpointIO, ShrinkRequest

__all__ = ["ShrinkCheckpointIO", "ShrinkRequest"]
