"""Replayed values, written where the user looks: the loggers the recorded run wrote to.

The hindsight store is the source of truth; this module copies a replay's new series into the
original run's TensorBoard log directory, CSV metrics file and MLflow run, on the same step axis
as the record, under ``replay/<name>`` so they are never mistaken for recorded values. The record
describes its loggers in the manifest (:func:`logger_target` dicts, written by the adapters);
nothing here imports a framework, and a logger whose files were moved or deleted is reported,
never recreated.

A target is a dict with a ``kind``:

* ``{"kind": "tensorboard", "log_dir": ...}``: a new event file in that directory, with the
  points no earlier replay's event file there holds (the first replay of a series keeps it).
* ``{"kind": "csv", "path": ...}``: values put into Lightning's ``metrics.csv`` (columns
  ``epoch``, ``step`` and one per metric) on the row of their (epoch, step), replacing an
  earlier replay's value of the same name and step; the file is rewritten through a
  temporary file.
* ``{"kind": "mlflow", "tracking_uri": ..., "run_id": ...}``: metrics added to that run, and
  its ``stalwart.replays`` tag lists the replays written into it.
* ``{"kind": "unsupported", "name": ...}``: a logger the record could not describe.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from stalwart import durable

#: Replayed series are written under this prefix, so they never pass for recorded values.
REPLAY_PREFIX = "replay/"

#: Manifest key under which a run's loggers are described.
LOGGERS_KEY = "loggers"


def tensorboard_target(log_dir: str | os.PathLike) -> dict[str, Any]:
    return {"kind": "tensorboard", "log_dir": os.path.abspath(log_dir)}


def csv_target(path: str | os.PathLike) -> dict[str, Any]:
    return {"kind": "csv", "path": os.path.abspath(path)}


def mlflow_target(tracking_uri: str, run_id: str) -> dict[str, Any]:
    uri = _absolute_tracking_uri(tracking_uri)
    return {"kind": "mlflow", "tracking_uri": uri, "run_id": run_id}


def unsupported_target(logger: object) -> dict[str, Any]:
    return {"kind": "unsupported", "name": type(logger).__name__}


def _absolute_tracking_uri(uri: str) -> str:
    # A relative file store (file:./mlruns) must still be found from another working directory.
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return "file:" + os.path.abspath(uri[len("file:") :])
    if "://" not in uri and not uri.startswith("file:"):
        return "file:" + os.path.abspath(uri)
    return uri


def write_back(
    points: pd.DataFrame, targets: Iterable[Mapping[str, Any]], replay_id: str
) -> tuple[list[str], list[str]]:
    """Write ``points`` (columns name, epoch, step, value) into every target.

    Returns ``(written, problems)``: a description of each target written, and for each target
    that could not be written, why (the replay itself is unaffected).
    """
    points = points.assign(name=REPLAY_PREFIX + points.name)
    written, problems = [], []
    for target in targets:
        problem = target_problem(target)
        if problem is not None:
            problems.append(problem)
        else:
            written.append(_WRITERS[target["kind"]](points, target, replay_id))
    return written, problems


def target_problem(target: Mapping[str, Any]) -> str | None:
    """Why replayed values cannot be written to ``target`` (None if they can); writes nothing."""
    kind = target.get("kind")
    if kind == "tensorboard":
        if not Path(target["log_dir"]).is_dir():
            return (
                f"TensorBoard log dir {target['log_dir']} no longer exists (moved or deleted); "
                "replayed values stay in the store. Pass loggers=[...] to write them elsewhere."
            )
    elif kind == "csv":
        if not Path(target["path"]).is_file():
            return (
                f"CSV metrics file {target['path']} no longer exists (moved or deleted); "
                "replayed values stay in the store. Pass loggers=[...] to write them elsewhere."
            )
    elif kind == "mlflow":
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        try:
            MlflowClient(tracking_uri=target["tracking_uri"]).get_run(target["run_id"])
        except MlflowException as error:
            return (
                f"MLflow run {target['run_id']} at {target['tracking_uri']} cannot be read "
                f"({error.message}); replayed values stay in the store."
            )
    else:
        return (
            f"{target.get('name', kind)}: stalwart cannot write replayed values to this logger "
            "(TensorBoard, CSV and MLflow are supported); they are in the store."
        )
    return None


def _tensorboard(points: pd.DataFrame, target: Mapping[str, Any], replay_id: str) -> str:
    """A new event file with the points no earlier replay wrote to this directory.

    An event file cannot be rewritten in place, so the first replay of a series keeps its
    points: a (tag, step) already in an earlier replay's event file (``*.replay-<id>``) is
    skipped, and nothing is written when every point is.
    """
    from torch.utils.tensorboard import SummaryWriter

    written = _replayed_tensorboard_points(Path(target["log_dir"]))
    keys = zip(points.name, points.step.astype(int), strict=True)
    points = points.loc[[key not in written for key in keys]]
    if points.empty:
        return f"TensorBoard {target['log_dir']} (already written by an earlier replay)"
    writer = SummaryWriter(log_dir=target["log_dir"], filename_suffix=f".replay-{replay_id}")
    try:
        for row in points.itertuples(index=False):
            writer.add_scalar(row.name, row.value, global_step=int(row.step))
    finally:
        writer.close()
    return f"TensorBoard {target['log_dir']}"


def _replayed_tensorboard_points(log_dir: Path) -> set[tuple[str, int]]:
    """The (tag, step) of every scalar that earlier replays wrote into ``log_dir``."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    points = set()
    for path in log_dir.glob("events.out.tfevents.*.replay-*"):
        for event in EventFileLoader(str(path)).Load():
            if event.HasField("summary"):
                points.update((value.tag, int(event.step)) for value in event.summary.value)
    return points


