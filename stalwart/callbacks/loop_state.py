"""The state of a Lightning fit at the end of an epoch's training batches (the inner loop).

A hindsight checkpoint is taken at the epoch boundary, after validation, the epoch-end hooks and
the epoch-interval LR step. An outer-loop replay needs the state just *before* those: the same
weights and optimizer tensors, but the LR schedule and hyperparameters not yet stepped and the
RNG as the last training batch left it, and what the epoch's batches logged (the epoch's
aggregated training metrics and ``callback_metrics`` come from it). That small remainder is
captured here at record time.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback

from stalwart.callbacks.lightning_internals import (
    logged_in_training,
    restore_logged_in_training,
    restore_loop_progress,
)
from stalwart.callbacks.loader_rng import capture_loader_rng, restore_loader_rng
from stalwart.rng import capture_rng, restore_rng

INNER_LOOP_END_KEY = "stalwart_inner_loop_end"
#: What the epoch's training batches logged, in the inner-loop-end capture.
LOGGED_KEY = "logged"


def capture_inner_loop_end(trainer: Trainer) -> dict:
    """RNG (the DataLoaders' own generators too), LR scheduler states and optimizer
    hyperparameters after the last training batch."""
    return {
        "rng": capture_rng(),
        "loader_rng": capture_loader_rng(trainer),
        "lr_schedulers": [
            copy.deepcopy(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs
        ],
        "param_groups": [
            [
                {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
                for group in opt.param_groups
            ]
            for opt in trainer.optimizers
        ],
    }


def capture_logged(inner_loop_end: dict, trainer: Trainer) -> None:
    """Add what the epoch's training batches logged to the capture :func:`capture_inner_loop_end`
    made after the last batch: called from ``on_train_epoch_end``, after every hook of that batch
    has logged (see :func:`~stalwart.callbacks.lightning_internals.logged_in_training`)."""
    inner_loop_end[LOGGED_KEY] = logged_in_training(trainer)


def restore_inner_loop_end(
    trainer: Trainer, checkpoint: dict, callbacks: Sequence[Callback] = ()
) -> None:
    """Put a fit in the state its recorded epoch had after its last training batch.

    Weights, optimizer tensors and loop counters come from the epoch's checkpoint, and
    ``callbacks`` get it through ``on_load_checkpoint`` (see :func:`hand_checkpoint_to`);
    schedulers, hyperparameters, RNG and what the batches logged from the inner-loop-end capture
    stored beside them.
    """
    module = trainer.lightning_module
    module.load_state_dict(checkpoint["state_dict"])
    for optimizer, state in zip(trainer.optimizers, checkpoint["optimizer_states"], strict=True):
        optimizer.load_state_dict(state)
    hand_checkpoint_to(callbacks, trainer, checkpoint)
    inner = checkpoint[INNER_LOOP_END_KEY]
    for config, state in zip(trainer.lr_scheduler_configs, inner["lr_schedulers"], strict=True):
        config.scheduler.load_state_dict(state)
    for optimizer, groups in zip(trainer.optimizers, inner["param_groups"], strict=True):
        for group, saved in zip(optimizer.param_groups, groups, strict=True):
            group.update(saved)
    restore_loop_progress(trainer, checkpoint["loops"]["fit_loop"])
    # Absent from records made before it was captured: their memoized epochs' callback_metrics
    # lack the training metrics, as they always did.
    if inner.get(LOGGED_KEY) is not None:
        restore_logged_in_training(trainer, inner[LOGGED_KEY])
    restore_rng(inner["rng"])
    if inner.get("loader_rng"):  # absent from records made before it was captured
        restore_loader_rng(trainer, inner["loader_rng"])


def hand_checkpoint_to(callbacks: Sequence[Callback], trainer: Trainer, checkpoint: dict) -> None:
    """Call each callback's ``on_load_checkpoint`` with a memoized epoch's checkpoint, after the
    weights are loaded, as Lightning's resume does.

    Lightning's weight averaging (``EMAWeightAveraging``) needs it: its ``on_save_checkpoint``
    puts the *averaged* weights in ``checkpoint["state_dict"]`` and the training weights in
    ``checkpoint["current_model_state"]``, and its ``on_load_checkpoint`` puts both back. By default
    its average changes per training batch only, so the epoch's end holds it as the last batch left
    it (updates at epoch ends are in the docs' Limitations).

    Callbacks' ``load_state_dict`` is not called: state such as ``EarlyStopping``'s wait count
    changes in the epoch-end hooks a memoized epoch runs again, and loading it as the epoch
    ended would count that epoch twice. Such state carries on from the segment's start as it did
    in the record.
    """
    module = trainer.lightning_module
    previous, module._current_fx_name = module._current_fx_name, "on_load_checkpoint"
    try:
        for callback in callbacks:
            callback.on_load_checkpoint(trainer, module, checkpoint)
    finally:
        module._current_fx_name = previous
