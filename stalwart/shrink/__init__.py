"""Shrunken checkpoints (Inshrinkerator): non-uniform quantization chosen by search under a
quality bound, delta-coded between checkpoints.

Example::

    import stalwart.shrink
    report = stalwart.shrink.save(model.state_dict(), "0.shrunk", evaluate=loss, tau=0.05)
    report = stalwart.shrink.save(model.state_dict(), "1.shrunk", previous=report, evaluate=loss)
    print(report.ratio, report.config)
    model.load_state_dict(stalwart.shrink.load("1.shrunk"))
"""

from stalwart.shrink.api import ShrinkReport, load, load_with_extra, save
from stalwart.shrink.partition import QuantConfig
from stalwart.shrink.search import ConfigSearch

__all__ = ["ConfigSearch", "QuantConfig", "ShrinkReport", "load", "load_with_extra", "save"]
