"""Choosing a checkpoint's quantization under a quality bound (Inshrinkerator section 4.3).

Quality falls monotonically along each axis of the "configuration cube" (fewer bins, more
pruning, less protection), so the first checkpoint walks the feasibility staircase of the
(bins, prune) plane for each prune metric — O(bins + prune levels) evaluations instead of all of
them — and then tries less protection at the best point found. Later checkpoints look only at the
radius-1 neighbourhood of the previous choice, never more aggressive than it (models grow more
sensitive as they train), and fall back to the full search when nothing there qualifies.

The fallback is the first checkpoint's full search, without that ceiling (the paper's ceiling is
the neighbourhood's), and the neighbourhood steps the bins only within the paper's table (up to 32
levels): past it, the full search decides. A bound that noise crosses now and then — a held-out
loss near zero, where one image moves the relative degradation by several percent — otherwise
makes each false alarm permanent: with a ceiling on the fallback and neighbourhood steps to 64 and
96 levels, the digits CNN's search kept climbing (64 levels by its tenth checkpoint in seed 1, 96 in
seed 2; keyframes 6.5-7.3x in seeds 0-2); with neither, its keyframes were 8.2-14x in all five
seeds at the same test accuracy (measured, docs/measurements/shrink.md).

Per layer type (the spec's partition; opt-in): whenever the search had to move, the types are
refined one at a time, largest first — fewer bins for that type alone while the bound holds and
the estimate of the stored size falls — so a tolerant type (e.g. attention) does not pay for a
sensitive one. The ceiling applies per type: no type is ever quantized more coarsely than before
by the neighbourhood search (also when the previous configuration came from a file written with
the refinement on).

Scoring dominates the cost (93% of a char-transformer save). With a ``screen`` — the same loss on a
small share of the scoring data — every candidate is first judged on the screen. An answer whose
screened degradation is at most ``screen_accept * tau`` is taken on the screen alone: the margin
covers the screen's error (measured on the char transformer, see docs/measurements/shrink.md), and
scoring the uncompressed reference and the answer on the full batches was most of a later
checkpoint's cost. An answer closer to the bound is scored on the full scoring batches; when that
confirmation fails, the candidate is marked infeasible and the search resumes from what it already
knows, so a confirmed configuration meets tau on the full scoring batches, whatever the screen said.

The bound follows the learning rate (``lr_share``, :func:`learning_rate_share`; the adapters'
``tau_follows_lr``, on by default): a restore's damage is repaired by training, at the pace the
learning rate sets. With a cosine decay to a tenth, the char transformer's restores at tau = 0.05
left the final validation bpc +1.1..+2.4% behind the uncompressed run on eight seeds of eight; with
the bound scaled by the rate's share of its initial value (at most 5x stricter), within 1% on seven
of eight, at 29.4-32.1x instead of 33.0-35.8x (docs/measurements/shrink.md). Where nothing meets the
scaled bound, the save is searched again at tau (:func:`run_within_bound`), never stored losslessly
for it. At a constant rate nothing changes.
"""

from __future__ import annotations

import math
import numbers
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from stalwart.errors import ConfigurationError
from stalwart.shrink.cores import ThreadChoice
from stalwart.shrink.entropy import check_coder
from stalwart.shrink.partition import (
    BIN_CHOICES,
    PAPER_MAX_BINS,
    PROTECT_CHOICES,
    PRUNE_CHOICES,
    QuantConfig,
    bin_choices_for,
)
from stalwart.shrink.quantize import QuantizedTensor, TensorAnalysis

Evaluate = Callable[[Mapping[str, torch.Tensor]], float]

# Measured on the char transformer (43 candidates of a 10-checkpoint run scored on the screen and
# on the full batches, docs/measurements/shrink.md): the two differed by up to 0.36 tau near the
# bound, and the 6 candidates screened within tau/2 were all within 0.39 tau on the full batches.
DEFAULT_SCREEN_ACCEPT = 0.5
#: The strictest the learning rate makes the weights' bound: a fifth of tau. Without a floor a
#: schedule that ends at 0 would leave nothing within the bound and store the last checkpoints
#: losslessly.
LR_SHARE_FLOOR = 0.2


