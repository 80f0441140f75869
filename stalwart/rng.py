"""Capture and restore every random number generator a training run draws from.

Lightning's checkpoints leave RNG out, so a resumed run shuffles and drops out differently from the
uninterrupted one. The states are stored as tensors and plain Python values only, so checkpoints
stay loadable with ``torch.load(weights_only=True)`` (Lightning's default).
"""

from __future__ import annotations

import random

import numpy as np
import torch

RNG_KEY = "stalwart_rng"


def capture_rng() -> dict:
    """The states of Python's, NumPy's, torch's CPU and every CUDA device's generator."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "python": {
            "version": version,
            "state": torch.from_numpy(np.array(internal, dtype=np.int64)),
            "gauss": gauss,
        },
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
        # A process that never initialized CUDA has drawn nothing from its generators (and
        # is_available() costs ~75 us once Lightning is imported: it asks NVML every call).
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
    }


def restore_rng(state: dict) -> None:
    """Put every generator back where :func:`capture_rng` found it."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
