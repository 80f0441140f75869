"""The package's public surface: every exported name resolves, and importing the package (or a
framework-neutral core) does not pull in Lightning, PyG, Composer or DeepSpeed."""

from __future__ import annotations

import subprocess
import sys

import pytest

import stalwart

HEAVY = ("lightning", "torch_geometric", "composer", "deepspeed")


def test_every_public_name_resolves():
    for name in stalwart.__all__:
        assert getattr(stalwart, name) is not None, name
    assert set(stalwart.__all__) <= set(dir(stalwart))
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        stalwart.not_a_name  # noqa: B018 - the lookup is the test


def test_importing_the_package_or_a_core_does_not_import_the_frameworks():
    # One fresh interpreter: nothing imported by this test session can hide an eager import.
    # The child processes' entry points (``python -m ...``) are listed too: they must start light.
    cores = [
        "stalwart", "stalwart.shrink", "stalwart.hindsight", "stalwart.ps", "stalwart.cli",
        "stalwart.ps.launch", "stalwart.pipeline.runtime", "stalwart.pipeline.node",
        "stalwart.pipeline.launch", "stalwart.store_host",
    ]  # fmt: skip
    code = (
        f"import importlib, sys\n"
        f"for name in {cores!r}:\n"
        f"    importlib.import_module(name)\n"
        f"    print(name, sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.splitlines() == [f"{name} []" for name in cores]