def learning_rate_share(optimizers: Sequence[torch.optim.Optimizer]) -> float:
    """How much of its initial learning rate the run trains at now, in [LR_SHARE_FLOOR, 1].

    The weights' bound is ``tau`` times this share: at a tenth of the rate, training repairs a
    restore's damage about ten times more slowly, so a checkpoint late in a decayed run may cost
    less. The initial rate is the ``initial_lr`` that PyTorch's schedulers write into each param
    group (it travels with the optimizer's state, so a resumed run sees the same share); without a
    scheduler the share is 1. A warm-up counts too (its first checkpoints are held stricter);
    a rate above its initial value (e.g. OneCycleLR's peak) counts as 1.
    """
    shares = [
        group["lr"] / group["initial_lr"]
        for optimizer in optimizers
        for group in optimizer.param_groups
        if group.get("initial_lr")
    ]
    if not shares:
        return 1.0
    return min(1.0, max(LR_SHARE_FLOOR, max(shares)))


def run_within_bound(search: ConfigSearch, *inputs: Any, **named: Any) -> SearchOutcome:
    """``search.run(*inputs, **named)``; where the learning rate's share made the bound stricter
    than anything met, the search again at ``tau`` itself (``lr_share`` left at 1, so
    :attr:`ConfigSearch.bound` says what the answer was held to), and the two searches' costs
    added up.

    The share is a preference for precision late in a decayed run; ``tau`` is the promise.
    Without the fallback the digits CNN (a cosine to 0, a held-out loss near zero) found nothing
    within a fifth of tau at its last checkpoint of seed 0 and stored it losslessly: the chain
    came out 27.1x smaller than ``torch.save``, 42.8x with the fallback
    (docs/measurements/shrink.md).
    """
    outcome = search.run(*inputs, **named)
    if outcome.config is not None or search.lr_share >= 1.0:
        return outcome
    search.lr_share = 1.0
    again = search.run(*inputs, **named)
    again.trials = outcome.trials + again.trials
    again.seconds += outcome.seconds
    again.evaluations += outcome.evaluations
    again.screenings += outcome.screenings
    return again


def check_screen_accept(screen_accept: float) -> None:
    """Raise :class:`ConfigurationError` unless ``screen_accept`` is a share of tau in [0, 1]."""
    if not 0.0 <= screen_accept <= 1.0:
        raise ConfigurationError(
            f"screen_accept is a share of tau in [0, 1] (0 confirms every answer on the full "
            f"scoring batches), got {screen_accept}"
        )


def check_adapter_arguments(
    tau: float,
    eval_batches: int,
    screen_fraction: float,
    grad_window: int,
    grad_beta: float,
    continue_steps: int,
) -> None:
    """The checks ``ShrinkCheckpoint`` and Composer's ``Shrink`` share, made before either
    creates anything: raise :class:`ConfigurationError` naming the first bad argument."""
    if not tau >= 0:
        raise ConfigurationError(f"tau is a relative degradation >= 0, got {tau}")
    if eval_batches < 1:
        raise ConfigurationError(f"eval_batches must be >= 1, got {eval_batches}")
    if not 0.0 <= screen_fraction < 1.0:
        raise ConfigurationError(f"screen_fraction must be in [0, 1), got {screen_fraction}")
    if grad_window < 0 or not 0.0 < grad_beta <= 1.0:
        raise ConfigurationError(
            f"grad_window must be >= 0 and grad_beta in (0, 1]; got {grad_window}, {grad_beta}"
        )
    if continue_steps < 1:
        raise ConfigurationError(f"continue_steps must be >= 1, got {continue_steps}")


