"""A stage-file writer SIGKILLed mid-write: the previous file survives, the torn bytes are caught.

A real child process (forked, so it starts without importing torch again) overwrites a good
stage file with a ~50 MB one and is killed while the bytes are going out: it is stopped with
SIGSTOP as soon as its temp file appears, let run in short slices until the temp has grown, then
SIGKILLed while stopped, so the kill lands mid-write every time.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stalwart import durable
from stalwart.errors import CorruptCheckpointError
from stalwart.pipeline.stage_files import latest_checkpoint, load_stage, save_stage, stage_path

PARAMETERS = 4096 * 3072 + 3072  # of the child's stage: ~50 MB of float32


def write_large_stage(path: str, ready: Any, go: Any) -> None:
    """The child: build a ~50 MB stage, say so, and on ``go`` write it to ``path``."""
    torch.manual_seed(1)
    module = nn.Linear(4096, 3072)
    ready.set()
    go.wait()
    save_stage(module, None, path)


def small_stage(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    module = nn.Linear(64, 32)
    optimizer = torch.optim.Adam(module.parameters())
    module(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    return module, optimizer


def wait_stopped(pid: int) -> None:
    """Until the kernel reports ``pid`` stopped (SIGSTOP is delivered asynchronously)."""
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the writer did not stop"
        time.sleep(0.0005)


def kill_mid_write(child: multiprocessing.Process, go: Any, temp: Path) -> int:
    """Stop ``child`` as soon as ``temp`` appears, step it until ``temp`` grows, SIGKILL it
    while stopped. Returns the temp's size at the kill."""
    go.set()
    deadline = time.monotonic() + 60
    while not temp.exists():  # busy: the whole write takes only tens of milliseconds
        assert child.is_alive() and time.monotonic() < deadline, "no temp file appeared"
    os.kill(child.pid, signal.SIGSTOP)
    wait_stopped(child.pid)
    first = temp.stat().st_size
    for _ in range(1000):
        size = temp.stat().st_size  # the child is stopped: the temp is still there
        if size > first:
            break
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.0002)
        os.kill(child.pid, signal.SIGSTOP)
        wait_stopped(child.pid)
    assert size > first, "the temp file never grew"
    os.kill(child.pid, signal.SIGKILL)
    child.join(timeout=30)
    return size


@pytest.mark.timeout(120)
def test_sigkill_mid_write_keeps_the_previous_stage_file_and_the_torn_one_is_detected(tmp_path):
    for stage in (0, 1):
        for step in (0, 1):
            save_stage(*small_stage(seed=10 * step + stage), stage_path(tmp_path, step, stage))
    target = stage_path(tmp_path, 1, 1)
    previous = target.read_bytes()
    ctx = multiprocessing.get_context("fork")
    ready, go = ctx.Event(), ctx.Event()
    child = ctx.Process(target=write_large_stage, args=(str(target), ready, go), daemon=True)
    child.start()
    try:
        assert ready.wait(timeout=60), "the writer did not start"
        temp = target.with_name(f".{target.name}{durable.TEMP_MARKER}{child.pid}")
        torn_size = kill_mid_write(child, go, temp)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == -signal.SIGKILL
    # The killed writer left only its hidden temp file, part-written.
    assert temp.exists() and durable.is_temp(temp) and 0 < torn_size < 4 * PARAMETERS
    # The previous file is intact, byte for byte, and loads as the state it held.
    assert target.read_bytes() == previous
    expected, expected_opt = small_stage(seed=11)
    state = load_stage(target)
    assert torch.equal(state["module"]["weight"], expected.weight.detach())
    exp_avg = expected_opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], exp_avg)
    # The temp neither breaks nor completes a step.
    assert latest_checkpoint(tmp_path, num_stages=2) == 1
    target.unlink()
    assert latest_checkpoint(tmp_path, num_stages=2) == 0  # the temp alone does not count
    # The torn bytes under the real name (a copy that lost its rename's atomicity) are refused.
    shutil.copyfile(temp, target)
    with pytest.raises(CorruptCheckpointError):
        load_stage(target)
    assert latest_checkpoint(tmp_path, num_stages=2) == 0


def test_a_truncated_stage_file_fails_to_load_and_its_step_is_not_complete(tmp_path):
    for stage in (0, 1):
        for step in (0, 1):
            save_stage(*small_stage(seed=stage), stage_path(tmp_path, step, stage))
    assert latest_checkpoint(tmp_path, num_stages=2) == 1
    path = stage_path(tmp_path, 1, 0)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="torn"):
        load_stage(path)
    assert latest_checkpoint(tmp_path, num_stages=2) == 0
    # One flipped byte with the length intact: the listing's cheap check passes, the load's
    # CRC-32 does not.
    path.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    assert latest_checkpoint(tmp_path, num_stages=2) == 1
    with pytest.raises(CorruptCheckpointError):
        load_stage(path)
