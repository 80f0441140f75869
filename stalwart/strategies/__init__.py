"""Lightning strategies."""

from stalwart.strategies.redundant_pipeline import RedundantPipelineStrategy

__all__ = ["RedundantPipelineStrategy"]
