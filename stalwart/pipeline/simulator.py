"""Event-driven preemption simulator: redundant pipelines vs checkpoint/restart vs on-demand.

Thesis §3.6.2: input a preemption process (hourly preemption probability per node, bulk
preemptions within a zone, random hourly allocation probabilities, or a recorded trace of
``(time, add|remove, node)`` rows), the measured step throughput and the recovery,
reconfiguration and restart costs; output throughput, cost, value (= throughput / cost),
fatal failures and the useful-time share, averaged over many runs.

Model (the same spot market for both spot strategies):

* Redundant pipelines (Bamboo): up to D pipelines of depth P (= 1.5 x the on-demand depth).
  A lost node whose predecessor is alive is absorbed by failover (a short pause, then the
  pipeline runs slower while the shadow does two stages' work). Two consecutive losses in a
  pipeline, or a loss next to an absorbed one, need a reconfiguration: standby nodes fill the
  holes, else the pipeline is dissolved and its nodes wait on standby (pipelines stay
  symmetric). When no pipeline is left, that is a fatal failure: roll back to the last
  checkpoint and wait for nodes. At step boundaries standby nodes repair degraded pipelines or
  form new ones; the cluster never exceeds P x D nodes.
* Checkpoint/restart: pipelines of the on-demand depth; every preemption of a working node
  stops training, rolls back to the last checkpoint and pays a restart.
* On-demand: the same on-demand pipelines at the on-demand price, never preempted.

Example:
    >>> s = SimulationSettings(runs=20, work_hours=2.0)
    >>> row = simulate(0.10, s)["bamboo"]
    >>> row.value > simulate(0.10, s)["on-demand"].value
    True
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from stalwart.errors import ConfigurationError


@dataclass
class SimulationSettings:
    """Cluster, costs and market. Defaults follow the thesis' BERT-large setting (Table 3.1).

    Args:
        num_stages: Bamboo pipeline depth P.
        demand_stages: on-demand (and checkpoint/restart) pipeline depth.
        num_pipelines: D.
        pipeline_throughput: samples/s of one healthy on-demand pipeline.
        rc_overhead: per-step slowdown of redundant computation (eager FRC), e.g. 0.1977.
        failover_slowdown: step-time factor of a pipeline whose shadow runs two stages.
        recovery_seconds: pause of a failover (shadow takes over, lazy BRC of one step).
        reconfig_seconds: pause of a reconfiguration (re-form pipelines, move layers).
        restart_seconds: checkpoint/restart: restart the job and load the checkpoint.
        checkpoint_minutes: checkpoint interval (both spot strategies).
        zones: availability zones; a preemption event hits one zone.
        bulk_mean: mean number of nodes one preemption event takes.
        allocation_max: each hour draws an allocation probability in [0, allocation_max] that
            a missing node is granted within the hour.
        spot_price / demand_price: $ per node-hour.
        work_hours: amount of training, in hours of the on-demand cluster's work.
        max_hours: give up after this much wall time.
        runs: simulations per setting.
        seed: base random seed.
    """

    num_stages: int = 12
    demand_stages: int = 8
    num_pipelines: int = 4
    pipeline_throughput: float = 27.0
    rc_overhead: float = 0.1977
    failover_slowdown: float = 1.25
    recovery_seconds: float = 20.0
    reconfig_seconds: float = 120.0
    restart_seconds: float = 600.0
    checkpoint_minutes: float = 30.0
    zones: int = 3
    bulk_mean: float = 2.0
    allocation_max: float = 0.9
    spot_price: float = 0.918
    demand_price: float = 3.06
    work_hours: float = 12.0
    max_hours: float = 240.0
    runs: int = 1000
    seed: int = 0

    def validate(self) -> SimulationSettings:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "seed" and not value > 0 and f.name != "rc_overhead":
                raise ConfigurationError(f"{f.name}={value}: must be positive.")
        if self.rc_overhead < 0 or self.failover_slowdown < 1:
            raise ConfigurationError("rc_overhead must be >= 0 and failover_slowdown >= 1.")
        return self


@dataclass
class Row:
    """Averages over the runs of one strategy at one preemption probability."""

    strategy: str
    probability: float
    preemptions: float
    fatal_failures: float
    nodes: float
    throughput: float
    cost: float
    value: float
    useful_share: float
    hours: float


Event = tuple[float, str, int, int]  # (hour, "add" | "remove", node, zone)


class MarketProcess:
    """Random spot market: bulk preemptions (one zone per event) at hourly probability ``p``
    per node; allocations at an hourly probability redrawn every hour.

    ``next_event`` returns ``(hour, kind, arg)``: ``("add", zone|None)``,
    ``("remove-bulk", k)``, or ``("tick", 0)`` on the hour.
    """

    def __init__(self, p: float, s: SimulationSettings, rng: random.Random, target: int):
        if not 0 <= p < 1:
            raise ConfigurationError(f"preemption probability {p}: use a value in [0, 1).")
        self.rate = -math.log1p(-p)  # per node-hour
        self.s, self.rng, self.target = s, rng, target
        self.alloc_rate = 0.0
        self.hour = -1

    def next_event(self, now: float, alive: int) -> tuple[float, str, int | None]:
        rng, s = self.rng, self.s
        if int(now) != self.hour:  # a new hour: a new allocation probability
            self.hour = int(now)
            self.alloc_rate = -math.log1p(-min(rng.uniform(0, s.allocation_max), 0.999))
        alloc = self.alloc_rate * max(0, self.target - alive)
        remove = self.rate * alive / s.bulk_mean
        total = alloc + remove
        boundary = math.floor(now) + 1.0
        if total <= 0:
            return boundary, "tick", 0
        when = now + rng.expovariate(total)
        if when >= boundary:  # memoryless: redraw from the hour boundary
            return boundary, "tick", 0
        if rng.random() * total < alloc:
            return when, "add", None
        k = 1 + int(rng.expovariate(1.0 / (s.bulk_mean - 1))) if s.bulk_mean > 1 else 1
        return when, "remove-bulk", k


class TraceMarket:
    """A recorded trace: ``add`` grants node ``n`` (in ``zone``), ``remove`` preempts it."""

    def __init__(self, events: Sequence[Event]) -> None:
        self.events = sorted(events)
        self.i = 0
        self.target = 0

    def next_event(self, now: float, alive: int) -> tuple[float, str, int | None]:
        if self.i >= len(self.events):
            return now + 1.0, "tick", 0
        t, kind, node, zone = self.events[self.i]
        self.i += 1
        return max(t, now), "add" if kind == "add" else "remove-node", (node, zone)


class _Cluster:
    """Nodes of one run: ``zone[node]``; helpers to add and remove in bulk from one zone."""

    def __init__(self, rng: random.Random, zones: int) -> None:
        self.rng, self.zones = rng, zones
        self.zone: dict[int, int] = {}
        self.next_id = 0

    def add(self, arg: object = None) -> int:
        """A new node: a fresh id and random zone, or a trace's ``(node, zone)``."""
        if isinstance(arg, tuple):
            node, zone = arg
        else:
            node, zone = self.next_id, self.rng.randrange(self.zones)
            self.next_id += 1
        self.zone[node] = zone
        return node

    def remove(self, kind: str, arg: object) -> list[int]:
        if kind == "remove-node":
            node = arg[0]
            return [node] if self.zone.pop(node, None) is not None else []
        return self.remove_bulk(arg)

    def remove_bulk(self, k: int) -> list[int]:
        if not self.zone:
            return []
        victims_zone = self.zone[self.rng.choice(list(self.zone))]
        candidates = [n for n, z in self.zone.items() if z == victims_zone]
        victims = self.rng.sample(candidates, min(int(k), len(candidates)))
        for n in victims:
            del self.zone[n]
        return victims


