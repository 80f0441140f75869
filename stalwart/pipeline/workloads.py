"""Workloads for the pipeline runtime: a model as a list of layers, a loss and micro-batches.

A workload is named by import path (``"stalwart.pipeline.workloads:DigitsMLP"``) plus keyword
arguments, so every worker process builds the same model from the same seed and reads the same
micro-batch for (step, micro-batch id) — which is what lets a shadow redo a victim's work
exactly and lets the tests compare loss sequences across runs.

Example:
    >>> w = DigitsMLP(hidden=32, depth=4)
    >>> x, y = w.microbatch(step=0, index=1, num_microbatches=4, batch_size=16)
    >>> x.shape, y.shape
    (torch.Size([4, 64]), torch.Size([4]))
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch import nn

from stalwart.errors import ConfigurationError


class PipelineWorkload:
    """Interface: ``layers()`` (fresh, seeded by the caller), ``microbatch()``, ``loss()``."""

    def layers(self) -> list[nn.Module]:
        raise NotImplementedError

    def microbatch(
        self, step: int, index: int, num_microbatches: int, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def _rows(step: int, index: int, num_microbatches: int, batch_size: int, n: int) -> torch.Tensor:
    if batch_size % num_microbatches:
        raise ConfigurationError(
            f"batch_size={batch_size} is not a multiple of num_microbatches={num_microbatches}."
        )
    per = batch_size // num_microbatches
    start = step * batch_size + index * per
    return torch.arange(start, start + per) % n


def _digits() -> np.ndarray:
    """scikit-learn's bundled digits table (64 pixels + label per row), read from its data file:
    importing scikit-learn costs seconds in every worker process, the file read milliseconds."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigurationError(
            "DigitsMLP needs scikit-learn installed (pip install scikit-learn)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    return np.loadtxt(path, delimiter=",")


class DigitsMLP(PipelineWorkload):
    """scikit-learn's bundled 8x8 digits (1,797 images), an MLP of ``depth`` hidden layers.

    Args:
        hidden: hidden width.
        depth: number of hidden Linear+Tanh blocks (the model has ``2 * depth + 1`` layers).
    """

    def __init__(self, hidden: int = 64, depth: int = 4) -> None:
        data = _digits()
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
        self.x = torch.tensor(data[:, :-1], dtype=torch.float32)[order] / 16.0
        self.y = torch.tensor(data[:, -1], dtype=torch.long)[order]
        self.hidden, self.depth = hidden, depth

    def layers(self) -> list[nn.Module]:
        out: list[nn.Module] = []
        width = 64
        for _ in range(self.depth):
            out += [nn.Linear(width, self.hidden), nn.Tanh()]
            width = self.hidden
        return [*out, nn.Linear(width, 10)]

    def microbatch(self, step, index, num_microbatches, batch_size):
        rows = _rows(step, index, num_microbatches, batch_size, len(self.y))
        return self.x[rows], self.y[rows]


class Block(nn.Module):
    """A pre-norm causal transformer block (one pipeline layer)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(context, dim) / math.sqrt(dim))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos[: idx.shape[1]]


class Head(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class CharLM(PipelineWorkload):
    """A small character transformer LM on the Python standard library's own source text.

    Args:
        dim: model width.
        blocks: transformer blocks (the model has ``blocks + 2`` layers).
        context: characters per sample.
        heads: attention heads.
        max_chars: how much text to read.
    """

    def __init__(
        self, dim: int = 64, blocks: int = 4, context: int = 64, heads: int = 4,
        max_chars: int = 400_000,
    ) -> None:  # fmt: skip
        root = Path(sysconfig.get_paths()["stdlib"])
        text = ""
        for path in sorted(root.glob("*.py")):
            text += path.read_text(encoding="utf-8", errors="replace")
            if len(text) >= max_chars:
                break
        data = torch.tensor(list(text[:max_chars].encode("ascii", errors="replace")))
        self.data = data.clamp(max=127)
        self.dim, self.blocks, self.context, self.heads = dim, blocks, context, heads

    def layers(self) -> list[nn.Module]:
        return [
            Embed(128, self.dim, self.context),
            *[Block(self.dim, self.heads) for _ in range(self.blocks)],
            Head(128, self.dim),
        ]

    def microbatch(self, step, index, num_microbatches, batch_size):
        windows = (len(self.data) - 1) // self.context
        rows = _rows(step, index, num_microbatches, batch_size, windows)
        starts = (rows * 7919 % windows) * self.context  # spread samples over the text
        offsets = starts[:, None] + torch.arange(self.context + 1)
        chunk = self.data[offsets]
        return chunk[:, :-1], chunk[:, 1:]


# Workloads handed over in memory (e.g. a LightningModule's layers and data): forked workers
# inherit this table, so the object needs no import path and is never pickled.
IN_MEMORY: dict[str, PipelineWorkload] = {}


def load_workload(spec: str, kwargs: dict | None = None) -> PipelineWorkload:
    """``package.module:Class`` + kwargs -> a workload instance (or an ``IN_MEMORY`` name)."""
    if spec in IN_MEMORY:
        return IN_MEMORY[spec]
    module_name, _, attr = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigurationError(
            f"workload {spec!r} cannot be imported ({exc}): write it as package.module:Class."
        ) from None
    return cls(**(kwargs or {}))
