"""Replayed values land in the loggers the recorded run wrote to, read back with their own tools.

Real packages throughout: Lightning's TensorBoardLogger, CSVLogger and MLFlowLogger recording
into files under tmp_path (a local MLflow file store, no server), read back with TensorBoard's
event reader, pandas and MLflow's client.
"""

from __future__ import annotations

import os
import shutil

import lightning as L
import numpy as np
import pandas as pd
import pytest
from digits import DigitsClassifier, DigitsDataModule
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import stalwart
from stalwart import HindsightCallback
from tests.helpers import EpochProbe, GradProbe

EPOCHS = 3


def fresh():
    L.seed_everything(5)
    return DigitsClassifier(width=16), DigitsDataModule(batch_size=128, train_size=640)


def trainer_for(root, loggers=False) -> stalwart.Trainer:
    return stalwart.Trainer(
        max_epochs=EPOCHS,
        callbacks=[HindsightCallback(dirpath=root / "runs")],
        logger=loggers,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )


@pytest.fixture(autouse=True)
def _mlflow_file_store(monkeypatch):
    # MLflow 3 keeps its file store for those who opt in; that is what a local run without a
    # server uses.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


@pytest.fixture
def recorded(tmp_path):
    """A run recorded with all three loggers; returns (root, loggers)."""
    loggers = [
        TensorBoardLogger(tmp_path / "tb", name="digits"),
        CSVLogger(tmp_path / "csv", name="digits"),
        MLFlowLogger(experiment_name="digits", tracking_uri=f"file:{tmp_path / 'mlruns'}"),
    ]
    trainer_for(tmp_path, loggers).fit(*fresh())
    return tmp_path, loggers


def csv_of(logger) -> pd.DataFrame:
    return pd.read_csv(os.path.join(logger.log_dir, "metrics.csv"))


def steps_of(frame: pd.DataFrame, column: str, epochs) -> list[int]:
    rows = frame[frame[column].notna() & frame.epoch.isin(epochs)]
    return rows.step.astype(int).tolist()


def test_replayed_values_land_in_tensorboard_csv_and_mlflow_on_the_records_step_axis(recorded):
    root, (tb, csv, mlf) = recorded
    recorded_csv = csv_of(csv)
    inner = trainer_for(root).replay(*fresh(), probe=GradProbe(), epochs=[1, 2])
    outer = trainer_for(root).replay(*fresh(), probe=EpochProbe())
    assert inner.logger_problems == [] and outer.logger_problems == []
    assert len(inner.logged_to) == 3

    grad = inner.metrics("grad_norm")
    w_norm = outer.metrics("w_norm")
    # The original run's step axis: where Lightning put the record's per-batch train_loss and
    # the epoch-level val_loss of the same epochs.
    batch_steps = steps_of(recorded_csv, "train_loss", [1, 2])
    epoch_steps = steps_of(recorded_csv, "val_loss", range(EPOCHS))
    assert len(batch_steps) == len(grad) == 2 * 5

    # TensorBoard: a new event file in the run's own log dir, read with TensorBoard's reader.
    events = EventAccumulator(tb.log_dir)
    events.Reload()
    scalars = events.Scalars("replay/grad_norm")
    assert [s.step for s in scalars] == batch_steps
    assert [s.value for s in scalars] == grad.value.astype(np.float32).tolist()
    assert [s.step for s in events.Scalars("replay/w_norm")] == epoch_steps
    assert "train_loss" in events.Tags()["scalars"]  # the record's own series are still there

    # CSV: the same metrics.csv, new columns; every recorded row kept as it was.
    after = csv_of(csv)
    pd.testing.assert_frame_equal(after[recorded_csv.columns].iloc[: len(recorded_csv)],
                                  recorded_csv)  # fmt: skip
    assert steps_of(after, "replay/grad_norm", [1, 2]) == batch_steps
    assert after["replay/grad_norm"].dropna().tolist() == grad.value.tolist()
    assert steps_of(after, "replay/w_norm", range(EPOCHS)) == epoch_steps
    assert after["replay/w_norm"].dropna().tolist() == w_norm.value.tolist()

    # MLflow: the recorded run itself, tagged with the replays written into it.
    client = MlflowClient(f"file:{root / 'mlruns'}")
    history = client.get_metric_history(mlf.run_id, "replay/grad_norm")
    assert [m.step for m in history] == batch_steps
    assert [m.value for m in history] == grad.value.tolist()
    assert [m.step for m in client.get_metric_history(mlf.run_id, "replay/w_norm")] == epoch_steps
    tag = client.get_run(mlf.run_id).data.tags["stalwart.replays"]
    assert tag.split(",") == [inner.replay_id, outer.replay_id]


