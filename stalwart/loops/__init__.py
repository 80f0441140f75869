"""Lightning-side training loops: a LightningModule trained by a parameter server."""

from stalwart.loops.parameter_server import LightningPSWorkload, ParameterServerTrainer

__all__ = ["LightningPSWorkload", "ParameterServerTrainer"]
