"""Composer algorithms: one line each in ``Trainer(..., algorithms=[Hindsight(), Shrink()])``.

Thin adapters over the framework-neutral cores :mod:`stalwart.hindsight` and
:mod:`stalwart.shrink`; each has a method card (How to use / Implementation details / Suggested
hyperparameters / Attribution) beside its module.
"""

from stalwart.algorithms.hindsight import Hindsight, replay
from stalwart.algorithms.shrink import Shrink

__all__ = ["Hindsight", "Shrink", "replay"]
