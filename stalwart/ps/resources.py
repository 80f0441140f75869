"""What the run's processes cost: peak memory sampled while they live, CPU time once reaped."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

#: Roles whose peak memory a run reports.
REPORTED_ROLES = ("ps", "replica", "worker", "store")
SERVER_ROLES = ("ps", "replica")


def peak_rss_kb(pid: int) -> int:
    """The peak resident set of process ``pid`` in KiB (0 if unknown or already gone; Linux)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Measured(Protocol):
    """What :func:`usage` reads of a process (a :class:`stalwart.ps.processes.ChildProcess`)."""

    role: str
    started: float
    ended: float | None
    cpu: float
    peak_kb: int


@dataclass
class ResourceUsage:
    """CPU and memory of a run's processes.

    Attributes:
        worker_cpu_utilisation: the workers' CPU seconds over the seconds they were alive.
        server_cpu: CPU seconds of every PS and replica process, killed ones included.
        peak_rss_mb: the largest peak resident set per role, MiB.
    """

    worker_cpu_utilisation: float = 0.0
    server_cpu: float = 0.0
    peak_rss_mb: dict[str, float] = field(default_factory=dict)


def usage(processes: Iterable[Measured], workers: Iterable[Measured]) -> ResourceUsage:
    """The :class:`ResourceUsage` of ``processes``, of which ``workers`` are the workers."""
    processes, workers = list(processes), list(workers)
    busy = sum(p.cpu for p in workers)
    alive = sum((p.ended or time.time()) - p.started for p in workers)
    peaks = {}
    for role in REPORTED_ROLES:
        sizes = [p.peak_kb for p in processes if p.role == role and p.peak_kb]
        if sizes:
            peaks[role] = max(sizes) / 1024
    return ResourceUsage(
        worker_cpu_utilisation=busy / alive if alive else 0.0,
        server_cpu=sum(p.cpu for p in processes if p.role in SERVER_ROLES),
        peak_rss_mb=peaks,
    )
