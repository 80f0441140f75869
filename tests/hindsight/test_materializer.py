"""Background materialization: snapshot isolation, atomic files, bounded children, no zombies."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

from stalwart import durable
from stalwart.durable import WrittenFile
from stalwart.hindsight.checkpoint_file import (
    DIRECT_WRITE_BYTES,
    read_checkpoint,
    write_checkpoint,
)
from stalwart.hindsight.materializer import (
    ForkMaterializer,
    InlineMaterializer,
    WriteJob,
    WriterThread,
    _warm_copy_per_byte,
    host_copy,
    make_materializer,
    python_slowdown,
    refill_copy,
    writer_has_a_core,
)
from stalwart.pipeline.threadclock import ThreadClock
from tests.helpers import pages_in_page_cache, require_direct_io

MB = 1 << 20


def zombie_children() -> list[int]:
    """Pids of this process's children that exited and were never reaped."""
    zombies = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            zombies.append(int(stat.parent.name))
    return zombies


def big_state(mb: int = 64) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"weight": torch.randn(mb * MB // 4, generator=gen), "step": 3}


def written(results: list, path) -> dict:
    (entry,) = [r for r in results if r.path == str(path)]
    return read_checkpoint(path, entry.nbytes, entry.crc32)


class Recorder:
    """Collects WrittenFile results; from a forked child it appends to a file instead."""

    def __init__(self, log_path) -> None:
        self.log_path = log_path

    def __call__(self, result) -> None:
        with open(self.log_path, "a") as f:
            f.write(f"{result.path}\t{result.nbytes}\t{result.crc32}\t{result.seconds!r}\n")

    def results(self) -> list:
        rows = [line.split("\t") for line in Path(self.log_path).read_text().splitlines()]
        return [WrittenFile(p, int(n), int(c), float(s)) for p, n, c, s in rows]


@pytest.mark.parametrize("small_bytes", [1 << 30, 0], ids=["copy-thread", "fork-cow"])
def test_mutating_state_right_after_submit_never_changes_what_is_written(tmp_path, small_bytes):
    materializer = ForkMaterializer(small_bytes=small_bytes)
    recorder = Recorder(tmp_path / "index.tsv")
    state = big_state(32)
    expected = state["weight"].clone()
    path = tmp_path / "ckpt.pt"
    materializer.submit(WriteJob(state, path, recorder))
    state["weight"].mul_(-1.0).add_(7.0)  # in place, as an optimizer step would
    state["step"] = 4
    materializer.close()
    loaded = written(recorder.results(), path)
    assert torch.equal(loaded["weight"], expected)
    assert loaded["step"] == 3
    assert (materializer.forks, materializer.copies) == ((0, 1) if small_bytes else (1, 0))


def test_the_copy_handed_to_the_writer_is_independent_and_keeps_what_torch_save_keeps():
    module = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    module[1].weight = module[0].weight  # tied: one storage under two names
    flat = torch.arange(12.0)
    state = {
        "state_dict": module.state_dict(),
        "views": [flat[2:5], flat.view(3, 4)[:, 1]],  # views of one storage
        "scalars": (3, 0.5, "adam", None, torch.float32),
        "param": torch.nn.Parameter(torch.ones(2)),  # not a plain tensor: deep-copied
        "empty": [torch.empty(0), torch.empty(0)],
    }
    copied = host_copy(state)
    names = list(state["state_dict"])
    assert list(copied["state_dict"]) == names
    # load_state_dict reads a state dict's _metadata
    assert copied["state_dict"]._metadata == state["state_dict"]._metadata
    tied = copied["state_dict"]["0.weight"], copied["state_dict"]["1.weight"]
    assert tied[0].untyped_storage().data_ptr() == tied[1].untyped_storage().data_ptr()
    first, column = copied["views"]
    assert first.untyped_storage().data_ptr() == column.untyped_storage().data_ptr()
    assert torch.equal(first, flat[2:5]) and torch.equal(column, flat.view(3, 4)[:, 1])
    assert copied["scalars"] == state["scalars"]
    assert type(copied["param"]) is torch.nn.Parameter
    # Nothing done to the original afterwards reaches the copy.
    with torch.no_grad():
        for tensor in [*state["state_dict"].values(), flat, state["param"]]:
            tensor.add_(100.0)
    assert torch.equal(first, torch.arange(2.0, 5.0))
    assert torch.equal(copied["param"], torch.ones(2))
    assert all((tensor < 100).all() for tensor in copied["state_dict"].values())
    # Written, it holds the storages the original would (the tied one once).
    assert saved_storage_sizes(copied) == saved_storage_sizes(state) == [160, 40, 48, 8, 0, 0]


def tied_state() -> dict:
    module = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    module[1].weight = module[0].weight
    flat = torch.arange(12.0)
    return {
        "state_dict": module.state_dict(),
        "views": [flat[2:5], flat.view(3, 4)[:, 1]],
        "scalars": (3, 0.5, "adam", None, torch.float32),
        "empty": [torch.empty(0), torch.empty(0)],
        "policy": {"recent_costs": [0.5, 0.25]},
    }


def data_ptrs(obj) -> list[int]:
    leaves = torch.utils._pytree.tree_leaves(obj)
    return [leaf.untyped_storage().data_ptr() for leaf in leaves if isinstance(leaf, torch.Tensor)]


def test_a_copy_written_into_an_earlier_copys_buffers_is_the_copy_host_copy_makes():
    state = tied_state()
    spare = host_copy(state)
    with torch.no_grad():  # the next epoch's state: new values, the same structure
        for tensor in [*state["state_dict"].values(), state["views"][1]]:
            tensor.add_(1.0)
    state["scalars"] = (4, 0.25, "adam", None, torch.float32)
    # Plain data may differ: a list that grew, a key the earlier copy lacks.
    state["policy"]["recent_costs"].append(0.125)
    state["loop_end"] = {"batch": 7}
    refilled = refill_copy(spare, state)
    fresh = host_copy(state)
    assert refilled is not None
    assert data_ptrs(refilled) == data_ptrs(spare)  # no new buffers
    assert refilled["scalars"] == fresh["scalars"]
    assert refilled["policy"] == {"recent_costs": [0.5, 0.25, 0.125]}
    assert refilled["loop_end"] == {"batch": 7}
    assert refilled["policy"]["recent_costs"] is not state["policy"]["recent_costs"]
    assert refilled["state_dict"]._metadata == state["state_dict"]._metadata
    leaves = torch.utils._pytree.tree_leaves
    for mine, theirs in zip(leaves(refilled), leaves(fresh), strict=True):
        assert torch.equal(mine, theirs) if isinstance(mine, torch.Tensor) else mine == theirs

    # The whole storage is refilled, as host_copy clones it, bytes no view shows included.
    def whole(tensor):
        return torch.empty(0).set_(tensor.untyped_storage(), 0, (12,), (1,))

    assert torch.equal(whole(refilled["views"][0]), whole(state["views"][0]))
    assert saved_storage_sizes(refilled) == saved_storage_sizes(fresh)
    # Nothing done to the original afterwards reaches the copy.
    state["state_dict"]["1.bias"].add_(100.0)
    assert (refilled["state_dict"]["1.bias"] < 100).all()


@pytest.mark.parametrize(
    "change",
    [
        "other shape",
        "other dtype",
        "other key",
        "longer list",
        "untied",
        "tied",
        "parameter",
        "cycle",
    ],
)
def test_a_state_of_another_structure_is_not_written_into_an_earlier_copy(change):
    state = tied_state()
    spare = host_copy(state)
    weights = state["state_dict"]
    if change == "other shape":
        weights["1.bias"] = torch.zeros(11)
    elif change == "other dtype":
        weights["1.bias"] = weights["1.bias"].double()
    elif change == "other key":  # a new key whose value holds a tensor
        weights["2.bias"] = weights.pop("1.bias")
    elif change == "longer list":  # a list that grew by a tensor
        state["empty"].append(torch.empty(0))
    elif change == "untied":  # tied in the copy: refilling one would overwrite the other
        weights["1.weight"] = weights["1.weight"].clone()
    elif change == "tied":  # the copy has two storages where the state has one
        spare["views"] = [torch.arange(12.0)[2:5], torch.arange(12.0).view(3, 4)[:, 1]]
    elif change == "parameter":
        state["scalars"] = torch.nn.Parameter(torch.ones(2))
        spare["scalars"] = torch.nn.Parameter(torch.ones(2))
    elif change == "cycle":
        state["loop"] = [1]
        state["loop"].append(state["loop"])
        spare["loop"] = [1, [1]]
    assert refill_copy(spare, state) is None


def test_the_writer_thread_keeps_a_written_copy_only_when_asked_and_only_once_written(tmp_path):
    """A kept job's object becomes the spare once it is written, never while it is queued or
    being written; an unkept one's (a CPU state's copy) is dropped."""
    import stalwart.hindsight.materializer as materializer_module

    write = materializer_module._run_job
    started, release = threading.Event(), threading.Event()

    def held(job):
        started.set()
        release.wait(10)
        write(job)

    writer = WriterThread()
    kept = {"w": torch.ones(4)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(materializer_module, "_run_job", held)
        writer.put(WriteJob(kept, tmp_path / "a.pt"), 16, keep=True)
        assert started.wait(10)
        assert writer.take_spare() is None  # being written: not a spare yet
        release.set()
        writer.drain()
    assert writer.take_spare() is kept and writer.take_spare() is None  # taken once
    writer.put(WriteJob({"w": torch.ones(4)}, tmp_path / "b.pt"), 16)
    writer.drain()
    assert writer.take_spare() is None
    writer.close()


def test_a_cpu_states_copies_are_fresh_every_time(tmp_path):
    """On CPU, copies into the last copy's buffers made whole fits slower
    (docs/measurements/hindsight.md): each checkpoint's copy is new memory, and nothing is kept
    once written."""
    materializer = ForkMaterializer(small_bytes=MB)
    recorder = Recorder(tmp_path / "index.tsv")
    state = {"w": torch.zeros(1000), "step": 0}
    for i in range(4):
        state["w"].fill_(float(i))
        state["step"] = i
        materializer.submit(WriteJob(state, tmp_path / f"{i}.pt", recorder))
        materializer._writer.drain()
        assert materializer._writer.take_spare() is None
    materializer.close()
    assert (materializer.copies, materializer.refills) == (4, 0)
    results = recorder.results()
    for i in range(4):
        loaded = written(results, tmp_path / f"{i}.pt")
        assert torch.equal(loaded["w"], torch.full((1000,), float(i))) and loaded["step"] == i


def saved_storage_sizes(obj) -> list[int]:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    archive = zipfile.ZipFile(buffer)
    return [i.file_size for i in archive.infolist() if i.filename.split("/")[-1].isdigit()]


def test_copies_are_written_in_order_by_the_writer_thread_and_its_cpu_time_is_charged(tmp_path):
    materializer = ForkMaterializer(small_bytes=MB)
    recorder = Recorder(tmp_path / "index.tsv")
    main_thread = 0.0
    for i in range(10):
        state = {"w": torch.full((1000,), float(i))}
        main_thread += materializer.submit(WriteJob(state, tmp_path / f"{i}.pt", recorder))
        state["w"].zero_()  # the writer thread has a copy
    materializer.close()
    assert materializer.forks == 0 and materializer.copies == 10 and not materializer.failures
    results = recorder.results()
    assert [Path(r.path).name for r in results] == [f"{i}.pt" for i in range(10)]
    for i in range(10):
        assert torch.equal(
            written(results, tmp_path / f"{i}.pt")["w"], torch.full((1000,), float(i))
        )
    # What the thread took (serialize, checksum, write) is charged once, after the fact.
    assert materializer.take_background_cost() > 0
    assert materializer.take_background_cost() == 0


def test_copies_waiting_for_a_slow_writer_thread_are_bounded(tmp_path, monkeypatch):
    import stalwart.hindsight.materializer as materializer_module

    write = materializer_module._run_job

    def slow(job):
        time.sleep(0.2)
        write(job)

    monkeypatch.setattr(materializer_module, "_run_job", slow)
    materializer = ForkMaterializer(small_bytes=MB, max_children=2)
    costs = []
    for i in range(5):
        costs.append(materializer.submit(WriteJob({"w": torch.ones(10)}, tmp_path / f"{i}.pt")))
        assert materializer._writer.pending <= 2
    materializer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{i}.pt" for i in range(5)]
    assert max(costs) >= 0.1  # a submit that waited for the writer is charged the wait


def test_a_failed_write_on_the_writer_thread_is_reported(tmp_path):
    materializer = ForkMaterializer(small_bytes=MB)
    materializer.submit(WriteJob({"w": torch.ones(4)}, tmp_path / "missing-dir" / "x.pt"))
    materializer.close()
    assert len(materializer.failures) == 1 and "x.pt" in materializer.failures[0]


@pytest.mark.parametrize(
    ("copy_cost", "fork_cost", "path"), [(0.02, 0.05, "copy"), (0.05, 0.02, "fork")]
)
def test_with_cuda_in_use_the_probe_makes_the_cheaper_path_the_runs(
    tmp_path, monkeypatch, copy_cost, fork_cost, path
):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    materializer = ForkMaterializer()
    monkeypatch.setattr(materializer, "_copy_cost", lambda nbytes, directory: copy_cost)
    monkeypatch.setattr(materializer, "_fork_cost", lambda nbytes, directory: fork_cost)
    assert materializer.probe_cost(8 * MB, tmp_path) == min(copy_cost, fork_cost)
    # The run's checkpoints hold a little more than the probed tensors: same path for them.
    materializer.submit(WriteJob(big_state(9), tmp_path / "a.pt"))
    materializer.close()
    assert (materializer.copies, materializer.forks) == ((1, 0) if path == "copy" else (0, 1))


def test_on_cpu_the_copy_is_taken_and_no_fork_is_probed(tmp_path, monkeypatch):
    materializer = ForkMaterializer()
    monkeypatch.setattr(os, "fork", lambda: pytest.fail("probed a fork"))
    assert materializer.probe_cost(64 * MB, tmp_path) > 0
    materializer.submit(WriteJob(big_state(64), tmp_path / "a.pt"))
    materializer.close()
    assert (materializer.copies, materializer.forks) == (1, 0)


def test_a_staged_checkpoint_is_the_state_at_submit_serialized_there_and_committed_behind(
    tmp_path,
):
    """Staged: the calling thread serializes the state itself into memory (no copy is made; a
    change right after submit is not in the file) and the writer thread only writes it, in
    order, indexed as a written one is; its CPU time is charged after the fact like a write's."""
    materializer = ForkMaterializer(stage=True)
    recorder = Recorder(tmp_path / "index.tsv")
    main_thread = 0.0
    for i in range(6):
        state = {"w": torch.full((1 << 18,), float(i)), "step": i}
        main_thread += materializer.submit(WriteJob(state, tmp_path / f"{i}.pt", recorder))
        state["w"].zero_()  # in place, as the next optimizer step would
    materializer.close()
    assert (materializer.stages, materializer.copies, materializer.forks) == (6, 0, 0)
    assert materializer.failures == []
    results = recorder.results()
    assert [Path(r.path).name for r in results] == [f"{i}.pt" for i in range(6)]
    for i in range(6):
        loaded = written(results, tmp_path / f"{i}.pt")
        assert torch.equal(loaded["w"], torch.full((1 << 18,), float(i))) and loaded["step"] == i
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{i}.pt" for i in range(6)] + ["index.tsv"]
    )  # no temp left
    assert materializer.stage_bytes == 6 << 20 and 0 < materializer.stage_seconds <= main_thread
    assert materializer.take_background_cost() > 0  # the writes' CPU: charged once
    assert materializer.take_background_cost() == 0


def test_a_staged_checkpoint_that_cannot_be_written_is_reported(tmp_path, monkeypatch):
    """A staged checkpoint whose write fails on the writer thread (a full disk) is reported as a
    failed write is, and nothing is put in place, no temp file left."""

    def disk_full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(durable.DirectFile, "write", disk_full)
    materializer = ForkMaterializer(stage=True)
    materializer.submit(WriteJob({"w": torch.ones(4)}, tmp_path / "x.pt"))
    materializer.close()
    assert len(materializer.failures) == 1 and "x.pt" in materializer.failures[0]
    assert "No space" in materializer.failures[0]
    assert list(tmp_path.iterdir()) == []


def test_checkpoints_are_staged_where_training_leaves_the_writer_no_core(monkeypatch):
    """By default a CPU state is staged where torch's threads take every core this process may
    use, and copied to the writer thread where one is free or where it is written past the page
    cache; never with CUDA in use (the fork or the pinned copy), nor where the caller chose the
    path by size."""
    cores = len(os.sched_getaffinity(0))
    own = torch.get_num_threads()
    small, large = 10 * MB, DIRECT_WRITE_BYTES
    try:
        torch.set_num_threads(cores)
        assert not writer_has_a_core()
        assert ForkMaterializer().stages_for(small) and not ForkMaterializer().stages_for(large)
        assert not ForkMaterializer(small_bytes=MB).stages_for(small)
        assert not ForkMaterializer(stage=False).stages_for(small)
        assert ForkMaterializer(stage=True).stages_for(large)
        if cores > 1:
            torch.set_num_threads(cores - 1)
            assert writer_has_a_core() and not ForkMaterializer().stages_for(small)
            assert ForkMaterializer(stage=True).stages_for(small)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        assert not ForkMaterializer(stage=True).stages_for(small)
    finally:
        torch.set_num_threads(own)


def test_a_staged_checkpoints_price_is_the_staging_measured_and_no_probe_is_written(tmp_path):
    """Staged, the first decision's price is the run's first write's own serialization (its
    init.ckpt) at its rate per byte, plus the writer's writes; nothing is probed beside
    training and nothing left on disk."""
    materializer = ForkMaterializer(stage=True)
    materializer.submit(WriteJob(big_state(4), tmp_path / "init.ckpt"))
    materializer.prime(tmp_path)
    assert materializer._cost_probe is None
    materializer._writer.drain()
    rate = materializer.stage_seconds / materializer.stage_bytes
    price = materializer.probe_cost(8 * MB, tmp_path)
    assert rate * 8 * MB <= price <= 2 * rate * 8 * MB + 0.01
    assert sorted(p.name for p in tmp_path.iterdir()) == ["init.ckpt"]
    materializer.close()
    fresh = ForkMaterializer(stage=True)  # nothing staged yet: a probe serialized in memory
    assert fresh.probe_cost(8 * MB, tmp_path) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["init.ckpt"]


def test_the_measured_probe_prices_both_paths(tmp_path):
    """On this machine, measured: both estimates positive; a 16 MB state's copy path costs at
    least its copy and write CPU, its fork path at least the fork."""
    materializer = ForkMaterializer()
    by_copy = materializer._copy_cost(16 * MB, tmp_path)
    by_fork = materializer._fork_cost(16 * MB, tmp_path)
    assert by_copy > 0 and by_fork > 0
    assert list(tmp_path.iterdir()) == []  # the probe writes leave nothing behind


def test_the_probe_prices_a_warm_copy_and_write_not_the_processs_first(tmp_path, monkeypatch):
    """A process's first copy and write pay one-time costs no later checkpoint pays; priced
    cold, the first checkpoint's coverage period came out 1-3 epochs too long."""
    import stalwart.hindsight.materializer as materializer_module

    calls = []

    def write(obj, path, direct=False):  # the first write of the process is the slow one
        calls.append(path)
        spin_python(0.2 if len(calls) == 1 else 0.002)

    copies = []
    real_copy = materializer_module.host_copy

    def copy(obj):
        copies.append(obj)
        if len(copies) == 1:
            time.sleep(0.2)
        return real_copy(obj)

    monkeypatch.setattr(materializer_module, "_probe_write", write)
    monkeypatch.setattr(materializer_module, "host_copy", copy)
    price = ForkMaterializer().probe_cost(MB, tmp_path)
    assert len(calls) == 2 and len(copies) == 2
    assert 0.002 <= price < 0.05, price


def test_the_write_price_leaves_out_the_processs_first_write(tmp_path, monkeypatch):
    """The first write (a run's init.ckpt) paid one-time costs: the price is the rate of the
    writes after it, or a probe write while there are none (no warm-up: the process is warm)."""
    import stalwart.hindsight.materializer as materializer_module

    materializer = ForkMaterializer()
    materializer.submit(WriteJob({"w": torch.ones(1 << 16)}, tmp_path / "init.pt"))
    materializer._writer.drain()
    assert materializer._writer.writes == 1 and materializer._writer.warm_bytes == 0
    probes = []
    monkeypatch.setattr(
        materializer_module, "_probe_write", lambda obj, path, direct=False: probes.append(path)
    )
    materializer._write_cpu(MB, tmp_path)
    assert len(probes) == 1  # one timed probe write, no warm-up
    materializer.submit(WriteJob({"w": torch.ones(1 << 16)}, tmp_path / "a.pt"))
    materializer.close()
    writer = materializer._writer
    assert writer.writes == 2 and writer.warm_bytes == (1 << 16) * 4
    assert writer.warm_cpu_seconds < writer.cpu_seconds
    price = materializer._write_cpu(MB, tmp_path)
    assert len(probes) == 1  # priced from the second write alone
    assert price == pytest.approx(writer.warm_cpu_seconds / writer.warm_bytes * MB)


def test_the_first_price_is_measured_beside_training_after_the_first_write(tmp_path, monkeypatch):
    """Primed behind a run's first write, the probe write runs on the writer thread, with no
    torch kernel there (see CostProbe); the copy is priced by the first copy's warm repeat: the
    first decision's price then costs the training thread neither a probe write nor a copy."""
    import stalwart.hindsight.materializer as materializer_module

    threads: list[tuple[str, str]] = []

    def on_thread(name, real):
        def timed(*args, **kwargs):
            threads.append((name, threading.current_thread().name))
            return real(*args, **kwargs)

        return timed

    monkeypatch.setattr(
        materializer_module, "_probe_write", on_thread("write", materializer_module._probe_write)
    )
    monkeypatch.setattr(
        materializer_module, "host_copy", on_thread("copy", materializer_module.host_copy)
    )
    materializer = ForkMaterializer()
    materializer.submit(WriteJob(big_state(2), tmp_path / "init.pt"))
    with monkeypatch.context() as kernels:  # no torch kernel on the writer thread
        kernels.setattr(torch, "ones", on_thread("kernel", torch.ones))
        kernels.setattr(torch.Tensor, "clone", on_thread("kernel", torch.Tensor.clone))
        materializer.prime(tmp_path)
        materializer._writer.drain()
    probe = materializer._cost_probe
    assert probe is not None and probe.ready and probe.nbytes == 2 * MB
    assert materializer._writer.writes == 1  # the probe is no write of the run ...
    assert materializer.take_background_cost() > 0  # ... but its CPU is charged like one
    writer, here = "stalwart-checkpoint-writer", threading.current_thread().name
    assert threads == [("write", writer)]
    price = materializer.probe_cost(3 * MB, tmp_path)
    assert threads[1:] == []  # no copy and no write here
    copy_per_byte = materializer.copy_per_byte
    assert copy_per_byte is not None and copy_per_byte > 0
    assert price == pytest.approx((probe.write_per_byte + copy_per_byte) * 3 * MB)
    # A state written past the page cache is priced by a probe of that path, here and now.
    materializer.probe_cost(DIRECT_WRITE_BYTES, tmp_path)
    assert threads[1:] == [("write", here)]
    materializer.close()
    assert [path.name for path in tmp_path.iterdir()] == ["init.pt"]  # no probe file left


def test_the_copys_price_is_timed_on_the_first_copy_which_it_leaves_as_it_was(tmp_path):
    """The warm repeat that prices the copy writes into the copy about to be written: the file
    still holds the state, tied tensors still share storage; a copy whose structure differs from
    the state (no leaves to pair) gives no price, and the probe prices the copy then."""
    results: list[WrittenFile] = []
    shared = torch.randn(MB // 4, generator=torch.Generator().manual_seed(1))
    state = {"a": shared, "tied": shared, "half": shared[: MB // 8], "step": 7, "name": "x"}
    materializer = ForkMaterializer()
    materializer.submit(WriteJob(state, tmp_path / "init.pt", results.append))
    materializer.close()
    assert materializer.copy_per_byte is not None and materializer.copy_per_byte > 0
    loaded = written(results, tmp_path / "init.pt")
    assert torch.equal(loaded["a"], shared) and torch.equal(loaded["half"], shared[: MB // 8])
    assert loaded["tied"].untyped_storage().data_ptr() == loaded["a"].untyped_storage().data_ptr()
    assert (loaded["step"], loaded["name"]) == (7, "x")
    assert _warm_copy_per_byte({"b": shared.clone()}, {"a": shared}) is None
    assert _warm_copy_per_byte({"step": 1}, {"step": 1}) is None


def test_a_probe_that_fails_leaves_the_price_to_the_calling_thread(tmp_path, monkeypatch):
    import stalwart.hindsight.materializer as materializer_module

    def full_disk(obj, path, direct=False):
        raise OSError(28, "No space left on device")

    materializer = ForkMaterializer()
    materializer.submit(WriteJob(big_state(1), tmp_path / "init.pt"))
    with monkeypatch.context() as failing:
        failing.setattr(materializer_module, "_probe_write", full_disk)
        materializer.prime(tmp_path)
        materializer._writer.drain()
    assert materializer._cost_probe.done.is_set() and not materializer._cost_probe.ready
    assert materializer.failures == [] and materializer._writer.failures == []
    assert materializer.probe_cost(MB, tmp_path) > 0  # measured here instead
    materializer.close()


def spin_python(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def unqueued_slowdown(work) -> tuple[float, float]:
    """:func:`python_slowdown`, less the time this (the spinning) thread waited for a core.

    With other processes runnable (a loaded CI machine) the spinning thread also waits on the
    run queue, and that reads as lost whatever the job holds; the scheduler's clock of the
    thread says how long it waited (over the whole call: the calibration's waits, also left
    out, only lower what remains). That takes nothing from a job's work counted as lost wrongly:
    with no queueing it reads in full, and with some, the spinner's own running time still
    stands against it. (Where the OS keeps no such clock it reads 0: nothing is left out.)"""
    clock = ThreadClock()
    try:
        waited = clock.read()[1]
        lost, used = python_slowdown(work)
        return lost - (clock.read()[1] - waited), used
    finally:
        clock.close()


def test_python_slowdown_counts_the_lock_a_background_job_holds_not_its_free_cores():
    # Best and worst of three tries: a busy machine moves one measurement, not all three.
    # (A job that holds the lock is measured whole: waiting for a core only adds to it.)
    spinning = [python_slowdown(lambda: spin_python(0.06)) for _ in range(3)]  # holds the lock
    assert all(used >= 0.05 for _, used in spinning)
    assert max(lost / used for lost, used in spinning) >= 0.5, spinning
    sleeping = [unqueued_slowdown(lambda: time.sleep(0.06)) for _ in range(3)]  # holds nothing
    assert all(used < 0.01 for _, used in sleeping)
    assert min(lost for lost, _ in sleeping) < 0.04, sleeping  # (the spin rate varies a little)
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a job that releases the lock needs a second core to run beside")
    # Hashing releases the lock: it runs on the other core (if that one is free: the run queue's
    # waits are left out). A job of ~0.1 s keeps the calibration's waits a small part of it.
    data = bytes(128 * MB)
    shares = []
    for _ in range(3):
        lost, used = unqueued_slowdown(lambda: hashlib.sha256(data).digest())
        shares.append(lost / used)
    assert min(shares) <= 0.5, shares


def test_with_cuda_in_use_the_probe_prices_the_writes_cpu_at_its_measured_share(
    tmp_path, monkeypatch
):
    materializer = ForkMaterializer(small_bytes=MB)
    materializer.prepare(tmp_path)  # no CUDA: not measured, all of the write's CPU is priced
    assert materializer.contention == 1.0
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    synced = []  # a probe measures CPU time: it never waits for the disk
    with monkeypatch.context() as probing:
        probing.setattr(os, "fsync", synced.append)
        materializer.prepare(tmp_path)
    assert synced == []
    assert 0.0 <= materializer.contention <= 1.0
    assert list(tmp_path.iterdir()) == []
    materializer.contention = 0.25  # as if measured: a quarter of the writer's CPU slows training
    # The probe prices either path's write at that share: a second of write CPU costs 0.25 ...
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(materializer, "_write_cpu", lambda nbytes, directory: 1.0)
    # (plus the copy, or the fork and its faults: the fork of a test process that has run many
    # tests took 53 ms once, and more on a loaded machine; a share of 1 would price the write
    # at a second and more)
    assert 0.25 <= materializer._copy_cost(MB, tmp_path) < 0.5
    assert 0.25 <= materializer._fork_cost(MB, tmp_path) < 1.0
    # ... while what the writes really used stands in whole until the slowdown is measured.
    materializer.submit(WriteJob({"w": torch.ones(1 << 16)}, tmp_path / "a.pt"))
    materializer.close()
    used = materializer._writer.cpu_seconds
    assert used > 0 and materializer.take_background_cost() == used


def test_never_more_than_max_children_and_all_reaped(tmp_path):
    materializer = ForkMaterializer(small_bytes=0, max_children=2)
    seen = 0
    for i in range(6):
        materializer.submit(WriteJob(big_state(16), tmp_path / f"{i}.pt"))
        seen = max(seen, materializer.live_children)
        assert materializer.live_children <= 2
    materializer.close()
    assert seen >= 1 and materializer.live_children == 0
    assert not materializer.failures
    assert not zombie_children()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{i}.pt" for i in range(6)]


def test_failed_child_is_reported(tmp_path):
    materializer = ForkMaterializer(small_bytes=0)
    materializer.submit(WriteJob(big_state(1), tmp_path / "missing-dir" / "x.pt"))
    materializer.close()
    assert len(materializer.failures) == 1 and "x.pt" in materializer.failures[0]


def test_inline_materializer_writes_on_the_calling_thread(tmp_path):
    recorder = Recorder(tmp_path / "index.tsv")
    state = big_state(8)
    start = time.perf_counter()
    cost = InlineMaterializer().submit(WriteJob(state, tmp_path / "a.pt", recorder))
    wall = time.perf_counter() - start
    (result,) = recorder.results()
    # The charged cost is the whole write on this thread: at least the durable write itself
    # (serialize, checksum, fsyncs, rename, as timed by the writer), at most the call's wall time.
    assert 0 < result.seconds <= cost <= wall
    assert result.nbytes == (tmp_path / "a.pt").stat().st_size > 8 * MB
    loaded = written(recorder.results(), tmp_path / "a.pt")
    assert torch.equal(loaded["weight"], state["weight"])


def test_unknown_materializer_is_rejected():
    from stalwart.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="fork"):
        make_materializer("thread")


@pytest.mark.parametrize(
    "path",
    [{"small_bytes": 0}, {"small_bytes": 16 << 20}, {"stage": True}],
    ids=["fork-cow", "copy-thread", "staged"],
)
def test_checkpoints_written_by_the_callback_hold_the_state_at_their_epoch_boundary(tmp_path, path):
    """End to end: the optimizer steps right after each fork never leak into the file."""
    import lightning as L
    from digits import DigitsClassifier, DigitsDataModule

    import stalwart

    class EveryEpoch(stalwart.HindsightCallback):
        def should_checkpoint(self, trainer, policy_says: bool) -> bool:
            return True

    class Witness(L.Callback):
        """Copies the weights at each epoch start, i.e. at the previous epoch's boundary."""

        def __init__(self) -> None:
            self.at_boundary: dict[int, dict] = {}

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            if trainer.current_epoch > 0:
                # Host copies: on a GPU machine this trains on CUDA; checkpoints hold host tensors.
                state = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}
                self.at_boundary[trainer.current_epoch - 1] = state

    witness = Witness()
    L.seed_everything(0)
    trainer = L.Trainer(
        max_epochs=4,
        callbacks=[
            EveryEpoch(dirpath=tmp_path, materializer=ForkMaterializer(**path)),
            witness,
        ],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = DigitsClassifier(width=512, depth=2)
    trainer.fit(model, DigitsDataModule(batch_size=256))
    run = stalwart.hindsight.open(tmp_path).run()
    assert [c.epoch for c in run.checkpoints()] == [0, 1, 2, 3]
    for epoch, expected in witness.at_boundary.items():
        written = run.checkpoint(epoch).load()["state_dict"]
        for name, tensor in expected.items():
            assert torch.equal(written[name], tensor), (epoch, name)
    assert not torch.equal(
        run.checkpoint(0).load()["state_dict"]["net.0.weight"], model.net[0].weight.detach().cpu()
    )


def test_a_large_checkpoint_goes_past_the_page_cache_and_a_small_one_through_it(tmp_path):
    """A record keeps every checkpoint and reads none back until a replay: from
    DIRECT_WRITE_BYTES of tensors the write skips the page cache (whose kernel time per page came
    out of training), below it torch writes by name (fewer round trips of the interpreter lock)."""
    require_direct_io(tmp_path)
    large = {"w": torch.randn(DIRECT_WRITE_BYTES // 4 + 1000), "step": 3}
    small = {"w": torch.randn((DIRECT_WRITE_BYTES // 4) // 8), "step": 4}
    written = {name: write_checkpoint(state, tmp_path / f"{name}.ckpt")
               for name, state in (("large", large), ("small", small))}  # fmt: skip
    cached, pages = pages_in_page_cache(tmp_path / "large.ckpt")
    assert cached < 0.01 * pages
    cached, pages = pages_in_page_cache(tmp_path / "small.ckpt")
    assert cached > 0.9 * pages
    for name, state in (("large", large), ("small", small)):  # both read back whole
        loaded = read_checkpoint(written[name].path, written[name].nbytes, written[name].crc32)
        assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == state["step"]
