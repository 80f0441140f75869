"""The CUDA paths, on a real GPU: skipped without one (CI has none; see docs/gpu.md).

Hindsight records from CUDA tensors (pinned host snapshots written by forked children) and
replays bit for bit; ShrinkCheckpoint compresses CUDA state and training resumes on the GPU
from the shrunken files; the redundant pipeline trains with CUDA tensors and survives a SIGKILL.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from digits_cnn import DigitsCNN, DigitsCNNDataModule

import stalwart
import stalwart.shrink as shrink
from stalwart import ShrinkCheckpoint
from stalwart.errors import ConfigurationError
from stalwart.hindsight.materializer import ForkMaterializer
from stalwart.pipeline.faults import Fault
from stalwart.pipeline.job import PipelineJob
from stalwart.pipeline.launch import launch
from stalwart.shrink.chain import ChainWriter
from stalwart.shrink.container import is_shrunk_file
from tests.helpers import QUIET
from tests.hindsight.test_replay import EpochProbe, EveryEpoch, GradProbe, fresh, values

pytestmark = pytest.mark.gpu

GPU = {"accelerator": "gpu", "devices": 1}
EPOCHS = 6


class WeightsAtEpochEnd(L.Callback):
    """The device the module trained on, and a CPU copy of its weights after every epoch."""

    def __init__(self) -> None:
        self.devices: set[str] = set()
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.devices.add(pl_module.device.type)
        self.weights[trainer.current_epoch] = {
            k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()
        }


def gpu_trainer(dirpath, callbacks=(), materializer="fork") -> stalwart.Trainer:
    return stalwart.Trainer(
        max_epochs=EPOCHS,
        callbacks=[EveryEpoch(dirpath=dirpath, materializer=materializer), *callbacks],
        deterministic=True,
        **GPU,
        **QUIET,
    )


@pytest.mark.timeout(300)
def test_hindsight_records_cuda_state_through_forked_children_and_replays_bit_exact(tmp_path):
    # small_bytes=0: every checkpoint takes the pinned-snapshot + fork path (not the buffer).
    materializer = ForkMaterializer(small_bytes=0)
    seen = WeightsAtEpochEnd()
    gpu_trainer(tmp_path / "record", [seen], materializer).fit(*fresh())
    assert seen.devices == {"cuda"}
    assert materializer.forks >= EPOCHS and materializer.failures == []
    run = stalwart.hindsight.open(tmp_path / "record").run()
    entries = run.checkpoints()
    assert len(entries) >= EPOCHS
    for entry in entries:  # what the children wrote is the GPU state at that epoch, exactly
        state = entry.load()["state_dict"]
        expected = seen.weights[entry.epoch]
        assert state.keys() == expected.keys()
        assert all(torch.equal(state[k], expected[k]) for k in expected), entry.epoch

    truth_dir = tmp_path / "truth"
    gpu_trainer(truth_dir, [EpochProbe(), GradProbe()]).fit(*fresh())
    truth = stalwart.hindsight.open(truth_dir).run()
    serial = gpu_trainer(tmp_path / "record").replay(*fresh(), probe=GradProbe())
    assert values(serial.metrics("grad_norm")).equals(values(truth.metrics("grad_norm")))
    assert serial.mismatches == []
    # CUDA is initialized here, so two workers cannot be forked: the segments run in turn.
    parallel = gpu_trainer(tmp_path / "record").replay(*fresh(), probe=GradProbe(), workers=2)
    assert len(parallel.segments) == 2
    assert values(parallel.metrics("grad_norm")).equals(values(serial.metrics("grad_norm")))
    outer = gpu_trainer(tmp_path / "record").replay(*fresh(), probe=EpochProbe())
    assert outer.batches_executed == 0
    assert values(outer.metrics("w_norm")).equals(values(truth.metrics("w_norm")))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", ["measured", "copy"])
def test_default_materializer_records_cuda_state_exactly_by_the_path_it_chose(tmp_path, path):
    # The default decides between the writer thread's pinned copy and a fork by its probe; the
    # copy path (_HostCopier's pinned copies, written by the thread) is pinned in the other case.
    materializer = ForkMaterializer(small_bytes=None if path == "measured" else 1 << 62)
    seen = WeightsAtEpochEnd()
    gpu_trainer(tmp_path, [seen], materializer).fit(*fresh())
    assert seen.devices == {"cuda"} and materializer.failures == []
    if path == "copy":
        assert materializer.copies >= EPOCHS and materializer.forks == 0
        # Copies after the first written one go into its pinned buffers (not new pinned memory)
        # where the previous write has finished; the files below must still be exact.
        assert materializer.refills >= 1
    else:  # the probe ran on the GPU state and chose one path for the whole run
        assert materializer.small_bytes is not None
        assert materializer.forks + materializer.copies >= EPOCHS
        assert materializer.forks == 0 or materializer.copies <= 1  # at most the initial state
    print(f"\n{path}: small_bytes={materializer.small_bytes} forks={materializer.forks} "
          f"copies={materializer.copies} refills={materializer.refills}")  # fmt: skip
    entries = stalwart.hindsight.open(tmp_path).run().checkpoints()
    assert len(entries) >= EPOCHS
    for entry in entries:
        state = entry.load()["state_dict"]
        expected = seen.weights[entry.epoch]
        assert all(torch.equal(state[k], expected[k]) for k in expected), entry.epoch


class RestoredWeights(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.device = pl_module.device.type
        self.weights = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}


@pytest.mark.timeout(300)
def test_shrink_compresses_cuda_state_and_training_resumes_on_the_gpu(tmp_path):
    L.seed_everything(0)
    dm = DigitsCNNDataModule()
    reports, ckpt, restored = [], None, None
    for end in (3, 5, 7):
        callback = ShrinkCheckpoint(dirpath=tmp_path, compress_optimizer="auto")
        restored = RestoredWeights()
        trainer = L.Trainer(
            max_epochs=end, callbacks=[callback, restored], **GPU,
            **{**QUIET, "enable_checkpointing": True},
        )  # fmt: skip
        trainer.fit(DigitsCNN(max_epochs=7), dm, ckpt_path=ckpt)
        reports += callback.reports
        files = [p for p in tmp_path.iterdir() if is_shrunk_file(p)]
        if ckpt is not None:  # the resumed run started from the file's weights, on the GPU
            decoded = shrink.load(ckpt)
            assert restored.device == "cuda"
            assert all(torch.equal(restored.weights[k], decoded[k]) for k in decoded)
        ckpt = max(files, key=lambda p: p.stat().st_mtime_ns)
    assert len(reports) == 7
    assert all(r.degradation is None or r.degradation <= 0.05 for r in reports)
    weights = sum(r.weight_bytes for r in reports) / sum(r.weight_stored for r in reports)
    assert weights >= 8, [round(r.ratio, 1) for r in reports]
    on_gpu = shrink.load(ckpt, map_location="cuda")
    assert {t.device.type for t in on_gpu.values()} == {"cuda"}


def test_a_background_save_of_cuda_weights_is_refused_with_what_to_do(tmp_path):
    # A forked child cannot use CUDA: the save says so before forking, and nothing is written.
    writer = ChainWriter(config=shrink.QuantConfig(bins=16), background=True)
    weights = {"w": torch.randn(64, 64, device="cuda")}
    with pytest.raises(ConfigurationError, match="background=False"):
        writer.save(weights, None, tmp_path / "0.shrunk")
    assert not list(tmp_path.iterdir())


PIPELINE = dict(
    num_stages=4, num_microbatches=4, steps=6, failure_timeout=20.0, verify_replicas=True
)


def run_pipeline(device: str, faults=()):
    # spawn: this test process may hold a CUDA context already, which forked workers cannot use.
    job = PipelineJob(**PIPELINE, device=device)
    return launch(job, faults=faults, timeout=180, start_method="spawn")


@pytest.mark.timeout(600)
def test_pipeline_trains_with_cuda_tensors_and_fails_over_after_sigkill():
    cpu = run_pipeline("cpu")
    clean = run_pipeline("cuda")
    assert not clean.events
    assert max(abs(a - b) for a, b in zip(clean.losses, cpu.losses, strict=True)) <= 1e-4
    assert all(pair["owner"] == pair["replica"] for pair in clean.digests.values())
    fault = Fault(rank=2, step=2, phase="forward", microbatch=1)
    killed = run_pipeline("cuda", [fault])
    assert killed.exit_codes[fault.rank] == -9
    (event,) = killed.events
    assert event["kind"] == "failover" and event["lost"] == [fault.rank]
    assert max(abs(a - b) for a, b in zip(killed.losses, clean.losses, strict=True)) <= 1e-5
