"""stalwart.durable: atomic writes, seals, and the checks that catch a torn or changed file."""

from __future__ import annotations

import errno
import io
import json
import os
import zipfile
import zlib

import pytest
import torch

from stalwart import durable
from stalwart.errors import CorruptCheckpointError
from tests.helpers import pages_in_page_cache, require_direct_io


@pytest.mark.parametrize("direct", [False, True], ids=["page cache", "direct"])
def test_sealed_torch_round_trip(tmp_path, direct):
    path = tmp_path / "state.pt"
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 7}
    written = durable.save_torch(state, path, direct=direct)
    loaded = durable.load_torch(path)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7
    # The seal is 16 bytes after the payload; size and CRC-32 are the payload's.
    payload = durable.read_sealed(path)
    assert path.stat().st_size == written.nbytes + 16
    assert (len(payload), zlib.crc32(payload)) == (written.nbytes, written.crc32)
    assert written.path == str(path) and written.seconds > 0
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]


def test_unsealed_file_is_plain_and_verified_against_its_record(tmp_path):
    path = tmp_path / "plain.pt"
    written = durable.save_torch({"w": torch.ones(10)}, path, seal=False)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(10))
    data = durable.verify_file(path, written.nbytes, written.crc32)
    assert data == path.read_bytes() and len(data) == written.nbytes
    with pytest.raises(CorruptCheckpointError, match="expected .* bytes"):
        durable.verify_file(path, written.nbytes + 1, written.crc32)
    with pytest.raises(CorruptCheckpointError, match="CRC-32"):
        durable.verify_file(path, written.nbytes, written.crc32 ^ 1)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        durable.verify_file(tmp_path / "gone.pt", written.nbytes, written.crc32)
    # A plain file has no seal: read as sealed, it is refused rather than trusted.
    with pytest.raises(CorruptCheckpointError):
        durable.load_torch(path)


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped", "seal-only", "empty"])
def test_torn_or_changed_sealed_file_is_detected(tmp_path, damage):
    path = tmp_path / "state.pt"
    durable.save_torch({"w": torch.randn(4096)}, path)
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "bit-flipped":
        data[len(data) // 3] ^= 0x10
    elif damage == "seal-only":
        data = data[-16:]
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=str(path)):
        durable.load_torch(path)
    with pytest.raises(CorruptCheckpointError):
        durable.read_sealed(path)


def _record_offset(data: bytes, tensor: torch.Tensor) -> int:
    """Where a tensor's bytes sit in a torch.save archive."""
    return data.index(tensor.numpy().tobytes()[:64])


@pytest.mark.parametrize("direct", [False, True], ids=["page cache", "direct"])
@pytest.mark.parametrize("damage", ["tensor byte", "directory byte", "truncated", "extended"])
def test_a_torch_zip_is_verified_by_its_own_record_crcs_and_its_directory(tmp_path, damage, direct):
    path = tmp_path / "epoch=0001.ckpt"
    weights = torch.randn(4096)
    written = durable.save_torch({"w": weights, "step": 3}, path, seal=False, direct=direct)
    data = durable.verify_file(path, written.nbytes, written.crc32)
    assert data == path.read_bytes() and written.nbytes == len(data)
    assert torch.equal(torch.load(path, weights_only=True)["w"], weights)
    assert [p.name for p in tmp_path.iterdir()] == ["epoch=0001.ckpt"]  # no temp left
    broken = bytearray(data)
    if damage == "tensor byte":
        broken[_record_offset(data, weights) + 4096] ^= 0x10
    elif damage == "directory byte":
        broken[-40] ^= 0x10
    elif damage == "truncated":
        broken = broken[: len(broken) // 2]
    else:
        broken += b"\0"
    path.write_bytes(bytes(broken))
    with pytest.raises(CorruptCheckpointError, match="is corrupted"):
        durable.verify_file(path, written.nbytes, written.crc32)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        durable.verify_file(tmp_path / "gone.ckpt", written.nbytes, written.crc32)


def test_a_torch_zip_indexed_with_the_crc_of_all_its_bytes_still_verifies(tmp_path):
    """Hindsight's index rows written before kept the CRC-32 of the whole file."""
    path = tmp_path / "old.ckpt"
    durable.save_torch({"w": torch.ones(100)}, path, seal=False)
    data = path.read_bytes()
    nbytes, crc32 = len(data), zlib.crc32(data)  # the row as it was written before
    assert durable.verify_file(path, nbytes, crc32) == data
    with pytest.raises(CorruptCheckpointError, match="is corrupted"):
        durable.verify_file(path, nbytes, crc32 ^ 1)


def test_missing_sealed_file_is_named(tmp_path):
    with pytest.raises(CorruptCheckpointError, match="missing"):
        durable.load_torch(tmp_path / "nothing.pt")


def test_a_failing_writer_leaves_the_previous_file_and_no_temp(tmp_path):
    path = tmp_path / "state.bin"
    durable.write_atomic(path, b"previous", seal=True)

    def half_then_fail(handle) -> None:
        handle.write(b"new bytes that never land")
        raise RuntimeError("serializer failed")

    with pytest.raises(RuntimeError, match="serializer failed"):
        durable.write_atomic(path, half_then_fail, seal=True)
    assert durable.read_sealed(path) == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]


