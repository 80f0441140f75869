"""Optimizer state in a shrunken checkpoint: which tensors are moments, and how cheaply each may be
stored.

Adam's two moments are twice the size of the weights, so they decide what a checkpoint costs on
disk. Neither needs the weights' precision to resume training well:

* the **first moment** (``exp_avg``, SGD's ``momentum_buffer``) is a short average of recent
  gradients (beta1 = 0.9: about ten steps) whose mass sits in few coordinates: ExCP-style, its
  smaller three quarters are pruned and the rest quantized to 4 non-uniform levels (``sparse``),
  its smaller half pruned and the rest at 8 levels (``pruned``), or 16 levels without pruning
  (``quantized``). (Restored as zeros it is rebuilt within those ten steps, but
  that cost measurably more than the ladder allows; see :data:`LADDER`.)
* the **second moment** (``exp_avg_sq``) only scales each coordinate's step. Adafactor (Shazeer &
  Stern, 2018) trains with its row and column sums alone (``v_ij ~ r_i c_j / sum(r)``): a matrix's
  second moment is stored in ``rows + columns`` numbers (bfloat16: the estimate is far coarser
  than their rounding). Where that is too coarse, ``log`` stores each value on a fixed
  half-octave grid (the step size it implies is within 9% of the exact one); the grid is
  absolute, so a value that did not move keeps its index from one checkpoint to the next.

Which of these a checkpoint uses is decided by measurement, like the weights' quantization: the
:data:`LADDER` of settings is tried from the most compressed, and the first whose short
continuation of training (a few optimizer steps from the restored weights, then the held-out loss)
is within ``tau`` of the same continuation from the exact state is written (:func:`choose_setting`).
Anything else in an optimizer's state (step counts, an unknown optimizer's buffers, tensors whose
shape is not their parameter's) is stored losslessly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stalwart.shrink.partition import QuantConfig
from stalwart.shrink.quantize import TensorAnalysis

FIRST_MOMENTS = frozenset({"exp_avg", "momentum_buffer"})
SECOND_MOMENTS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg"})
FIRST_FORMS = ("zero", "sparse", "pruned", "quantized", "lossless")
SECOND_FORMS = ("factored", "log", "lossless")
FIRST_MOMENT_CONFIG = QuantConfig(bins=16, prune=0.0, prune_metric="magnitude", protect=0.01)
# ExCP's observation: most of a momentum's mass sits in few coordinates; the smaller half is
# zeroed and the rest gets 8 levels (~1.5 bits an element after entropy coding).
PRUNED_MOMENT_CONFIG = QuantConfig(bins=8, prune=0.5, prune_metric="magnitude", protect=0.005)
# Further along the same line: three quarters zeroed, the largest quarter at 4 levels (~1.3 bits).
SPARSE_MOMENT_CONFIG = QuantConfig(bins=4, prune=0.75, prune_metric="magnitude", protect=0.005)
FIRST_MOMENT_CONFIGS = {
    "quantized": FIRST_MOMENT_CONFIG,
    "pruned": PRUNED_MOMENT_CONFIG,
    "sparse": SPARSE_MOMENT_CONFIG,
}
# Half-octave grid for second moments: v = 2 ** (index / LOG_STEPS). The Adam step scales with
# 1/sqrt(v), so rounding log2(v) to the nearest half moves it by at most 2 ** (1/8) - 1 = 9%.
LOG_STEPS = 2
LOG_ZERO = 0  # index of an exact zero (a coordinate that never had a gradient)
LOG_LEVELS = 255  # indices 1..255 cover the top 127 octaves present; anything lower is clamped up
# The factored form's row and column sums are stored in bfloat16: rounding each by <= 2**-8 moves
# the estimate r_i c_j / sum(r) by < 1.2%, where the rank-one estimate itself is off from the
# exact second moment by factors (it keeps one number per row and column). In float32 the sums
# were ~10% of a char-transformer chain's bytes (3.6 bytes each after byte-plane coding, 1.5 in
# bfloat16).
SUMS_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class MomentSetting:
    """How a checkpoint stores its optimizers' moments.

    Args:
        first: ``"zero"`` (not stored; restored as zeros), ``"sparse"`` (75% pruned, 4
            levels), ``"pruned"`` (50% pruned, 8 levels), ``"quantized"`` (16 non-uniform
            levels) or ``"lossless"``.
        second: ``"factored"`` (row and column sums of each matrix, in bfloat16; vectors fall
            back to ``"log"``), ``"log"`` (half-octave grid) or ``"lossless"``.
    """

    first: str
    second: str

    def __post_init__(self) -> None:
        if self.first not in FIRST_FORMS or self.second not in SECOND_FORMS:
            raise ValueError(f"unknown moment setting {self.first!r}/{self.second!r}")

    @property
    def lossless(self) -> bool:
        return self.first == "lossless" and self.second == "lossless"

    def describe(self) -> str:
        return "lossless" if self.lossless else f"first {self.first}, second {self.second}"

    def form_of(self, role: str) -> str:
        return self.first if role == "first" else self.second


LOSSLESS = MomentSetting("lossless", "lossless")
#: Most compressed first; the last rung needs no check.
#
#: No rung zeroes the first moment: a 4-step check passes it (a smaller first step even lowers the
#: loss), but on the digits CNN restored after every epoch (~20 steps each) it ended 30% above the
#: lossless optimizer's held-out loss, where "pruned" ended within 3% (tests/shrink and
#: docs/measurements/shrink.md). The form stays available to a caller's own ladder. "sparse" (75%
#: pruned) was measured through 5-7 restores on the digits CNN and the char transformer, 3 seeds
#: each, before it became the first rung: final metric as with "pruned", whole checkpoints 32-41x
#: instead of 24-32x (docs/measurements/shrink.md).
LADDER = (
    MomentSetting("sparse", "factored"),
    MomentSetting("pruned", "factored"),
    MomentSetting("pruned", "log"),
    MomentSetting("quantized", "factored"),
    MomentSetting("quantized", "log"),
    MomentSetting("quantized", "lossless"),
    LOSSLESS,
)


def is_optimizer_state(value: Any) -> bool:
    """An ``Optimizer.state_dict()`` (torch's layout: ``state`` per parameter, ``param_groups``)."""
    return (
        isinstance(value, Mapping)
        and isinstance(value.get("state"), Mapping)
        and isinstance(value.get("param_groups"), list)
    )


def optimizer_states(obj: Any) -> list[Mapping]:
    """Every optimizer state dict inside a checkpoint object, in a stable (depth-first) order."""
    found: list[Mapping] = []

    def walk(value: Any) -> None:
        if is_optimizer_state(value):
            found.append(value)
        elif isinstance(value, Mapping):
            for item in value.values():
                walk(item)
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)

    walk(obj)
    return found


