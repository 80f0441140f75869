"""Event-driven preemption simulator: redundant pipelines (Bamboo) vs checkpoint/restart vs
on-demand instances, for one training job on a spot market.

What it answers: at an hourly preemption probability ``p`` per node, what throughput, bill and
value (throughput per $/h, thesis §3.6.1: "V = T/C") each strategy gets, averaged over many
random runs (:func:`simulate`, :func:`sweep`) or from one recorded trace (:func:`replay_trace`).
It is a model whose inputs are :class:`SimulationSettings`, not a measurement of stalwart's
runtime. Like the thesis' own simulator (chapter 3, §3.6.2) it takes "(1) the preemption
probability (including preemption frequency and the number of preemptions in each bulk), (2)
per-iteration training time, and (3) Bamboo's recovery and reconfiguration time" and trains
"until completion". Each modelling choice, with the passage behind it:

* Market (:class:`MarketProcess`). Each node is preempted with hourly probability ``p``,
  constant over the run (§3.6.2: "kept the preemption probability constant throughout the
  entire run"). An event takes a bulk from one zone (§3.3: of 127 preemption timestamps in the
  EC2 trace "only 7 see preemptions from multiple zones"); bulk sizes are geometric with mean
  ``bulk_mean`` and events are rarer by that factor, so each node's probability stays ``p``.
  Missing nodes are granted at an allocation probability drawn uniformly every hour, in a
  random zone (§3.6.2: "we randomly generated different creation probabilities per hour and
  also randomly picked zones for allocations"), refilling towards P x D nodes and never beyond
  (§3.4: "Bamboo would never try to scale the training beyond P x D").
* Cost: every allocated spot node is billed, working or standby; a preempted node is not.
* Throughput. With all D pipelines healthy, each runs at the on-demand pipeline's rate slowed
  by eager forward redundant computation (``rc_overhead``): the extra depth holds replicas, it
  does not add speed (§3.4). The global batch is kept when pipelines are lost (no sample
  dropping, §3.3), so each of D' < D pipelines runs D/D' times the M micro-batches per step, and
  a 1F1B step of m micro-batches on P stages takes m + P - 1 micro-batch slots: fewer pipelines
  fill their bubble better. A pipeline in failover runs at the pace of its shadow, which
  executes "all instructions of the victim node" (§3.5.2), i.e. the forward and backward of two
  stages (``failover_slowdown``); the pipelines all-reduce "at the end of each iteration" (§3.4),
  so the whole step waits for it.
* Failover: a lost node whose predecessor (its shadow) is alive costs every pipeline a recovery
  pause: "each node participating in all-reduce ... if another pipeline has a failure, waits
  until the failure is handled" (§3.5).
* Reconfiguration (§3.7), "a much longer pause ... than recovering using RC". Triggered
  "immediately when (1) consecutive preemptions occur" in a pipeline (one replica cannot cover
  two consecutive stages, §3.5.1), and at a step boundary when the standby queue can fill every
  failed-over stage ("if we have had F failures and J (> F) nodes are waiting to join the
  cluster ... we can fully recover all pipelines to depth P"; this covers trigger "(b) ... close
  to a critical failure", which here arises only with one pipeline left) or when "(a) the
  cluster has gained enough new nodes to reconstruct a new pipeline". It re-forms
  min(D, nodes // P) full pipelines of depth P ("instead of creating asymmetric pipelines ... we
  move some nodes into the standby queue and decrease the total number of data-parallel
  pipelines"), stages ordered round-robin over zones (§3.5.1: "consecutive nodes come from
  different zones"). Layers lost in one pipeline are copied from another (§3.7: nodes "send or
  receive model and optimizer state from other nodes").
* Fatal failure: some stage's layers have no live copy in any pipeline (two consecutive losses
  with one pipeline left, or the same stage lost in every pipeline). Training restarts from the
  last checkpoint (§3.7: "These checkpoints will not be used unless Bamboo restarts the training
  from a rare fatal failure"), losing the work since it and paying a restart. With fewer than P
  nodes no pipeline can run: training is suspended (nodes still billed) after a checkpoint and
  resumes when nodes return.
* Checkpoint/restart: D pipelines of the on-demand depth on spot nodes (§3.6.3: "a D x P
  pipeline (i.e., the same as on-demand instances)"); a preemption of a working node stops
  everyone, rolls back to the last checkpoint and pays a restart.
* On-demand: D pipelines of the on-demand depth at the on-demand price, never preempted.

Useful share = hours of training whose work was kept / wall hours (§3.6.3 compares the two spot
strategies by it). The pause lengths are inputs the thesis does not print; value depends on them
most, because pauses grow with the event rate. ``benchmarks/simulator_sensitivity.py`` varies
them, and ``benchmarks/pipeline_simulator_vs_thesis.py`` sets the defaults beside the thesis'
Table 3.3.

Example:
    >>> s = SimulationSettings(runs=20, work_hours=2.0)
    >>> rows = simulate(0.10, s)
    >>> rows["bamboo"].value > rows["on-demand"].value
    True
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from stalwart.errors import ConfigurationError

#: Table 3.5 of the thesis (BERT): per-iteration overhead of eager-FRC-lazy-BRC (Bamboo) and of
#: eager-FRC-eager-BRC (every node runs its successor's forward and backward too).
EAGER_FRC_OVERHEAD = 0.1977
EAGER_FRC_EAGER_BRC_OVERHEAD = 0.7151


@dataclass
class SimulationSettings:
    """Cluster, costs and market. Defaults follow the thesis' BERT-large setting (Table 3.1:
    D=4, P=8x1.5=12; §3.6: $3.06 on-demand, $0.918 spot per GPU-hour; Table 3.2: 108 samples/s
    on demand, i.e. 27 per pipeline).

    Args:
        num_stages: Bamboo pipeline depth P.
        demand_stages: on-demand (and checkpoint/restart) pipeline depth.
        num_pipelines: D.
        num_microbatches: micro-batches per pipeline per step when all D pipelines run (M);
            20 gives the ratios of the BERT step times for 1, 2 and 3 pipelines that the
            thesis authors' simulator takes as input (5.7 / 3.1 / 2.3 s).
        pipeline_throughput: samples/s of one healthy on-demand pipeline.
        rc_overhead: per-step slowdown of redundant computation (eager FRC, Table 3.5).
        failover_slowdown: step-time factor while a shadow runs two stages: eager-FRC-eager-BRC
            over eager-FRC-lazy-BRC (Table 3.5), since the shadow does the victim's forward and
            backward as well as its own.
        recovery_seconds: pause of a failover (shadow takes over, lazy BRC of one step); an
            assumption of a few BERT iterations.
        reconfig_seconds: pause of a reconfiguration (re-form pipelines, move layers); 42 s
            makes reconfiguration take 7% of the time over p = 0.10-0.33, the share the thesis
            reports for its real runs on traces of those rates (§3.6.1).
        restart_seconds: restart the job and load the checkpoint (checkpoint/restart, and
            Bamboo after a fatal failure).
        checkpoint_minutes: checkpoint interval (both spot strategies).
        zones: availability zones; a preemption event hits one zone.
        bulk_mean: mean number of nodes one preemption event takes; 1 because in Table 3.3
            the interval between events times their number equals the run length.
        allocation_max: each hour draws an allocation probability in [0, allocation_max] that
            a missing node is granted within the hour.
        spot_price / demand_price: $ per node-hour.
        work_hours: amount of training, in hours of the on-demand cluster's work.
        max_hours: give up after this much wall time.
        runs: simulations per setting.
        seed: base random seed.

    Example:
        >>> SimulationSettings(runs=100, reconfig_seconds=60).validate().runs
        100
    """

    num_stages: int = 12
    demand_stages: int = 8
    num_pipelines: int = 4
    num_microbatches: int = 20
    pipeline_throughput: float = 27.0
    rc_overhead: float = EAGER_FRC_OVERHEAD
    failover_slowdown: float = (1 + EAGER_FRC_EAGER_BRC_OVERHEAD) / (1 + EAGER_FRC_OVERHEAD)
    recovery_seconds: float = 20.0
    reconfig_seconds: float = 42.0
    restart_seconds: float = 600.0
    checkpoint_minutes: float = 30.0
    zones: int = 3
    bulk_mean: float = 1.0
    allocation_max: float = 1.0
    spot_price: float = 0.918
    demand_price: float = 3.06
    work_hours: float = 12.0
    max_hours: float = 240.0
    runs: int = 1000
    seed: int = 0

    def validate(self) -> SimulationSettings:
        """Raise :class:`ConfigurationError` naming the first setting out of range."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in ("seed", "rc_overhead") and not value > 0:
                raise ConfigurationError(f"--{f.name.replace('_', '-')}={value}: must be > 0.")
        if self.rc_overhead < 0 or self.failover_slowdown < 1:
            raise ConfigurationError("rc_overhead must be >= 0 and failover_slowdown >= 1.")
        if self.bulk_mean < 1 or self.allocation_max > 1:
            raise ConfigurationError("bulk_mean must be >= 1 and allocation_max <= 1.")
        if self.num_stages < 2:
            raise ConfigurationError("num_stages must be >= 2: a replica lives on another stage.")
        return self


