"""The `stalwart` console script, run as a real process."""

from __future__ import annotations

import shutil
import subprocess
import sys

import lightning as L
from digits import DigitsClassifier, DigitsDataModule

from stalwart import HindsightCallback


def stalwart_cli(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("stalwart") or sys.executable
    prefix = [] if exe.endswith("stalwart") else ["-m", "stalwart.cli"]
    return subprocess.run([exe, *prefix, *args], capture_output=True, text=True, timeout=120)


def test_runs_and_metrics_commands(tmp_path):
    trainer = L.Trainer(
        max_epochs=2,
        callbacks=[HindsightCallback(dirpath=tmp_path)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(DigitsClassifier(width=8), DigitsDataModule(batch_size=500))
    listing = stalwart_cli("runs", str(tmp_path))
    assert listing.returncode == 0, listing.stderr
    assert "run_0001" in listing.stdout and "completed" in listing.stdout
    assert "train_loss" in listing.stdout
    metric = stalwart_cli("metrics", str(tmp_path), "train_loss")
    assert metric.returncode == 0, metric.stderr
    assert len(metric.stdout.splitlines()) == 1 + 2 * 3  # header + 3 batches x 2 epochs


def test_errors_are_one_clear_line_and_exit_2(tmp_path):
    missing = stalwart_cli("runs", str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    assert missing.stderr.startswith("stalwart: error: no hindsight record")
    assert "Traceback" not in missing.stderr
