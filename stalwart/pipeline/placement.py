"""Which node runs which stage, which node holds which replica, and how that changes.

Pure data. :class:`Placement` maps stages to owner ranks and replica holders; the replicas of a
node's stages live on its ring predecessor (the last node holds stage 0's replica).
:func:`plan_recovery` decides, after nodes are lost, between *failover* (every lost stage has a
live replica: its holder becomes the owner, no state moves) and *checkpoint fallback* (some
stage has no live copy). :func:`plan_cluster` is the reconfiguration policy of thesis §3.7:
symmetric pipelines, spare nodes on standby, never more than P x D nodes, suspend when fewer
than one pipeline's worth remain.

Example:
    >>> p = Placement.initial(4, [0, 1, 2, 3])
    >>> plan_recovery(p, alive={0, 1, 3}).placement.stages_of(1)
    [1, 2]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Stage ownership and replica placement of one pipeline.

    Args:
        owner: ``owner[stage]`` is the rank that runs the stage.
        replica: ``replica[stage]`` is the rank holding its replica, or ``None``.
    """

    owner: tuple[int, ...]
    replica: tuple[int | None, ...]

    @classmethod
    def initial(cls, num_stages: int, ranks: Sequence[int]) -> Placement:
        """Stages spread contiguously over ``ranks``; replicas on each rank's ring predecessor."""
        n = len(ranks)
        owner = tuple(ranks[stage * n // num_stages] for stage in range(num_stages))
        if n < 2:
            return cls(owner, (None,) * num_stages)
        index = {r: i for i, r in enumerate(ranks)}
        replica = tuple(ranks[(index[o] - 1) % n] for o in owner)
        return cls(owner, replica)

    @property
    def num_stages(self) -> int:
        return len(self.owner)

    @property
    def ranks(self) -> list[int]:
        return sorted(set(self.owner))

    def stages_of(self, rank: int) -> list[int]:
        """The rank's stages in the order its stream runs them (ring order, so a node that took
        over stage 0 from its wrap-around successor runs [P-1, 0])."""
        mine = [s for s in range(self.num_stages) if self.owner[s] == rank]
        starts = [s for s in mine if (s - 1) % self.num_stages not in mine]
        if not starts:
            return mine
        first = starts[0]
        return sorted(mine, key=lambda s: (s - first) % self.num_stages)

    def replicas_of(self, rank: int) -> list[int]:
        """Stages whose replica the rank holds, in pipeline order (stage 0 first when it wraps)."""
        mine = [s for s in range(self.num_stages) if self.replica[s] == rank]
        starts = [s for s in mine if (s - 1) % self.num_stages not in mine]
        if not starts:
            return mine
        return sorted(mine, key=lambda s: (s - starts[0]) % self.num_stages)

    def fatal_if_lost(self, rank: int) -> bool:
        """Whether losing ``rank`` alone would leave a stage with no live copy."""
        return any(self.replica[s] is None for s in self.stages_of(rank))


@dataclass(frozen=True)
class Recovery:
    """Outcome of :func:`plan_recovery`: ``kind`` is ``"failover"``, ``"fallback"`` or
    ``"suspend"``; ``placement`` is the new placement (``None`` when suspending)."""

    kind: str
    placement: Placement | None
    lost: tuple[int, ...]
    reason: str = ""


def plan_recovery(placement: Placement, alive: Iterable[int], min_nodes: int = 1) -> Recovery:
    """Decide how the survivors ``alive`` continue after the other ranks were lost.

    Failover when every stage of a lost rank has a live replica: the replica holder (the
    shadow) becomes the owner; replicas that lived on lost ranks, or that were just promoted,
    are gone until a reconfiguration. Otherwise fall back to the last checkpoint on the
    survivors (stages spread contiguously, replicas on ring predecessors), or suspend when fewer
    than ``min_nodes`` survive.
    """
    alive_set = set(alive)
    lost = tuple(r for r in placement.ranks if r not in alive_set)
    survivors = [r for r in placement.ranks if r in alive_set]
    if not lost:
        return Recovery("failover", placement, lost, "nothing lost")
    if len(survivors) < max(1, min_nodes):
        return Recovery("suspend", None, lost, f"{len(survivors)} node(s) left < {min_nodes}")
    owner = list(placement.owner)
    replica = list(placement.replica)
    for stage, rank in enumerate(placement.owner):
        if rank in alive_set:
            continue
        holder = placement.replica[stage]
        if holder is None or holder not in alive_set:
            return Recovery(
                "fallback",
                Placement.initial(placement.num_stages, survivors),
                lost,
                f"stage {stage} lost its owner {rank} and its replica "
                f"({'none' if holder is None else f'on rank {holder}'})",
            )
        owner[stage] = holder
        replica[stage] = None
    for stage, holder in enumerate(replica):
        if holder is not None and holder not in alive_set:
            replica[stage] = None
    return Recovery("failover", Placement(tuple(owner), tuple(replica)), lost, "shadow takes over")


@dataclass(frozen=True)
class ClusterPlan:
    """Outcome of :func:`plan_cluster`."""

    pipelines: int
    active: int
    standby: int
    suspend: bool


def plan_cluster(
    num_stages: int, max_pipelines: int, nodes: int, standby_limit: int | None = None
) -> ClusterPlan:
    """Thesis §3.7 reconfiguration policy for ``nodes`` available nodes.

    Keep pipelines symmetric (depth P): run ``min(D, nodes // P)`` pipelines and put the rest on
    standby (at most ``standby_limit``; extra nodes are released so the cluster never exceeds
    ``P x D`` nodes in use or waiting). With fewer than P nodes, suspend (checkpoint and wait for
    allocations).
    """
    pipelines = min(max_pipelines, nodes // num_stages)
    active = pipelines * num_stages
    cap = num_stages * max_pipelines - active
    if standby_limit is not None:
        cap = min(cap, standby_limit)
    standby = min(nodes - active, cap)
    return ClusterPlan(pipelines, active, standby, pipelines == 0)


def should_reconfigure(
    placement: Placement, standby: int, num_stages: int, failures_pending: bool
) -> bool:
    """Reconfigure at a step boundary when (a) consecutive failures are pending, (b) standby
    nodes can bring the pipeline back to one node per stage, or (c) one more failure of some
    node would be fatal and a standby node could restore its redundancy."""
    if failures_pending:
        return True
    missing = num_stages - len(placement.ranks)
    if 0 < missing <= standby:
        return True
    return standby > 0 and any(placement.fatal_if_lost(r) for r in placement.ranks)


@dataclass(frozen=True)
class Layout:
    """D data-parallel pipelines: their placements, which data shards each one trains, and the
    nodes on standby.

    The global batch of a step is split into ``num_pipelines`` (the D the job started with)
    shards of M micro-batches. Each active pipeline trains its shards one after another and the
    gradients are summed across pipelines, so dropping a pipeline hands its shards to the others
    and the global batch and learning rate never change.

    Args:
        pipelines: one :class:`Placement` per active pipeline (global ranks).
        shards: ``shards[i]`` are the data shards pipeline ``i`` trains each step.
        standby: live nodes in no pipeline, waiting to replace a lost one.
    """

    pipelines: tuple[Placement, ...]
    shards: tuple[tuple[int, ...], ...]
    standby: tuple[int, ...] = ()

    @classmethod
    def initial(
        cls, num_stages: int, num_pipelines: int, ranks: Sequence[int], redundancy: bool = True
    ) -> Layout:
        """As many full pipelines as :func:`plan_cluster` allows on ``ranks`` (contiguous blocks
        of P ranks), the D shards dealt round robin, the remaining ranks on standby. Fewer than
        P ranks form one pipeline with several stages per node (the checkpoint fallback)."""
        ranks = sorted(ranks)
        plan = plan_cluster(num_stages, num_pipelines, len(ranks))
        if plan.pipelines:
            blocks = [ranks[i * num_stages : (i + 1) * num_stages] for i in range(plan.pipelines)]
            standby = tuple(ranks[plan.active : plan.active + plan.standby])
        else:
            blocks, standby = [ranks], ()
        pipelines = []
        for block in blocks:
            placement = Placement.initial(num_stages, block)
            if not redundancy:
                placement = Placement(placement.owner, (None,) * num_stages)
            pipelines.append(placement)
        return cls(tuple(pipelines), _deal(range(num_pipelines), len(blocks)), standby)

    @property
    def members(self) -> list[int]:
        """The ranks that train (in some pipeline), sorted."""
        return sorted({r for p in self.pipelines for r in p.ranks})

    def pipeline_of(self, rank: int) -> int | None:
        for i, placement in enumerate(self.pipelines):
            if rank in placement.ranks:
                return i
        return None

    def to_dict(self) -> dict:
        """JSON-able form (what the survivors agree on through the store)."""
        return {
            "pipelines": [[list(p.owner), list(p.replica)] for p in self.pipelines],
            "shards": [list(s) for s in self.shards],
            "standby": list(self.standby),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Layout:
        """Inverse of :meth:`to_dict`."""
        pipelines = tuple(Placement(tuple(o), tuple(r)) for o, r in data["pipelines"])
        shards = tuple(tuple(s) for s in data["shards"])
        return cls(pipelines, shards, tuple(data["standby"]))


def _deal(shards: Iterable[int], pipelines: int) -> tuple[tuple[int, ...], ...]:
    dealt: list[list[int]] = [[] for _ in range(pipelines)]
    for n, shard in enumerate(sorted(shards)):
        dealt[n % pipelines].append(shard)
    return tuple(tuple(d) for d in dealt)


@dataclass(frozen=True)
class LayoutRecovery:
    """Outcome of :func:`plan_layout`. ``kind``: ``"failover"`` (every pipeline kept; shadows
    took over), ``"reconfigure"`` (pipelines with a lost stage dropped, their shards dealt to the
    others, their live nodes to standby — no checkpoint), ``"fallback"`` (no pipeline left
    whole: re-form from the last checkpoint) or ``"suspend"``."""

    kind: str
    layout: Layout | None
    lost: tuple[int, ...]
    reason: str = ""


def plan_layout(
    layout: Layout, alive: Iterable[int], num_pipelines: int, redundancy: bool = True
) -> LayoutRecovery:
    """Decide how the live ranks continue (thesis §3.5 failover and §3.7 reconfiguration).

    Each pipeline recovers on its own (:func:`plan_recovery`): a lost stage with a live replica
    fails over to its shadow. A pipeline with a stage that has no live copy is dropped rather
    than rebuilt unevenly (symmetric pipelines); its live nodes go on standby and its data shards
    to the surviving pipelines, so no checkpoint is loaded while one pipeline is whole. Only when
    no pipeline survives do the live nodes (standby included) re-form as many full pipelines as
    :func:`plan_cluster` allows from the last checkpoint — never more than P x D nodes, since
    nodes are only ever lost here.
    """
    alive_set = set(alive)
    everyone = set(layout.members) | set(layout.standby)
    lost = tuple(sorted(r for r in everyone if r not in alive_set))
    kept: list[tuple[Placement, tuple[int, ...]]] = []
    orphans: list[int] = []
    standby = [r for r in layout.standby if r in alive_set]
    reasons = []
    for placement, shards in zip(layout.pipelines, layout.shards, strict=True):
        rec = plan_recovery(placement, alive_set)
        if rec.kind == "failover":
            kept.append((rec.placement, shards))
        else:
            orphans += shards
            standby += [r for r in placement.ranks if r in alive_set]
            reasons.append(rec.reason)
    if not lost:
        return LayoutRecovery("failover", layout, lost, "nothing lost")
    if kept:
        shards = [list(s) for _, s in kept]
        for n, shard in enumerate(sorted(orphans)):
            shards[n % len(kept)].append(shard)
        dealt = tuple(tuple(sorted(s)) for s in shards)
        new = Layout(tuple(p for p, _ in kept), dealt, tuple(sorted(standby)))
        if orphans:
            return LayoutRecovery("reconfigure", new, lost, "; ".join(reasons))
        return LayoutRecovery("failover", new, lost, "shadow takes over")
    survivors = sorted(standby)
    num_stages = layout.pipelines[0].num_stages
    if not survivors:
        return LayoutRecovery("suspend", None, lost, "no node left")
    new = Layout.initial(num_stages, num_pipelines, survivors, redundancy)
    return LayoutRecovery("fallback", new, lost, "; ".join(reasons))
