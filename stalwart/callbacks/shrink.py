"""``ShrinkCheckpoint``: a ModelCheckpoint that writes shrunken (quantized, delta) checkpoints."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.model_helpers import is_overridden

from stalwart.callbacks.lightning_internals import silenced_log, skip_unused_hooks
from stalwart.errors import ConfigurationError
from stalwart.plugins.shrink_io import ShrinkCheckpointIO, ShrinkRequest
from stalwart.shrink.api import ShrinkReport
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
    learning_rate_share,
)

#: The ``ModelCheckpoint`` hooks that save; each save they make is a shrunken one.
SAVING_HOOKS = (
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_validation_end",
    "on_exception",
    "on_train_end",
)


class ShrinkCheckpoint(ModelCheckpoint):
    """Whole checkpoints (weights and optimizer state) many times smaller, within a quality bound
    (Inshrinkerator for the weights; see ``docs/shrink.md`` for measured ratios).

    Schedules saves exactly like :class:`~lightning.pytorch.callbacks.ModelCheckpoint` (it is
    one). Each save searches the quantization whose held-out loss is at most ``tau`` (relative)
    worse than the uncompressed weights', guided by a gradient EMA captured during the last
    ``grad_window`` batches before the save, and stores the quantized weights as a delta against
    the previous save. The optimizer's moments are stored in the most compressed form whose short
    continuation of training (``continue_steps`` steps on the last training batches, from the
    restored weights) is within ``tau`` of continuing from the exact state
    (:mod:`stalwart.shrink.moments`). Resuming with ``trainer.fit(ckpt_path=...)`` reads shrunken
    files transparently (the callback installs :class:`~stalwart.plugins.ShrinkCheckpointIO`,
    which still reads plain checkpoints too).

    Args:
        dirpath: where checkpoints go (as in ``ModelCheckpoint``).
        tau: largest relative increase of the held-out loss a checkpoint may cause, at the
            initial learning rate.
        tau_follows_lr: hold each checkpoint's weights to ``tau`` times the learning rate's share
            of its initial value (at least a fifth of ``tau``; see
            :func:`stalwart.shrink.search.learning_rate_share`); where nothing meets that, to
            ``tau`` itself. Late in a decayed run training repairs a restore's damage slowly: on
            the char transformer with a cosine decay to a tenth, restores at a fixed
            ``tau=0.05`` ended +1.1..+2.4% behind in validation bpc over eight seeds, with this
            within 1% on seven (at ~13% more bytes; docs/measurements/shrink.md). At a constant
            rate (or without a scheduler) it changes nothing. False holds every save to ``tau``.
        every_n_epochs: save every this many epochs (default 1 unless ``every_n_train_steps``
            or ``train_time_interval`` is given; those work too, as in ``ModelCheckpoint``). A
            save by ``train_time_interval`` cannot be foreseen: its gradient EMA is the one
            captured over the last ``grad_window`` batches of an epoch before it.
        keyframe_every: a full checkpoint (no delta) every this many saves.
        compress_optimizer: ``"auto"`` (default: the moments' form chosen by the continuation
            check; lossless under manual optimization, where no step can be replayed),
            ``"lossless"`` or ``"lossy"`` (every optimizer tensor quantized, unchecked).
        continue_steps: optimizer steps of the continuation check (the last this many training
            batches before the save are kept for it).
        eval_batches: how many validation batches the search scores candidates on. Scoring
            dominates compression time; two batches measure the relative degradation within
            ~10% of the whole validation set's (char transformer, 8k characters a batch).
        screen_fraction: share of those batches' rows (from the first batch) every candidate is
            screened on first; the search's answer is then scored on all of them (unless
            ``screen_accept`` takes it on the screen), and one that fails there is passed over.
            0 scores every candidate on all of them.
        screen_accept: an answer whose screened degradation is at most ``screen_accept * tau``
            is written without the full scoring (the two full scorings, uncompressed reference
            and answer, were most of a later checkpoint's cost); the report's
            ``degradation_on`` then says ``"screen"``. 0 confirms every answer on the full
            scoring batches.
        per_type_bins: refine the bin count per layer type after the shared choice (off by
            default: it adds screenings and a full scoring at each checkpoint where the search
            moves, and did not raise the char transformer's ratio in a run with restores).
        evaluate: ``evaluate(module) -> loss`` on held-out data, for modules whose
            ``training_step`` cannot score a batch (manual optimization); default: mean of
            ``training_step`` over the first ``eval_batches`` validation batches, in eval mode.
        grad_window: batches before each save whose gradients feed the EMA (0 = magnitude only).
        grad_beta: weight of the newest gradient in the EMA.
        coder: entropy coder of the index streams: ``"auto"`` (default: per stream the
            smallest of rANS per previous level, rANS, and run lengths + zstd), ``"ans-grouped"``,
            ``"ans"``, ``"zstd"`` or ``"huffman"``.
        save_top_k: as in ``ModelCheckpoint``; default -1 (keep all: deltas are small).
        background: shrink each checkpoint in a forked child while training goes on, instead of
            holding training for the search. It pays where training leaves a core idle (the char
            transformer on one torch thread of two cores: training paid 0.06-0.47% of its time for
            12 saves, against ~3-4% with saves in the fit); beside training on every core the child
            slows it about as much as a save in the fit (docs/measurements/shrink.md). The child
            scores on one thread at a lower priority, so its choices may differ in the last bits
            from a foreground save's; the file appears when it is done (a logger that uploads
            checkpoints as they are saved would not find it yet), and the fit ends only once the
            last one is written. CPU training only.
        **kwargs: any other ``ModelCheckpoint`` argument (``filename``, ``monitor``...).
            ``save_last=True`` writes ``last.ckpt`` as a delta on the checkpoint just saved that
            no later checkpoint extends (it is rewritten at every save); resuming from it
            continues the chain from that checkpoint.

    Example::

        trainer = stalwart.Trainer(max_epochs=30, callbacks=[ShrinkCheckpoint(dirpath="ckpt")])
        trainer.fit(model, datamodule)
        trainer.fit(model, datamodule, ckpt_path="ckpt/epoch=9-step=170.ckpt")  # resumes
    """

    def __init__(
        self,
        dirpath: str | None = None,
        tau: float = 0.05,
        tau_follows_lr: bool = True,
        every_n_epochs: int | None = None,
        keyframe_every: int = 10,
        compress_optimizer: str = "auto",
        continue_steps: int = 4,
        eval_batches: int = 2,
        screen_fraction: float = 0.125,
        screen_accept: float = DEFAULT_SCREEN_ACCEPT,
        per_type_bins: bool = False,
        evaluate: Callable[[pl.LightningModule], float] | None = None,
        grad_window: int = 50,
        grad_beta: float = 0.9,
        coder: str = DEFAULT_CODER,
        save_top_k: int = -1,
        background: bool = False,
        **kwargs: Any,
    ) -> None:
        check_adapter_arguments(
            tau, eval_batches, screen_fraction, grad_window, grad_beta, continue_steps
        )
        #: Steps between saves (0: saves by epoch or time), for the gradient window.
        self._save_every_steps: int = kwargs.get("every_n_train_steps") or 0
        # ModelCheckpoint saves every epoch when no schedule is given, and refuses two.
        super().__init__(
            dirpath=dirpath, every_n_epochs=every_n_epochs, save_top_k=save_top_k, **kwargs
        )
        self.io = ShrinkCheckpointIO(
            tau=tau,
            keyframe_every=keyframe_every,
            compress_optimizer=compress_optimizer,
            coder=coder,
            background=background,
        )
        self.tau = tau
        self.tau_follows_lr = tau_follows_lr
        self.eval_batches = eval_batches
        self.screen_fraction = screen_fraction
        self.evaluate = evaluate
        self.grad_window = grad_window
        self.grad_beta = grad_beta
        self.search = ConfigSearch(tau, per_type=per_type_bins, screen_accept=screen_accept)
        self.ema = GradientEMA(grad_beta)
        self._held_out: list[Any] | None = None
        self._batch_idx = 0
        self.continue_steps = continue_steps
        self._recent: deque[Any] = deque(maxlen=continue_steps)
        self._saving_last = False  # inside ModelCheckpoint's save of last.ckpt
        # Every batch's other hooks would each cost Lightning's dispatch (a profiler section).
        skip_unused_hooks(self)

    @property
    def reports(self) -> list[ShrinkReport]:
        """One :class:`~stalwart.shrink.ShrinkReport` per checkpoint written in this process."""
        return self.io.reports

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._install_io(trainer)
        if self.evaluate is None and not pl_module.automatic_optimization:
            raise ConfigurationError(
                "ShrinkCheckpoint scores candidates with training_step, which steps the optimizer "
                "under manual optimization; pass evaluate=lambda module: <held-out loss>."
            )
        held_out = trainer.enable_validation or _datamodule_has_val_dataloader(trainer)
        if self.evaluate is None and stage == "fit" and not held_out:
            raise _no_validation_batches(trainer, pl_module)  # now, not after training to a save

    def _install_io(self, trainer: pl.Trainer) -> None:
        """Route the Trainer's saves and loads through this callback's ShrinkCheckpointIO.

        A Trainer has one checkpoint IO: a second ShrinkCheckpoint's saves, or those of a
        ShrinkCheckpointIO the user passed, would be written with this one's settings (or this
        one's with theirs), so both are refused rather than silently ignored.
        """
        if any(c is not self and isinstance(c, ShrinkCheckpoint) for c in trainer.callbacks):
            raise ConfigurationError(
                "One ShrinkCheckpoint per Trainer: its saves all go through the Trainer's one "
                "checkpoint IO, so a second ShrinkCheckpoint's settings (tau, its chain) would be "
                "ignored. Keep one ShrinkCheckpoint (its monitor and save_top_k choose which "
                "files are kept) and add a plain ModelCheckpoint for any other schedule (its "
                "files are ordinary Lightning checkpoints)."
            )
        current = trainer.strategy.checkpoint_io
        if current is self.io:
            return  # a later fit of the same Trainer
        if isinstance(current, ShrinkCheckpointIO):
            raise ConfigurationError(
                "ShrinkCheckpoint brings its own ShrinkCheckpointIO, and this Trainer was given "
                "one in plugins=[...], whose settings would be ignored. Pass them to "
                "ShrinkCheckpoint instead (tau, keyframe_every, compress_optimizer, coder, "
                "background) and drop the plugin, or keep the plugin with a plain "
                "ModelCheckpoint (a fixed configuration, no search)."
            )
        self.io.delegate = current
        trainer.strategy.checkpoint_io = self.io

    # --- gradient EMA over the window before each save -------------------------------------

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch_idx = batch_idx

    def _in_window(self, trainer: pl.Trainer) -> bool:
        if self.grad_window == 0:
            return False
        if self._save_every_steps:
            left = self._save_every_steps - trainer.global_step % self._save_every_steps
            return left <= self.grad_window
        every = self.every_n_epochs or 1
        if (trainer.current_epoch + 1) % every:
            return False
        total = trainer.num_training_batches
        return total == float("inf") or total - self._batch_idx <= self.grad_window

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._in_window(trainer):
            self.ema.update(pl_module.named_parameters())

    # --- the saves: ModelCheckpoint's own, each given a ShrinkRequest -----------------------

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._recent.append(batch)  # what the continuation check trains on
        with self._shrinking(trainer):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with self._shrinking(trainer):
            super().on_train_epoch_end(trainer, pl_module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with self._shrinking(trainer):
            super().on_validation_end(trainer, pl_module)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        with self._shrinking(trainer):
            super().on_exception(trainer, pl_module, exception)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with self._shrinking(trainer):
            super().on_train_end(trainer, pl_module)

    def _save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict) -> None:
        # ModelCheckpoint writes last.ckpt again at every save, right after the top-k file: a
        # delta on it would break when it is overwritten. It is a side save (a delta on the
        # chain's last file, which stays the chain's last file; see ShrinkRequest.side). Private
        # Lightning API: tests/shrink/test_save_last.py fails if it is renamed.
        self._saving_last = True
        try:
            super()._save_last_checkpoint(trainer, monitor_candidates)
        finally:
            self._saving_last = False

    @contextlib.contextmanager
    def _shrinking(self, trainer: pl.Trainer) -> Iterator[None]:
        """Saves made in this block (by ``ModelCheckpoint``) carry this callback's request."""
        with self.io.requesting(lambda: self._request(trainer)):
            yield

    def _request(self, trainer: pl.Trainer) -> ShrinkRequest:
        module = trainer.lightning_module
        return ShrinkRequest(
            evaluate=self._evaluator(trainer, module),
            screen=self._screen(trainer, module),
            gradients=self.ema.take(),
            layer_types=layer_types_of(module),
            search=self.search,
            continue_training=self._continuation(trainer, module),
            parameter_shapes=[
                dict(enumerate(tuple(p.shape) for g in o.param_groups for p in g["params"]))
                for o in trainer.optimizers
            ],
            lr_share=learning_rate_share(trainer.optimizers) if self.tau_follows_lr else 1.0,
            side=self._saving_last,
        )

    def _evaluator(
        self, trainer: pl.Trainer, module: pl.LightningModule
    ) -> Callable[[Mapping[str, torch.Tensor]], float]:
        if self.evaluate is not None:
            return live_evaluator(module, self.evaluate)
        batches = self._held_out_batches(trainer, module)
        return live_evaluator(module, lambda scored: self._mean_loss(scored, batches))

    def _screen(
        self, trainer: pl.Trainer, module: pl.LightningModule
    ) -> Callable[[Mapping[str, torch.Tensor]], float] | None:
        if self.evaluate is not None:
            return None  # a user's scorer cannot be split into a cheaper share
        batches = screening_batches(self._held_out_batches(trainer, module), self.screen_fraction)
        if batches is None:
            return None
        return live_evaluator(module, lambda scored: self._mean_loss(scored, batches))

    def _continuation(self, trainer: pl.Trainer, module: pl.LightningModule):
        """The optimizer check's ``continue_training``; None where steps cannot be replayed."""
        if not module.automatic_optimization or not trainer.optimizers:
            return None
        batches = list(self._recent) or self._held_out_batches(trainer, module)
        held_out = self._held_out_batches(trainer, module)
        score = self.evaluate or (lambda scored: self._mean_loss(scored, held_out))
        return live_continuation(
            module, trainer.optimizers, batches[-self.continue_steps :], self._step_loss, score
        )

    @staticmethod
    def _step_loss(module: pl.LightningModule, batch: Any, index: int) -> torch.Tensor:
        with silenced_log(module):  # logging is not part of the check
            output = module.training_step(batch, index)
        return output["loss"] if isinstance(output, Mapping) else output

    @staticmethod
    def _mean_loss(module: pl.LightningModule, batches: list[Any]) -> float:
        losses = []
        with silenced_log(module):  # logging is not part of scoring
            for index, batch in enumerate(batches):
                output = module.training_step(batch, index)
                loss = output["loss"] if isinstance(output, Mapping) else output
                losses.append(float(loss))
        return sum(losses) / len(losses)

    def _held_out_batches(self, trainer: pl.Trainer, module: pl.LightningModule) -> list[Any]:
        if self._held_out is not None:
            return self._held_out
        loaders = trainer.val_dataloaders
        if isinstance(loaders, list | tuple):
            loaders = loaders[0] if loaders else None
        if loaders is None and _datamodule_has_val_dataloader(trainer):
            # No validation loop this fit (e.g. limit_val_batches=0): the data is still there.
            loaders = trainer.datamodule.val_dataloader()
        if loaders is None:
            raise _no_validation_batches(trainer, module)
        self._held_out = first_batches(loaders, self.eval_batches, trainer.strategy.batch_to_device)
        return self._held_out

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["shrink_search"] = self.search.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.search.load_state_dict(state_dict.pop("shrink_search", {}))
        super().load_state_dict(state_dict)


def _datamodule_has_val_dataloader(trainer: pl.Trainer) -> bool:
    """Whether the fit's datamodule has validation data, which is there even with no validation."""
    return trainer.datamodule is not None and is_overridden("val_dataloader", trainer.datamodule)


def _no_validation_batches(trainer: pl.Trainer, module: pl.LightningModule) -> ConfigurationError:
    """What to do when ShrinkCheckpoint has no validation batches to score candidates on."""
    if trainer.limit_val_batches == 0:
        why = (
            "validation is off in this fit (limit_val_batches=0), so Lightning loads no "
            "validation dataloader, not even one given to fit"
        )
    elif not is_overridden("validation_step", module):
        why = (
            "the LightningModule has no validation_step, so Lightning runs no validation and "
            "loads no validation dataloader, not even one given to fit"
        )
    elif not trainer.enable_validation:
        why = "this fit was given no validation dataloader"
    else:
        why = "Lightning has loaded no validation dataloader by this save (no validation ran yet)"
    return ConfigurationError(
        f"ShrinkCheckpoint scores candidates on validation batches, but {why}. Pass "
        "evaluate=lambda module: <held-out loss>, or give the validation data in a "
        "LightningDataModule (its val_dataloader() is read even where validation does not run)."
    )