def _order_by_zone(nodes: list[int], zone: dict[int, int]) -> list[int]:
    """Round-robin over zones so consecutive pipeline stages come from different zones."""
    by_zone: dict[int, list[int]] = {}
    for n in nodes:
        by_zone.setdefault(zone[n], []).append(n)
    out: list[int] = []
    queues = sorted(by_zone.values(), key=len, reverse=True)
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop())
    return out


class _Run:
    """Shared accounting: progress in samples, pauses, checkpoints, cost."""

    def __init__(self, s: SimulationSettings, target_samples: float) -> None:
        self.s = s
        self.t = 0.0
        self.samples = 0.0
        self.checkpoint = 0.0
        self.next_checkpoint = s.checkpoint_minutes / 60
        self.paused_until = 0.0
        self.cost = 0.0
        self.node_hours = 0.0
        self.progress_hours = 0.0
        self.wasted_hours = 0.0
        self.since_checkpoint_hours = 0.0
        self.target = target_samples
        self.fatal = 0
        self.preemptions = 0

    def advance(self, until: float, rate: float, allocated: int) -> bool:
        """Move time to ``until``; return True when the work is done."""
        while self.t < until:
            step_end = min(until, self.next_checkpoint)
            dt = step_end - self.t
            self.cost += dt * allocated * self.s.spot_price
            self.node_hours += dt * allocated
            run_from = max(self.t, self.paused_until)
            work = max(0.0, step_end - run_from) if rate > 0 else 0.0
            if work > 0:
                need = (self.target - self.samples) / (rate * 3600)
                if need <= work:
                    self.cost -= (work - need) * allocated * self.s.spot_price
                    self.node_hours -= (work - need) * allocated
                    self.samples = self.target
                    self.progress_hours += need
                    self.t = run_from + need
                    return True
                self.samples += rate * 3600 * work
                self.progress_hours += work
                self.since_checkpoint_hours += work
            self.t = step_end
            if self.t >= self.next_checkpoint:
                self.checkpoint = self.samples
                self.since_checkpoint_hours = 0.0
                self.next_checkpoint += self.s.checkpoint_minutes / 60
        return False

    def pause(self, seconds: float) -> None:
        self.paused_until = max(self.paused_until, self.t) + seconds / 3600

    def roll_back(self) -> None:
        self.samples = self.checkpoint
        self.wasted_hours += self.since_checkpoint_hours
        self.since_checkpoint_hours = 0.0


