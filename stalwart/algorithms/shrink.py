"""Shrunken checkpoints (Inshrinkerator) for MosaicML Composer: the ``Shrink`` algorithm.

Composer's own checkpointing (``save_folder``, ``save_interval``, ``save_num_checkpoints_to_keep``)
decides when and where checkpoints are written; ``Shrink`` changes what is written: the model
weights quantized under a quality bound and delta-coded against the previous checkpoint
(:class:`stalwart.shrink.chain.ChainWriter`, the same writer as Lightning's
:class:`~stalwart.ShrinkCheckpointIO`), the rest of the state losslessly. Composer's loader reads
shrunken files when the loading Trainer has a ``Shrink`` too, so
``Trainer(load_path=..., algorithms=[Shrink()])`` resumes from them. Composer's checkpoint
functions are routed only while a Trainer with ``Shrink`` is open
(:mod:`stalwart.algorithms.composer_internals`); importing this module changes nothing.
Method card: ``shrink.md`` beside this file.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch
from composer.callbacks import CheckpointSaver
from composer.core import Algorithm, Callback, Event, State
from composer.loggers import Logger

from stalwart.algorithms import composer_internals
from stalwart.algorithms.hindsight import building_a_replay
from stalwart.errors import ConfigurationError
from stalwart.shrink.api import ShrinkReport, load_with_extra
from stalwart.shrink.chain import ChainWriter, ShrinkRequest
from stalwart.shrink.entropy import DEFAULT_CODER
from stalwart.shrink.gradients import GradientEMA
from stalwart.shrink.partition import layer_types_of
from stalwart.shrink.scoring import (
    first_batches,
    live_continuation,
    live_evaluator,
    screening_batches,
)
from stalwart.shrink.search import (
    DEFAULT_SCREEN_ACCEPT,
    ConfigSearch,
    check_adapter_arguments,
    check_writer_arguments,
    learning_rate_share,
)


def _total_loss(loss: Any) -> torch.Tensor:
    """A ComposerModel's loss as one tensor (it may return a dict or a tuple of parts)."""
    if isinstance(loss, Mapping):
        return loss["total"] if "total" in loss else sum(loss.values())
    if isinstance(loss, (tuple, list)):
        return sum(loss)
    return loss


def _load_named_state(optimizer: torch.optim.Optimizer, state: Mapping) -> None:
    """Load a Composer checkpoint's optimizer state (keyed by parameter name, the names listed in
    its groups in the optimizer's own order) into a torch optimizer (keyed by position)."""
    position: dict[Any, int] = {}
    groups = []
    for group in state["param_groups"]:
        ids = [position.setdefault(name, len(position)) for name in group["params"]]
        groups.append({**group, "params": ids})
    per_parameter = {position[name]: value for name, value in state["state"].items()}
    optimizer.load_state_dict({"state": per_parameter, "param_groups": groups})


