"""Parallel replay computes like the record: the torch settings that decide numerics travel along.

The workload is ``benchmarks/replay_speed.py``'s (digits MLP width 128, batch 8), recorded with
2 torch threads. On most machines a gradient norm computed with 2 threads differs in its last bits
from one computed with 1, so replay workers that ran with 1 thread each (as they once did) fail
these tests by their values; on a machine whose kernels compute this workload alike at both
counts (one of ours), the probe's own reading of the thread count still catches them.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule

import stalwart
from stalwart.hindsight.numerics import NUMERICS_KEY
from stalwart.hindsight.replay import Mismatch
from tests import helpers
from tests.helpers import QUIET, EveryEpoch

EPOCHS = 4


class GradProbe(helpers.GradProbe):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        pl_module.log("torch_threads", float(torch.get_num_threads()))


def trainer_for(dirpath, probes=()) -> stalwart.Trainer:
    return stalwart.Trainer(
        max_epochs=EPOCHS,
        callbacks=[EveryEpoch(dirpath=dirpath), *probes],
        deterministic=True,
        **QUIET,
    )


def fresh():
    L.seed_everything(0)
    return DigitsClassifier(width=128, depth=2), DigitsDataModule(batch_size=8)


def record_with_threads(root, threads: int):
    """Record with the probe present, so the record itself holds the true grad norms."""
    own = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        trainer_for(root, [GradProbe()]).fit(*fresh())
    finally:
        torch.set_num_threads(own)
    return stalwart.hindsight.open(root).run()


@pytest.fixture(scope="module")
def two_threads(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_threads")
    return root, record_with_threads(root, 2)


def series(frame):
    return frame.sort_values(["epoch", "step"], kind="stable").value.tolist()


def test_the_record_keeps_what_decides_its_numerics(two_threads):
    _, run = two_threads
    numerics = run.config[NUMERICS_KEY]
    assert numerics["torch_threads"] == 2
    assert numerics["deterministic"] is True  # Trainer(deterministic=True)
    assert numerics["float32_matmul_precision"] == torch.get_float32_matmul_precision()


def test_thread_count_changes_the_values_so_the_next_test_can_fail(two_threads, tmp_path):
    _, run = two_threads
    one_thread = record_with_threads(tmp_path, 1)
    assert set(series(one_thread.metrics("torch_threads"))) == {1.0}
    assert set(series(run.metrics("torch_threads"))) == {2.0}
    if series(one_thread.metrics("grad_norm")) == series(run.metrics("grad_norm")):
        pytest.skip(
            "this machine's kernels compute this workload alike with 1 and 2 threads: here only "
            "the probe's reading of the thread count (next test) catches a worker's wrong count"
        )


def test_parallel_replay_equals_serial_replay_equals_the_record(two_threads):
    root, run = two_threads
    replayed = range(1, EPOCHS)
    threads_before = torch.get_num_threads()  # 1 in the test suite: the record's 2 must win
    serial = trainer_for(root).replay(*fresh(), probe=GradProbe(), epochs=replayed)
    parallel = trainer_for(root).replay(*fresh(), probe=GradProbe(), epochs=replayed, workers=2)
    assert torch.get_num_threads() == threads_before  # the caller's setting is put back

    assert len(parallel.segments) == 2
    recorded = run.metrics("grad_norm", source="record")
    recorded = series(recorded[recorded.epoch.isin(replayed)])
    assert len(recorded) == len(replayed) * 180  # 1437 samples / batch 8
    assert series(serial.metrics("grad_norm")) == recorded
    assert series(parallel.metrics("grad_norm")) == recorded
    # Every replayed batch ran with the record's 2 threads, in this process and in each worker.
    assert set(series(serial.metrics("torch_threads"))) == {2.0}
    assert set(series(parallel.metrics("torch_threads"))) == {2.0}
    assert serial.mismatches == []
    assert parallel.mismatches == []


def test_a_mismatch_prints_a_summary_not_its_series():
    recorded = [float(i) for i in range(1000)]
    replayed = list(recorded)
    replayed[7] += 0.5
    replayed[900] -= 2.0
    mismatch = Mismatch("train_loss", 3, recorded, replayed)
    text = repr(mismatch)
    assert text == str(mismatch)
    assert "\n" not in text and len(text) < 200
    assert "'train_loss' epoch 3: 2 of 1000 differ" in text
    assert "first at 7 (7.0 recorded, 7.5 replayed)" in text
    assert "max |difference| 2" in text
    assert mismatch.differing.tolist() == [7, 900]

    nan = float("nan")
    assert Mismatch("x", 0, [nan, 1.0], [nan, 1.0]).differing.size == 0
    shorter = repr(Mismatch("x", 0, [1.0, 2.0], [1.0]))
    assert "0 of 2 differ" in shorter and "2 recorded vs 1 replayed values" in shorter