def optimizer_signature(state: Mapping) -> list:
    """What identifies an optimizer's kind in its state dict: the sorted per-parameter state keys
    and the sorted hyperparameter names of its groups (JSON-friendly)."""
    keys = sorted(
        {
            str(key)
            for per_parameter in state["state"].values()
            if isinstance(per_parameter, Mapping)
            for key in per_parameter
        }
    )
    hyperparameters = sorted(
        {str(key) for group in state["param_groups"] for key in group} - {"params"}
    )
    return [keys, hyperparameters]


@dataclass
class Moment:
    """One moment tensor of one parameter."""

    key: str  # e.g. "exp_avg"
    parameter: Any  # the optimizer state's key for the parameter (an index, or a name)
    role: str  # "first" or "second"
    tensor: torch.Tensor


def moments_of(
    state: Mapping, parameter_shapes: Mapping[Any, tuple[int, ...]] | None
) -> tuple[list[Moment], list[str]]:
    """The compressible moments of one optimizer state dict, and why anything else is not.

    A tensor is a moment when its key is a known first or second moment, it is floating point,
    has at least one dimension and one element, and (when ``parameter_shapes`` is given) has its
    parameter's shape; everything else stays lossless, and the notes say what was kept so and why
    (one line each, for the user's log).
    """
    moments: list[Moment] = []
    unknown: set[str] = set()
    misshapen: set[str] = set()
    too_small: set[str] = set()
    non_finite: set[str] = set()
    for parameter, per_parameter in state["state"].items():
        if not isinstance(per_parameter, Mapping):
            unknown.add(type(per_parameter).__name__)
            continue
        for key, value in per_parameter.items():
            if key == "step":
                continue
            role = "first" if key in FIRST_MOMENTS else "second" if key in SECOND_MOMENTS else None
            if role is None or not isinstance(value, torch.Tensor) or not value.is_floating_point():
                unknown.add(key)
                continue
            if value.dim() == 0 or value.numel() == 0:
                # A scalar's or an empty parameter's moment: no form stores it in fewer bytes
                # (and none has a row or a quantile to compute).
                too_small.add(key)
                continue
            if not bool(torch.isfinite(value).all()):
                non_finite.add(key)  # exact, so a restore shows what diverged
                continue
            expected = None if parameter_shapes is None else parameter_shapes.get(parameter)
            if parameter_shapes is not None and (
                expected is None or tuple(expected) != tuple(value.shape)
            ):
                misshapen.add(key)
                continue
            if role == "second" and bool((value < 0).any()):
                unknown.add(key)  # not a second moment after all
                continue
            moments.append(Moment(key, parameter, role, value))
    notes = []
    if too_small:
        notes.append(
            f"optimizer moments {sorted(too_small)} of scalar (0-dim) or empty parameters: "
            "stored losslessly (nothing to compress)"
        )
    if non_finite:
        notes.append(
            f"optimizer moments {sorted(non_finite)} hold NaN or inf values: stored exactly"
        )
    if unknown:
        notes.append(f"optimizer state {sorted(unknown)} is not a known moment: stored losslessly")
    if misshapen:
        notes.append(
            f"optimizer state {sorted(misshapen)} does not have its parameter's shape: stored "
            "losslessly"
        )
    return moments, notes