class Shrink(Algorithm):
    """Checkpoints 20-40x smaller within a quality bound, written by Composer's checkpointing.

    Each checkpoint Composer saves searches the quantization whose held-out loss is at most
    ``tau`` (relative) worse than the uncompressed weights', guided by an EMA of the gradients of
    the last ``grad_window`` batches of the epoch (captured on ``AFTER_BACKWARD``), and stores
    the weights as a delta against the previous checkpoint. Resuming with
    ``Trainer(load_path=...)`` reads the shrunken file (and its chain) transparently.

    Args:
        tau: largest relative increase of the held-out loss a checkpoint may cause, at the
            initial learning rate.
        tau_follows_lr: as in :class:`stalwart.callbacks.shrink.ShrinkCheckpoint`: each
            checkpoint's weights held to ``tau`` times the learning rate's share of its initial
            value (at least a fifth of ``tau``; ``tau`` where nothing meets that); on by
            default, False holds every save to ``tau``.
        keyframe_every: a full checkpoint (no delta) every this many saves.
        compress_optimizer: ``"auto"`` (default: the optimizer moments' form chosen by a short
            continuation of training, see :mod:`stalwart.shrink.moments`), ``"lossless"`` or
            ``"lossy"`` (every optimizer tensor quantized, unchecked).
        continue_steps: optimizer steps of that continuation (on the last training batches).
        eval_batches: how many batches of the first evaluator the search scores candidates on.
        screen_fraction, screen_accept, per_type_bins: as in
            :class:`stalwart.callbacks.shrink.ShrinkCheckpoint` (the same search).
        evaluate: ``evaluate(model) -> loss`` on held-out data, instead of the model's own loss
            on the first evaluator's batches.
        grad_window: batches at the end of each epoch whose gradients feed the EMA
            (0 = magnitude only).
        grad_beta: weight of the newest gradient in the EMA.
        coder: entropy coder of the index streams: ``"auto"`` (default: per stream the
            smallest of rANS per previous level, rANS, and run lengths + zstd), ``"ans-grouped"``,
            ``"ans"``, ``"zstd"`` or ``"huffman"``.

    Example::

        from composer import Trainer
        from stalwart.algorithms import Shrink

        trainer = Trainer(model=model, train_dataloader=train, eval_dataloader=held_out,
                          max_duration="10ep", save_folder="ckpt", save_interval="1ep",
                          algorithms=[Shrink(tau=0.05)])
        trainer.fit()
        # later, or after a failure: resumes from the shrunken checkpoint
        Trainer(..., load_path="ckpt/ep5-ba60-rank0.pt", algorithms=[Shrink()]).fit()
    """

    def __init__(
        self,
        tau: float = 0.05,
        tau_follows_lr: bool = True,
        keyframe_every: int = 10,
        compress_optimizer: str = "auto",
        continue_steps: int = 4,
        eval_batches: int = 2,
        screen_fraction: float = 0.125,
        screen_accept: float = DEFAULT_SCREEN_ACCEPT,
        per_type_bins: bool = False,
        evaluate: Callable[[torch.nn.Module], float] | None = None,
        grad_window: int = 50,
        grad_beta: float = 0.9,
        coder: str = DEFAULT_CODER,
    ) -> None:
        check_adapter_arguments(
            tau, eval_batches, screen_fraction, grad_window, grad_beta, continue_steps
        )
        # As ShrinkCheckpoint and ShrinkCheckpointIO check them: a typo in coder, or a
        # keyframe_every of 2.5, failed only at the first save, after training up to it.
        check_writer_arguments(tau, keyframe_every, coder)
        self.writer = ChainWriter(
            tau=tau, keyframe_every=keyframe_every, compress_optimizer=compress_optimizer,
            coder=coder,
        )  # fmt: skip
        self.ema = GradientEMA(grad_beta)
        self.search = ConfigSearch(tau, per_type=per_type_bins, screen_accept=screen_accept)
        self.tau = tau
        self.tau_follows_lr = tau_follows_lr
        self.eval_batches = eval_batches
        self.screen_fraction = screen_fraction
        self.evaluate = evaluate
        self.grad_window = grad_window
        self.grad_beta = grad_beta
        self._state: State | None = None
        self._held_out: list[Any] | None = None
        self.continue_steps = continue_steps
        self._recent: deque[Any] = deque(maxlen=continue_steps)
        #: Set per Trainer at INIT: a Trainer that a hindsight replay builds writes no checkpoint.
        self.passive = False

    def __repr__(self) -> str:
        return f"Shrink(tau={self.tau}, keyframe_every={self.writer.keyframe_every})"

    @property
    def reports(self) -> list[ShrinkReport]:
        """One :class:`~stalwart.shrink.ShrinkReport` per checkpoint written in this process."""
        return self.writer.reports

    def match(self, event: Event, state: State) -> bool:
        if event == Event.INIT:  # decided per Trainer: one instance may serve record and replay
            self.passive = building_a_replay()
        if event in (Event.INIT, Event.AFTER_LOAD):
            return True
        if self.passive:  # nothing will be saved: no batches or gradients to collect for it
            return False
        if event == Event.BATCH_END:
            return True
        return event == Event.AFTER_BACKWARD and self._in_window(state)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.INIT:
            if self.passive:
                self._open_for_replay(state)
            else:
                self._open(state)
        elif event == Event.AFTER_LOAD:
            composer_internals.reading(None)  # the Trainer has loaded its load_path (if any)
        elif event == Event.BATCH_END:
            self._recent.append(state.batch)  # what the optimizer check trains on
        else:
            self.ema.update(state.model.named_parameters())

    def _in_window(self, state: State) -> bool:
        if self.grad_window == 0:
            return False
        total = state.dataloader_len
        if total is None:
            return True
        return int(total) - int(state.timestamp.batch_in_epoch) <= self.grad_window

    def _open(self, state: State) -> None:
        """Join a Trainer: its savers write shrunken files, its ``load_path`` continues a chain."""
        savers = [cb for cb in state.callbacks if isinstance(cb, CheckpointSaver)]
        if not savers:
            raise ConfigurationError(
                "Shrink compresses the checkpoints Composer saves, and this Trainer saves none: "
                "pass save_folder='checkpoints' (and save_interval, e.g. '1ep') to the Trainer."
            )
        # What an earlier Trainer of this instance saw (its batches, gradients) is not this one's.
        # Its chain is kept: a save into its folder may extend it (retiring there keeps what a
        # delta needs), one into another folder starts a keyframe (ChainWriter), so deleting the
        # earlier run's folder breaks nothing of this one's.
        self._state = state
        self._held_out = None
        self._recent.clear()
        self.ema = GradientEMA(self.grad_beta)
        closing = _CloseWithTrainer(savers)
        state.callbacks.append(closing)
        composer_internals.hold(closing)
        for saver in savers:
            composer_internals.route_saver(saver, self._write, self.writer.remove)
        composer_internals.reading(self._read)

    def _open_for_replay(self, state: State) -> None:
        """Join a Trainer that ``stalwart.algorithms.replay`` builds (``save_folder=None``): it
        writes no checkpoints, so nothing is routed for writing, but the file it resumes from
        may be a shrunken one (a recorded fit that resumed from this Shrink's checkpoint)."""
        closing = _CloseWithTrainer([])
        state.callbacks.append(closing)
        composer_internals.hold(closing)
        composer_internals.reading(self._read_only)

    def _read_only(self, path: str) -> dict[str, Any]:
        """As :meth:`_read`, without taking up the file's chain: this instance's next save (in
        a Trainer of its own) must not become a delta of a file a replay happened to load."""
        weights, extra, _ = load_with_extra(path)
        return self._as_composer_checkpoint(weights, extra)

    def _read(self, path: str) -> dict[str, Any]:
        """A shrunken checkpoint as Composer's loader expects it; the chain continues from it."""
        weights, extra = self.writer.load(path)
        return self._as_composer_checkpoint(weights, extra)

    @staticmethod
    def _as_composer_checkpoint(weights: dict[str, torch.Tensor], extra: Any) -> dict[str, Any]:
        checkpoint = dict(extra or {})
        checkpoint["state"] = {**checkpoint.get("state", {}), "model": weights}
        return checkpoint

    def _write(self, checkpoint: dict[str, Any], filename: str) -> None:
        if composer_internals.is_archive(filename):
            raise ConfigurationError(
                f"Shrink writes its own compressed format, not {filename!r}'s archive: use a plain "
                "save_filename such as 'ep{epoch}-ba{batch}-rank{rank}.pt'."
            )
        state = self._state
        model = state.model
        inner = dict(checkpoint["state"])
        weights = inner.pop("model")
        extra = {**checkpoint, "state": inner}
        screen = None
        if self.evaluate is None:  # a user's scorer cannot be split into a cheaper share
            batches = screening_batches(self._held_out_batches(state), self.screen_fraction)
            if batches is not None:
                screen = live_evaluator(model, self._mean_loss(batches))
        request = ShrinkRequest(
            evaluate=live_evaluator(model, self._scorer(state)),
            screen=screen,
            gradients=self.ema.take(),
            layer_types=layer_types_of(model),
            search=self.search,
            continue_training=self._continuation(state),
            parameter_shapes=[
                {name: tuple(p.shape) for name, p in model.named_parameters()}
                for _ in state.optimizers
            ],
            lr_share=learning_rate_share(state.optimizers) if self.tau_follows_lr else 1.0,
        )
        self.writer.save(weights, extra, filename, request)

    def _continuation(self, state: State):
        if not state.optimizers:
            return None
        batches = list(self._recent) or self._held_out_batches(state)
        return live_continuation(
            state.model, list(state.optimizers), batches[-self.continue_steps :],
            lambda model, batch, index: _total_loss(model.loss(model(batch), batch)),
            self._scorer(state), load_optimizer_state=_load_named_state,
        )  # fmt: skip

    def _scorer(self, state: State) -> Callable[[torch.nn.Module], float]:
        if self.evaluate is not None:
            return self.evaluate
        return self._mean_loss(self._held_out_batches(state))

    @staticmethod
    def _mean_loss(batches: list[Any]) -> Callable[[torch.nn.Module], float]:
        def mean_loss(model: torch.nn.Module) -> float:
            losses = [float(_total_loss(model.loss(model(batch), batch))) for batch in batches]
            return sum(losses) / len(losses)

        return mean_loss

    def _held_out_batches(self, state: State) -> list[Any]:
        if self._held_out is not None:
            return self._held_out
        if not state.evaluators:
            raise ConfigurationError(
                "Shrink scores candidate quantizations on held-out batches, and this Trainer has "
                "no eval_dataloader: pass one, or Shrink(evaluate=lambda model: <held-out loss>)."
            )
        self._held_out = first_batches(
            state.evaluators[0].dataloader.dataloader, self.eval_batches,
            state.device.batch_to_device,
        )  # fmt: skip
        return self._held_out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "shrink_search": self.search.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.search.load_state_dict(state.get("shrink_search", {}))


class _CloseWithTrainer(Callback):
    """Added to a Trainer that has a ``Shrink``: when Composer closes that Trainer (``close()``,
    garbage collection or interpreter exit), its savers and Composer's checkpoint functions are
    given back."""

    def __init__(self, savers: list[CheckpointSaver]) -> None:
        self.savers = savers

    def close(self, state: State, logger: Logger) -> None:
        for saver in self.savers:
            composer_internals.unroute_saver(saver)
        composer_internals.reading(None)
        composer_internals.release(self)