def _simulate_bamboo(market, s: SimulationSettings, rng: random.Random, target: float) -> dict:
    P, D = s.num_stages, s.num_pipelines
    cluster = _Cluster(rng, s.zones)
    run = _Run(s, target)
    pipelines: list[list[int]] = []  # node per position (fewer than P after a shrink)
    holes: list[set[int]] = []  # failed-over positions per pipeline (the shadow covers them)
    standby: list[int] = []
    per_pipeline = s.pipeline_throughput / (1 + s.rc_overhead)

    def rate() -> float:
        return sum(
            per_pipeline * min(1.0, len(pl) / P) / (s.failover_slowdown if h else 1.0)
            for pl, h in zip(pipelines, holes, strict=True)
        )

    def reconfigure() -> None:
        """Step-boundary policy (thesis §3.7): reconfigure only when the standby nodes can
        restore every pipeline to full depth, can form a new pipeline, or when every pipeline
        is degraded (one more loss could be fatal). Then fill holes, regrow shrunken
        pipelines and form new full-depth ones, in one pause."""
        missing = sum(len(h) + P - len(pl) for pl, h in zip(pipelines, holes, strict=True))
        trigger = (
            (missing and len(standby) >= missing)
            or (len(pipelines) < D and len(standby) >= P + missing)
            or (pipelines and standby and all(holes))
        )
        if not trigger:
            return
        changed = False
        for pl, h in zip(pipelines, holes, strict=True):
            while h and standby:
                pl[h.pop()] = standby.pop()
                changed = True
            while len(pl) < P and standby:
                pl.append(standby.pop())
                changed = True
        while len(pipelines) < D and len(standby) >= P:
            ordered = _order_by_zone(standby, cluster.zone)
            pipelines.append(ordered[:P])
            holes.append(set())
            standby[:] = ordered[P:]
            changed = True
        if changed:
            run.pause(s.reconfig_seconds)

    if isinstance(market, MarketProcess):
        standby.extend(cluster.add() for _ in range(P * D))
        reconfigure()
        run.paused_until = 0.0
    while run.t < s.max_hours:
        when, kind, arg = market.next_event(run.t, len(cluster.zone))
        if run.advance(when, rate(), len(cluster.zone)):
            break
        if kind == "add":
            if len(cluster.zone) < P * D:  # never more than P x D nodes
                standby.append(cluster.add(arg))
        elif kind.startswith("remove"):
            lost = set(cluster.remove(kind, arg))
            run.preemptions += len(lost)
            standby[:] = [n for n in standby if n not in lost]
            absorbed = False
            for i in reversed(range(len(pipelines))):
                pl, h = pipelines[i], holes[i]
                hit = [j for j, n in enumerate(pl) if n in lost and j not in h]
                h.update(hit)
                n = len(pl)
                # A hole whose shadow (predecessor) is a hole too: no live copy of its layers.
                if not any((j - 1) % n in h for j in h) and len(h) < n:
                    absorbed = absorbed or bool(hit)
                    continue
                run.pause(s.reconfig_seconds)
                if len(standby) >= len(h):
                    continue  # reconfigure() refills the holes from standby
                live = [node for j, node in enumerate(pl) if j not in h]
                if len(live) >= s.demand_stages:  # shrink: fewer, fuller stages
                    pipelines[i], holes[i] = live, set()
                else:  # too shallow to hold the model: release to standby
                    standby.extend(live)
                    del pipelines[i], holes[i]
            if absorbed:
                run.pause(s.recovery_seconds)
            if lost and not pipelines and run.samples > run.checkpoint:
                run.fatal += 1
                run.roll_back()
        reconfigure()
    return _summary(run)


