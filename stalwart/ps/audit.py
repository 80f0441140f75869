"""The end-of-run audit: walk the committed lineage and the workers' reports into a result.

Every gradient has an id ``(worker, step)``. The workers' reports say which were produced and
when; the lineage of the committed head (:mod:`stalwart.ps.lineage`) says which were applied.
From the two: gradients lost, applied twice, produced while the PS was down; and, for an audited
run (``keep_gradients``), whether replaying the log reproduces the committed weights bit for bit.
"""

from __future__ import annotations

import json
import os

import torch

from stalwart.ps import layout
from stalwart.ps.config import PSConfig
from stalwart.ps.failure import Kill
from stalwart.ps.lineage import Record, head_lineage, head_state, replay
from stalwart.ps.resources import ResourceUsage
from stalwart.ps.result import PSRunResult
from stalwart.ps.store import KeyValueStore
from stalwart.ps.worker import report_path


def read_reports(run_dir: str, workers: int) -> list[dict]:
    """The reports the workers wrote (a worker killed before writing one has none)."""
    reports = []
    for worker in range(workers):
        path = report_path(run_dir, worker)
        if os.path.exists(path):
            with open(path) as handle:
                reports.append(json.load(handle))
    return reports


def recoveries(store: KeyValueStore) -> list[dict]:
    """How each PS incarnation started (``event/E``), oldest first."""
    events = []
    for epoch in range(1, store.add(layout.EPOCH, 0) + 1):
        raw = store.get(layout.event(epoch))
        if raw is not None:
            events.append(json.loads(raw))
    return events


def _count_gradients(result: PSRunResult, reports: list[dict], lineage: list[Record]) -> None:
    applied_ids = [i for record in lineage for i in record.ids]
    produced_ids = {(r["worker"], k) for r in reports for k, _, _ in r["pushed"]}
    result.produced = len(produced_ids)
    result.applied = len(set(applied_ids))
    result.duplicates = len(applied_ids) - len(set(applied_ids))
    result.lost = len(produced_ids - set(applied_ids))
    result.updates = len(lineage)
    # "trailed": how many of a backlog's gradients the PS read as workers' running sums.
    result.backlogs = [
        {
            "ref": r.ref, "gradients": len(r.ids), "workers": r.merged, "scale": r.scale,
            "trailed": sum(end - start for start, end in r.sums),
        }
        for r in lineage
        if r.merged
    ]  # fmt: skip


def _record_kills(result: PSRunResult, kills: list[Kill], reports: list[dict]) -> None:
    t0 = result.started_at
    for kill in kills:
        assert kill.killed_at is not None and kill.restarted_at is not None
        # Down until a PS has recovered and committed again (a chain takeover: at once).
        recovered = min(
            (e["committed"] for e in result.recoveries if e["committed"] > kill.killed_at),
            default=kill.restarted_at,
        )
        result.kills.append({
            "at_gradient": kill.event.at_gradient, "at_seconds": kill.event.at_seconds,
            "targets": list(kill.event.targets),
            "produced_at_kill": kill.produced, "killed": kill.killed_at - t0,
            "restarted": kill.restarted_at - t0, "recovered": recovered - t0,
            "pids": kill.pids, "deferred": kill.deferred,
            "due": None if kill.due_at is None else kill.due_at - t0,
        })  # fmt: skip
        result.produced_during_downtime += sum(
            kill.killed_at <= t <= recovered for r in reports for _, t, _ in r["pushed"]
        )


def audit(
    store: KeyValueStore,
    config: PSConfig,
    *,
    started_at: float,
    wall: float,
    kills: list[Kill],
    timeline: list[dict],
    resources: ResourceUsage,
) -> PSRunResult:
    """The :class:`PSRunResult` of a finished run whose store is still up.

    Args:
        store: the run's store.
        config: the run.
        started_at: when the workers started (epoch seconds).
        wall: seconds from the start until the server drained the last gradients.
        kills: what the failure injector did.
        timeline: the accuracy samples (:class:`stalwart.ps.timeline.AccuracyTimeline`).
        resources: the processes' CPU and memory.
    """
    reports = read_reports(config.run_dir, config.workers)
    lineage = head_lineage(store)
    result = PSRunResult(
        config, wall, started_at, timeline=timeline, reports=reports, lineage=lineage
    )
    _count_gradients(result, reports, lineage)
    result.recoveries = recoveries(store)
    _record_kills(result, kills, reports)
    result.worker_idle = [r["idle"] for r in reports]
    result.worker_cpu_utilisation = resources.worker_cpu_utilisation
    result.server_cpu = resources.server_cpu
    result.peak_rss_mb = resources.peak_rss_mb
    result.store_retries = sum(r["retries"] for r in reports)
    result.final_accuracy = timeline[-1]["accuracy"] if timeline else None
    _, _, result.weights = head_state(store)
    if config.keep_gradients:
        result.weights_verified = torch.equal(replay(store, lineage), result.weights)
    return result