def check_writer_arguments(tau: float, keyframe_every: int, coder: str) -> None:
    """The chain writer's arguments as every adapter takes them (``ShrinkCheckpointIO``, so
    ``ShrinkCheckpoint``, and Composer's ``Shrink``), checked when the adapter is made: a bad one
    would otherwise surface only at the first save, after training up to it. Raises
    :class:`ConfigurationError`."""
    # tau is checked as check_adapter_arguments checks it; the scoring settings that check also
    # covers are not the writer's (a ShrinkRequest brings its scorers), so valid ones are passed.
    check_adapter_arguments(
        tau, eval_batches=1, screen_fraction=0.0, grad_window=0, grad_beta=1.0, continue_steps=1
    )
    if isinstance(keyframe_every, bool) or not isinstance(keyframe_every, numbers.Integral):
        raise ConfigurationError(
            f"keyframe_every is a whole number of saves (>= 1), got {keyframe_every!r}"
        )
    check_coder(coder)


@dataclass
class Trial:
    """One candidate's measurement. ``degradation`` decides ``feasible``: on the full scoring
    batches when ``confirmed``, else on the screen."""

    config: QuantConfig
    degradation: float
    feasible: bool
    size_bits: float
    confirmed: bool = True


@dataclass
class SearchOutcome:
    """The chosen config (None = nothing qualified: store losslessly) and what it cost to find.
    ``degradation`` is the chosen config's on the full scoring batches when ``confirmed``, else on
    the screen (an answer accepted within the screen's margin)."""

    config: QuantConfig | None
    quantized: dict[str, QuantizedTensor]
    degradation: float
    confirmed: bool = True
    trials: list[Trial] = field(default_factory=list)
    seconds: float = 0.0
    exhaustive: bool = False
    evaluations: int = 0  # on the full scoring batches, the reference included
    screenings: int = 0  # on the screen, its reference included


def estimated_size_bits(quantized: Mapping[str, QuantizedTensor]) -> float:
    """Entropy of the indices + protected values + codebooks: the ratio a candidate will reach."""
    bits = 0.0
    for tensor in quantized.values():
        counts = torch.bincount(tensor.indices.long()).double()
        p = counts[counts > 0] / tensor.indices.numel()
        bits += float(-(p * torch.log2(p)).sum()) * tensor.indices.numel()
        bits += 16.0 * tensor.protected.numel() + 32.0 * tensor.levels.numel()
    return bits


def _one_step_more(choices: tuple[int, ...], bins: int) -> int | None:
    """The neighbourhood's next bin count above ``bins``: within the paper's table only (past
    it, the full search decides; see the module docstring)."""
    return next((b for b in choices if bins < b <= PAPER_MAX_BINS), None)


