"""Adaptive checkpoint period: Flor's Joint Invariant (Garcia et al., VLDB 2021, Eq. 4).

After an epoch ran and before anything is materialized, checkpoint it only if

    M / C < n / (k + 1) * min(1 / (1 + c), eps)

M: main-thread cost of materializing one checkpoint, C: compute time of one epoch, n: epochs so far
(this one included), k: checkpoints taken so far, c: restore/materialize cost ratio, eps: the record
overhead budget. The ``k + 1`` makes the invariant keep holding *after* this checkpoint is taken.

Unlike Flor, the invariant spends only half the budget (``aim``) on its own: what the record
cannot measure (the noise of the machine, Lightning's and Python's costs of one more callback
beyond what is charged) must not take the user's wall clock past eps. Coverage still guarantees a
checkpoint at least every ``ceil(r / eps) + 1`` epochs within the whole budget, so expensive
checkpoints are spaced as Flor would space them at most one epoch further apart.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass

from stalwart.errors import ConfigurationError

#: Flor's measured mean restore/materialize ratio over its workloads (paper §3.2.2).
DEFAULT_RESTORE_RATIO = 1.38
DEFAULT_EPSILON = 1 / 15
#: The share of eps the Joint Invariant spends by itself (coverage may spend up to eps).
DEFAULT_AIM = 0.5


@dataclass(frozen=True)
class Decision:
    """One policy decision, as recorded in the run manifest."""

    epoch: int
    n: int
    k: int
    materialize_cost: float
    compute_time: float
    threshold: float
    checkpoint: bool

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Totals:
    """What a policy has accounted: epochs, checkpoints, compute seconds and the record's
    seconds (all of them, and the part outside checkpoints). See
    :meth:`JointInvariantPolicy.own`."""

    epochs: int = 0
    checkpoints: int = 0
    compute: float = 0.0
    materialize: float = 0.0
    fixed: float = 0.0

    @property
    def overhead(self) -> float:
        """``materialize / compute``: the record overhead these totals amount to."""
        return self.materialize / self.compute if self.compute > 0 else 0.0


def validate_epsilon(epsilon: float) -> float:
    if not isinstance(epsilon, (int, float)) or not 0.0 < float(epsilon) < 1.0:
        raise ConfigurationError(
            f"epsilon={epsilon!r} is not an overhead budget: pass a fraction in (0, 1), "
            "e.g. epsilon=1/15 for at most 6.67% record overhead."
        )
    return float(epsilon)


class JointInvariantPolicy:
    """Decides at each epoch end whether to checkpoint, keeping record overhead below ``epsilon``.

    The policy is pure: it sees only numbers. ``C`` is taken as the mean epoch compute time so far,
    which makes the test equivalent to ``(k + 1) * M < eps * sum(C)``: with steady costs the
    cumulative overhead ``sum(M) / sum(C)`` never exceeds ``eps``, whatever one noisy epoch does.
    Eq. 4 assumes every checkpoint costs the same; when the cost drifts down over a run, past
    checkpoints may have cost more than ``M``, so the budget actually spent is checked as well,
    against the share of it the invariant may spend (``sum(M_taken) + M <= aim * eps * sum(C)``).
    Costs charged after the fact (background interference, the record's start) can put that sum
    over for a long stretch, and expensive checkpoints never fit it; coverage then still takes a
    checkpoint every ``ceil(r / eps) + 1`` epochs (r: the lower of the typical M and the run's
    median expected M, over mean C) when it fits the whole budget of the compute since the
    previous one.

    Args:
        epsilon: record overhead budget, a fraction in (0, 1). Default 1/15 (6.67%), as in Flor.
        restore_ratio: ``c``, the expected restore time as a multiple of the materialize time.
            Flor starts at 1.0 and refines it from replays; its measured mean is 1.38.
        aim: the share of ``epsilon`` the invariant spends by itself, in (0, 1]; ``1`` is
            Flor's policy. Coverage checkpoints may spend the rest.

    Example::

        policy = JointInvariantPolicy(epsilon=0.05)
        for compute, cost in [(10.0, 0.2), (10.0, 0.2)]:
            if policy.decide(compute_time=compute, materialize_cost=cost).checkpoint:
                policy.checkpointed(cost)
    """

    #: How many recent checkpoints' measured costs form the typical cost (their median).
    RECENT = 5

    def __init__(
        self,
        epsilon: float = DEFAULT_EPSILON,
        restore_ratio: float = DEFAULT_RESTORE_RATIO,
        aim: float = DEFAULT_AIM,
    ) -> None:
        self.epsilon = validate_epsilon(epsilon)
        if not 0 <= restore_ratio < math.inf:  # also NaN, which compares False
            raise ConfigurationError(
                f"restore_ratio={restore_ratio!r} must be a finite number >= 0 (the restore's "
                "time as a multiple of the write's; the default is "
                f"{DEFAULT_RESTORE_RATIO})."
            )
        if not 0.0 < aim <= 1.0:
            raise ConfigurationError(f"aim={aim!r} must be in (0, 1]: the share of epsilon spent.")
        self.restore_ratio = float(restore_ratio)
        self.aim = float(aim)
        self.epochs = 0
        self.checkpoints = 0
        self.total_compute = 0.0
        self.total_materialize = 0.0
        #: Part of ``total_materialize`` that no checkpoint caused alone: the record's start and
        #: finish (store, fingerprints, the initial state, waiting for the last write).
        self.total_fixed = 0.0
        self.recent_costs: deque[float] = deque(maxlen=self.RECENT)
        # ``epochs`` when the last checkpoint was taken (0: the state training started from)
        self.last_checkpoint_epochs = 0
        self.compute_at_last_checkpoint = 0.0  # ``total_compute`` then
        #: Every epoch's expected cost so far: coverage's period is kept from that run-wide
        #: median as well as the recent one (see :meth:`decide`).
        self.estimates: list[float] = []
        #: What a checkpoint this policy was loaded from had accounted (see :meth:`own`).
        self.inherited = Totals()

    @property
    def typical_cost(self) -> float | None:
        """The low median measured cost of the last few checkpoints (None before the first).

        A median, so one checkpoint whose cost was inflated by a noisy epoch stops counting as
        soon as a few normal ones follow; and :meth:`decide` keeps taking them (coverage).
        """
        return statistics.median_low(self.recent_costs) if self.recent_costs else None

    def coverage_period(self, materialize_cost: float, compute_time: float) -> int:
        """``ceil(r / budget) + 1`` epochs, r = M/C: the longest a run may go without a
        checkpoint; a steady run's Joint Invariant period is about ``r / budget``."""
        return math.ceil(materialize_cost / compute_time / self.budget) + 1

    @property
    def budget(self) -> float:
        """``min(1/(1+c), eps)``: the per-checkpoint ratio both invariants allow."""
        return min(1.0 / (1.0 + self.restore_ratio), self.epsilon)

    @property
    def overhead(self) -> float:
        """Cumulative measured overhead so far: ``sum(M) / sum(C)`` (a resumed record's
        included; :meth:`own` has this run's alone)."""
        return self.total_materialize / self.total_compute if self.total_compute > 0 else 0.0

    def totals(self) -> Totals:
        """Everything accounted so far, the runs this one resumed from included."""
        return Totals(
            self.epochs, self.checkpoints, self.total_compute, self.total_materialize,
            self.total_fixed,
        )  # fmt: skip

    def own(self) -> Totals:
        """What this run accounted itself: :meth:`totals` less what the checkpoint it was loaded
        from had (:meth:`load_state_dict`). A resumed record's decisions keep weighing the whole
        history, but its figure is its own epochs, checkpoints and seconds."""
        now, before = self.totals(), self.inherited
        return Totals(
            now.epochs - before.epochs,
            now.checkpoints - before.checkpoints,
            max(now.compute - before.compute, 0.0),
            max(now.materialize - before.materialize, 0.0),
            max(now.fixed - before.fixed, 0.0),
        )

    def should_checkpoint(
        self, n: int, k: int, materialize_cost: float, compute_time: float
    ) -> bool:
        """The Joint Invariant itself (Eq. 4); override to plug in another policy."""
        if compute_time <= 0:
            return False
        return materialize_cost / compute_time < n / (k + 1) * self.budget

    def decide(
        self, *, compute_time: float, materialize_cost: float, epoch: int | None = None
    ) -> Decision:
        """Account one finished epoch and decide whether to checkpoint it.

        Args:
            compute_time: seconds the epoch took, excluding materialization.
            materialize_cost: the expected main-thread seconds of one checkpoint.
            epoch: the epoch index to record in the decision (defaults to the count so far).
        """
        self.epochs += 1
        self.total_compute += max(compute_time, 0.0)
        n, k = self.epochs, self.checkpoints
        self.estimates.append(max(materialize_cost, 0.0))
        mean_compute = self.total_compute / n
        take = self.should_checkpoint(n, k, materialize_cost, mean_compute) and (
            self.total_materialize + materialize_cost
            <= self.aim * self.epsilon * self.total_compute
        )
        if not take and mean_compute > 0:
            # Coverage: past costs (a noisy epoch charged to a checkpoint, the record's start)
            # must not leave the rest of the run without checkpoints. After the steady period,
            # a checkpoint is taken if it fits the budget of the compute since the last one:
            # the cumulative overhead then only ever moves towards eps, and without costs
            # charged after the fact it never exceeds it (the invariant holds by induction).
            # The period from the cheaper of the recent and the run-wide median cost: where a
            # checkpoint costs about eps of an epoch, a few noisy recent costs must not stretch
            # the period past what the run's costs as a whole give (1 MB in 0.1 s epochs: 4.6
            # ms through most of a run, 7.8 ms for its last epochs, a gap of 3 for a bound of 2).
            typical = min(materialize_cost, statistics.median(self.estimates))
            period = self.coverage_period(typical, mean_compute)
            window = self.total_compute - self.compute_at_last_checkpoint
            take = (
                n - self.last_checkpoint_epochs >= period
                and materialize_cost <= self.budget * window
            )
        return Decision(
            epoch=n - 1 if epoch is None else epoch,
            n=n,
            k=k,
            materialize_cost=materialize_cost,
            compute_time=compute_time,
            threshold=n / (k + 1) * self.budget,
            checkpoint=take,
        )

    def checkpointed(self, materialize_cost: float) -> None:
        """Account a checkpoint that was taken, with its measured main-thread cost."""
        self.checkpoints += 1
        self.total_materialize += max(materialize_cost, 0.0)
        self.recent_costs.append(max(materialize_cost, 0.0))
        self.last_checkpoint_epochs = self.epochs
        self.compute_at_last_checkpoint = self.total_compute

    def prior(self, cost: float) -> None:
        """Seed the typical cost with a measured probe, so a stalled first checkpoint is one
        sample of two, and the low median sets the price until more checkpoints are measured."""
        if not self.recent_costs:
            self.recent_costs.append(max(cost, 0.0))

    def charge(self, cost: float) -> None:
        """Add checkpoint cost measured after the fact (background interference) to the budget
        and to the last checkpoint's cost; a negative cost refunds an earlier over-estimate."""
        self.total_materialize = max(self.total_materialize + cost, 0.0)
        if self.recent_costs and self.checkpoints:
            self.recent_costs[-1] = max(self.recent_costs[-1] + cost, 0.0)

    def charge_fixed(self, cost: float) -> None:
        """Add a cost of recording that no checkpoint caused (start, finish) to the budget."""
        self.total_materialize += max(cost, 0.0)
        self.total_fixed += max(cost, 0.0)

    def revise_last_cost(self, estimated: float, measured: float) -> None:
        """Replace the estimate a checkpoint was accounted with by its measured cost."""
        self.total_materialize += max(measured, 0.0) - max(estimated, 0.0)
        if self.recent_costs:
            self.recent_costs[-1] = max(measured, 0.0)

    def state_dict(self) -> dict:
        return {
            "epochs": self.epochs,
            "checkpoints": self.checkpoints,
            "total_compute": self.total_compute,
            "total_materialize": self.total_materialize,
            "restore_ratio": self.restore_ratio,
            "aim": self.aim,
            "total_fixed": self.total_fixed,
            "recent_costs": list(self.recent_costs),
            "last_checkpoint_epochs": self.last_checkpoint_epochs,
            "compute_at_last_checkpoint": self.compute_at_last_checkpoint,
            "estimates": list(self.estimates),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue a checkpointed policy: its totals go on counting here (decisions weigh the
        whole record), noted as :attr:`inherited` so that :meth:`own` stays this run's. What
        this run charged before the load (its start) stays charged, on top of them."""
        charged = self.totals()
        self.inherited = Totals(
            int(state["epochs"]),
            int(state["checkpoints"]),
            float(state["total_compute"]),
            float(state["total_materialize"]),
            float(state.get("total_fixed", 0.0)),
        )
        self.epochs = self.inherited.epochs + charged.epochs
        self.checkpoints = self.inherited.checkpoints + charged.checkpoints
        self.total_compute = self.inherited.compute + charged.compute
        self.total_materialize = self.inherited.materialize + charged.materialize
        self.total_fixed = self.inherited.fixed + charged.fixed
        self.restore_ratio = float(state.get("restore_ratio", self.restore_ratio))
        self.aim = float(state.get("aim", 1.0))  # saved before the aim existed: Flor's policy
        before = self.inherited
        recent = state.get("recent_costs")
        if recent is None and before.checkpoints:  # saved before per-checkpoint costs were kept
            recent = [before.materialize / before.checkpoints]
        self.recent_costs = deque(map(float, recent or []), maxlen=self.RECENT)
        self.last_checkpoint_epochs = int(state.get("last_checkpoint_epochs", before.epochs))
        self.compute_at_last_checkpoint = float(
            state.get("compute_at_last_checkpoint", before.compute)
        )
        self.estimates = list(map(float, state.get("estimates", [])))
