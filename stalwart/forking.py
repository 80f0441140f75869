"""Forked children that write beside training (hindsight's checkpoints, background shrink saves).

A fork is a free, consistent snapshot of everything the parent holds; the child must then stay
out of training's way and leave no trace of the parent's exit code behind.
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
