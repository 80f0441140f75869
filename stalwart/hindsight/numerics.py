"""The torch settings that decide a run's floating-point results, captured and restored.

Replay is only bit-exact if it computes the way the record did. Besides RNG state (see
:mod:`stalwart.rng`), torch's numerics depend on process-wide settings: the number of
intra-op threads (a parallel reduction splits its sum differently with 1 thread than with 2),
deterministic algorithms, the float32 matmul precision and cuDNN's flags. The record stores them
in its manifest; each replay process restores them before it computes anything.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

#: Manifest key under which a run's numerics settings are stored.
NUMERICS_KEY = "numerics"


def capture_numerics() -> dict[str, Any]:
    """This process's numerics settings, as plain JSON values."""
    return {
        "torch_threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
    }


def restore_numerics(settings: Mapping[str, Any]) -> None:
    """Apply settings from :func:`capture_numerics`; keys a record lacks are left alone."""
    if "torch_threads" in settings:
        torch.set_num_threads(int(settings["torch_threads"]))
    if "deterministic" in settings:
        torch.use_deterministic_algorithms(
            bool(settings["deterministic"]),
            warn_only=bool(settings.get("deterministic_warn_only", False)),
        )
    if "float32_matmul_precision" in settings:
        torch.set_float32_matmul_precision(settings["float32_matmul_precision"])
    if "cudnn_deterministic" in settings:
        torch.backends.cudnn.deterministic = bool(settings["cudnn_deterministic"])
    if "cudnn_benchmark" in settings:
        torch.backends.cudnn.benchmark = bool(settings["cudnn_benchmark"])


@contextmanager
def recorded_numerics(settings: Mapping[str, Any]) -> Iterator[None]:
    """Compute with the record's settings inside the block, then put this process's back."""
    own = capture_numerics()
    restore_numerics(settings)
    try:
        yield
    finally:
        restore_numerics(own)
