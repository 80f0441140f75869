"""Shared test setup: the examples folder (the digits workload) is importable from every test."""

from __future__ import annotations

import multiprocessing
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

# Two cores: keep torch from oversubscribing them when tests spawn processes.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run only where torch sees a CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch sees none)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _quiet_lightning_tips():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        yield


def pytest_sessionfinish(session, exitstatus):
    """Kill child processes a test left behind, and name them: multiprocessing joins every
    non-daemon child at interpreter exit, so one hung child held a whole CI run past its limit."""
    leftovers = multiprocessing.active_children()
    for child in leftovers:
        child.kill()
        child.join(timeout=10)
    if leftovers:
        names = ", ".join(f"{child.name} (pid {child.pid})" for child in leftovers)
        sys.stderr.write(f"\nkilled {len(leftovers)} child process(es) left by tests: {names}\n")
