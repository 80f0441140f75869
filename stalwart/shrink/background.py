"""A save run in a forked child while training goes on (``ShrinkCheckpoint(background=True)``).

A fork is the snapshot: the child sees the model, the optimizer, the held-out batches and every
RNG exactly as they were at the save, copy-on-write, while the parent trains on. The child runs
the save on one thread at a lower priority (:func:`stalwart.forking.fork_child`), writes its
result (the report, the chain state the next delta extends, the search's state) to a private
temp file and exits; the parent collects it before its next save, a load, a removal, or at the
end of the fit. A process that exits with a save still in flight (a save made by hand after the
fit, with nothing after it) waits for it first, so the file is there when the process is gone.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

from stalwart.errors import BackgroundSaveError
from stalwart.forking import fork_child

log = logging.getLogger(__name__)

_in_child = False
#: The children not yet collected; the process waits for them before it exits.
_in_flight: set[ForkedCall] = set()


def in_child() -> bool:
    """True inside a background save's child: it shares the cores with training, which goes on
    meanwhile, so it keeps one torch thread (``stalwart.shrink.cores.spare_cores`` asks this)."""
    return _in_child


class ForkedCall:
    """``function()`` run in a forked child; :meth:`result` waits for it and returns its value.

    Args:
        function: what the child runs; its return value must pickle.
        what: how errors name this call (e.g. the file being written).
    """

    def __init__(self, function: Callable[[], Any], what: str) -> None:
        self.what = what
        descriptor, self._result_path = tempfile.mkstemp(prefix="stalwart-save-", suffix=".pkl")
        os.close(descriptor)
        self.pid: int | None = fork_child(lambda: _run_in_child(function, self._result_path))
        self._status = 0
        self._parent = os.getpid()  # a process forked from this one later cannot wait for it
        _in_flight.add(self)

    def done(self) -> bool:
        """Whether the child has finished (without waiting; the result is collected later)."""
        if self.pid is None:
            return True
        finished, status = os.waitpid(self.pid, os.WNOHANG)
        if finished:  # reaped here: result() reads the status kept
            self.pid, self._status = None, status
        return self.pid is None

    def result(self) -> Any:
        """Wait for the child: its return value, or
        :class:`~stalwart.errors.BackgroundSaveError` with the child's error."""
        _in_flight.discard(self)
        if self.pid is not None:
            _, self._status = os.waitpid(self.pid, 0)
            self.pid = None
        code = os.waitstatus_to_exitcode(self._status)
        try:
            with open(self._result_path, "rb") as file:
                outcome, value = pickle.load(file)  # written by our own child, not foreign input
        except (OSError, EOFError, pickle.UnpicklingError, ValueError):
            outcome, value = "error", f"the child exited with {code} and left no result"
        finally:
            os.unlink(self._result_path)
        if code != 0 or outcome != "ok":
            raise BackgroundSaveError(f"the background save of {self.what} failed: {value}")
        return value


@atexit.register
def _wait_for_children_at_exit() -> None:
    # Without this the orphaned child still writes the file, but after the process is gone: a
    # script that saves and exits, and whatever reads the file next, would not find it yet.
    ours = [call for call in _in_flight if call._parent == os.getpid()]
    if not ours:
        return
    log.info("waiting for %d background checkpoint save(s) to finish", len(ours))
    for call in ours:
        try:
            call.result()
        except Exception as error:  # too late to raise: the process is exiting
            log.error("%s", error)


def _run_in_child(function: Callable[[], Any], result_path: str) -> None:
    global _in_child
    _in_child = True
    try:
        outcome = ("ok", function())
    except BaseException as error:
        # The error's own line first; the child's traceback below it (its stderr may be lost).
        summary = "".join(traceback.format_exception_only(error)).strip()
        outcome = ("error", f"{summary}\n\nin the child:\n{traceback.format_exc(limit=-8)}")
    with open(result_path, "wb") as file:
        pickle.dump(outcome, file, protocol=pickle.HIGHEST_PROTOCOL)
