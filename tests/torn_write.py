"""A real writer process SIGKILLed in the middle of a durable write, for the crash-safety tests.

The child is a fresh ``python -c`` that runs a writer of stalwart (hindsight's checkpoint writer,
shrink's container writer) on a path that already holds a good file. Its disk (the files
``stalwart.durable`` opens, and those ``torch.save`` opens by name) is made to stall once
``stall_after`` bytes of the temp file are written: every byte before that is the real
writer's, the stall stands in for a slow disk so the kill always lands mid-write (on a fast disk
a write of tens of MB can finish between two polls, and the test would not be deterministic).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from stalwart import durable

# Run first in the child: durable's ``open`` becomes one whose files stop writing (and block the
# writer forever) once STALL_AFTER bytes are on disk.
_STALLING_DISK = """
import os, signal
from stalwart import durable

STALL_AFTER = {stall_after}


class _StallingFile:
    def __init__(self, raw):
        self._raw = raw
        self._written = 0

    def write(self, data):
        view = memoryview(data).cast("B")
        room = STALL_AFTER - self._written
        self._raw.write(view[:room])
        self._written += min(room, len(view))
        if self._written >= STALL_AFTER:
            self._raw.flush()
            os.fsync(self._raw.fileno())
            while True:
                signal.pause()  # the disk stalls; only SIGKILL ends this
        return len(view)

    def __getattr__(self, name):
        return getattr(self._raw, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._raw.close()


durable.open = lambda path, mode: _StallingFile(open(path, mode))

# durable.save_torch lets torch write its temp file by name: that write goes to the same disk.
import torch

_save_by_name = torch.save


def _save_to_stalling_disk(obj, f, *args, **kwargs):
    if isinstance(f, (str, os.PathLike)):
        with _StallingFile(open(f, "wb")) as handle:
            return _save_by_name(obj, handle, *args, **kwargs)
    return _save_by_name(obj, f, *args, **kwargs)


torch.save = _save_to_stalling_disk
"""


def kill_mid_write(
    writer_code: str, target: Path, *, stall_after: int, timeout: float = 60.0
) -> tuple[Path, int]:
    """Run ``writer_code`` (which writes ``target``) in a child; SIGKILL it once its temp file
    holds ``stall_after`` bytes. Returns the torn temp file and the child's pid."""
    code = _STALLING_DISK.format(stall_after=stall_after) + textwrap.dedent(writer_code)
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    temp = target.with_name(f".{target.name}{durable.TEMP_MARKER}{child.pid}")
    deadline = time.monotonic() + timeout
    try:
        while not (temp.exists() and temp.stat().st_size >= stall_after):
            if child.poll() is not None:
                output = child.stdout.read().decode(errors="replace")
                raise AssertionError(f"writer exited with {child.returncode}:\n{output[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"writer {child.pid} did not start writing {temp.name}")
            time.sleep(0.005)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
    return temp, child.pid
