"""``ShrinkCheckpointIO``: Lightning checkpoints written and read in the shrunken format."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO

from stalwart.errors import ConfigurationError
from stalwart.hindsight.checkpoint_file import temp_path_for
from stalwart.shrink.api import ShrinkReport, load_with_extra, save
from stalwart.shrink.codec import ChainState
from stalwart.shrink.container import is_shrunk_file, read_header
from stalwart.shrink.partition import QuantConfig
from stalwart.shrink.search import ConfigSearch

OPTIMIZER_MODES = ("lossless", "lossy")
RETIRED_FILE = ".shrink-retired.json"


@dataclass
class ShrinkRequest:
    """What a caller (``ShrinkCheckpoint``) adds to one save: passed as ``storage_options``."""

    evaluate: Callable[[Mapping[str, torch.Tensor]], float] | None = None
    gradients: Mapping[str, torch.Tensor] | None = None
    layer_types: Mapping[str, str] | None = None
    search: ConfigSearch | None = None


class ShrinkCheckpointIO(CheckpointIO):
    """Saves Lightning checkpoints as shrunken delta chains; loads them (and plain ones) back.

    The model weights (``checkpoint["state_dict"]``) are quantized and delta-coded against the
    previous checkpoint this plugin wrote; everything else (optimizer state, loops, callbacks) is
    stored losslessly unless ``compress_optimizer="lossy"``. Loading follows the chain, so
    ``trainer.fit(ckpt_path=...)`` resumes from a shrunken file as from any other. A checkpoint
    that a later delta still needs is never deleted: ``remove_checkpoint`` retires it, and it is
    deleted once nothing depends on it.

    Args:
        tau: quality bound when a save comes with an ``evaluate`` function
            (from ``ShrinkCheckpoint``).
        config: fixed :class:`~stalwart.shrink.QuantConfig` for saves without a search
            (default: 16 levels, no pruning, 0.5% protected).
        keyframe_every: a full (non-delta) checkpoint every this many saves; bounds restore time
            and how much one lost file costs.
        compress_optimizer: ``"lossless"`` (default) or ``"lossy"`` (quantized, no delta).
        coder: ``"zstd"`` or ``"huffman"``.
        delegate: the IO that plain (non-shrunken) checkpoints are read with and, when set, the
            one that saves without a :class:`ShrinkRequest` go to.

    Example::

        trainer = Trainer(plugins=[ShrinkCheckpointIO()], callbacks=[ModelCheckpoint(...)])
        trainer.fit(model, datamodule, ckpt_path="checkpoints/epoch=3-step=40.ckpt")
    """

    def __init__(
        self,
        tau: float = 0.05,
        config: QuantConfig | None = None,
        keyframe_every: int = 10,
        compress_optimizer: str = "lossless",
        coder: str = "zstd",
        delegate: CheckpointIO | None = None,
    ) -> None:
        if keyframe_every < 1:
            raise ConfigurationError(f"keyframe_every must be >= 1, got {keyframe_every}")
        if compress_optimizer not in OPTIMIZER_MODES:
            raise ConfigurationError(
                f"compress_optimizer must be one of {OPTIMIZER_MODES}, got {compress_optimizer!r}"
            )
        self.tau = tau
        self.config = config
        self.keyframe_every = keyframe_every
        self.compress_optimizer = compress_optimizer
        self.coder = coder
        self.delegate = delegate
        self.chain: ChainState | None = None
        self.reports: list[ShrinkReport] = []

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        if not isinstance(storage_options, ShrinkRequest) and self.delegate is not None:
            self.delegate.save_checkpoint(checkpoint, path, storage_options)
            return
        request = storage_options if isinstance(storage_options, ShrinkRequest) else ShrinkRequest()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        weights = checkpoint["state_dict"]
        extra = {key: value for key, value in checkpoint.items() if key != "state_dict"}
        previous = self.chain
        if previous is not None and (
            previous.position + 1 >= self.keyframe_every
            or not previous.path.exists()
            or previous.path.resolve() == path.resolve()
            or {n: tuple(t.shape) for n, t in weights.items()} != previous.shapes
        ):
            previous = None
        report = save(
            weights,
            path,
            previous=previous,
            evaluate=request.evaluate,
            tau=self.tau,
            gradients=request.gradients,
            config=self.config if request.evaluate is None else None,
            search=request.search,
            layer_types=request.layer_types,
            extra=extra,
            lossy_extra=self.compress_optimizer == "lossy",
            coder=self.coder,
        )
        self.chain = report.chain
        self.reports.append(report)
        self._collect_retired(path.parent)

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if not is_shrunk_file(path):
            fallback = self.delegate or TorchCheckpointIO()
            return fallback.load_checkpoint(path, map_location=map_location)
        weights, extra, chain = load_with_extra(path)
        checkpoint = dict(extra or {})
        checkpoint["state_dict"] = weights
        # A resumed fit continues the chain it was restored from.
        self.chain = chain
        return checkpoint

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        path = Path(path)
        if not is_shrunk_file(path):
            (self.delegate or TorchCheckpointIO()).remove_checkpoint(path)
            return
        retired = self._retired(path.parent)
        retired.add(path.name)
        self._write_retired(path.parent, retired)
        self._collect_retired(path.parent)

    def _retired(self, directory: Path) -> set[str]:
        try:
            return set(json.loads((directory / RETIRED_FILE).read_text()))
        except (FileNotFoundError, ValueError):
            return set()

    def _write_retired(self, directory: Path, names: set[str]) -> None:
        target = directory / RETIRED_FILE
        temp = temp_path_for(target)
        temp.write_text(json.dumps(sorted(names)))
        os.replace(temp, target)

    def _collect_retired(self, directory: Path) -> None:
        """Delete retired files that no live file depends on, directly or through others."""
        retired = self._retired(directory)
        if not retired:
            return
        bases: dict[str, str | None] = {}
        for candidate in directory.iterdir():
            header = read_header(candidate) if candidate.is_file() else None
            if header is not None:
                base = header.get("base")
                bases[candidate.name] = None if base is None else Path(base["file"]).name
        needed: set[str] = set()
        live = [name for name in bases if name not in retired]
        if self.chain is not None:
            live.append(self.chain.path.name)
        for name in live:
            while name is not None and name not in needed:
                needed.add(name)
                name = bases.get(name)
        for name in sorted(retired - needed):
            (directory / name).unlink(missing_ok=True)
        self._write_retired(directory, retired & needed)