# --- the forms: reconstruction (what a restore will see) and the stored payload ---------------


def factored(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row sums, column sums) of a non-negative tensor seen as ``shape[0] x rest``, rounded to
    :data:`SUMS_DTYPE` (what a file stores and a restore sees)."""
    matrix = tensor.detach().float().reshape(tensor.shape[0], -1)
    return matrix.sum(dim=1).to(SUMS_DTYPE), matrix.sum(dim=0).to(SUMS_DTYPE)


def unfactored(
    rows: torch.Tensor, columns: torch.Tensor, shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """Adafactor's rank-one estimate ``r c^T / sum(r)`` (zeros where everything is zero)."""
    total = rows.double().sum()
    if float(total) <= 0.0:
        return torch.zeros(tuple(shape), dtype=dtype)
    estimate = (rows.double()[:, None] * columns.double()[None, :]) / total
    return estimate.reshape(tuple(shape)).to(dtype)


def log_indices(tensor: torch.Tensor) -> tuple[np.ndarray, int]:
    """(uint8 indices, offset) of a non-negative tensor on the half-octave grid."""
    values = tensor.detach().double().reshape(-1).numpy()
    positive = values > 0
    grid = np.zeros(values.size, dtype=np.int64)
    grid[positive] = np.rint(np.log2(values[positive]) * LOG_STEPS).astype(np.int64)
    top = int(grid[positive].max()) if positive.any() else 0
    offset = top - LOG_LEVELS  # index 1 = offset + 1; lower values are clamped up to it
    indices = np.zeros(values.size, dtype=np.uint8)
    indices[positive] = np.clip(grid[positive] - offset, 1, LOG_LEVELS)
    return indices, offset


