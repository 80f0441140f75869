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


def fork_child(work: Callable[[], None], *, idle: bool = False) -> int:
    """Fork a child that runs ``work()`` and exits; the child's pid (to ``os.waitpid``).

    The child runs at a lower priority (nice 10), or with ``idle`` in Linux's ``SCHED_IDLE``
    class where it has one: only on cores nothing else wants, so that training on every core
    does not wait for it in its parallel regions.

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
        if idle and hasattr(os, "sched_setscheduler"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.nice(10)  # yield the cores to training when they are contended
        torch.set_num_threads(1)  # OpenMP's pool is not fork-safe, and training has the rest
        work()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)