def _csv(points: pd.DataFrame, target: Mapping[str, Any], replay_id: str) -> str:
    """Replayed values into ``metrics.csv``, one per name and step.

    A value goes on the first row of its (epoch, step) (beside the record's values of that
    batch), or on a new row when there is none. A series replayed again replaces the values an
    earlier replay wrote at the same steps; rows left with no value are dropped.
    """
    path = Path(target["path"])
    merged = _merge_csv(pd.read_csv(path), points)
    durable.write_text(path, merged.to_csv(index=False))
    return f"CSV {path}"


def _merge_csv(existing: pd.DataFrame, points: pd.DataFrame) -> pd.DataFrame:
    for name, steps in points.groupby("name").step:
        if name not in existing:
            existing[name] = float("nan")
        existing.loc[existing.step.isin(steps), name] = float("nan")
    rows = {}
    for index, epoch, step in zip(existing.index, existing.epoch, existing.step, strict=True):
        if not (pd.isna(epoch) or pd.isna(step)):
            rows.setdefault((int(epoch), int(step)), index)
    pending = []
    for point in points.itertuples(index=False):
        index = rows.get((int(point.epoch), int(point.step)))
        if index is None:
            pending.append(point)
        else:
            existing.at[index, point.name] = point.value
    if pending:
        # One row per (epoch, step), one column per replayed series: the layout Lightning writes.
        wide = pd.DataFrame(pending).pivot_table(
            index=["epoch", "step"], columns="name", values="value"
        )
        wide = wide.reset_index()
        wide.columns.name = None
        existing = pd.concat([existing, wide], ignore_index=True)
    values = existing.drop(columns=["epoch", "step"], errors="ignore")
    return existing.loc[values.notna().any(axis=1)].reset_index(drop=True)


def _mlflow(points: pd.DataFrame, target: Mapping[str, Any], replay_id: str) -> str:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=target["tracking_uri"])
    run_id = target["run_id"]
    now = int(time.time() * 1000)
    metrics = [
        Metric(row.name, float(row.value), now, int(row.step))
        for row in points.itertuples(index=False)
    ]
    for start in range(0, len(metrics), 1000):  # MLflow's batch limit
        client.log_batch(run_id, metrics=metrics[start : start + 1000])
    replays = client.get_run(run_id).data.tags.get("stalwart.replays", "")
    client.set_tag(run_id, "stalwart.replays", ",".join(filter(None, [replays, replay_id])))
    return f"MLflow run {run_id} ({target['tracking_uri']})"


_WRITERS = {"tensorboard": _tensorboard, "csv": _csv, "mlflow": _mlflow}