def from_log_indices(
    indices: np.ndarray, offset: int, shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    exponents = (indices.astype(np.float64) + offset) / LOG_STEPS
    values = np.where(indices == LOG_ZERO, 0.0, np.exp2(exponents))
    return torch.from_numpy(values).reshape(tuple(shape)).to(dtype)


def effective_form(moment: Moment, setting: MomentSetting) -> str:
    """The form ``setting`` gives ``moment`` (vectors cannot be factored: they use the grid)."""
    form = setting.form_of(moment.role)
    if form == "factored" and moment.tensor.dim() < 2:
        return "log"
    return form


def reconstruct(moment: Moment, form: str) -> torch.Tensor:
    """What a restore of ``moment`` stored in ``form`` gives back."""
    tensor = moment.tensor.detach().cpu()
    if form == "lossless":
        return tensor
    if form == "zero":
        return torch.zeros_like(tensor)
    if form in FIRST_MOMENT_CONFIGS:
        return TensorAnalysis(tensor).quantize(FIRST_MOMENT_CONFIGS[form]).dequantize()
    if form == "factored":
        return unfactored(*factored(tensor), tensor.shape, tensor.dtype)
    if form == "log":
        indices, offset = log_indices(tensor)
        return from_log_indices(indices, offset, tensor.shape, tensor.dtype)
    raise ValueError(f"unknown moment form {form!r}")


def with_setting(
    states: Sequence[Mapping],
    moments: Sequence[Sequence[Moment]],
    setting: MomentSetting,
) -> list[dict]:
    """Copies of ``states`` whose moments are replaced by what ``setting`` restores."""
    out = []
    for state, found in zip(states, moments, strict=True):
        per_parameter = {key: dict(value) for key, value in state["state"].items()}
        for moment in found:
            per_parameter[moment.parameter][moment.key] = reconstruct(
                moment, effective_form(moment, setting)
            )
        out.append({**state, "state": per_parameter})
    return out


# --- choosing a setting by a short continuation of training -----------------------------------

ContinueTraining = Callable[[Sequence[Mapping]], float]


@dataclass
class MomentChoice:
    """The setting a checkpoint's optimizer state was written with, and the check behind it."""

    setting: MomentSetting
    degradation: float | None  # the continuation's relative loss increase; None: not checked
    tried: list[tuple[str, float]]  # (setting, degradation) of every candidate, in order
    seconds: float = 0.0
    reason: str = ""
    reused: bool = False  # the setting of an earlier save's check, taken without one here
    #: The moments the check was run on (see :func:`moment_layout`): a later save reuses the
    #: setting only for the same ones.
    layout: list | None = None

    def describe(self) -> str:
        if self.degradation is None:
            return f"{self.setting.describe()} ({self.reason or 'not checked'})"
        return f"{self.setting.describe()} (continuation {self.degradation:+.4f})"


def moment_layout(moments: Sequence[Sequence[Moment]]) -> list:
    """Which moments there are, per optimizer state: (parameter, key, shape) of each, sorted."""
    return [
        sorted((str(m.parameter), m.key, tuple(m.tensor.shape)) for m in found) for found in moments
    ]


def relative_increase(loss: float, reference: float) -> float:
    if not math.isfinite(loss):
        return math.inf
    return (loss - reference) / max(abs(reference), 1e-12)


def choose_setting(
    states: Sequence[Mapping],
    moments: Sequence[Sequence[Moment]],
    continue_training: ContinueTraining,
    tau: float,
    ladder: Sequence[MomentSetting] = LADDER,
) -> MomentChoice:
    """The most compressed setting of ``ladder`` whose continuation is within ``tau``.

    ``continue_training(states) -> held-out loss`` continues training a few steps from the
    restored weights with the given optimizer states (and puts everything back). The reference is
    the same continuation from the exact states; the last rung (lossless) needs no check.
    """
    start = time.perf_counter()
    reference = continue_training(states)
    tried: list[tuple[str, float]] = []
    for setting in ladder:
        if setting.lossless:
            break
        loss = continue_training(with_setting(states, moments, setting))
        increase = relative_increase(loss, reference)
        tried.append((setting.describe(), increase))
        if increase <= tau:
            return MomentChoice(setting, increase, tried, time.perf_counter() - start)
    return MomentChoice(
        LOSSLESS, 0.0, tried, time.perf_counter() - start, reason="no lossy setting within tau"
    )
