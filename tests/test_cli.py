"""The `stalwart` console script, run as a real process."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart import HindsightCallback
from tests.helpers import fit_digits


def stalwart_cli(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("stalwart") or sys.executable
    prefix = [] if exe.endswith("stalwart") else ["-m", "stalwart.cli"]
    return subprocess.run([exe, *prefix, *args], capture_output=True, text=True, timeout=120)


def test_runs_and_metrics_commands(tmp_path):
    record = HindsightCallback(dirpath=tmp_path)
    fit_digits([record], epochs=2)
    listing = stalwart_cli("runs", str(tmp_path))
    assert listing.returncode == 0, listing.stderr
    assert "run_0001" in listing.stdout and "completed" in listing.stdout
    # The figure the fit's summary printed (see tests/hindsight/test_runs_overhead.py).
    assert f"overhead {record.policy.overhead:.2%} of training compute" in listing.stdout
    assert "train_loss" in listing.stdout
    decisions = stalwart_cli("runs", str(tmp_path), "--decisions")
    assert decisions.returncode == 0, decisions.stderr
    assert "threshold" in decisions.stdout and len(decisions.stdout.splitlines()) == 2 + 2
    metric = stalwart_cli("metrics", str(tmp_path), "train_loss")
    assert metric.returncode == 0, metric.stderr
    assert len(metric.stdout.splitlines()) == 1 + 2 * 3  # header + 3 batches x 2 epochs


def test_errors_are_one_clear_line_and_exit_2(tmp_path):
    missing = stalwart_cli("runs", str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    assert missing.stderr.startswith("stalwart: error: no hindsight record")
    assert "Traceback" not in missing.stderr


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
# Configs that record with HindsightCallback are fit AND replayed here; the others are exercised
# by their capability's tests (tests/gnn, tests/pipeline, ...).
CONFIGS = sorted(
    path
    for path in (ROOT / "examples" / "configs").glob("*.yaml")
    if "stalwart.HindsightCallback" in path.read_text()
)


def offline_data(config) -> list[str]:
    """Where a config's Planetoid data comes from in tests: the offline copy (no download)."""
    if "StaleGatherDataModule" not in config.read_text():
        return []
    from tests.gnn.graphs import HAVE_CORA, planetoid_root

    return [f"--data.root={planetoid_root()}"] if HAVE_CORA else ["--data.fallback_sbm=true"]


def cli_in(cwd, *args: str) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    exe = shutil.which("stalwart")
    command = [exe] if exe else [sys.executable, "-m", "stalwart.cli"]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )


def said_once(out: subprocess.CompletedProcess, text: str) -> bool:
    """``text`` appears once in all the command printed, and LightningCLI did not warn that it
    was given both ``args`` and a command line."""
    return (out.stdout + out.stderr).count(text) == 1 and "args parameter" not in out.stderr


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_example_config_fits_and_replays_from_yaml(tmp_path, config):
    data = offline_data(config)
    fit = cli_in(tmp_path, "fit", "--config", str(config), "--trainer.max_epochs=2", *data)
    assert fit.returncode == 0, fit.stderr[-2000:]
    assert "args parameter" not in fit.stderr
    record = next(tmp_path.glob("runs/*"))  # named by the config's HindsightCallback
    planned = cli_in(
        tmp_path, "replay", "--config", str(config), "--trainer.max_epochs=2",
        "--probe", "examples.probes:GradNormProbe", "--epochs", "1:1", "--dry-run",
        "--dirpath", str(record), *data,
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert "replay plan for run_0001: inner-loop" in planned.stdout
    assert said_once(planned, "replay plan for"), planned.stderr[-2000:]
    assert "grad_norm" not in planned.stdout  # nothing ran
    batches = planned.stdout.split(" training batches")[0].rsplit(" ", 1)[-1]
    replayed = cli_in(
        tmp_path, "replay", "--config", str(config), "--trainer.max_epochs=2",
        "--probe", "examples.probes:GradNormProbe", "--epochs", "1:1", *data,
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr[-2000:]
    assert "inner-loop" in replayed.stdout and "0 mismatch(es)" in replayed.stdout
    assert said_once(replayed, "mismatch(es)"), replayed.stderr[-2000:]
    assert f", {batches} training batches" in replayed.stdout and "(estimated " in replayed.stdout
    assert "grad_norm (per epoch)" in replayed.stdout
    plot = cli_in(tmp_path, "runs", str(record), "--plot", "grad_norm", "--out", "g.png")
    assert plot.returncode == 0, plot.stderr
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_cli_rejects_a_bad_probe_spec(tmp_path):
    config = CONFIGS[0]
    out = cli_in(tmp_path, "replay", "--config", str(config), "--probe", "no_such_module:Probe")
    assert out.returncode == 2
    assert "cannot be imported" in out.stderr


def test_fit_resumes_from_a_shrunken_ckpt_path_and_continues_its_chain(tmp_path, monkeypatch):
    """The resume command in digits_shrink.yaml's header: LightningCLI reads the checkpoint's
    hyperparameters before it builds the model, and the file is a ShrinkCheckpoint one.
    (In this process, through ``main``: two console-script starts would cost most of the time.)"""
    from stalwart.cli import main
    from stalwart.shrink.container import read_header

    monkeypatch.chdir(tmp_path)  # the config's checkpoint and record folders are relative
    monkeypatch.setattr(sys, "path", list(sys.path))  # main puts the cwd on it
    config = str(ROOT / "examples" / "configs" / "digits_shrink.yaml")
    short = ["--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2"]
    short += ["--trainer.enable_progress_bar=false"]
    # A model unlike the config's: the resume builds the right one only from the file's
    # hyperparameters (with the config's sizes, its weights would not load).
    small = ["--model.init_args.channels=4", "--model.init_args.hidden=32"]
    assert main(["fit", "--config", config, "--trainer.max_epochs=1", *short, *small]) == 0
    folder = tmp_path / "checkpoints" / "digits_cnn"
    first = folder / "epoch=0-step=4.ckpt"
    resume = ["fit", "--config", config, "--trainer.max_epochs=2", *short]
    assert main([*resume, "--ckpt_path", str(first)]) == 0
    header = read_header(folder / "epoch=1-step=8.ckpt")
    assert header is not None and header["base"] is not None  # a delta, not a new keyframe
    assert Path(header["base"]["file"]).name == first.name


def test_plot_to_a_missing_folder_is_a_clear_error_before_plotting(tmp_path, capsys):
    from stalwart.cli import main

    fit_digits([HindsightCallback(dirpath=tmp_path / "runs")], epochs=1)
    out = tmp_path / "nodir" / "x.png"
    assert main(["runs", str(tmp_path / "runs"), "--plot", "train_loss", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stalwart: error: ") and str(out.parent) in err
    assert not out.parent.exists()


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_runs_on_a_damaged_database_is_one_clear_error(tmp_path, capsys, damage):
    from stalwart.cli import main

    fit_digits([HindsightCallback(dirpath=tmp_path / "runs")], epochs=1)
    db = tmp_path / "runs" / "hindsight.db"
    for side in ("-wal", "-shm"):
        Path(f"{db}{side}").unlink(missing_ok=True)
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 3] if damage == "truncated" else b"")
    assert main(["runs", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"stalwart: error: {db} is damaged") and "Traceback" not in err
    assert db.stat().st_size == (len(data) // 3 if damage == "truncated" else 0)


@pytest.mark.parametrize(
    ("source", "said"),
    [
        ("class P(Callback)\n    pass\n", "importing {module} failed with SyntaxError"),
        ("raise RuntimeError('not here')\n", "importing {module} failed with RuntimeError"),
        (
            "class P(Callback):\n    def __init__(self, k):\n        self.k = k\n",
            "the probe class's constructor must take no arguments",
        ),
    ],
    ids=["syntax_error", "raises_on_import", "constructor_needs_arguments"],
)
def test_replay_cli_says_why_a_probe_cannot_be_loaded(tmp_path, monkeypatch, capsys, source, said):
    from stalwart.cli import main

    module = f"broken_probe_{tmp_path.name}"  # a fresh name: no module cached from another case
    (tmp_path / f"{module}.py").write_text(
        "from lightning.pytorch.callbacks import Callback\n" + source
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["replay", "--config", str(CONFIGS[0]), "--probe", f"{module}:P"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"stalwart: error: --probe '{module}:P'") and "Traceback" not in err
    assert said.format(module=module) in err


def test_a_reversed_epoch_range_says_so():
    from stalwart.cli import parse_epochs
    from stalwart.errors import ConfigurationError

    assert parse_epochs("2:4") == [2, 3, 4]
    with pytest.raises(ConfigurationError, match="ends before it starts; .*e.g. 3:5"):
        parse_epochs("5:3")