@pytest.mark.parametrize("direct", [False, True], ids=["page cache", "direct"])
def test_a_failing_torch_save_leaves_the_previous_file_and_no_temp(tmp_path, direct):
    # torch writes the temp file; a pickling error midway must not reach the target.
    path = tmp_path / "state.pt"
    durable.save_torch({"w": torch.ones(3)}, path, direct=direct)
    before = path.read_bytes()
    with pytest.raises(Exception, match="pickle"):
        durable.save_torch({"w": torch.ones(1 << 20), "hook": lambda: None}, path, direct=direct)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]


def _odd_state() -> dict:
    """Tensors that straddle the direct writer's 8 MB buffer and end off any block boundary."""
    return {
        "big": torch.randn(3_000_001),  # 12 MB: more than one buffer
        "view": torch.randn(7, 5).t(),  # not contiguous
        "bytes": torch.arange(4099, dtype=torch.uint8),
        "step": 11,
    }


@pytest.mark.parametrize("seal", [False, True], ids=["indexed", "sealed"])
def test_a_direct_write_larger_than_its_buffer_round_trips_at_its_exact_length(tmp_path, seal):
    path = tmp_path / "epoch=0003.ckpt"
    state = _odd_state()
    written = durable.save_torch(state, path, seal=seal, direct=True)
    if seal:
        loaded = durable.load_torch(path)
        assert path.stat().st_size == written.nbytes + 16
    else:
        data = durable.verify_file(path, written.nbytes, written.crc32)
        assert len(data) == written.nbytes == path.stat().st_size  # the padding cut away
        loaded = torch.load(path, weights_only=True)
    for key in ("big", "view", "bytes"):
        assert torch.equal(loaded[key], state[key])
    assert loaded["step"] == 11
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_direct_write_leaves_the_checkpoint_out_of_the_page_cache(tmp_path):
    """What the direct write is for: the kernel caches none of the file's pages (only the zip's
    tail, read back for its CRC-32), where the same save through the page cache leaves all."""
    require_direct_io(tmp_path)
    state = {"w": torch.randn(8 << 20)}  # 32 MB
    durable.save_torch(state, tmp_path / "direct.ckpt", seal=False, direct=True)
    durable.save_torch(state, tmp_path / "cached.ckpt", seal=False, direct=False)
    cached, pages = pages_in_page_cache(tmp_path / "cached.ckpt")
    assert cached > 0.9 * pages  # the measurement sees a cached file as cached
    direct, pages = pages_in_page_cache(tmp_path / "direct.ckpt")
    assert direct < 0.01 * pages


def test_without_o_direct_the_same_bytes_go_through_the_page_cache(tmp_path, monkeypatch):
    """macOS has no O_DIRECT: the writer falls back to plain writes of the same file."""
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    path = tmp_path / "epoch=0003.ckpt"
    state = _odd_state()
    written = durable.save_torch(state, path, seal=False, direct=True)
    durable.verify_file(path, written.nbytes, written.crc32)
    assert torch.equal(torch.load(path, weights_only=True)["big"], state["big"])
    with durable.DirectFile(tmp_path / "probe") as handle:
        assert not handle.direct


