"""``ShrinkCheckpointIO``: Lightning checkpoints written and read in the shrunken format."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO

from stalwart.shrink.api import ShrinkReport
from stalwart.shrink.chain import OPTIMIZER_MODES, RETIRED_FILE, ChainWriter, ShrinkRequest
from stalwart.shrink.codec import ChainState
from stalwart.shrink.container import is_shrunk_file
from stalwart.shrink.entropy import DEFAULT_CODER
from stalwart.shrink.partition import QuantConfig
from stalwart.shrink.search import check_writer_arguments

__all__ = ["OPTIMIZER_MODES", "RETIRED_FILE", "ShrinkCheckpointIO", "ShrinkRequest"]


class ShrinkCheckpointIO(CheckpointIO):
    """Saves Lightning checkpoints as shrunken delta chains; loads them (and plain ones) back.

    The model weights (``checkpoint["state_dict"]``) are quantized and delta-coded against the
    previous checkpoint this plugin wrote; the optimizer's moments in the form the save's
    continuation check accepts (``ShrinkCheckpoint`` brings one; a save without one keeps them
    lossless); everything else (loops, callbacks) losslessly. Loading follows the chain, so
    ``trainer.fit(ckpt_path=...)`` resumes from a shrunken file as from any other. A checkpoint
    that a later delta still needs is never deleted: ``remove_checkpoint`` retires it, and it is
    deleted once nothing depends on it. Nor is one overwritten: a path written again (such as
    ``ModelCheckpoint(save_last=True)``'s ``last.ckpt``) keeps what a delta still needs aside,
    and from then on is written as a file no later delta extends (see
    :class:`~stalwart.shrink.chain.ChainWriter`; ``ShrinkCheckpoint`` writes its ``last.ckpt``
    so from the start, as does ``storage_options=ShrinkRequest(side=True)``).

    Args:
        tau: quality bound when a save comes with an ``evaluate`` function
            (from ``ShrinkCheckpoint``).
        config: fixed :class:`~stalwart.shrink.QuantConfig` for saves without a search
            (default: 16 levels, no pruning, 0.5% protected).
        keyframe_every: a full (non-delta) checkpoint every this many saves; bounds restore time
            and how much one lost file costs.
        compress_optimizer: ``"auto"`` (default; see
            :class:`~stalwart.shrink.chain.ChainWriter`), ``"lossless"`` or ``"lossy"``.
        coder: entropy coder of the index streams: ``"auto"`` (default: per stream the
            smallest of rANS per previous level, rANS, and run lengths + zstd), ``"ans-grouped"``,
            ``"ans"``, ``"zstd"`` or ``"huffman"``.
        delegate: the IO that plain (non-shrunken) checkpoints are read with and, when set, the
            one that saves without a :class:`ShrinkRequest` go to.
        background: shrink each checkpoint in a forked child while training goes on (see
            :class:`~stalwart.shrink.chain.ChainWriter`); the file appears when the child is
            done, and the fit's teardown waits for the last one.

    A save is searched under ``tau`` when it comes with a :class:`ShrinkRequest`: passed as
    ``trainer.save_checkpoint(path, storage_options=request)``, or built by the function given
    to :meth:`requesting` for the saves made while it is active (how ``ShrinkCheckpoint`` brings
    one to the saves ``ModelCheckpoint`` makes).

    Example::

        trainer = Trainer(plugins=[ShrinkCheckpointIO()], callbacks=[ModelCheckpoint(...)])
        trainer.fit(model, datamodule, ckpt_path="checkpoints/epoch=3-step=40.ckpt")
    """

    def __init__(
        self,
        tau: float = 0.05,
        config: QuantConfig | None = None,
        keyframe_every: int = 10,
        compress_optimizer: str = "auto",
        coder: str = DEFAULT_CODER,
        delegate: CheckpointIO | None = None,
        background: bool = False,
    ) -> None:
        check_writer_arguments(tau, keyframe_every, coder)
        self.writer = ChainWriter(
            tau, config, keyframe_every, compress_optimizer, coder, background=background
        )
        self.delegate = delegate
        self._request: Callable[[], ShrinkRequest] | None = None

    @property
    def chain(self) -> ChainState | None:
        return self.writer.chain

    @property
    def reports(self) -> list[ShrinkReport]:
        """Every save's report, in order. With ``background``, reading this waits for the save
        in flight and raises its :class:`~stalwart.errors.BackgroundSaveError` if it failed."""
        self.writer.wait()
        return self.writer.reports

    def teardown(self) -> None:
        """The end of a fit (or of a failed one) waits for a background save in flight."""
        self.writer.wait()
        if self.delegate is not None:
            self.delegate.teardown()

    @contextlib.contextmanager
    def requesting(self, request: Callable[[], ShrinkRequest]) -> Iterator[None]:
        """Saves made inside this block without a request of their own use ``request()``.

        The request is built only when a save happens (it captures the gradient window and the
        held-out batches at that moment).
        """
        previous, self._request = self._request, request
        try:
            yield
        finally:
            self._request = previous

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        request = storage_options if isinstance(storage_options, ShrinkRequest) else None
        if request is None and self._request is not None:
            request = self._request()
        if request is None and self.delegate is not None:
            # A plain save (by hand beside ShrinkCheckpoint) onto a file a live delta was written
            # against took that delta's base with it, silently.
            self.writer.before_plain_save(path)
            self.delegate.save_checkpoint(checkpoint, path, storage_options)
            return
        weights = checkpoint["state_dict"]
        extra = {key: value for key, value in checkpoint.items() if key != "state_dict"}
        self.writer.save(weights, extra, path, request)

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if not is_shrunk_file(path):
            # A plain file loads as Lightning would load it, weights_only included: dropped, a
            # resume with weights_only=False of a plain checkpoint whose hyperparameters hold a
            # class of the user's failed under ShrinkCheckpoint and only there.
            fallback = self.delegate or TorchCheckpointIO()
            return fallback.load_checkpoint(
                path, map_location=map_location, weights_only=weights_only
            )
        # A resumed fit continues the chain it was restored from. Like torch.load (and Lightning)
        # since torch 2.6, the non-tensor part loads weights-only unless the caller says False.
        weights, extra = self.writer.load(path, weights_only=weights_only is not False)
        checkpoint = dict(extra or {})
        checkpoint["state_dict"] = weights
        return checkpoint

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        path = Path(path)
        if not is_shrunk_file(path):
            (self.delegate or TorchCheckpointIO()).remove_checkpoint(path)
            return
        self.writer.remove(path)