class ConfigSearch:
    """Stateful search: remembers the last choice between checkpoints.

    Args:
        tau: the largest relative degradation of ``evaluate`` (a loss) a checkpoint may have, at
            the initial learning rate: each save is held to ``tau * lr_share`` (:attr:`bound`),
            where the caller sets ``lr_share`` (:func:`learning_rate_share`; 1 by default).
        has_gradients: whether sensitivity-based pruning is possible.
        neighbourhood: whether later checkpoints search near the previous choice (paper) or redo
            the full search every time.
        per_type: whether to refine the bin count per layer type after the shared choice
            (opt-in: each checkpoint where the search moves costs a few more screenings and one
            more full scoring).
        screen_accept: with a screen, an answer whose screened degradation is at most
            ``screen_accept * tau`` is accepted without being scored on the full batches; one
            closer to the bound is confirmed there. 0 confirms every answer (the bound then
            holds on the full scoring batches without exception); at most 1.

    Example::

        search = ConfigSearch(tau=0.05)
        outcome = search.run(analyses, state_dict, evaluate)
    """

    def __init__(
        self,
        tau: float = 0.05,
        *,
        neighbourhood: bool = True,
        per_type: bool = False,
        screen_accept: float = DEFAULT_SCREEN_ACCEPT,
    ) -> None:
        check_screen_accept(screen_accept)
        self.tau = tau
        self.lr_share = 1.0  # set by the caller before each save: see :attr:`bound`
        self.neighbourhood = neighbourhood
        self.per_type = per_type
        self.screen_accept = screen_accept
        self.previous: QuantConfig | None = None
        self.threads = ThreadChoice()  # the scoring's thread count: this machine now, not saved

    @property
    def bound(self) -> float:
        """The relative degradation this save's weights may have: ``tau * lr_share``."""
        return self.tau * self.lr_share

    def state_dict(self) -> dict:
        return {"previous": None if self.previous is None else self.previous.to_dict()}

    def load_state_dict(self, state: dict) -> None:
        previous = state.get("previous")
        self.previous = None if previous is None else QuantConfig.from_dict(previous)

    def run(
        self,
        analyses: Mapping[str, TensorAnalysis],
        state_dict: Mapping[str, torch.Tensor],
        evaluate: Evaluate,
        screen: Evaluate | None = None,
        fixed: Mapping[str, torch.Tensor] | None = None,
    ) -> SearchOutcome:
        """Choose a configuration for this checkpoint.

        Args:
            analyses: name -> the tensor's analysis (what every candidate shares).
            state_dict: the uncompressed weights (unquantized entries are kept as they are).
            evaluate: ``evaluate(state_dict) -> loss`` on the scoring batches; the bound tau holds
                on this function for a returned configuration that is ``confirmed``.
            screen: a cheaper estimate of the same loss (e.g. on a share of the scoring batches)
                that candidates are judged on first; None judges every candidate with
                ``evaluate``. The answer is then confirmed with ``evaluate`` unless its screened
                degradation is within ``screen_accept * tau``.
            fixed: name -> the tensor every candidate stores instead of ``state_dict``'s (the
                small tensors rounded to bfloat16), so the bound covers them too.
        """
        start = time.perf_counter()
        has_gradients = any(a.gradient is not None for a in analyses.values())
        cache: dict[QuantConfig, tuple[Trial, dict[str, QuantizedTensor]]] = {}
        # A tensor's quantization depends only on its own effective setting: candidates that
        # differ in another layer type's bins share it.
        tensors: dict[tuple, QuantizedTensor] = {}
        elements: Counter[str] = Counter()
        for analysis in analyses.values():
            elements[analysis.layer_type] += analysis.values.numel()
        shares = {t: n / max(sum(elements.values()), 1) for t, n in elements.items()}
        references: dict[str, float] = {}
        counts = {"evaluate": 0, "screen": 0}

        def relative(name: str, function: Evaluate, candidate: Mapping[str, torch.Tensor]) -> float:
            if name not in references:
                references[name] = float(function(state_dict))
                counts[name] += 1
            counts[name] += 1
            reference = references[name]
            return (float(function(candidate)) - reference) / max(abs(reference), 1e-12)

        def candidate_of(quantized: Mapping[str, QuantizedTensor]) -> dict[str, torch.Tensor]:
            candidate = dict(state_dict)
            candidate.update(fixed or {})
            candidate.update({name: q.dequantize() for name, q in quantized.items()})
            return candidate

        def measure(config: QuantConfig, quantized: dict[str, QuantizedTensor], full: bool) -> None:
            full = full or screen is None
            name, function = ("evaluate", evaluate) if full else ("screen", screen)
            degradation = relative(name, function, candidate_of(quantized))
            feasible = math.isfinite(degradation) and degradation <= self.bound
            size = estimated_size_bits(quantized)
            cache[config] = (Trial(config, degradation, feasible, size, full), quantized)

        def quantize(config: QuantConfig) -> dict[str, QuantizedTensor]:
            quantized = {}
            for name, analysis in analyses.items():
                key = (name, config.bins_for(analysis.layer_type), config.prune,
                       config.prune_metric, config.protect)  # fmt: skip
                if key not in tensors:
                    tensors[key] = analysis.quantize(config)
                quantized[name] = tensors[key]
            return quantized

        def settled(record: Trial) -> Trial:
            """``record`` as the answer: kept on its screen within the margin, else scored on the
            full batches (if it was not already)."""
            within_margin = (
                self.screen_accept > 0 and record.degradation <= self.screen_accept * self.bound
            )
            if not record.confirmed and not within_margin:
                measure(record.config, cache[record.config][1], True)
            return cache[record.config][0]

        def trial(config: QuantConfig) -> Trial:
            if config not in cache:
                measure(config, quantize(config), False)
            return cache[config][0]

        def checked(config: QuantConfig) -> Trial:
            """``trial``, with a rejection by the screen checked on the full batches: used where a
            rejection would leave nothing but storing the weights losslessly (the most precise
            points). Measured on the digits CNN (loss ~0.03): its 45-image screen rejected 96
            levels (+0.076) before a lossless checkpoint. Elsewhere a rejection stands: checking
            the previous configuration's rejections too kept the char transformer at the bound
            (+0.04 at most checkpoints) and its final val bpc went from +0.58% to +1.57%."""
            record = trial(config)
            if not record.feasible and not record.confirmed:
                measure(config, cache[config][1], True)
            return cache[config][0]

        metrics = ("magnitude", "sensitivity") if has_gradients else ("magnitude",)
        exhaustive = False
        while True:
            chosen = None
            if self.previous is not None and self.neighbourhood:
                chosen = self._neighbourhood(self.previous, metrics, trial, shares)
            if chosen is None:
                exhaustive = True
                chosen = self._guided_exhaustive(metrics, trial, checked)
            # The screen's answer, accepted within the margin or scored on the full batches. A
            # failed confirmation is remembered as infeasible, so the next pass of the (memoized)
            # search moves past it.
            if chosen is None or (chosen := settled(chosen)).feasible:
                break
        if chosen is not None and self.per_type and chosen.config != self.previous:
            ceiling = None if exhaustive else self.previous
            refined = settled(self._refine(chosen, shares, trial, ceiling=ceiling))
            if refined.feasible:  # else keep the shared choice, settled already
                chosen = refined
        trials = [record for record, _ in cache.values()]
        seconds = time.perf_counter() - start
        done = dict(
            trials=trials,
            seconds=seconds,
            exhaustive=exhaustive,
            evaluations=counts["evaluate"],
            screenings=counts["screen"],
        )
        if chosen is None:
            return SearchOutcome(None, {}, 0.0, True, **done)
        self.previous = chosen.config
        return SearchOutcome(
            chosen.config, cache[chosen.config][1], chosen.degradation, chosen.confirmed, **done
        )

    def _refine(
        self,
        start: Trial,
        shares: Mapping[str, float],
        trial: Callable[[QuantConfig], Trial],
        ceiling: QuantConfig | None,
    ) -> Trial:
        """Fewer bins per layer type, largest type first, one step at a time while the candidate
        stays feasible, within the ceiling, and smaller than the best so far."""
        best = start
        for layer_type in sorted(shares, key=shares.__getitem__, reverse=True):
            choices = bin_choices_for(layer_type)
            while True:
                fewer = [b for b in choices if b < best.config.bins_for(layer_type)]
                if not fewer:
                    break
                candidate = best.config.with_type_bins(layer_type, fewer[-1])
                if ceiling is not None and not candidate.at_most_as_aggressive_as(ceiling):
                    break
                record = trial(candidate)
                if not record.feasible or record.size_bits >= best.size_bits:
                    break
                best = record
        return best

    def _neighbourhood(
        self,
        previous: QuantConfig,
        metrics: tuple[str, ...],
        trial: Callable[[QuantConfig], Trial],
        shares: Mapping[str, float],
    ) -> Trial | None:
        metric = previous.prune_metric
        if previous.prune > 0 and len(metrics) > 1:
            # The paper first tries the other prune metric at the same point and switches when it
            # is clearly better. "Clearly": by a quarter of the bound, because a switch re-prunes
            # different elements and so costs a poorly compressible delta.
            other = replace(previous, prune_metric=next(m for m in metrics if m != metric))
            if trial(other).degradation < trial(previous).degradation - 0.25 * self.bound:
                metric = other.prune_metric
        base = replace(previous, prune_metric=metric if previous.prune > 0 else "magnitude")
        candidates = {base}
        more_bins = _one_step_more(BIN_CHOICES, base.bins)
        if more_bins is not None:
            candidates.add(replace(base, bins=more_bins))
        if base.prune in PRUNE_CHOICES and base.prune > 0:
            lower = PRUNE_CHOICES[PRUNE_CHOICES.index(base.prune) - 1]
            candidates.add(replace(base, prune=lower, prune_metric=base.prune_metric))
        if base.protect in PROTECT_CHOICES and base.protect < PROTECT_CHOICES[-1]:
            candidates.add(
                replace(base, protect=PROTECT_CHOICES[PROTECT_CHOICES.index(base.protect) + 1])
            )
        for layer_type, bins in base.type_bins:  # one step more precise for one type alone
            more = _one_step_more(bin_choices_for(layer_type), bins)
            if more is not None:
                candidates.add(base.with_type_bins(layer_type, more))
        for config in sorted(candidates, key=lambda candidate: candidate.estimated_bits(shares)):
            if trial(config).feasible:
                return trial(config)
        return None

    @staticmethod
    def _guided_exhaustive(
        metrics: tuple[str, ...],
        trial: Callable[[QuantConfig], Trial],
        checked: Callable[[QuantConfig], Trial],
    ) -> Trial | None:
        protect = PROTECT_CHOICES[1]
        frontier: list[Trial] = []

        def feasible(bins_at: int, prune: float, metric: str) -> bool:
            config = QuantConfig(BIN_CHOICES[bins_at], prune, metric, protect)
            # Giving up on the most precise point of a plane (then on the fallback below: storing
            # losslessly) needs the full batches' word, not the screen's.
            judge = checked if bins_at == len(BIN_CHOICES) - 1 and prune == 0 else trial
            return judge(config).feasible

        for metric in metrics:
            prunes = PRUNE_CHOICES if metric == "magnitude" else PRUNE_CHOICES[1:]
            # Staircase walk over the monotone (bins, prune) plane: the fewest feasible bins can
            # only grow with pruning, so they are found by bisection at the lightest pruning (the
            # paper's "variation of binary search"), then one pointer moves up as pruning grows.
            # Each (prune, fewest bins) pair is a frontier point. Bisection rather than a walk
            # down from the top: 3 scorings instead of up to 7, and a false alarm just below the
            # top (a loss near zero) no longer ends the walk there.
            if feasible(0, prunes[-1], metric):
                # The most aggressive corner already qualifies (typical early in training): it
                # dominates the whole plane, no walk needed.
                frontier.append(trial(QuantConfig(BIN_CHOICES[0], prunes[-1], metric, protect)))
                continue
            b = len(BIN_CHOICES) - 1
            if not feasible(b, prunes[0], metric):
                continue
            low = 0
            while low < b:  # invariant: b is feasible, everything below low is not
                middle = (low + b) // 2
                if feasible(middle, prunes[0], metric):
                    b = middle
                else:
                    low = middle + 1
            frontier.append(trial(QuantConfig(BIN_CHOICES[b], prunes[0], metric, protect)))
            for prune in prunes[1:]:
                while b < len(BIN_CHOICES) and not feasible(b, prune, metric):
                    b += 1
                if b == len(BIN_CHOICES):
                    break
                frontier.append(trial(QuantConfig(BIN_CHOICES[b], prune, metric, protect)))
        if not frontier:
            fallback = QuantConfig(BIN_CHOICES[-1], 0.0, "magnitude", PROTECT_CHOICES[-1])
            return checked(fallback) if checked(fallback).feasible else None
        best = min(frontier, key=lambda record: record.size_bits)
        leaner = replace(best.config, protect=PROTECT_CHOICES[0])
        if trial(leaner).feasible and trial(leaner).size_bits < best.size_bits:
            return trial(leaner)
        return best