def test_an_archive_in_memory_holds_the_state_as_it_was_and_is_in_place_once_written(tmp_path):
    """serialize_torch serializes the object as it is when called (a change after it is not in
    the file), the records torch.save writes with their CRC-32s; nothing is at the path until
    write_archive, which leaves what save_torch leaves."""
    path = tmp_path / "epoch=0001.ckpt"
    durable.save_torch({"w": torch.zeros(3)}, path, seal=False)  # the file already there
    state = {"w": torch.randn(1 << 20), "b": torch.arange(7), "step": 5}
    expected = state["w"].clone()
    saved = io.BytesIO()
    torch.save(state, saved)
    archive = durable.serialize_torch(state)
    state["w"].mul_(-1.0)  # as the next optimizer step would, before the writer writes
    assert _records(bytes(archive.view())) == _records(saved.getvalue())
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.zeros(3))
    written = durable.write_archive(archive, path)
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["w"], expected) and loaded["step"] == 5
    durable.verify_file(path, written.nbytes, written.crc32)
    assert written.nbytes == path.stat().st_size and written.path == str(path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    # The memory is reused for the next archive, grown as needed.
    again = durable.serialize_torch({"w": torch.ones(1 << 21)}, into=archive)
    assert again is archive and zipfile.ZipFile(io.BytesIO(bytes(again.view()))).testzip() is None


def test_the_archive_crc32s_are_filled_in_not_left_to_torch(tmp_path, monkeypatch):
    """On this torch the archive is written by torch's own steps without its CRC-32s (half of
    a small state's serialization), which are filled in afterwards; a torch whose private API
    differs gets torch.save, and the same bytes."""
    state = {"w": torch.randn(1 << 16), "step": 1}
    monkeypatch.setattr(torch, "save", _no_torch_save)
    fast = bytes(durable.serialize_torch(state).view())
    assert zipfile.ZipFile(io.BytesIO(fast)).testzip() is None
    monkeypatch.undo()
    monkeypatch.setattr(durable, "_SAVE_PARAMETERS", ("obj", "f"))  # another torch's _save
    slow = bytes(durable.serialize_torch(state).view())
    assert _records(slow) == _records(fast)


def _no_torch_save(*args, **kwargs):
    raise AssertionError("torch.save computes the CRC-32s itself: the slow path")


def _records(archive: bytes) -> dict[str, tuple[int, bytes]]:
    """An archive's records with their CRC-32s, after checking each; not the id torch draws at
    random for every save."""
    with zipfile.ZipFile(io.BytesIO(archive)) as opened:
        assert opened.testzip() is None
        return {
            info.filename: (info.CRC, opened.read(info))
            for info in opened.infolist()
            if not info.filename.endswith("serialization_id")
        }


def test_a_changed_record_of_an_archive_written_from_memory_is_detected(tmp_path):
    """The CRC-32s filled in are what verify_file checks each record against."""
    path = tmp_path / "epoch=0002.ckpt"
    state = {"w": torch.zeros(1 << 16)}
    written = durable.write_archive(durable.serialize_torch(state), path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of the tensor's record
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="not matching its CRC-32"):
        durable.verify_file(path, written.nbytes, written.crc32)


def test_a_failed_archive_write_keeps_the_previous_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "epoch=0001.ckpt"
    durable.save_torch({"w": torch.ones(3)}, path, seal=False)
    before = path.read_bytes()
    archive = durable.serialize_torch({"w": torch.randn(1 << 16)})

    def disk_full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(durable.DirectFile, "write", disk_full)
    with pytest.raises(OSError, match="No space"):
        durable.write_archive(archive, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_failing_serialization_raises_and_writes_nothing(tmp_path):
    archive = durable.ArchiveBuffer()
    with pytest.raises(Exception, match="pickle"):
        durable.serialize_torch({"w": torch.ones(1 << 20), "hook": lambda: None}, into=archive)
    assert list(tmp_path.iterdir()) == []
    state = {"w": torch.ones(4)}
    reused = durable.serialize_torch(state, into=archive)  # the buffer is still usable
    assert torch.equal(torch.load(io.BytesIO(bytes(reused.view())))["w"], state["w"])


def test_streaming_writer_counts_every_byte(tmp_path):
    chunks = [b"a" * 10, memoryview(b"bc"), bytearray(b"def")]

    def write(handle) -> None:
        for chunk in chunks:
            handle.write(chunk)

    written = durable.write_atomic(tmp_path / "f", write)
    whole = b"".join(bytes(c) for c in chunks)
    assert (tmp_path / "f").read_bytes() == whole
    assert (written.nbytes, written.crc32) == (len(whole), zlib.crc32(whole))


def test_text_and_json_are_plain_files(tmp_path):
    durable.write_text(tmp_path / "port", "29500")
    assert (tmp_path / "port").read_text() == "29500"
    durable.write_json(tmp_path / "names.json", ["a", "b"])
    assert json.loads((tmp_path / "names.json").read_text()) == ["a", "b"]


def test_temp_names_are_hidden_and_recognised(tmp_path):
    temp = durable.temp_path_for(tmp_path / "epoch=3.ckpt")
    assert temp.parent == tmp_path and temp.name.startswith(".epoch=3.ckpt")
    assert durable.is_temp(temp)
    assert not durable.is_temp(tmp_path / "epoch=3.ckpt")
    assert not durable.is_temp(tmp_path / ".hidden")  # a dot file that is no temp file