def test_loggers_none_writes_only_the_store_and_a_list_writes_there(recorded, tmp_path):
    root, (_, csv, _) = recorded
    before = csv_of(csv)
    alone = trainer_for(root).replay(*fresh(), probe=EpochProbe(), loggers=None)
    assert alone.logged_to == [] and len(alone.metrics("w_norm")) == EPOCHS
    pd.testing.assert_frame_equal(csv_of(csv), before)

    elsewhere = CSVLogger(tmp_path / "elsewhere", name="replays")
    result = trainer_for(root).replay(*fresh(), probe=EpochProbe(), loggers=[elsewhere])
    assert result.logged_to == [f"CSVLogger {elsewhere.log_dir}"]
    assert csv_of(elsewhere)["replay/w_norm"].tolist() == result.metrics("w_norm").value.tolist()
    pd.testing.assert_frame_equal(csv_of(csv), before)

    with pytest.raises(stalwart.errors.ConfigurationError, match="not a Lightning logger"):
        trainer_for(root).replay(*fresh(), probe=EpochProbe(), loggers=["csv"])


def test_a_replay_whose_logger_files_moved_still_works_and_names_them(recorded, tmp_path):
    root, (tb, csv, mlf) = recorded
    shutil.move(tb.log_dir, tmp_path / "tb_moved")
    os.remove(os.path.join(csv.log_dir, "metrics.csv"))

    plan = trainer_for(root).replay(*fresh(), probe=GradProbe(), epochs=[2], dry_run=True)
    assert len(plan.logger_problems) == 2
    assert tb.log_dir in plan.logger_problems[0] and "no longer exists" in plan.logger_problems[0]
    assert "metrics.csv" in plan.logger_problems[1]
    assert "cannot write to a logger of the record" in str(plan)

    with pytest.warns(UserWarning) as caught:
        result = trainer_for(root).replay(*fresh(), probe=GradProbe(), epochs=[2])
    said = [str(w.message) for w in caught]
    assert any("TensorBoard log dir" in m and "no longer exists" in m for m in said)
    assert any("CSV metrics file" in m and "no longer exists" in m for m in said)
    assert len(result.metrics("grad_norm")) == 5  # the store has every value
    assert result.logged_to == [f"MLflow run {mlf.run_id} (file:{root / 'mlruns'})"]
    assert not os.path.exists(tb.log_dir)  # nothing recreated where the user moved it from
    assert not os.path.exists(os.path.join(csv.log_dir, "metrics.csv"))


def test_composer_replay_writes_into_the_records_tensorboard_run(tmp_path):
    from composer.loggers import TensorboardLogger
    from composer_digits import WeightNormProbe, make_trainer

    from stalwart.algorithms import Hindsight, replay

    hindsight = Hindsight(tmp_path / "runs")

    def factory(**overrides):
        kwargs = {"loggers": [TensorboardLogger(log_dir=str(tmp_path / "tb"))], **overrides}
        return make_trainer(epochs=4, algorithms=[hindsight], **kwargs)

    factory().fit()
    (run_dir,) = (tmp_path / "tb").iterdir()  # Composer's run-name folder

    result = replay(factory, probe=WeightNormProbe(), epochs=[2, 3])
    assert result.logged_to == [f"TensorBoard {run_dir}"]
    assert list((tmp_path / "tb").iterdir()) == [run_dir]  # no new run folder for the replay
    events = EventAccumulator(str(run_dir))
    events.Reload()
    scalars = events.Scalars("replay/probe/weight_norm")
    assert [s.value for s in scalars] == (
        result.metrics("probe/weight_norm").value.astype(np.float32).tolist()
    )

    # The step axis is the one Composer itself would have used, had the probe been there.
    truth_logger = TensorboardLogger(log_dir=str(tmp_path / "truth"))
    make_trainer(epochs=4, callbacks=[WeightNormProbe()], loggers=[truth_logger]).fit()
    (truth_dir,) = (tmp_path / "truth").iterdir()
    truth = EventAccumulator(str(truth_dir))
    truth.Reload()
    everything = truth.Scalars("probe/weight_norm")
    assert len(everything) == 4 * 11  # 11 batches per epoch
    expected = everything[2 * 11 :]  # epochs 2 and 3
    assert [s.step for s in scalars] == [s.step for s in expected]
    assert [s.value for s in scalars] == [s.value for s in expected]
