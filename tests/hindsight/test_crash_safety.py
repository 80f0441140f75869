"""Crash safety of the hindsight record: real processes, killed with real signals, no mocks.

* A real training process (the digits workload, a checkpoint forced every epoch, ~60 MB of state)
  is SIGKILLed mid-run together with its background writers; what it left on disk must be a
  consistent record that a new ``Trainer.fit(ckpt_path=...)`` resumes from.
* The same process sent SIGTERM stops gracefully: writers in flight are drained and indexed, and
  the run is marked failed.
* A forked writer child is SIGKILLed mid-write: its torn temp file must never be indexed or taken
  for a checkpoint, and a truncated file at an indexed path must be refused on load.
* The checkpoint writer, in its own process, is SIGKILLed mid-write over a good previous file:
  that file stays intact and indexed, and the torn one is a temp file no reader takes.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule

import stalwart
from stalwart import CorruptCheckpointError, HindsightCallback, durable
from stalwart.durable import TEMP_MARKER
from stalwart.hindsight.checkpoint_file import read_checkpoint, write_checkpoint
from stalwart.hindsight.materializer import ForkMaterializer, WriteJob
from stalwart.hindsight.store import APPLICATION_ID, HindsightStore, checkpoint_recorder
from tests.torn_write import kill_mid_write

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# width 1024, depth 8: ~7.4 M parameters, so a checkpoint (weights + SGD momentum) is ~60 MB and
# each write takes a measurable fraction of the ~1.5 s epoch.
WIDTH, DEPTH = 1024, 8
TRAIN_BATCHES_PER_EPOCH = math.ceil(1437 / 64)  # DigitsDataModule's train split, batch size 64
CHECKPOINTS_BEFORE_KILL = 3
STARTUP_TIMEOUT = 60.0  # interpreter + torch + Lightning import (~7 s here) and 3 epochs


class EveryEpoch(HindsightCallback):
    """Checkpoint every epoch whatever the policy says (same name as in the training script, so
    Lightning hands this callback the state the crashed run saved)."""

    def should_checkpoint(self, trainer, policy_says: bool) -> bool:
        return True


TRAIN_SCRIPT = """
import sys

sys.path.insert(0, {examples!r})

import lightning as L
import torch
from digits import DigitsClassifier, DigitsDataModule

from stalwart import HindsightCallback
from stalwart.hindsight.materializer import ForkMaterializer


class EveryEpoch(HindsightCallback):
    def should_checkpoint(self, trainer, policy_says):
        return True


torch.set_num_threads(1)
L.seed_everything(0)
trainer = L.Trainer(
    max_epochs=1000,  # never finishes: the test kills it
    callbacks=[EveryEpoch(dirpath={dirpath!r}, materializer=ForkMaterializer(stage={stage}))],
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(DigitsClassifier(width={width}, depth={depth}), DigitsDataModule())
"""


def _trainer(max_epochs: int, callbacks: list) -> L.Trainer:
    return L.Trainer(
        max_epochs=max_epochs,
        callbacks=callbacks,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


# -- process helpers ---------------------------------------------------------------------------


def _live_group_members(pgid: int) -> list[int]:
    """Pids of the processes of group ``pgid`` that are not yet dead (zombies count as dead)."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == pgid and state not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _kill_group(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGKILL the training process and every writer it forked; wait until all of them are gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    while members := _live_group_members(proc.pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes {members} of the training run survived SIGKILL")
        time.sleep(0.02)


def _log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "<no log>"


def _temp_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if p.name.startswith(".") and TEMP_MARKER in p.name]


def _indexed_epochs(dirpath: Path) -> tuple[list[int], str]:
    """Epochs the latest run has indexed, read through the public reader (and the last error)."""
    try:
        with stalwart.hindsight.open(dirpath) as store:
            return [entry.epoch for entry in store.run().checkpoints()], ""
    except (stalwart.StalwartError, sqlite3.OperationalError) as exc:
        # Only while the recording process is still creating the database and its first run.
        return [], f"{type(exc).__name__}: {exc}"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return -1


def _wait_for(condition: Callable[[], bool], timeout: float, what: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what()}")
        time.sleep(0.001)


class _StartProbe(L.Callback):
    """Remembers the weights the resumed fit starts from and its first epoch."""

    def __init__(self) -> None:
        self.start_weights: dict[str, torch.Tensor] | None = None
        self.first_epoch: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.start_weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.first_epoch is None:
            self.first_epoch = trainer.current_epoch


