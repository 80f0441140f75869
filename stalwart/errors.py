"""User-facing errors. Every message says what went wrong and what to do about it."""

from __future__ import annotations


class StalwartError(Exception):
    """Base class of every error stalwart raises on bad input or bad state on disk."""


class ConfigurationError(StalwartError, ValueError):
    """An argument is outside its valid range or combination."""


class RunDirectoryError(StalwartError, OSError):
    """A run directory cannot be used: not writable, or it holds something that is not ours."""


class CorruptStoreError(RunDirectoryError):
    """A run directory's ``hindsight.db`` is damaged (truncated, emptied, overwritten): the
    record in it cannot be read. The checkpoint files beside it are separate files."""


class CorruptCheckpointError(StalwartError):
    """A checkpoint file is torn, truncated or does not match the checksum recorded for it."""


class RunNotFoundError(StalwartError, LookupError):
    """No recorded run (or metric) matches what was asked for."""


class ReplayError(StalwartError):
    """A replay cannot run as asked: the record does not match the model, or lacks what it needs."""


class StoreUnavailableError(StalwartError, ConnectionError):
    """The parameter-server store cannot be reached (at start, or for longer than the patience)."""


class SplitBrainError(StalwartError):
    """Another parameter server moved the committed head: two servers believe they are in charge.

    Only one PS may run against a store at a time; stop the other one (or use a fresh store).
    """


class PipelineRunError(StalwartError):
    """A pipeline run did not complete: it hung past its timeout, or the job was suspended.

    A suspended job resumes from its last checkpoint when enough nodes are back; a hang names
    the timeout to raise.
    """


class UnsafeCheckpointError(StalwartError):
    """A checkpoint holds pickled objects that a ``weights_only`` load refuses to run."""


class BackgroundSaveError(StalwartError):
    """A checkpoint shrunk in a background child failed; its file was not written (files are
    written under a temp name and renamed), and the chain goes on from the file before."""


class DatasetUnavailableError(ConfigurationError):
    """A dataset is neither under its root nor downloadable from here.

    Put its files under the root the message names, or pass ``root=`` pointing at a copy.
    """