def _simulate_checkpoint(market, s: SimulationSettings, rng: random.Random, target: float) -> dict:
    P, D = s.demand_stages, s.num_pipelines
    cluster = _Cluster(rng, s.zones)
    run = _Run(s, target)
    if isinstance(market, MarketProcess):
        market.target = P * D
        for _ in range(P * D):
            cluster.add()
    while run.t < s.max_hours:
        working = min(D, len(cluster.zone) // P)
        when, kind, arg = market.next_event(run.t, len(cluster.zone))
        if run.advance(when, working * s.pipeline_throughput, len(cluster.zone)):
            break
        if kind == "add":
            if len(cluster.zone) < P * D:
                cluster.add(arg)
                if min(D, len(cluster.zone) // P) > working:
                    run.pause(s.restart_seconds)  # restart on the larger cluster
        elif kind.startswith("remove"):
            lost = cluster.remove(kind, arg)
            run.preemptions += len(lost)
            if lost and working:
                run.fatal += 1  # every preemption of a working node is a restart
                run.roll_back()
                run.pause(s.restart_seconds)
    return _summary(run)


def _summary(run: _Run) -> dict:
    hours = max(run.t, 1e-9)
    return {
        "preemptions": run.preemptions,
        "fatal_failures": run.fatal,
        "nodes": run.node_hours / hours,
        "throughput": run.samples / (hours * 3600),
        "cost": run.cost / hours,
        "useful_share": max(0.0, run.progress_hours - run.wasted_hours) / hours,
        "hours": hours,
    }


def _mean(results: list[dict], name: str, p: float) -> Row:
    mean = {k: sum(r[k] for r in results) / len(results) for k in results[0]}
    value = mean["throughput"] / mean["cost"] if mean["cost"] else 0.0
    return Row(name, p, value=value, **mean)


def _on_demand(s: SimulationSettings, p: float) -> Row:
    nodes = s.demand_stages * s.num_pipelines
    throughput = s.pipeline_throughput * s.num_pipelines
    cost = nodes * s.demand_price
    return Row("on-demand", p, 0, 0, nodes, throughput, cost, throughput / cost, 1.0, s.work_hours)


def simulate(p: float, settings: SimulationSettings) -> dict[str, Row]:
    """Average ``settings.runs`` runs of each strategy at hourly preemption probability ``p``."""
    s = settings.validate()
    target = s.work_hours * 3600 * s.pipeline_throughput * s.num_pipelines
    rows: dict[str, Row] = {}
    for name, fn, depth in (
        ("bamboo", _simulate_bamboo, s.num_stages),
        ("checkpoint", _simulate_checkpoint, s.demand_stages),
    ):
        results = []
        for i in range(s.runs):
            rng = random.Random(f"{s.seed}/{name}/{p}/{i}")
            market = MarketProcess(p, s, rng, depth * s.num_pipelines)
            results.append(fn(market, s, rng, target))
        rows[name] = _mean(results, name, p)
    rows["on-demand"] = _on_demand(s, p)
    return rows


def replay_trace(events: Sequence[Event], settings: SimulationSettings) -> dict[str, Row]:
    """One run of each spot strategy on a recorded trace instead of the random market."""
    s = settings.validate()
    target = s.work_hours * 3600 * s.pipeline_throughput * s.num_pipelines
    rows = {}
    for name, fn in (("bamboo", _simulate_bamboo), ("checkpoint", _simulate_checkpoint)):
        rng = random.Random(f"{s.seed}/{name}/trace")
        rows[name] = _mean([fn(TraceMarket(events), s, rng, target)], name, float("nan"))
    rows["on-demand"] = _on_demand(s, float("nan"))
    return rows


def read_trace(path: str | Path) -> list[Event]:
    """Rows ``time_hours,add|remove,node[,zone]`` (a header row is skipped)."""
    events: list[Event] = []
    with open(path, newline="") as fh:
        for line_no, row in enumerate(csv.reader(fh), 1):
            if not row or row[0].strip().lower() in ("time", "hour", "time_hours"):
                continue
            try:
                t, kind, node = float(row[0]), row[1].strip(), int(row[2])
                zone = int(row[3]) if len(row) > 3 else 0
            except (IndexError, ValueError):
                raise ConfigurationError(
                    f"{path}:{line_no}: write rows as time_hours,add|remove,node[,zone]"
                ) from None
            if kind not in ("add", "remove"):
                raise ConfigurationError(f"{path}:{line_no}: event {kind!r} is not add|remove")
            events.append((t, kind, node, zone))
    return sorted(events)


def sweep(
    probabilities: Iterable[float], settings: SimulationSettings, progress: bool = False
) -> list[Row]:
    """:func:`simulate` for each probability; rows of all strategies."""
    rows = []
    for p in probabilities:
        result = simulate(p, settings)
        rows += result.values()
        if progress:
            print(f"p={p:.2f}: done ({settings.runs} runs per strategy)", flush=True)
    return rows
