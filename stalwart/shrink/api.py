"""``stalwart.shrink.save`` / ``load``: torch.save and torch.load for shrunken checkpoints."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stalwart.errors import ConfigurationError
from stalwart.shrink.codec import (
    ChainState,
    bfloat16_entry,
    decode_chain,
    entries_bytes,
    format_version,
    lossless_entry,
    pack_object,
    quantized_entry,
    unpack_object,
)
from stalwart.shrink.container import SectionWriter
from stalwart.shrink.cores import ThreadChoice
from stalwart.shrink.entropy import DEFAULT_CODER, check_coder
from stalwart.shrink.moments import (
    LOSSLESS,
    MomentChoice,
    choose_setting,
    effective_form,
    moment_layout,
    moments_of,
    optimizer_signature,
    optimizer_states,
)
from stalwart.shrink.partition import QuantConfig, guess_layer_type
from stalwart.shrink.quantize import QuantizedTensor, TensorAnalysis
from stalwart.shrink.search import (
    DEFAULT_SCREEN_ACCEPT,
    ConfigSearch,
    check_screen_accept,
    run_within_bound,
)

DEFAULT_CONFIG = QuantConfig(bins=16, prune=0.0, prune_metric="magnitude", protect=0.005)
LOSSY_OPTIMIZER_CONFIG = QuantConfig(bins=32, prune=0.0, prune_metric="magnitude", protect=0.01)
MIN_QUANTIZED_NUMEL = 1024
SMALL_TENSOR_MODES = ("bfloat16", "lossless")
OPTIMIZER_MODES = ("auto", "lossless", "lossy")
ContinueTraining = Callable[[Mapping[str, torch.Tensor], list[Mapping]], float]


@dataclass
class ShrinkReport:
    """What one :func:`save` wrote.

    ``ratio`` compares the state_dict's raw tensor bytes with the bytes its part of the file
    takes; ``optimizer_ratio`` the same for the optimizer states found in ``extra``;
    ``total_ratio`` for everything saved (weights + ``extra``, e.g. all of a Lightning
    checkpoint: the bytes of the file on disk). ``optimizer`` says how the optimizer state was
    stored and the continuation check that accepted it (see :mod:`stalwart.shrink.moments`).
    ``config`` is None when nothing met ``tau`` and the weights were stored losslessly.
    ``degradation`` (searched saves only) was held to ``bound`` (``tau`` times the learning
    rate's share, see :func:`stalwart.shrink.search.learning_rate_share`, or ``tau`` where
    nothing met that: :func:`stalwart.shrink.search.run_within_bound`) and measured on
    ``degradation_on``: ``"evaluate"``
    (the full scoring batches) or ``"screen"`` (an answer the search accepted on the screen
    within its margin, see ``screen_accept``). ``search`` says which search chose ``config``:
    ``"full"`` (the first checkpoint, a keyframe written by a :class:`ChainWriter`, or a later
    one whose neighbourhood had nothing within tau: it may then be more aggressive than the
    previous checkpoint's) or ``"neighbourhood"`` (never more aggressive); None when ``config``
    was given. ``side``: written with ``side=True`` (no later save extends this file; ``chain``
    is then the state of the file it is a delta on, or None for a keyframe).
    """

    path: str
    kind: str
    base: str | None
    chain_position: int
    config: QuantConfig | None
    degradation: float | None
    weight_bytes: int
    weight_stored: int
    total_bytes: int
    total_stored: int
    seconds: float
    search_seconds: float = 0.0
    evaluations: int = 0
    screenings: int = 0
    degradation_on: str | None = None
    bound: float | None = None
    search: str | None = None
    optimizer_bytes: int = 0
    optimizer_stored: int = 0
    optimizer: MomentChoice | None = None
    side: bool = False
    chain: ChainState | None = field(default=None, repr=False)

    @property
    def ratio(self) -> float:
        return self.weight_bytes / max(self.weight_stored, 1)

    @property
    def optimizer_ratio(self) -> float:
        return self.optimizer_bytes / max(self.optimizer_stored, 1)

    @property
    def total_ratio(self) -> float:
        return self.total_bytes / max(self.total_stored, 1)


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(value) for value in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(value) for value in obj)
    return 0


def _previous_state(previous: str | os.PathLike | ShrinkReport | ChainState | None):
    if previous is None or isinstance(previous, ChainState):
        return previous
    if isinstance(previous, ShrinkReport):
        return previous.chain if previous.chain is not None else decode_chain(previous.path)[2]
    return decode_chain(previous)[2]


def _check_matches(state_dict: Mapping[str, torch.Tensor], chain: ChainState) -> None:
    shapes = {name: tuple(t.shape) for name, t in state_dict.items()}
    if shapes == chain.shapes:
        return
    missing = sorted(set(chain.shapes) - set(shapes))
    added = sorted(set(shapes) - set(chain.shapes))
    reshaped = sorted(
        f"{n} {chain.shapes[n]} -> {shapes[n]}"
        for n in set(shapes) & set(chain.shapes)
        if shapes[n] != chain.shapes[n]
    )
    raise ConfigurationError(
        f"this state_dict does not match the chain it would extend ({chain.path}): "
        f"missing {missing[:5]}, new {added[:5]}, reshaped {reshaped[:5]}. A delta needs the same "
        "tensors; pass previous=None to start a new chain (a keyframe)."
    )


def save(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    *,
    previous: str | os.PathLike | ShrinkReport | None = None,
    evaluate: Callable[[Mapping[str, torch.Tensor]], float] | None = None,
    screen: Callable[[Mapping[str, torch.Tensor]], float] | None = None,
    tau: float = 0.05,
    screen_accept: float = DEFAULT_SCREEN_ACCEPT,
    gradients: Mapping[str, torch.Tensor] | None = None,
    config: QuantConfig | None = None,
    search: ConfigSearch | None = None,
    layer_types: Mapping[str, str] | None = None,
    extra: Any = None,
    compress_optimizer: str = "lossless",
    continue_training: ContinueTraining | None = None,
    parameter_shapes: Sequence[Mapping[Any, tuple[int, ...]]] | None = None,
    optimizer_choice: MomentChoice | None = None,
    coder: str = DEFAULT_CODER,
    min_numel: int = MIN_QUANTIZED_NUMEL,
    small_tensors: str = "bfloat16",
    side: bool = False,
) -> ShrinkReport:
    """Write ``state_dict`` shrunken to ``path``: quantized, delta-coded against ``previous``.

    Args:
        state_dict: name -> tensor (a model's ``state_dict()``).
        path: file to write (atomically).
        previous: the previous checkpoint of the chain (its path or the report :func:`save`
            returned, which avoids decoding it again); None writes a keyframe.
        evaluate: ``evaluate(state_dict) -> loss`` on held-out data; with it, the quantization is
            searched so that ``(loss - loss_uncompressed) / loss_uncompressed <= tau``.
        screen: a cheaper estimate of ``evaluate``'s loss (e.g. on a share of its batches) that
            candidates are judged on first; the search's answer is then scored with ``evaluate``
            (the bound holds there whatever the screen said) unless ``screen_accept`` takes it on
            the screen.
        tau: the quality bound for the search.
        screen_accept: an answer screened at most ``screen_accept * tau`` worse is written
            without scoring it with ``evaluate`` (``report.degradation_on == "screen"``); 0
            confirms every answer with ``evaluate``. Used when ``search`` is None (a given
            search keeps its own).
        gradients: name -> gradient EMA, enabling sensitivity (|g*w|) pruning and protection.
        config: a fixed :class:`QuantConfig` instead of a search.
        search: a :class:`ConfigSearch` kept across saves (neighbourhood search); created if None.
        layer_types: name -> layer type (see :mod:`stalwart.shrink.partition`); guessed if None.
        extra: any other object to store (e.g. the rest of a Lightning checkpoint); its optimizer
            state dicts are found by their layout (``state`` + ``param_groups``).
        compress_optimizer: ``"lossless"`` (default here), ``"auto"`` (the most compressed
            moment setting whose short continuation of training is within ``tau``; lossless
            without ``continue_training``) or ``"lossy"`` (every floating tensor of ``extra``
            quantized to 32 levels, unchecked).
        continue_training: ``continue_training(weights, optimizer_states) -> held-out loss``
            after a few training steps from those (leaving no trace); see
            :func:`stalwart.shrink.moments.choose_setting`.
        parameter_shapes: per optimizer state (in the order they sit in ``extra``), its
            parameter key -> parameter shape; a moment of another shape is stored losslessly.
        optimizer_choice: with ``"auto"``, the choice an earlier save's continuation check made,
            reused here without a check (the report says so) unless the optimizer state holds
            other moments than that check saw (then it checks again); see
            :class:`~stalwart.shrink.chain.ChainWriter`, which decides when that is safe.
        coder: entropy coder of the index streams: ``"auto"`` (default: per stream the smallest
            of rANS per previous level, rANS, and run lengths + zstd; measured: none wins
            everywhere), ``"ans-grouped"`` (rANS per previous level), ``"ans"``, ``"zstd"`` or
            ``"huffman"`` (the paper's).
        min_numel: tensors with fewer elements (biases, norms) are not quantized.
        small_tensors: how those are stored when float32: ``"bfloat16"`` (default; rounded, at
            the precision of the protected weights, inside the bound tau like everything else:
            on the char transformer they were 14% of the stored bits, half of it after rounding)
            or ``"lossless"``. Integer tensors, and everything when no configuration met tau,
            are stored losslessly.
        side: a file no later save extends, for a path that is written again and again (such as
            Lightning's ``last.ckpt``): a delta on a file that is later overwritten could not be
            restored. It is written as usual (a delta on ``previous``), but ``report.chain``, and
            the chain state a load of it gives, are ``previous``'s, so a save that continues
            from it extends ``previous`` instead.

    Example::

        report = stalwart.shrink.save(model.state_dict(), "ckpt/0.shrunk")
        report = stalwart.shrink.save(model.state_dict(), "ckpt/1.shrunk", previous=report)
        model.load_state_dict(stalwart.shrink.load("ckpt/1.shrunk"))
    """
    start = time.perf_counter()
    _check_arguments(coder, small_tensors, tau, screen_accept, compress_optimizer)
    path = Path(path)
    if not path.parent.is_dir():
        raise ConfigurationError(f"cannot write {path}: directory {path.parent} does not exist")
    chain = _checked_inputs(state_dict, path, previous)
    state_dict = {name: t.detach().cpu() for name, t in state_dict.items()}
    # Only the model's forwards and backwards may gain from idle cores, and they run on training's
    # threads or every core, whichever the clock says is faster (stalwart.shrink.cores; the choice
    # lives on the search, which an adapter keeps across saves). The codec's work (masks,
    # sketches, k-means, entropy coding) is many operations on tensors of ~10^4-10^5 elements that
    # torch's threads slow down: packing the char transformer's first moments took 0.23-0.35 s on
    # training's one thread and 0.29-1.70 s on two (docs/measurements/shrink.md), so it stays on
    # training's.
    choice = search.threads if search is not None else ThreadChoice()
    timed = screen if screen is not None else evaluate
    evaluate, screen, continue_training = (
        None if function is None else choice.wrap(function, timed=function is timed)
        for function in (evaluate, screen, continue_training)
    )
    exact = _non_finite(state_dict)
    analyses = _analyses(
        state_dict, gradients or {}, layer_types or {}, min_numel, chain, exclude=exact
    )
    weights = _quantize(
        state_dict, analyses, small_tensors, chain, config, evaluate, screen, search, tau,
        screen_accept, exact,
    )  # fmt: skip
    moments = _moment_plan(
        extra, compress_optimizer, continue_training, parameter_shapes, weights.restored, tau,
        optimizer_choice,
    )  # fmt: skip
    return _write(
        state_dict, weights, path, chain, extra, compress_optimizer == "lossy", coder,
        min_numel, start, moments, side,
    )  # fmt: skip


def _checked_inputs(
    state_dict: Mapping[str, torch.Tensor],
    path: Path,
    previous: str | os.PathLike | ShrinkReport | None,
) -> ChainState | None:
    """The chain ``previous`` names, once ``state_dict`` and ``path`` can be written as its next
    file; a ConfigurationError saying what to change otherwise."""
    bad = [name for name, t in state_dict.items() if not isinstance(t, torch.Tensor)]
    if bad:
        raise ConfigurationError(f"state_dict values must be tensors; not: {bad[:5]}")
    meta = [name for name, t in state_dict.items() if t.is_meta]
    if meta:
        raise ConfigurationError(
            f"tensors on the meta device have no values to save: {meta[:5]}; materialize the "
            "module (e.g. to_empty() and load or initialize its weights) before saving it"
        )
    chain = _previous_state(previous)
    # Where the write lands: a link at ``path`` is replaced, not the file it points to.
    if chain is not None and chain.path.resolve() == path.parent.resolve() / path.name:
        raise ConfigurationError(
            f"cannot write {path} as a delta on itself: the file it extends would be replaced. "
            "Write to another path, or pass previous=None for a keyframe."
        )
    if chain is not None:
        _check_matches(state_dict, chain)
    return chain


def _check_arguments(
    coder: str, small_tensors: str, tau: float, screen_accept: float, compress_optimizer: str
) -> None:
    check_coder(coder)
    if small_tensors not in SMALL_TENSOR_MODES:
        raise ConfigurationError(
            f"small_tensors must be one of {SMALL_TENSOR_MODES}, got {small_tensors!r}"
        )
    if not tau >= 0.0:
        raise ConfigurationError(f"tau is a relative degradation >= 0, got {tau}")
    check_screen_accept(screen_accept)
    if compress_optimizer not in OPTIMIZER_MODES:
        raise ConfigurationError(
            f"compress_optimizer must be one of {OPTIMIZER_MODES}, got {compress_optimizer!r}"
        )


def _non_finite(state_dict: dict[str, torch.Tensor]) -> set[str]:
    """Floating tensors holding NaN or inf: stored exactly, with a warning.

    Quantizing them would hide a diverged model (a NaN came back as an ordinary number) or fail
    (an inf's log-magnitude bucket sized an 8 GiB histogram); a restore must show what was saved.
    """
    found = {
        name
        for name, tensor in state_dict.items()
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    }
    if found:
        warnings.warn(
            f"{len(found)} tensor(s) hold NaN or inf values, stored exactly (not quantized): "
            f"{sorted(found)[:5]}",
            UserWarning,
            stacklevel=3,
        )
    return found


def _analyses(
    state_dict: dict[str, torch.Tensor],
    gradients: Mapping[str, torch.Tensor],
    layer_types: Mapping[str, str],
    min_numel: int,
    chain: ChainState | None,
    exclude: set[str] = frozenset(),
) -> dict[str, TensorAnalysis]:
    """The tensors to quantize (floating, at least ``min_numel``, not in ``exclude``), each with
    its statistics."""
    analyses = {
        name: TensorAnalysis(
            tensor, gradients.get(name), layer_types.get(name) or guess_layer_type(name, tensor)
        )
        for name, tensor in state_dict.items()
        if tensor.is_floating_point() and tensor.numel() >= min_numel and name not in exclude
    }
    if chain is not None:
        for name, analysis in analyses.items():
            analysis.previous_levels = chain.levels.get(name)
    return analyses


@dataclass
class _Weights:
    """How the weights are stored: what was quantized, rounded, and how that was chosen."""

    quantized: dict[str, QuantizedTensor]
    rounded: set[str]
    restored: dict[str, torch.Tensor]
    config: QuantConfig | None
    analyses: dict[str, TensorAnalysis]
    degradation: float | None = None
    degradation_on: str | None = None
    bound: float | None = None
    searched: str | None = None
    search_seconds: float = 0.0
    evaluations: int = 0
    screenings: int = 0


def _quantize(
    state_dict: dict[str, torch.Tensor],
    analyses: dict[str, TensorAnalysis],
    small_tensors: str,
    chain: ChainState | None,
    config: QuantConfig | None,
    evaluate: Callable[[Mapping[str, torch.Tensor]], float] | None,
    screen: Callable[[Mapping[str, torch.Tensor]], float] | None,
    search: ConfigSearch | None,
    tau: float,
    screen_accept: float,
    exact: set[str] = frozenset(),
) -> _Weights:
    """Quantize with ``config``, or the configuration a search finds within ``tau``; the
    tensors in ``exact`` stay as they are."""
    rounded = {}
    if small_tensors == "bfloat16":
        rounded = {
            name: tensor.to(torch.bfloat16).to(tensor.dtype)
            for name, tensor in state_dict.items()
            if name not in analyses and name not in exact and tensor.dtype == torch.float32
        }
    found = {}
    if config is None and evaluate is not None:
        search = search or ConfigSearch(tau, screen_accept=screen_accept)
        if chain is not None and search.previous is None and chain.config is not None:
            search.previous = chain.config
        outcome = run_within_bound(search, analyses, state_dict, evaluate, screen, fixed=rounded)
        config, quantized = outcome.config, outcome.quantized
        found = {
            "degradation": outcome.degradation,
            "bound": search.bound,
            "search_seconds": outcome.seconds,
            "evaluations": outcome.evaluations,
            "screenings": outcome.screenings,
        }
        if config is not None:
            found["degradation_on"] = "evaluate" if outcome.confirmed else "screen"
            found["searched"] = "full" if outcome.exhaustive else "neighbourhood"
        else:
            rounded = {}  # nothing met tau: every tensor is stored exactly
    else:
        config = config if config is not None else DEFAULT_CONFIG
        quantized = {name: a.quantize(config) for name, a in analyses.items()}
    restored = {
        name: quantized[name].dequantize() if name in quantized else rounded.get(name, tensor)
        for name, tensor in state_dict.items()
    }
    return _Weights(quantized, set(rounded), restored, config, analyses, **found)


@dataclass
class _MomentPlan:
    """How the optimizer states in ``extra`` are written: a form per moment tensor (by id)."""

    forms: dict[int, str]
    tensor_ids: set[int]
    raw_bytes: int
    choice: MomentChoice | None
    signature: list
    #: Whether compress_optimizer="lossy" quantized (unchecked) any of the optimizer's tensors.
    lossy: bool = False


#: How a file written with ``compress_optimizer="lossy"`` names its optimizer state's form.
LOSSY_OPTIMIZER_SETTING = f"lossy ({LOSSY_OPTIMIZER_CONFIG.bins} levels, unchecked)"


def _moment_plan(
    extra: Any,
    mode: str,
    continue_training: ContinueTraining | None,
    parameter_shapes: Sequence[Mapping[Any, tuple[int, ...]]] | None,
    restored: dict[str, torch.Tensor],
    tau: float,
    kept: MomentChoice | None = None,
) -> _MomentPlan:
    states = optimizer_states(extra)
    ids = {
        id(value)
        for state in states
        for per_parameter in state["state"].values()
        if isinstance(per_parameter, Mapping)
        for value in per_parameter.values()
        if isinstance(value, torch.Tensor)
    }
    raw = _tensor_bytes([state["state"] for state in states])
    signature = [optimizer_signature(state) for state in states]
    plan = _MomentPlan({}, ids, raw, None, signature)  # lossy: set once packed (_pack_extra)
    if mode != "auto" or not states:
        return plan
    found = []
    for index, state in enumerate(states):
        shapes = None
        if parameter_shapes is not None:
            shapes = parameter_shapes[index] if index < len(parameter_shapes) else {}
        moments, notes = moments_of(state, shapes)
        for note in notes:
            warnings.warn(note, UserWarning, stacklevel=3)
        found.append(moments)
    if not any(found):
        # E.g. Adagrad's "sum", or only scalar parameters: a continuation check would compare
        # the exact state with itself and "choose" a compressed setting that compresses nothing.
        reason = "nothing to compress: no known moments with elements in the optimizer state"
        plan.choice = MomentChoice(LOSSLESS, None, [], reason=reason)
        return plan
    layout = moment_layout(found)
    if kept is not None and kept.layout is not None and kept.layout != layout:
        # Moments the check never saw (a parameter group added, a layer unfrozen) would be
        # stored in its setting unchecked: this save checks again.
        kept = None
    if kept is not None:
        reason = f"reused: continuation {kept.degradation:+.4f} at its last check"
        plan.choice = MomentChoice(
            kept.setting, None, [], reason=reason, reused=True, layout=kept.layout
        )
    elif continue_training is None:
        plan.choice = MomentChoice(LOSSLESS, None, [], reason="no continuation check available")
        return plan
    else:
        plan.choice = choose_setting(
            states, found, lambda candidate: continue_training(restored, list(candidate)), tau
        )
        plan.choice.layout = layout
    setting = plan.choice.setting
    plan.forms = {id(m.tensor): effective_form(m, setting) for ms in found for m in ms}
    return plan


def _write(
    state_dict: dict[str, torch.Tensor],
    weights: _Weights,
    path: Path,
    chain: ChainState | None,
    extra: Any,
    lossy_extra: bool,
    coder: str,
    min_numel: int,
    start: float,
    moments: _MomentPlan,
    side: bool,
) -> ShrinkReport:
    sections = SectionWriter()
    entries: dict[str, dict] = {}
    for name, tensor in state_dict.items():
        if name in weights.quantized:
            previous = None if chain is None else chain.indices.get(name)
            entries[name] = quantized_entry(
                weights.quantized[name], previous, coder, sections,
                weights.analyses[name].layer_type,
            )  # fmt: skip
        elif name in weights.rounded:
            entries[name] = bfloat16_entry(tensor, sections)
        else:
            entries[name] = lossless_entry(tensor, sections)
    weight_stored = entries_bytes(entries)
    packed_extra, optimizer_stored = _pack_extra(
        extra, sections, lossy_extra, min_numel, coder, moments
    )
    header = _header(
        state_dict, weights, path, chain, extra, coder, entries, packed_extra, moments,
        optimizer_stored, side,
    )  # fmt: skip
    size, crc = sections.write(path, header, header["format"])
    # Header and framing are charged to the weights: the header is mostly their tensor table.
    extra_stored = sections.size - weight_stored
    follow = chain  # what a following delta extends: a side file's base, else this file
    if not side:
        follow = ChainState(
            path=path,
            crc32=crc,
            position=header["chain_position"],
            since_keyframe=header["chain_position"],
            shapes={name: tuple(t.shape) for name, t in state_dict.items()},
            indices={name: (q.indices, q.alphabet) for name, q in weights.quantized.items()},
            config=weights.config,
            levels={name: q.levels for name, q in weights.quantized.items()},
            optimizer_signature=moments.signature,
        )
    return _report(
        path, header, weights, chain, follow, size, size - extra_stored, start, moments,
        optimizer_stored,
    )  # fmt: skip


def _report(
    path: Path,
    header: dict,
    weights: _Weights,
    chain: ChainState | None,
    follow: ChainState | None,
    size: int,
    weight_stored: int,
    start: float,
    moments: _MomentPlan,
    optimizer_stored: int,
) -> ShrinkReport:
    return ShrinkReport(
        path=str(path),
        kind=header["kind"],
        base=None if chain is None else str(chain.path),
        chain_position=header["chain_position"],
        config=weights.config,
        degradation=weights.degradation,
        degradation_on=weights.degradation_on,
        bound=weights.bound,
        search=weights.searched,
        weight_bytes=header["weight_bytes"],
        weight_stored=weight_stored,
        total_bytes=header["weight_bytes"] + header["extra_bytes"],
        total_stored=size,
        seconds=time.perf_counter() - start,
        search_seconds=weights.search_seconds,
        evaluations=weights.evaluations,
        screenings=weights.screenings,
        optimizer_bytes=moments.raw_bytes,
        optimizer_stored=optimizer_stored,
        optimizer=moments.choice,
        side=bool(header["side"]),
        chain=follow,
    )


def _pack_extra(
    extra: Any,
    sections: SectionWriter,
    lossy_extra: bool,
    min_numel: int,
    coder: str,
    moments: _MomentPlan,
) -> tuple[dict | None, int]:
    """``extra`` packed into ``sections``, and the stored bytes of its optimizer moments."""
    if extra is None:
        return None, 0
    packed_ids: list[int] = []
    packed = pack_object(
        extra,
        sections,
        lossy=LOSSY_OPTIMIZER_CONFIG if lossy_extra else None,
        min_numel=min_numel,
        coder=coder,
        forms=moments.forms,
        ids=packed_ids,
    )
    optimizer_entries = [
        entry
        for index, entry in enumerate(packed["tensors"])
        if packed_ids[index] in moments.tensor_ids
    ]
    # Named lossy only where "lossy" quantized an optimizer tensor: one without state tensors
    # (SGD without momentum), or with only small or non-floating ones, is stored exactly.
    moments.lossy = lossy_extra and any(e["encoding"] == "quantized" for e in optimizer_entries)
    return packed, entries_bytes(dict(enumerate(optimizer_entries)))


def _header(
    state_dict: dict[str, torch.Tensor],
    weights: _Weights,
    path: Path,
    chain: ChainState | None,
    extra: Any,
    coder: str,
    entries: dict[str, dict],
    packed_extra: dict | None,
    moments: _MomentPlan,
    optimizer_stored: int,
    side: bool,
) -> dict:
    base = None
    if chain is not None:
        base = {"file": os.path.relpath(chain.path, path.parent), "crc32": chain.crc32}
    version = format_version(
        {**entries, **dict(enumerate(packed_extra["tensors"] if packed_extra else []))},
        weights.config,
    )
    choice = moments.choice
    # Without a choice the moments are lossless, unless "lossy" quantized them: the listing
    # (`stalwart shrink inspect`) showed such files as lossless.
    setting = LOSSY_OPTIMIZER_SETTING if moments.lossy else None
    return {
        "format": version,
        "kind": "keyframe" if chain is None else "delta",
        "base": base,
        "chain_position": 0 if chain is None else chain.position + 1,
        "side": side,  # no later save extends it (older readers ignore the key)
        "coder": coder,
        "config": None if weights.config is None else weights.config.to_dict(),
        "degradation": weights.degradation,
        "degradation_on": weights.degradation_on,
        "bound": weights.bound,
        "search": weights.searched,
        "order": list(state_dict),
        "tensors": entries,
        "extra": packed_extra,
        "weight_bytes": _tensor_bytes(state_dict),
        "extra_bytes": _tensor_bytes(extra),
        "optimizer": {
            "bytes": moments.raw_bytes,
            "stored": optimizer_stored,
            "signature": moments.signature,
            "setting": setting if choice is None else choice.setting.describe(),
            "degradation": None if choice is None else choice.degradation,
            "tried": [] if choice is None else choice.tried,
            "reused": choice is not None and choice.reused,
        },
    }


def load(path: str | os.PathLike, *, map_location: Any = "cpu") -> dict[str, torch.Tensor]:
    """The state_dict saved at ``path``, decoded through its delta chain (keyframe first).

    Raises :class:`~stalwart.errors.CorruptCheckpointError` naming the file when any file of the
    chain is torn, corrupted, missing or replaced.
    """
    _, tensors, _ = decode_chain(path)
    return {name: t.to(map_location) for name, t in tensors.items()}


def load_with_extra(
    path: str | os.PathLike, *, weights_only: bool = True
) -> tuple[dict[str, torch.Tensor], Any, ChainState]:
    """The state_dict, the ``extra`` object, and the chain state to continue the chain from.

    ``extra``'s non-tensor part is unpickled with ``weights_only`` as ``torch.load`` does
    (default True: plain containers and numbers only, so a file from elsewhere runs no code;
    :class:`~stalwart.errors.UnsafeCheckpointError` says what it refused). Pass False only for
    files you trust.
    """
    container, tensors, chain = decode_chain(path)
    packed = container.header.get("extra")
    if packed is None:
        return tensors, None, chain
    return tensors, unpack_object(container, packed, weights_only=weights_only), chain