@dataclass
class Row:
    """Averages over the runs of one strategy at one preemption probability."""

    strategy: str
    probability: float
    preemptions: float
    interval: float
    fatal_failures: float
    reconfigurations: float
    nodes: float
    throughput: float
    cost: float
    value: float
    useful_share: float
    paused_share: float
    reconfig_share: float
    hours: float


Event = tuple[float, str, int, int]  # (hour, "add" | "remove", node, zone)


class MarketProcess:
    """Random spot market: bulk preemptions (one zone per event) with hourly probability ``p``
    per node; allocations of missing nodes at an hourly probability redrawn every hour.

    ``next_event`` returns ``(hour, kind, arg)``: ``("add", None)``, ``("remove-bulk", k)``,
    or ``("tick", 0)`` on the hour.

    Args:
        p: hourly preemption probability of one node, in [0, 1).
        s: the settings (zones, bulk size, allocation bound).
        rng: the run's random source.
        target: cluster size the allocator refills towards.
    """

    def __init__(self, p: float, s: SimulationSettings, rng: random.Random, target: int):
        if not 0 <= p < 1:
            raise ConfigurationError(f"preemption probability {p}: use a value in [0, 1).")
        self.rate = -math.log1p(-p)  # per node-hour: P(preempted within an hour) = p
        self.s, self.rng, self.target = s, rng, target
        self.alloc_rate = 0.0
        self.hour = -1

    def next_event(self, now: float, alive: int) -> tuple[float, str, int | None]:
        rng, s = self.rng, self.s
        if math.floor(now) != self.hour:  # a new hour: a new allocation probability
            self.hour = math.floor(now)
            self.alloc_rate = -math.log1p(-min(rng.uniform(0, s.allocation_max), 0.999))
        alloc = self.alloc_rate * max(0, self.target - alive)
        remove = self.rate * alive / s.bulk_mean
        total = alloc + remove
        boundary = self.hour + 1.0
        if total <= 0:
            return boundary, "tick", 0
        when = now + rng.expovariate(total)
        if when >= boundary:  # memoryless: redraw from the hour boundary
            return boundary, "tick", 0
        if rng.random() * total < alloc:
            return when, "add", None
        return when, "remove-bulk", _geometric(rng, s.bulk_mean)