# -- the training process killed mid-run ---------------------------------------------------------


def _start_training(
    tmp_path: Path, dirpath: Path, log, stage: bool | None = None
) -> subprocess.Popen:
    """The training script in a process of its own; ``stage``: its materializer's (see
    :class:`ForkMaterializer`; with one torch thread the default copies)."""
    script = tmp_path / "train.py"
    script.write_text(
        TRAIN_SCRIPT.format(
            examples=str(EXAMPLES), dirpath=str(dirpath), width=WIDTH, depth=DEPTH, stage=stage
        )
    )
    return subprocess.Popen(
        [sys.executable, str(script)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
        start_new_session=True,  # its own process group: one killpg reaches the writers too
    )


def _wait_for_checkpoints(proc: subprocess.Popen, dirpath: Path, log_path: Path) -> None:
    """Poll the database, through the public reader, until enough checkpoints are indexed."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        if proc.poll() is not None:
            pytest.fail(
                f"training exited on its own with {proc.returncode}:\n{_log_tail(log_path)}"
            )
        epochs, error = _indexed_epochs(dirpath)
        if len(epochs) >= CHECKPOINTS_BEFORE_KILL:
            return
        if time.monotonic() > deadline:
            pytest.fail(
                f"only {len(epochs)} checkpoints indexed ({epochs}) after "
                f"{STARTUP_TIMEOUT:.0f} s; last reader error: {error or 'none'}\n"
                f"training log:\n{_log_tail(log_path)}"
            )
        time.sleep(0.1)


def _assert_complete_metrics(run, last_epoch: int) -> None:
    """Every epoch up to ``last_epoch`` has all its logged rows."""
    train_loss = run.metrics("train_loss")
    assert set(train_loss["source"]) == {"record"}
    assert train_loss["value"].map(math.isfinite).all()
    assert train_loss["step"].is_monotonic_increasing
    per_epoch = train_loss.groupby("epoch").size()
    for epoch in range(last_epoch + 1):
        assert per_epoch.get(epoch, 0) == TRAIN_BATCHES_PER_EPOCH, (
            f"epoch {epoch} has {per_epoch.get(epoch, 0)} train_loss rows, "
            f"expected {TRAIN_BATCHES_PER_EPOCH}"
        )
    for name in ("val_loss", "val_acc"):
        logged = set(run.metrics(name)["epoch"])
        missing = set(range(last_epoch + 1)) - logged
        assert not missing, f"{name} has no rows for epochs {sorted(missing)}"


def _integrity_check(db: Path) -> None:
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
        raw_paths = [path for (path,) in conn.execute("SELECT path FROM checkpoints")]
    finally:
        conn.close()
    assert not any(TEMP_MARKER in path for path in raw_paths), raw_paths


# -- the training process killed mid-run ---------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [None, True], ids=["copied", "staged"])
def test_sigkilled_training_leaves_a_consistent_resumable_record(tmp_path, stage):
    """SIGKILL mid-write: checkpoints copied to the writer thread (the default with one torch
    thread), and serialized on the training thread and committed by the writer (staged)."""
    dirpath = tmp_path / "runs"
    run_dir = dirpath / "run_0001"
    log_path = tmp_path / "train.log"
    killed_mid_write = False
    with open(log_path, "wb") as log:
        proc = _start_training(tmp_path, dirpath, log, stage)
        try:
            # 1. Wait until 3 checkpoints are indexed.
            _wait_for_checkpoints(proc, dirpath, log_path)
            # 2. Aim the kill at a write in flight (a temp file with bytes in it), for at most
            #    ~2 epochs; kill regardless after that.
            aim_deadline = time.monotonic() + 4.0
            while time.monotonic() < aim_deadline and proc.poll() is None:
                if any(_size(p) > 0 for p in _temp_files(run_dir)):
                    killed_mid_write = True
                    break
                time.sleep(0.001)
            assert proc.poll() is None, f"training exited before the kill:\n{_log_tail(log_path)}"
        finally:
            _kill_group(proc)
    assert proc.returncode == -signal.SIGKILL

    # 3. The database survived: integrity, and it is still recognisably ours.
    _integrity_check(dirpath / "hindsight.db")

    with stalwart.hindsight.open(dirpath) as store:
        (run,) = store.runs()
        assert run.name == "run_0001"
        assert run.status == "running", "the run never finished, yet it is not marked running"
        assert run.finished is None
        entries = run.checkpoints()
        assert len(entries) >= CHECKPOINTS_BEFORE_KILL, [e.epoch for e in entries]

        # 4. Every indexed checkpoint is complete: size + CRC-32 verified, and plain torch.load.
        indexed = set()
        payloads = {}
        for entry in entries:
            assert entry.path.parent == run_dir
            assert entry.path.name == f"epoch={entry.epoch:04d}.ckpt"
            indexed.add(entry.path.resolve())
            payload = entry.load()
            # The state once epoch ``entry.epoch`` has fully ended: all its optimizer steps done.
            assert payload["global_step"] == entry.step
            assert entry.step == (entry.epoch + 1) * TRAIN_BATCHES_PER_EPOCH
            assert "stalwart_rng" in payload
            plain = torch.load(entry.path, map_location="cpu", weights_only=True)
            assert plain["state_dict"].keys() == payload["state_dict"].keys()
            assert all(
                torch.equal(plain["state_dict"][k], v) for k, v in payload["state_dict"].items()
            )
            payloads[entry.epoch] = payload
            del plain
        last = entries[-1]

        # 5. Logged rows are readable and complete for every epoch up to the last checkpoint.
        _assert_complete_metrics(run, last.epoch)
        decided = run.decisions()
        assert set(range(last.epoch)) <= set(decided["epoch"])
        assert decided.set_index("epoch").loc[: last.epoch - 1, "checkpoint"].eq(1).all()

    # 6. Leftover temp files (torn writes) are never in the index.
    temps = _temp_files(run_dir)
    assert not {p.resolve() for p in temps} & indexed
    on_disk = {p.resolve() for p in run_dir.iterdir()}
    assert indexed <= on_disk
    print(
        f"killed {'mid-write' if killed_mid_write else 'between writes'}; "
        f"{len(entries)} indexed checkpoints (last epoch {last.epoch}); "
        f"leftover temp files: {[p.name for p in temps]}"
    )

    # 7. Lightning resumes from the last indexed checkpoint, recording into the same directory.
    probe = _StartProbe()
    torch.manual_seed(1234)  # a different init: the resumed weights must come from the file
    trainer = _trainer(last.epoch + 3, [EveryEpoch(dirpath=dirpath), probe])
    trainer.fit(
        DigitsClassifier(width=WIDTH, depth=DEPTH), DigitsDataModule(), ckpt_path=str(last.path)
    )
    assert probe.first_epoch == last.epoch + 1
    saved = payloads[last.epoch]["state_dict"]
    assert probe.start_weights.keys() == saved.keys()
    assert all(torch.equal(probe.start_weights[k], v) for k, v in saved.items())
    assert trainer.current_epoch == last.epoch + 3

    with stalwart.hindsight.open(dirpath) as store:
        crashed, resumed = store.runs()
        assert crashed.status == "running"
        assert resumed.status == "completed"
        assert resumed.resumed_from is not None
        assert resumed.resumed_from.endswith(f"#run_0001@epoch={last.epoch}")
        assert [e.epoch for e in resumed.checkpoints()] == [last.epoch + 1, last.epoch + 2]
        for entry in resumed.checkpoints():
            entry.load()
        assert set(resumed.metrics("train_loss")["epoch"]) == {last.epoch + 1, last.epoch + 2}
    _integrity_check(dirpath / "hindsight.db")


@pytest.mark.timeout(180)
def test_sigterm_drains_the_writers_and_marks_the_run_failed(tmp_path):
    """SIGTERM to the training process (what a scheduler sends first): Lightning stops after the
    current batch; the writers in flight must finish and be indexed before the process exits."""
    dirpath = tmp_path / "runs"
    run_dir = dirpath / "run_0001"
    log_path = tmp_path / "train.log"
    with open(log_path, "wb") as log:
        proc = _start_training(tmp_path, dirpath, log)
        try:
            _wait_for_checkpoints(proc, dirpath, log_path)
            aim_deadline = time.monotonic() + 4.0  # preferably while a write is in flight
            while time.monotonic() < aim_deadline and proc.poll() is None:
                if any(_size(p) > 0 for p in _temp_files(run_dir)):
                    break
                time.sleep(0.001)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"training ignored SIGTERM for 30 s:\n{_log_tail(log_path)}")
            leftover = _live_group_members(proc.pid)
            assert not leftover, f"writers {leftover} outlived the training process"
        finally:
            _kill_group(proc)
    assert proc.returncode >= 0, f"died of signal {-proc.returncode}:\n{_log_tail(log_path)}"
    log_text = log_path.read_text(errors="replace")
    assert "background writer" not in log_text, log_text[-3000:]

    _integrity_check(dirpath / "hindsight.db")
    with stalwart.hindsight.open(dirpath) as store:
        (run,) = store.runs()
        assert run.status == "failed"
        assert run.finished is not None
        entries = run.checkpoints()
        assert len(entries) >= CHECKPOINTS_BEFORE_KILL
        # Every write was drained: no temp file, and every file on disk is indexed and whole.
        assert _temp_files(run_dir) == []
        everything = run.checkpoints(include_initial=True)
        assert everything[0].path.name == "init.ckpt"
        assert sorted(p.name for p in run_dir.iterdir()) == sorted(e.path.name for e in everything)
        for entry in entries:
            assert entry.load()["global_step"] == entry.step
        decided = run.decisions()
        taken = sorted(decided.loc[decided["checkpoint"] == 1, "epoch"])
        assert taken == [e.epoch for e in entries], "a checkpoint that was decided went missing"
        _assert_complete_metrics(run, entries[-1].epoch)


# -- a writer child killed mid-write -----------------------------------------------------------

TORN_STATE_BYTES = 300 << 20  # ~1 s from fork to the last byte here: ample time to kill mid-write


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["immediately", "mid-write"])
def test_writer_killed_mid_write_is_never_indexed(tmp_path, when):
    root = tmp_path / "runs"
    store = HindsightStore(root, create=True)
    run_id = store.begin_run(hparams={}, fingerprints={}, config={})
    path = store.run_dir(run_id) / "epoch=0000.ckpt"
    # Untouched pages: 300 MB to serialize without 300 MB of resident memory.
    state = {"blob": torch.empty(TORN_STATE_BYTES, dtype=torch.uint8)}
    materializer = ForkMaterializer(small_bytes=0)  # always fork
    try:
        materializer.submit(
            WriteJob(state, path, checkpoint_recorder(store.db_path, run_id, epoch=0, step=0))
        )
        assert materializer.live_children == 1, "a 300 MB state must fork a writer at once"
        (pid,) = materializer._children
        temp = path.with_name(f".{path.name}{TEMP_MARKER}{pid}")
        if when == "mid-write":
            _wait_for(
                lambda: _size(temp) > 0 or path.exists(),
                timeout=60,
                what=lambda: f"writer {pid} to start writing {temp.name}",
            )
            assert not path.exists(), (
                f"writer {pid} finished before it could be killed; raise TORN_STATE_BYTES"
            )
        os.kill(pid, signal.SIGKILL)
        materializer.close()  # reaps the killed child
    finally:
        for child in list(materializer._children):  # only if the test failed before the kill
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
    del state

    # The materializer noticed, and says which file was not written.
    assert len(materializer.failures) == 1, materializer.failures
    assert f"writer {pid} exited with {-signal.SIGKILL}" in materializer.failures[0]
    assert str(path) in materializer.failures[0]

    # No final file, no index row; a torn temp file may remain, smaller than the full state.
    assert not path.exists()
    leftovers = _temp_files(path.parent)
    assert {p.name for p in leftovers} <= {temp.name}
    if when == "mid-write":
        assert temp.exists()
        assert 0 < temp.stat().st_size < TORN_STATE_BYTES
    assert store.run(run_id).checkpoints() == []
    assert store.query("SELECT count(*) AS n FROM checkpoints")["n"].item() == 0
    store.close()

    with stalwart.hindsight.open(root) as reader:
        assert reader.run().checkpoints() == []
        with pytest.raises(stalwart.RunNotFoundError, match=r"has no checkpoint of epoch 0"):
            reader.run().checkpoint(0)

    # A later complete write of the same epoch is indexed under the final name, not the temp one,
    # and the torn temp file next to it changes nothing.
    good_state = {"w": torch.arange(1 << 19, dtype=torch.float32)}
    materializer = ForkMaterializer(small_bytes=0)
    materializer.submit(
        WriteJob(
            good_state, path, checkpoint_recorder(root / "hindsight.db", run_id, epoch=0, step=0)
        )
    )
    materializer.close()
    assert materializer.failures == []
    with stalwart.hindsight.open(root) as reader:
        (entry,) = reader.run().checkpoints()
        assert entry.path == path
        assert torch.equal(entry.load()["w"], good_state["w"])
    assert {p.name for p in _temp_files(path.parent)} == {p.name for p in leftovers}


@pytest.mark.timeout(120)
def test_truncated_checkpoint_at_an_indexed_path_is_refused(tmp_path):
    dirpath = tmp_path / "runs"
    trainer = _trainer(2, [EveryEpoch(dirpath=dirpath, materializer="fork")])
    trainer.fit(DigitsClassifier(width=64), DigitsDataModule())
    with stalwart.hindsight.open(dirpath) as store:
        first, last = store.run().checkpoints()
    intact = last.path.read_bytes()
    assert last.load()["global_step"] == last.step

    for cut in (len(intact) // 2, len(intact) - 1, 0):
        # A truncated copy put in place the way a careless restore would: write aside, rename.
        aside = tmp_path / "copy.ckpt"
        aside.write_bytes(intact[:cut])
        os.replace(aside, last.path)
        with pytest.raises(CorruptCheckpointError) as info:
            last.load()
        message = str(info.value)
        assert str(last.path) in message
        assert f"expected {len(intact)} bytes" in message and f"found {cut} bytes" in message
        assert "use an earlier checkpoint" in message
        assert last.path.read_bytes() == intact[:cut], "load() must not touch the file"

    last.path.unlink()
    with pytest.raises(CorruptCheckpointError, match="missing on disk"):
        last.load()
    assert first.load()["global_step"] == first.step  # the other checkpoint is unaffected


def test_torn_files_of_dead_writers_are_swept_when_recording_resumes(tmp_path):
    store = HindsightStore(tmp_path, create=True)
    run_dir = store.run_dir(store.begin_run(hparams={}, fingerprints={}, config={}))
    store.close()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    torn = run_dir / f".epoch=0001.ckpt{TEMP_MARKER}{dead.pid}"
    live = run_dir / f".epoch=0002.ckpt{TEMP_MARKER}{os.getpid()}"
    kept = run_dir / "notes.txt"
    for path in (torn, live, kept):
        path.write_bytes(b"partial")
    HindsightStore(tmp_path, create=True).close()
    assert not torn.exists()
    assert live.exists() and kept.exists()


# -- the checkpoint writer itself killed mid-write, over a good previous file -------------------

CHECKPOINT_WRITER = """
import torch
from stalwart.hindsight.checkpoint_file import write_checkpoint

state = {{"w": torch.randn(10 << 20, generator=torch.Generator().manual_seed(1))}}  # 40 MB
write_checkpoint(state, {path!r})
"""


@pytest.mark.timeout(120)
def test_checkpoint_writer_killed_mid_write_leaves_the_previous_file(tmp_path):
    root = tmp_path / "runs"
    store = HindsightStore(root, create=True)
    run_id = store.begin_run(hparams={}, fingerprints={}, config={})
    path = store.run_dir(run_id) / "epoch=0000.ckpt"
    previous = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    checkpoint_recorder(store.db_path, run_id, epoch=0, step=0)(write_checkpoint(previous, path))
    store.close()
    intact = path.read_bytes()

    stall_after = 8 << 20
    temp, pid = kill_mid_write(
        CHECKPOINT_WRITER.format(path=str(path)), path, stall_after=stall_after
    )

    # The previous file is untouched and still the indexed, verified checkpoint.
    assert path.read_bytes() == intact
    with stalwart.hindsight.open(root) as reader:
        (entry,) = reader.run().checkpoints()
        assert entry.path == path
        assert torch.equal(entry.load()["w"], previous["w"])
    # The torn write is a temp file (never indexed), shorter than the 40 MB state, and no reader
    # takes it for the checkpoint.
    assert durable.is_temp(temp) and temp.name.endswith(str(pid))
    assert stall_after <= temp.stat().st_size < 40 << 20
    with pytest.raises(CorruptCheckpointError, match="is corrupted"):
        read_checkpoint(temp, entry.nbytes, entry.crc32)
    # Recording into the directory again sweeps it (its writer is dead).
    HindsightStore(root, create=True).close()
    assert not temp.exists() and path.read_bytes() == intact
