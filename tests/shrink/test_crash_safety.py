"""Crash safety of the shrunken-checkpoint writer: a real writer process, SIGKILLed mid-write over a
good previous file, leaves that file intact and a torn temp file no reader or chain takes."""

from __future__ import annotations

import shutil

import pytest
import torch

from stalwart import CorruptCheckpointError, durable, shrink
from stalwart.shrink.chain import ChainWriter
from stalwart.shrink.container import read_container
from stalwart.shrink.partition import QuantConfig
from tests.torn_write import kill_mid_write

CONFIG = QuantConfig(bins=16)

SHRINK_WRITER = """
import torch
from stalwart import shrink
from stalwart.shrink.partition import QuantConfig

weights = {{"w": torch.randn(4 << 20, generator=torch.Generator().manual_seed(1))}}  # 16 MB
shrink.save(weights, {path!r}, config=QuantConfig(bins=16))
"""


def _weights(seed: int, numel: int = 1 << 16) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(numel, generator=torch.Generator().manual_seed(seed))}


@pytest.mark.timeout(120)
def test_shrink_writer_killed_mid_write_leaves_the_previous_file(tmp_path):
    path = tmp_path / "epoch=1.shrunk"
    shrink.save(_weights(0), path, config=CONFIG)
    intact = path.read_bytes()
    restored = shrink.load(path)

    stall_after = 512 << 10
    temp, _ = kill_mid_write(SHRINK_WRITER.format(path=str(path)), path, stall_after=stall_after)

    # The previous file is untouched and loads as before.
    assert path.read_bytes() == intact
    assert torch.equal(shrink.load(path)["w"], restored["w"])
    # The torn write is a temp file, and reading it fails on its missing trailer.
    assert durable.is_temp(temp) and temp.stat().st_size >= stall_after
    with pytest.raises(CorruptCheckpointError, match="torn"):
        read_container(temp)
    # A chain resumed from the previous file continues from it: the next save is a delta on it,
    # and retiring it keeps it while that delta needs it, whatever the temp file holds.
    chain = ChainWriter(config=CONFIG)
    weights, _ = chain.load(path)
    assert torch.equal(weights["w"], restored["w"])
    report = chain.save(_weights(2), None, tmp_path / "epoch=2.shrunk")
    assert report.kind == "delta" and report.base == str(path)
    chain.remove(path)
    assert path.read_bytes() == intact


def test_a_complete_temp_file_is_no_live_file_of_the_chain(tmp_path):
    """A writer killed between its last byte and the rename leaves a whole file under a temp
    name; it must not keep retired files alive (nor be counted as part of the chain)."""
    chain = ChainWriter(config=CONFIG, keyframe_every=10)
    chain.save(_weights(0), None, tmp_path / "a.shrunk")
    chain.save(_weights(1), None, tmp_path / "b.shrunk")  # a delta on a
    whole = tmp_path / f".c.shrunk{durable.TEMP_MARKER}999999"
    shutil.copy(tmp_path / "b.shrunk", whole)  # a complete file whose base is a
    chain.save(_weights(2), None, tmp_path / "k.shrunk")
    chain.chain = None  # the next save starts a keyframe: nothing live depends on a or b
    chain.save(_weights(3), None, tmp_path / "z.shrunk")
    chain.remove(tmp_path / "b.shrunk")
    chain.remove(tmp_path / "k.shrunk")
    chain.remove(tmp_path / "a.shrunk")
    assert not (tmp_path / "a.shrunk").exists(), "a temp file kept a retired file alive"
    assert not (tmp_path / "b.shrunk").exists()
