"""Composer's private checkpoint functions that ``Shrink`` routes, and only while it is in use.

Composer has no pluggable checkpoint writer or reader: ``CheckpointSaver`` writes through the
module function ``composer.utils.checkpoint._write_checkpoint_file`` and ``load_path`` reads
through ``safe_torch_load``, both called through that module's globals. ``Shrink`` replaces
them there, but only while at least one Trainer with a ``Shrink`` is open (from its ``INIT``
event until ``trainer.close()``); importing stalwart changes nothing. Even then every file that
no ``Shrink`` is writing, and every file not in the shrunken format, goes to Composer's own
functions, so a Trainer without ``Shrink`` in the same process writes and reads as always.

``pyproject.toml`` pins Composer's minor version (``mosaicml==0.32.*``) and
``tests/algorithms/test_composer_internals.py`` fails, naming it, when one of these goes away.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator
from typing import Any

from composer.callbacks import CheckpointSaver
from composer.core import State
from composer.loggers import Logger
from composer.utils import checkpoint as composer_checkpoint

from stalwart.shrink.container import is_shrunk_file

#: ``write(checkpoint, filename)`` of the Shrink whose saver is writing right now.
_WRITE: contextvars.ContextVar[Callable[[dict[str, Any], str], None] | None] = (
    contextvars.ContextVar("stalwart_shrink_write", default=None)
)
#: ``read(path) -> checkpoint`` of the Shrink whose Trainer is loading its ``load_path`` now.
_READ: contextvars.ContextVar[Callable[[str], dict[str, Any]] | None] = contextvars.ContextVar(
    "stalwart_shrink_read", default=None
)
#: Composer's own functions while they are replaced; empty when nothing is.
_originals: dict[str, Callable[..., Any]] = {}
#: What holds the replacement in place (one entry per open Trainer with a Shrink).
_holders: list[object] = []


def _write_checkpoint_file(state_dict: dict[str, Any], filename: str) -> None:
    write = _WRITE.get()
    if write is None:
        _originals["_write_checkpoint_file"](state_dict, filename)
    else:
        write(state_dict, filename)


def _safe_torch_load(composer_states_filepath: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    # Composer links the file into a temporary folder first; a delta names its base relative to
    # where it really is.
    path = os.path.realpath(composer_states_filepath)
    read = _READ.get()
    if read is None or not is_shrunk_file(path):
        return _originals["safe_torch_load"](composer_states_filepath, *args, **kwargs)
    return read(path)


_REPLACEMENTS = {
    "_write_checkpoint_file": _write_checkpoint_file,
    "safe_torch_load": _safe_torch_load,
}


def hold(holder: object) -> None:
    """Route Composer's checkpoint writes and reads through here until :func:`release`."""
    if not _holders:
        for name, replacement in _REPLACEMENTS.items():
            _originals[name] = getattr(composer_checkpoint, name)
            setattr(composer_checkpoint, name, replacement)
    if holder not in _holders:
        _holders.append(holder)


def release(holder: object) -> None:
    """Undo :func:`hold`; Composer's own functions are back once no holder is left."""
    if holder in _holders:
        _holders.remove(holder)
    if not _holders and _originals:
        for name, original in _originals.items():
            setattr(composer_checkpoint, name, original)
        _originals.clear()


def reading(read: Callable[[str], dict[str, Any]] | None) -> None:
    """Shrunken files that Composer loads from now on (in this context) are read by ``read``;
    ``None`` ends it (the Trainer has loaded its ``load_path``)."""
    _READ.set(read)


@contextlib.contextmanager
def _writing(write: Callable[[dict[str, Any], str], None]) -> Iterator[None]:
    token = _WRITE.set(write)
    try:
        yield
    finally:
        _WRITE.reset(token)


def route_saver(
    saver: CheckpointSaver,
    write: Callable[[dict[str, Any], str], None],
    remove: Callable[[str], None],
) -> None:
    """Make ``saver``'s checkpoint files go to ``write``, and its rotation delete with ``remove``.

    Rotation is taken over because Composer deletes the oldest files, and a delta's base must
    outlive the delta: ``remove`` retires a shrunken file until nothing depends on it.
    """
    save, rotate = saver._save_checkpoint, saver._rotate_checkpoints

    def save_checkpoint(state: State, logger: Logger) -> None:
        with _writing(write):
            save(state, logger)

    def rotate_checkpoints(sharding_enabled: bool = False) -> None:
        keep = saver.num_checkpoints_to_keep
        while len(saver.saved_checkpoints) > keep:
            oldest = saver.saved_checkpoints[0]
            if not is_shrunk_file(oldest):
                rotate(sharding_enabled)
                continue
            saver.saved_checkpoints.pop(0)
            remove(oldest)

    saver._save_checkpoint = save_checkpoint
    saver._rotate_checkpoints = rotate_checkpoints


def unroute_saver(saver: CheckpointSaver) -> None:
    vars(saver).pop("_save_checkpoint", None)
    vars(saver).pop("_rotate_checkpoints", None)


def is_archive(filename: str) -> bool:
    """Whether Composer would write ``filename`` as a tar or compressed archive."""
    return composer_checkpoint.is_tar(filename) or composer_checkpoint.is_compressed_pt(filename)
