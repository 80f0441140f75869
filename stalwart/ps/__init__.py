"""Training through parameter-server failure (Cao et al., "Training Through Failure").

Data-parallel training with a parameter server in five modes -- checkpointing (sync/async), chain
replication (sync/async) and the stateless PS whose weights and gradient queues live in an
external store -- with real processes, a SIGKILL failure injector and the paper's experiment.
Framework-neutral: plain torch and the standard library (no Lightning import here); what is
trained is a :class:`PSWorkload` (the Lightning adapter is :mod:`stalwart.loops.parameter_server`).

Example:
    >>> from stalwart.ps import KillEvent, PSConfig, run_training
    >>> config = PSConfig(mode="stateless", workers=2, steps=200, kills=[KillEvent(150, 2.0)])
    >>> result = run_training(config)  # doctest: +SKIP
    >>> result.lost, result.duplicates  # doctest: +SKIP
    (0, 0)
"""

from stalwart.ps.config import MODES, KillEvent, PSConfig
from stalwart.ps.result import PSRunResult
from stalwart.ps.runner import run_training
from stalwart.ps.store import KeyValueStore, RetryingStore, TCPStoreClient
from stalwart.ps.workload import DigitsWorkload, PSWorkload

__all__ = [
    "MODES",
    "DigitsWorkload",
    "KeyValueStore",
    "KillEvent",
    "PSConfig",
    "PSRunResult",
    "PSWorkload",
    "RetryingStore",
    "TCPStoreClient",
    "run_training",
]