def _geometric(rng: random.Random, mean: float) -> int:
    """A bulk size >= 1 with the given mean."""
    if mean <= 1:
        return 1
    q = 1.0 / mean  # P(bulk == k) = (1 - q)^(k - 1) q
    return 1 + int(math.log(1.0 - rng.random()) / math.log1p(-q))


class TraceMarket:
    """A recorded trace: ``add`` grants node ``n`` (in ``zone``), ``remove`` preempts it."""

    def __init__(self, events: Sequence[Event]) -> None:
        self.events = sorted(events)
        self.i = 0
        self.target = 0

    def next_event(self, now: float, alive: int) -> tuple[float, str, object]:
        if self.i >= len(self.events):
            return now + 1.0, "tick", 0
        t, kind, node, zone = self.events[self.i]
        self.i += 1
        return max(t, now), "add" if kind == "add" else "remove-node", (node, zone)


Market = MarketProcess | TraceMarket


class _Cluster:
    """Nodes of one run: ``zone[node]``; add one, remove a bulk from one zone."""

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
        # The zone of a uniformly drawn node: zones are hit in proportion to their nodes.
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
        self.paused_hours = 0.0
        self.reconfig_hours = 0.0
        self.wasted_hours = 0.0
        self.since_checkpoint_hours = 0.0
        self.target = target_samples
        self.fatal = 0
        self.preemptions = 0
        self.preemption_events = 0
        self.reconfigurations = 0

    def advance(self, until: float, rate: float, allocated: int) -> bool:
        """Move time to ``until`` at ``rate`` samples/s; return True when the work is done."""
        while self.t < until:
            step_end = min(until, self.next_checkpoint)
            dt = step_end - self.t
            self.cost += dt * allocated * self.s.spot_price
            self.node_hours += dt * allocated
            run_from = min(step_end, max(self.t, self.paused_until))
            work = step_end - run_from if rate > 0 else 0.0
            self.paused_hours += run_from - self.t if rate > 0 else 0.0
            if work > 0:
                need = (self.target - self.samples) / (rate * 3600)
                if need <= work:  # done mid-interval: stop the clock (and the bill) there
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
                self.save_checkpoint()
                self.next_checkpoint += self.s.checkpoint_minutes / 60
        return False

    def save_checkpoint(self) -> None:
        self.checkpoint = self.samples
        self.since_checkpoint_hours = 0.0

    def pause(self, seconds: float) -> None:
        self.paused_until = max(self.paused_until, self.t) + seconds / 3600

    def roll_back(self) -> None:
        self.samples = self.checkpoint
        self.wasted_hours += self.since_checkpoint_hours
        self.since_checkpoint_hours = 0.0


