"""Forked children that write beside training (hindsight's checkpoints, background shrink saves).

A fork is a free, consistent snapshot of everything the parent holds; the child must then stay
out of training's way and leave no trace of the parent's exit code behind.

:func:`describe_exit` says how any child process ended, for the errors of every capability
that runs them (the PS's processes, the GNN's partitions).
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Callable

import torch


def fork_child(work: Callable[[], None]) -> int:
    """Fork a child that runs ``work()`` at a lower priority and exits; the child's pid (to
    ``os.waitpid``).

    Nice 10, not Linux's ``SCHED_IDLE``: in an idle class a background shrink save beside
    training on every core got only the cycles training left, took 4-10x longer and cost training
    as much (docs/measurements/shrink.md).

    The child exits 0 when ``work`` returns and 1 when it raises (its traceback on stderr),
    with ``os._exit``: none of the parent's exit code (atexit handlers, Lightning's teardown)
    runs in it.
    """
    sys.stdout.flush()  # what the parent buffered must not be written twice
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        # Ctrl-C, or a scheduler's SIGTERM to the whole process group, must not tear the file in
        # flight: the work finishes (SIGKILL still ends it; temp names keep that harmless).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.nice(10)  # yield the cores to training when they are contended
        torch.set_num_threads(1)  # OpenMP's pool is not fork-safe, and training has the rest
        work()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def describe_exit(code: int) -> str:
    """How a child process ended, for an error: ``"exit code 1"``, or for a negative code
    (Popen's way to say a signal ended it) the signal's name: nothing in the run sends a signal
    to a process it did not mean to kill, so the signal came from outside."""
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = "; the out-of-memory killer sends it" if name == "SIGKILL" else ""
    return f"killed by {name} from outside the run{hint}"
