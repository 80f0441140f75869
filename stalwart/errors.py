"""User-facing errors. Every message says what went wrong and what to do about it."""

from __future__ import annotations


class StalwartError(Exception):
    """Base class of every error stalwart raises on bad input or bad state on disk."""


class ConfigurationError(StalwartError, ValueError):
    """An argument is outside its valid range or combination."""


class RunDirectoryError(StalwartError, OSError):
    """A run directory cannot be used: not writable, or it holds something that is not ours."""


class CorruptCheckpointError(StalwartError):
    """A checkpoint file is torn, truncated or does not match the checksum recorded for it."""


class RunNotFoundError(StalwartError, LookupError):
    """No recorded run (or metric) matches what was asked for."""


class ReplayError(StalwartError):
    """A replay cannot run as asked: the record does not match the model, or lacks what it needs."""


class StoreUnavailableError(StalwartError, ConnectionError):
    """The parameter-server store cannot be reached (at start, or for longer than the patience)."""


class UnsafeCheckpointError(StalwartError):
    """A checkpoint holds pickled objects that a ``weights_only`` load refuses to run."""