class _Bamboo:
    """One run of redundant pipelines (the policy of §3.5 and §3.7; see the module docstring).

    ``pipelines[i][j]`` is the node running stage ``j`` of pipeline ``i`` (always P stages);
    ``holes[i]`` are its stages whose node was lost and whose shadow (stage ``j - 1``) runs them.
    Node ``j`` holds stage ``j``'s layers and a replica of stage ``j + 1``'s (the last node
    holds stage 0's), so a pipeline keeps every stage's layers unless two cyclically
    consecutive stages are holes.
    """

    def __init__(
        self, market: Market, s: SimulationSettings, rng: random.Random, target: float
    ) -> None:
        self.market, self.s = market, s
        self.P, self.D = s.num_stages, s.num_pipelines
        self.cluster = _Cluster(rng, s.zones)
        self.run = _Run(s, target)
        self.pipelines: list[list[int]] = []
        self.holes: list[set[int]] = []
        self.standby: list[int] = []
        self.restart_pending = False  # a fatal failure while too few nodes to restart
        self.per_pipeline = s.pipeline_throughput / (1 + s.rc_overhead)

    def rate(self) -> float:
        slow = self.s.failover_slowdown if any(self.holes) else 1.0
        return _throughput(self.s, self.P, len(self.pipelines), self.per_pipeline) / slow

    def lost_stages(self) -> bool:
        """True when some stage's layers have no live copy in any pipeline."""
        return any(all(j in h and (j - 1) % self.P in h for h in self.holes) for j in range(self.P))

    def rebuild(self, seconds: float, restart: bool = False) -> None:
        """Re-form min(D, nodes // P) full pipelines from every live node (§3.7)."""
        pool = [n for pl, h in zip(self.pipelines, self.holes, strict=True)
                for j, n in enumerate(pl) if j not in h] + self.standby  # fmt: skip
        count = min(self.D, len(pool) // self.P)
        ordered = _order_by_zone(pool, self.cluster.zone)
        self.pipelines = [ordered[i * self.P : (i + 1) * self.P] for i in range(count)]
        self.holes = [set() for _ in range(count)]
        self.standby = ordered[count * self.P :]
        if not count:  # suspend: checkpoint what the survivors hold, resume when nodes return
            self.run.save_checkpoint()
            self.restart_pending |= restart
            return
        if self.restart_pending:
            seconds, restart, self.restart_pending = self.s.restart_seconds, True, False
        if not restart:
            self.run.reconfigurations += 1
            self.run.reconfig_hours += seconds / 3600
        self.run.pause(seconds)

    def preempt(self, lost: set[int]) -> None:
        run = self.run
        run.preemptions += len(lost)
        run.preemption_events += 1
        self.standby = [n for n in self.standby if n not in lost]
        broken = absorbed = False
        for pl, h in zip(self.pipelines, self.holes, strict=True):
            hit = {j for j, n in enumerate(pl) if n in lost and j not in h}
            if hit:
                h |= hit
                if any((j + 1) % self.P in h for j in h):
                    broken = True  # two consecutive stages gone: this pipeline lost layers
                else:
                    absorbed = True
        if broken and self.lost_stages():
            run.fatal += 1  # gone everywhere: restart from the last checkpoint (§3.7)
            run.roll_back()
            self.rebuild(self.s.restart_seconds, restart=True)
        elif broken:  # consecutive preemptions: reconfigure at once (§3.7 trigger 1)
            self.rebuild(self.s.reconfig_seconds)
        elif absorbed:
            run.pause(self.s.recovery_seconds)

    def step_boundary(self) -> None:
        """Reconfigure at a step boundary (§3.7) when the standby nodes can fill every hole
        ("J (> F) nodes are waiting to join ... we can fully recover all pipelines"; this
        includes trigger (b): with one pipeline left, a hole leaves a single copy of two
        stages), or when (a) a new pipeline can be formed."""
        holes = sum(len(h) for h in self.holes)
        nodes = len(self.pipelines) * self.P - holes + len(self.standby)
        new_pipeline = len(self.pipelines) < min(self.D, nodes // self.P)
        if new_pipeline or 0 < holes <= len(self.standby):
            self.rebuild(self.s.reconfig_seconds)

    def simulate(self) -> dict:
        run, cluster = self.run, self.cluster
        if isinstance(self.market, MarketProcess):  # start from a full cluster
            self.standby = [cluster.add() for _ in range(self.P * self.D)]
            self.rebuild(0.0, restart=True)
        while run.t < self.s.max_hours:
            when, kind, arg = self.market.next_event(run.t, len(cluster.zone))
            if run.advance(when, self.rate(), len(cluster.zone)):
                break
            if kind == "add":
                if len(cluster.zone) < self.P * self.D:  # never more than P x D nodes
                    self.standby.append(cluster.add(arg))
            elif kind.startswith("remove"):
                lost = set(cluster.remove(kind, arg))
                if lost:
                    self.preempt(lost)
            self.step_boundary()
        return _summary(run)


def _throughput(s: SimulationSettings, depth: int, pipelines: int, per_pipeline: float) -> float:
    """Samples/s of ``pipelines`` synchronous pipelines sharing the global batch of D.

    The global batch is kept (Bamboo does not drop samples, §3.3), so each of ``pipelines``
    pipelines runs ``M * D / pipelines`` micro-batches per step, and a 1F1B step of ``m``
    micro-batches on ``depth`` stages takes ``(m + depth - 1)`` micro-batch slots.
    """
    if pipelines == 0:
        return 0.0
    M, D = s.num_microbatches, s.num_pipelines
    return D * per_pipeline * (M + depth - 1) / (M * D / pipelines + depth - 1)


def _simulate_bamboo(
    market: Market, s: SimulationSettings, rng: random.Random, target: float
) -> dict:
    return _Bamboo(market, s, rng, target).simulate()


def _simulate_checkpoint(
    market: Market, s: SimulationSettings, rng: random.Random, target: float
) -> dict:
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
        rate = _throughput(s, P, working, s.pipeline_throughput)
        if run.advance(when, rate, len(cluster.zone)):
            break
        if kind == "add":
            if len(cluster.zone) < P * D:
                cluster.add(arg)
                if min(D, len(cluster.zone) // P) > working:
                    run.reconfigurations += 1
                    run.pause(s.restart_seconds)  # restart on the larger cluster
        elif kind.startswith("remove"):
            lost = cluster.remove(kind, arg)
            run.preemptions += len(lost)
            run.preemption_events += bool(lost)
            if lost and working:
                run.fatal += 1  # every preemption of a working node is a restart
                run.roll_back()
                run.pause(s.restart_seconds)
    return _summary(run)


def _summary(run: _Run) -> dict:
    hours = max(run.t, 1e-9)
    return {
        "preemptions": run.preemptions,
        "preemption_events": run.preemption_events,
        "fatal_failures": run.fatal,
        "reconfigurations": run.reconfigurations,
        "nodes": run.node_hours / hours,
        "throughput": run.samples / (hours * 3600),
        "cost": run.cost / hours,
        "useful_share": max(0.0, run.progress_hours - run.wasted_hours) / hours,
        "paused_share": run.paused_hours / hours,
        "reconfig_share": run.reconfig_hours / hours,
        "hours": hours,
    }


def _mean(results: list[dict], name: str, p: float) -> Row:
    mean = {k: sum(r[k] for r in results) / len(results) for k in results[0]}
    value = mean["throughput"] / mean["cost"] if mean["cost"] else 0.0
    events = mean.pop("preemption_events")
    interval = mean["hours"] / events if events else math.inf
    return Row(name, p, value=value, interval=interval, **mean)


def _on_demand(s: SimulationSettings, p: float) -> Row:
    nodes = s.demand_stages * s.num_pipelines
    throughput = s.pipeline_throughput * s.num_pipelines
    cost = nodes * s.demand_price
    return Row(
        "on-demand", p, preemptions=0, interval=math.inf, fatal_failures=0, reconfigurations=0,
        nodes=nodes, throughput=throughput, cost=cost, value=throughput / cost, useful_share=1.0,
        paused_share=0.0, reconfig_share=0.0, hours=s.work_hours,
    )  # fmt: skip


Progress = Callable[[str, float, int, int], None]
STRATEGIES = ("bamboo", "checkpoint")
_SIMULATORS = {"bamboo": _simulate_bamboo, "checkpoint": _simulate_checkpoint}


def simulate(
    p: float,
    settings: SimulationSettings,
    progress: Progress | None = None,
    strategies: Sequence[str] = STRATEGIES,
) -> dict[str, Row]:
    """Average ``settings.runs`` runs of each spot strategy at hourly preemption probability
    ``p`` (plus the on-demand row). ``progress(strategy, p, done, runs)`` is called every 10%
    of the runs."""
    s = settings.validate()
    target = s.work_hours * 3600 * s.pipeline_throughput * s.num_pipelines
    rows: dict[str, Row] = {}
    every = max(1, s.runs // 10)
    for name in strategies:
        depth = s.num_stages if name == "bamboo" else s.demand_stages
        results = []
        for i in range(s.runs):
            rng = random.Random(f"{s.seed}/{name}/{p}/{i}")
            market = MarketProcess(p, s, rng, depth * s.num_pipelines)
            results.append(_SIMULATORS[name](market, s, rng, target))
            if progress and ((i + 1) % every == 0 or i + 1 == s.runs):
                progress(name, p, i + 1, s.runs)
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
    probabilities: Iterable[float],
    settings: SimulationSettings,
    progress: Progress | None = None,
    strategies: Sequence[str] = STRATEGIES,
) -> list[Row]:
    """:func:`simulate` for each probability; rows of all strategies."""
    rows: list[Row] = []
    for p in probabilities:
        rows += simulate(p, settings, progress, strategies).values()
    return rows
