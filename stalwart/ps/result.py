"""What one parameter-server run measured: counters, timelines, recoveries, resource use."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stalwart.ps.config import PSConfig
from stalwart.ps.lineage import Record


@dataclass
class PSRunResult:
    """What one run measured. Times are seconds since the workers started."""

    config: PSConfig
    wall: float
    #: When the workers started (epoch seconds); worker push times in ``reports`` are absolute.
    started_at: float = 0.0
    timeline: list[dict] = field(default_factory=list)
    kills: list[dict] = field(default_factory=list)
    #: Scheduled kills the run ended before (``{"at_gradient", "at_seconds", "targets"}``
    #: each): not in ``kills``, whose every entry fired.
    unfired_kills: list[dict] = field(default_factory=list)
    recoveries: list[dict] = field(default_factory=list)
    produced: int = 0
    applied: int = 0
    lost: int = 0
    duplicates: int = 0
    #: Optimizer updates on the committed lineage (an update may consume many gradients).
    updates: int = 0
    #: Updates that merged a backlog: ``{"ref", "gradients", "workers", "scale"}`` each.
    backlogs: list[dict] = field(default_factory=list)
    produced_during_downtime: int = 0
    worker_idle: list[float] = field(default_factory=list)
    worker_cpu_utilisation: float = 0.0
    server_cpu: float = 0.0
    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    store_retries: int = 0
    #: The newest score of the committed weights; None when the run scored nothing (an empty
    #: ``timeline``: no metric), so no accuracy is read where none was measured.
    final_accuracy: float | None = None
    #: The committed weights at the end of the run (flat, as the workload's model orders them).
    weights: torch.Tensor | None = None
    weights_verified: bool | None = None
    reports: list[dict] = field(default_factory=list)
    lineage: list[Record] = field(default_factory=list)

    def time_to_accuracy(self, target: float, window: int = 3) -> float | None:
        """First time the mean test accuracy of the last ``window`` committed weights sampled
        reached ``target`` (None if never). The mean keeps one lucky sample of a noisy curve
        from deciding when a run "got there"."""
        accuracies = [p["accuracy"] for p in self.timeline]
        for i in range(window - 1, len(accuracies)):
            if sum(accuracies[i - window + 1 : i + 1]) / window >= target:
                return self.timeline[i]["t"]
        return None

    def summary(self) -> dict:
        return {
            "mode": self.config.mode, "kills": len(self.kills), "wall_s": round(self.wall, 2),
            "produced": self.produced, "applied": self.applied, "lost": self.lost,
            "applied_twice": self.duplicates, "during_downtime": self.produced_during_downtime,
            "updates": self.updates,
            "backlog_updates": [
                {"gradients": b["gradients"], "workers": b["workers"]} for b in self.backlogs
            ],
            "deferred_kills": sum(bool(k.get("deferred")) for k in self.kills),
            "unfired_kills": len(self.unfired_kills),
            "worker_idle_s": round(sum(self.worker_idle), 2),
            "worker_cpu_util": round(self.worker_cpu_utilisation, 3),
            "server_cpu_s": round(self.server_cpu, 2),
            "peak_rss_mb": {k: round(v, 1) for k, v in self.peak_rss_mb.items()},
            # None when nothing was scored (no metric): 0.0 would read as a model that learned
            # nothing.
            "final_accuracy": (
                None if self.final_accuracy is None else round(self.final_accuracy, 4)
            ),
        }  # fmt: skip
