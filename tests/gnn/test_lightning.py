"""The Lightning surface: StaleGatherDataModule + StaleGCN/StaleGAT through stalwart.Trainer,
and the example YAML config through the `stalwart` CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart import Trainer
from stalwart.datamodules import StaleGAT, StaleGatherDataModule, StaleGCN
from tests.gnn.graphs import HAVE_CORA, planetoid_root, sbm
from tests.helpers import QUIET

pytest.importorskip("torch_geometric")
ROOT = Path(__file__).resolve().parents[2]


def fit(module, staleness, epochs: int, **data_args):
    from torch_geometric.data import Data

    dm = StaleGatherDataModule(Data(**sbm(num_nodes=400, seed=4)), num_intervals=6,
                               staleness=staleness, **data_args)  # fmt: skip
    trainer = Trainer(max_epochs=epochs, **QUIET)
    trainer.fit(module, dm)
    metrics = dict(trainer.callback_metrics)
    (result,) = trainer.test(module, dm, verbose=False)
    return metrics, result["test_acc"]


@pytest.mark.parametrize("staleness", ["sync", 1])
def test_stale_gcn_trains_through_the_trainer(staleness):
    module = StaleGCN(hidden=16, dropout=0.2)
    metrics, accuracy = fit(module, staleness, epochs=30, straggler_delay=0.001)
    assert accuracy > 0.6  # 4 classes: chance is 0.25; own features alone give ~0.45
    assert {"train_loss", "val_acc", "gate_lead", "stale_reads"} <= set(metrics)
    assert len(module.epoch_seconds) == 30
    bound = 0 if staleness == "sync" else staleness
    gate_log = module.last_engine.gate.log
    assert max(lead for *_, lead in gate_log) <= bound
    if staleness == "sync":
        assert float(metrics["stale_reads"]) == 0.0


def test_stale_gat_applyedge_trains():
    _, accuracy = fit(StaleGAT(hidden=16, dropout=0.2), 0, epochs=30, workers=0)
    assert accuracy > 0.6


def test_example_config_fits_from_yaml(tmp_path):
    config = ROOT / "examples" / "configs" / "gnn_cora.yaml"
    exe = shutil.which("stalwart")
    command = [exe] if exe else [sys.executable, "-m", "stalwart.cli"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # Cora from the offline copy, named explicitly; without one, the generated graph on request.
    data = [f"--data.root={planetoid_root()}"] if HAVE_CORA else ["--data.fallback_sbm=true"]
    out = subprocess.run(
        [*command, "fit", "--config", str(config), "--trainer.max_epochs=2",
         "--data.staleness=1", "--data.straggler_delay=0.001",
         "--trainer.enable_progress_bar=false", *data],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "max_epochs=2" in out.stderr + out.stdout
    assert any((tmp_path / "runs" / "gnn_cora").glob("run_*"))
