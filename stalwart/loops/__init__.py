"""Lightning-side training loops: a LightningModule trained by a parameter server."""

from stalwart.loops.parameter_server import LightningWorkload, ParameterServerTrainer

__all__ = ["LightningWorkload", "ParameterServerTrainer"]
