"""ThreadClock: per-thread run and run-queue seconds from Linux's schedstat."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from stalwart.pipeline.threadclock import ThreadClock

linux_only = pytest.mark.skipif(
    not os.path.exists("/proc/thread-self/schedstat"), reason="schedstat is Linux-only"
)


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def wait_blocked(tid: int) -> None:
    """Until thread ``tid`` of this process is asleep (its CPU time is then fully accounted)."""
    deadline = time.monotonic() + 60
    while Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "S":
        assert time.monotonic() < deadline, f"thread {tid} never blocked"
        time.sleep(0.001)


@linux_only
def test_own_clock_counts_this_threads_cpu_not_its_sleep():
    clock = ThreadClock()
    run0, wait0 = clock.read()
    spin(0.05)
    time.sleep(0.05)
    run1, wait1 = clock.read()
    clock.close()
    assert 0.04 < run1 - run0 < 0.09  # the spin, not the sleep
    assert wait1 >= wait0 >= 0.0
    assert clock.read() == (0.0, 0.0)  # closed


@linux_only
def test_clock_of_another_thread_by_native_id():
    started, spun, done = threading.Event(), threading.Event(), threading.Event()
    ids: list[int] = []

    def work() -> None:
        ids.append(threading.get_native_id())
        started.set()
        spin(0.05)
        spun.set()
        done.wait(60)

    worker = threading.Thread(target=work)
    worker.start()
    assert started.wait(60)
    other = ThreadClock(ids[0])
    # Meanwhile the worker spins; this thread blocks (no CPU of its own). Wait for the spin to
    # end, not for a fixed time: on a loaded machine 0.05 s of CPU can take far longer.
    assert spun.wait(60)
    wait_blocked(ids[0])  # the kernel adds a running thread's CPU time only at a tick or switch
    ran = other.read()[0]
    done.set()
    worker.join(10)
    other.close()
    assert ran >= 0.04


def test_without_schedstat_it_reads_zero(monkeypatch):
    def refuse(*args, **kwargs):
        raise FileNotFoundError("no /proc here")

    monkeypatch.setattr(os, "open", refuse)
    assert ThreadClock().read() == (0.0, 0.0)


@linux_only
def test_a_disabled_clock_reads_zero_and_opens_nothing():
    spin(0.01)  # this thread has run: an enabled clock would read > 0
    assert ThreadClock().read()[0] > 0.0
    assert ThreadClock(enabled=False).read() == (0.0, 0.0)
