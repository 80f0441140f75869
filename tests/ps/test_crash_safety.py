"""The PS checkpoint survives a SIGKILL in the middle of writing the next one.

A real child process writes a large checkpoint (64 MB of weights) over a good one through the
server's own save path and is SIGKILLed while the new file is still a temp (before the rename).
The previous checkpoint must still load through the server's recovery, the temp must never be
read, and a truncated checkpoint must be detected rather than loaded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stalwart import durable
from stalwart.errors import CorruptCheckpointError
from stalwart.ps import layout
from stalwart.ps.config import PSConfig
from stalwart.ps.server import CHECKPOINT_FILE, ParameterServer, load_checkpoint, save_checkpoint
from stalwart.ps.store import KeyValueStore
from stalwart.ps.wire import pack

#: 16M float32 weights: 64 MB, so the write takes long enough to be caught half done.
LARGE = 16 * 1024 * 1024
WRITER = """
import sys, torch
from stalwart.ps.server import save_checkpoint
print("ready", flush=True)
sys.stdin.readline()
save_checkpoint(sys.argv[1], 9, "1/9", torch.ones(int(sys.argv[2])))
"""


class MemoryStore(KeyValueStore):
    """The store contract in a dict: enough for one PS recovery in this process."""

    address = "memory"

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def get_many(self, keys: list[str]) -> list[bytes]:
        return [self.data[k] for k in keys]

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bool:
        if self.data.get(key, b"") != expected:
            return False
        self.data[key] = desired
        return True

    def delete(self, key: str) -> None:
        self.data.pop(key, None)


def _recover_from_checkpoint(run_dir: str) -> ParameterServer:
    """A PS restarted in checkpoint mode against a store that holds a run's initial state."""
    store = MemoryStore()
    header = {"version": 0, "log": layout.INIT, "cursors": [0], "epoch": 0}
    store.set(layout.state(layout.INITIAL), pack(header, torch.zeros(3)))
    store.set(layout.count(0), b"0")
    store.set(layout.HEAD, json.dumps({"key": layout.INITIAL, "cursors": [0]}).encode())
    server = ParameterServer(PSConfig(mode="checkpoint-async", workers=1, run_dir=run_dir), store)
    server.recover("checkpoint")
    return server


def _temps(directory: str) -> list[str]:
    return [name for name in os.listdir(directory) if durable.is_temp(name)]


def _kill_mid_write(path: str) -> int:
    """Start a writer of a large checkpoint at ``path``, SIGKILL it while its temp file exists
    and holds data (frozen by SIGSTOP first, so the check and the kill see the same moment);
    the temp file's size at the kill."""
    directory = os.path.dirname(path)
    for _ in range(3):  # a write that finished between two polls is tried again
        child = subprocess.Popen(
            [sys.executable, "-c", WRITER, path, str(LARGE)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert child.stdout.readline() == b"ready\n"  # torch imported: the write starts now
        child.stdin.write(b"go\n")
        child.stdin.flush()
        size = 0
        while child.poll() is None:
            if _temps(directory):
                os.kill(child.pid, signal.SIGSTOP)
                temps = _temps(directory)
                size = os.path.getsize(os.path.join(directory, temps[0])) if temps else 0
                if size > 0:
                    break
                os.kill(child.pid, signal.SIGCONT)
            time.sleep(0.0005)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        if size > 0:
            return size
    pytest.fail("the writer finished before it could be caught mid-write three times")


def test_a_sigkill_mid_write_leaves_the_previous_checkpoint_and_a_torn_one_is_detected(tmp_path):
    run_dir = str(tmp_path)
    path = os.path.join(run_dir, CHECKPOINT_FILE)
    previous = torch.arange(1000, dtype=torch.float32)
    save_checkpoint(path, 5, "1/5", previous)
    before = Path(path).read_bytes()

    torn_size = _kill_mid_write(path)

    # The previous checkpoint is intact, byte for byte, and the server recovers from it.
    assert Path(path).read_bytes() == before
    server = _recover_from_checkpoint(run_dir)
    assert (server.version, server.ref) == (5, "1/5")
    assert torch.equal(server.weights, previous)
    # The killed writer's temp is left behind, recognisably a temp, and was never read: the
    # server's weights are the previous 1000, not the 16M of the torn write.
    leftovers = [name for name in os.listdir(run_dir) if name != CHECKPOINT_FILE]
    assert len(leftovers) == 1 and _temps(run_dir) == leftovers
    assert 0 < torn_size <= os.path.getsize(os.path.join(run_dir, leftovers[0]))
    assert server.weights.numel() == previous.numel() < LARGE

    # A truncated checkpoint (e.g. copied off a disk that filled up) is detected, not loaded.
    with open(path, "r+b") as handle:
        handle.truncate(len(before) // 2)
    with pytest.raises(CorruptCheckpointError, match="delete it to restart from the initial"):
        load_checkpoint(path)
    with pytest.raises(CorruptCheckpointError, match=CHECKPOINT_FILE):
        _recover_from_checkpoint(run_dir)
