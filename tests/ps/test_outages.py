"""Long outages: the stateless PS turns the work done while it was down into progress.

Real processes and real SIGKILLs, as in ``test_failures.py``; the audit trail in the store
(``keep_gradients=True``) checks every claim on the weights themselves.
"""

from __future__ import annotations

import os

import pytest

from stalwart.errors import ConfigurationError
from stalwart.ps.config import KillEvent, PSConfig
from stalwart.ps.runner import run_training

SMALL = {"hidden": 32, "batch_size": 16, "keep_gradients": True}


def _during(result, kill: dict) -> int:
    """Gradients pushed while the PS was down (between the kill and the recovery)."""
    return sum(
        kill["killed"] <= t - result.started_at <= kill["recovered"]
        for report in result.reports
        for _, t, _ in report["pushed"]
    )


def test_stateless_beats_checkpointing_when_the_run_ends_right_after_long_outages(tmp_path):
    # Two 2 s outages, 0.2 s apart; the run stops 0.45 s after the second restart. Both modes
    # are killed at the same wall-clock times and train for the same time, but checkpoint-async
    # trains only while its PS is up: ~0.9 s of the 4.95 (less the updates each restart rolls
    # back). With 1.45 s up (kills at 0.5 s and 3.0 s) a fast machine gave it enough updates to
    # reach this small CNN's ceiling (0.86-0.94, 2026-11-30), within the swing of the stateless
    # run's last update, which merges two trajectories of hundreds of local steps and can cost
    # accuracy (0.76-0.90 seen when the run ended 0.3 s after the restart; 0.875 against 0.928
    # failed this test once). With ~0.9 s up it stays well below (the numbers are below).
    downtime, kills_at = 2.0, (0.3, 2.5)
    duration = kills_at[-1] + downtime + 0.45
    results = {}
    for mode in ("stateless", "checkpoint-async"):
        config = PSConfig(
            mode=mode, workers=2, steps=100_000, duration=duration, lr=0.1, seed=3,
            kills=[KillEvent(at_seconds=t, downtime=downtime) for t in kills_at],
            run_dir=str(tmp_path / mode), **SMALL,
        )  # fmt: skip
        results[mode] = run_training(config)
    stateless, checkpoint = results["stateless"], results["checkpoint-async"]

    for kill in stateless.kills:
        assert _during(stateless, kill) >= 200  # a real backlog piled up in each outage
    assert duration - stateless.kills[-1]["recovered"] <= 0.5  # the run ended right after
    # Every gradient applied exactly once, and the weights are the replay of the audit log.
    assert stateless.lost == 0 and stateless.duplicates == 0
    assert stateless.applied == stateless.produced
    assert stateless.weights_verified is True
    # Each outage's backlog became the mean of the two workers' local trajectories: an update
    # that consumed hundreds of gradients at scale 1/2 (the old rule: 1/backlog, one SGD step).
    assert len(stateless.backlogs) >= 2
    for backlog in sorted(stateless.backlogs, key=lambda b: -b["gradients"])[:2]:
        assert backlog["gradients"] >= 200 and backlog["workers"] == 2
        assert backlog["scale"] == 0.5
        # The recovered PS read the outage's work as the workers' trails (running sums), not
        # gradient by gradient: only what each worker pushed before its trail started (the
        # trail.TRAIL_AFTER local steps and any lag before them) and after the trail's last write
        # came one by one. The audit replay above sums the same spans, bit for bit.
        singles = backlog["gradients"] - backlog["trailed"]
        assert 0 <= singles <= 0.2 * backlog["gradients"]
    assert stateless.updates < stateless.applied  # counters tell updates from gradients
    summary = stateless.summary()
    assert summary["updates"] == stateless.updates
    assert max(b["gradients"] for b in summary["backlog_updates"]) >= 200
    # The point of it all: the outages' work is progress. The stateless run applied every
    # gradient its workers produced, through both outages (1300-2800 in eight loaded runs with
    # the earlier kills, 5000-5300 in five fast ones with these); checkpoint-async's workers
    # waited for a PS that was down, and its restarts rolled back what they had done since the
    # last checkpoint (140-390 applied then, 219-238 now: 5 to 24 times fewer).
    assert stateless.applied >= 3 * checkpoint.applied
    # So the stateless weights learned the task (0.94-0.99 in those runs; chance is 0.1), and
    # beat checkpoint-async's (0.33-0.74, once 0.93, with the earlier kills; 0.46-0.71 with
    # these). The floor is set well below those: a merge of two long trajectories can cost
    # accuracy (0.73-0.90 seen when fewer updates followed it), and a run's last sample swings
    # with its last updates.
    assert stateless.final_accuracy > 0.5
    assert stateless.final_accuracy >= checkpoint.final_accuracy


def test_a_kill_passed_while_the_ps_is_down_is_deferred_and_the_final_backlog_merged(tmp_path):
    # 2 workers x 50 steps: they never wait, so they produce the remaining 80 gradients during
    # the first 3 s outage (the backlog ends the run; ~1 s of work on an idle machine, so a
    # loaded one has room). The second kill's trigger (gradient 80) is passed while the PS is
    # down: it fires once the PS is back, after the workers have finished.
    config = PSConfig(
        mode="stateless", workers=2, steps=50, lr=0.1,
        kills=[KillEvent(20, 3.0), KillEvent(80, 0.5)], run_dir=str(tmp_path / "run"), **SMALL,
    )  # fmt: skip
    result = run_training(config)
    first, second = result.kills
    last_push = max(t - result.started_at for r in result.reports for _, t, _ in r["pushed"])
    assert last_push < first["recovered"]  # the premise: the outage's backlog ended the run
    assert not first["deferred"] and second["deferred"]
    assert second["killed"] > first["recovered"]  # never on top of the first outage
    assert second["produced_at_kill"] == 100  # the workers had finished
    assert result.produced == result.applied == 100 and result.lost == 0
    assert result.duplicates == 0 and result.weights_verified is True
    assert result.summary()["deferred_kills"] == 1
    # The backlog that ended the run was merged like one in the middle: one update of both
    # workers' trajectories, their mean, holding everything pushed while the PS was down.
    final = max(result.backlogs, key=lambda b: b["gradients"])
    assert final["gradients"] >= _during(result, first) >= 40
    assert final["workers"] == 2 and final["scale"] == 0.5
    # Any other backlog (a worker that started first and pushed a few before the PS caught up)
    # is the mean of the trajectories it holds, never the old one-step rule.
    assert all(b["scale"] == 1 / b["workers"] for b in result.backlogs)
    assert [e["source"] for e in result.recoveries] == ["store"] * 3


def test_a_kill_list_that_cannot_fire_is_rejected_before_any_process_starts(tmp_path):
    run_dir = tmp_path / "run"
    config = PSConfig(
        mode="stateless", duration=5.0, run_dir=str(run_dir),
        kills=[KillEvent(at_seconds=2.0, downtime=3.5), KillEvent(at_seconds=4.0, downtime=0.5)],
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match=r"4.0 s can never fire.*down until at least 5.5"):
        run_training(config)
    assert not os.path.exists(run_dir)  # nothing started, nothing written


def test_a_deferred_kill_that_still_fits_the_run_is_accepted():
    config = PSConfig(
        duration=10.0,
        kills=[KillEvent(at_seconds=2.0, downtime=3.0), KillEvent(at_seconds=4.0, downtime=1.0)],
    )
    config.validate()  # fires at 5 s at the earliest, before the end
