"""Every use of Lightning's private API in stalwart, in one place, for the tested Lightning range.

The adapters use Lightning's public hooks wherever one exists. What follows has no public
equivalent, and each function says what it needs and why:

- the complete checkpoint as a dict in memory (the hindsight materializer forks and writes it in
  the background; ``trainer.save_checkpoint`` only writes a file in the foreground);
- the one exact resume point after an epoch (after the module's own epoch-end hook and the
  epoch-interval LR step, where no callback hook runs), whether the fit stops there (the fit
  loop's own test, without the message it logs), and a resume from it that starts the next epoch
  afresh whatever ``max_steps`` is (Lightning restarts the loops when it is set);
- the moment a fit has built its training DataLoaders and not yet made their first iterator;
- the hook a ``self.log`` call came from, and every raw ``self.log`` call (loggers only see
  reduced values);
- a replayed epoch whose training batches are restored instead of run, the loop counters it
  restores, and what its batches logged (the training loop's result collection, which Lightning
  keeps out of its checkpoints: it aggregates epoch metrics and feeds ``callback_metrics``);
- what Lightning's private hook dispatch (``trainer/call.py``) spends handing one hook to one
  callback, which the record charges to itself for every hook of every batch, and that this
  dispatch skips a hook that is not callable (so a callback's unused hooks cost nothing).
- a ``ModelCheckpoint`` that decides as usual but writes, links and deletes no file (a replay's,
  for user code reading ``trainer.checkpoint_callback``): its saving and removing methods;
- a fit stopped without its end-of-fit hooks (a replay segment that ends where the recorded fit
  went on): that same dispatch's skipping, by instance attributes.

``pyproject.toml`` bounds Lightning to the range these were written against, and
``tests/callbacks/test_lightning_internals.py`` fails loudly, naming the attribute, when an
installed Lightning no longer has one of them.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.loops.utilities import _is_max_limit_reached
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.trainer.connectors.logger_connector.result import (
    _Metadata,
    _ResultMetric,
    _Sync,
)
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torchmetrics import Metric

#: The fit loop's progress trackers an epoch's checkpoint restores (keys of its ``loops`` state).
LOOP_PROGRESS_KEYS = (
    "epoch_loop.batch_progress",
    "epoch_loop.automatic_optimization.optim_progress",
    "epoch_loop.manual_optimization.optim_step_progress",
    "epoch_loop.scheduler_progress",
)

#: Set in a checkpoint's fit-loop state (``loops["fit_loop"]``) when it was taken between epochs:
#: a fit resuming from it starts the next epoch afresh (see :func:`resume_at_epoch_start`).
#: Lightning's own loading ignores keys its loops do not have.
EPOCH_START_KEY = "stalwart_epoch_start"


#: Callback hooks Lightning calls per training batch under automatic optimization (batch start,
#: before zero_grad, before and after backward, before the optimizer step, batch end); under
#: manual optimization only the batch start and end are certain.
HOOKS_PER_BATCH = {
    True: (
        "on_train_batch_start",
        "on_before_zero_grad",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_train_batch_end",
    ),
    False: ("on_train_batch_start", "on_train_batch_end"),
}

#: Callback methods Lightning calls directly instead of through ``_call_callback_hooks``: these
#: must stay callable.
_CALLED_DIRECTLY = frozenset({"on_save_checkpoint", "on_load_checkpoint"})


def skip_unused_hooks(callback: Callback) -> None:
    """Make Lightning skip the hooks ``callback``'s class leaves as ``Callback``'s no-ops.

    ``trainer/call.py::_call_callback_hooks`` hands every hook of every batch to every callback,
    each inside a profiler section with a formatted name (measured: an empty callback costs a fit
    of 1 ms batches 2.5% of its wall clock), but it skips an attribute that is not callable. Each
    hook the class does not override is set to ``None`` on the instance, so Lightning's whole
    cost for it is one attribute lookup. A subclass's own hooks are kept and called as usual.
    """
    for name, member in vars(Callback).items():
        hook = name.startswith("on_") or name in ("setup", "teardown")
        if hook and name not in _CALLED_DIRECTLY and getattr(type(callback), name) is member:
            setattr(callback, name, None)


def dispatched_per_batch(callback: Callback, automatic_optimization: bool) -> int:
    """How many of a training batch's hooks Lightning hands to ``callback`` (those not skipped
    by :func:`skip_unused_hooks`)."""
    return sum(
        callable(getattr(callback, hook)) for hook in HOOKS_PER_BATCH[automatic_optimization]
    )


def _no_op(*args: Any) -> None:
    pass


def hook_dispatch_seconds(trainer: Trainer, callback: Callback, repeats: int = 100) -> float:
    """Seconds Lightning spends calling one hook of ``callback``, the hook itself aside: the loop
    body of ``trainer/call.py::_call_callback_hooks`` (the attribute lookup, the profiler section
    and its name, the call), timed on a no-op. The profiler is a pass-through one, so nothing
    lands in the user's profile."""
    profiler, pl_module = PassThroughProfiler(), trainer.lightning_module
    hook = "on_train_batch_end"
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            fn = getattr(callback, hook)
            if callable(fn):
                with profiler.profile(f"[Callback]{callback.state_key}.{hook}"):
                    _no_op(trainer, pl_module, None)
        rounds.append((time.perf_counter() - start) / repeats)
    return statistics.median(rounds)


def dump_checkpoint(trainer: Trainer) -> dict[str, Any]:
    """Everything ``trainer.save_checkpoint`` would write, as a dict, without writing it.

    Taken between epochs (no epoch started since the last one completed: before the first, or
    at the epoch boundary), its fit-loop state is marked with :data:`EPOCH_START_KEY`. The
    ``processed`` count is not compared: with ``max_steps`` set, a fit that Lightning restarted
    inside an epoch's end (from a ``ModelCheckpoint`` file saved in ``on_train_epoch_end``)
    runs that epoch end again and counts it as processed twice, so from there on ``processed``
    is one ahead of ``completed`` at every boundary of the fit.
    """
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    epoch = trainer.fit_loop.epoch_progress.current
    if epoch.ready == epoch.started == epoch.completed <= epoch.processed:
        checkpoint["loops"]["fit_loop"][EPOCH_START_KEY] = True
    return checkpoint


def resume_at_epoch_start(trainer: Trainer) -> None:
    """A fit resuming from a checkpoint :func:`dump_checkpoint` marked as taken between epochs
    starts the next epoch afresh, as Lightning resumes it when ``max_steps`` is -1.

    With ``max_steps`` set, Lightning restarts the loops from any checkpoint (an iteration-based
    fit may have stopped mid-epoch: ``_FitLoop.restarting``'s setter), and a restart reads the
    epoch loop's state at the boundary (its last batch done, ``is_last_batch``) as an epoch still
    running: the next epoch runs no batch and the one after it starts at the same step, the fit
    loop skips the first epoch's plateau LR step, and restarting from the first epoch's start
    runs a phantom batch that shifts the loggers' step. Between epochs nothing is left to
    restart: after Lightning's load the loops are set not to restart (as Lightning's own setter
    sets them for a finished epoch when ``max_steps`` is -1). A checkpoint without the mark
    (e.g. ``ModelCheckpoint``'s, mid-epoch) loads as Lightning loads it. The fit loop's
    ``load_state_dict`` is wrapped on this trainer until :func:`release_epoch_start`.
    """
    loop = trainer.fit_loop
    if "load_state_dict" in vars(loop):  # already wrapped (it is the same for every caller)
        return
    load = loop.load_state_dict

    def load_state_dict(state_dict: dict, prefix: str = "") -> None:
        load(state_dict, prefix)
        if state_dict.get(prefix + EPOCH_START_KEY):
            # _Loop's setter, not _FitLoop's (which forces True when max_steps is set); it
            # passes the value on to the epoch, validation and optimization loops.
            _Loop.restarting.fset(loop, False)

    loop.load_state_dict = load_state_dict


def release_epoch_start(trainer: Trainer) -> None:
    vars(trainer.fit_loop).pop("load_state_dict", None)


def when_loaders_built(trainer: Trainer, action: Callable[[], None]) -> None:
    """Call ``action`` each time the fit has built its training DataLoaders, before it makes
    their first iterator.

    ``_FitLoop.setup_data`` builds the loaders and creates the first epoch's iterator at once,
    before any hook runs (``on_train_start`` comes after; a resumed fit's first epoch uses that
    iterator), and the iterator draws its worker seed from the loader's generator when it is
    made. State that this draw must see is put back here: right after Lightning restores its own
    stateful loaders' states (``_load_combined_loader_states``). Wrapped on this trainer until
    :func:`release_loaders_built`.
    """
    loop = trainer.fit_loop
    load_states = loop._load_combined_loader_states

    def load_combined_loader_states() -> None:
        load_states()
        action()

    loop._load_combined_loader_states = load_combined_loader_states


def release_loaders_built(trainer: Trainer) -> None:
    vars(trainer.fit_loop).pop("_load_combined_loader_states", None)


def hook_epoch_boundary(
    trainer: Trainer, on_end: Callable[[], None], on_error: Callable[[], None]
) -> None:
    """Call ``on_end`` each time the fit loop has completely finished an epoch.

    Lightning's ``on_train_epoch_end`` callback hooks run before the module's own and before the
    epoch-interval LR step, and the next ``on_train_epoch_start`` sees loop counters that a
    restart reads as a later epoch; the fit loop's ``on_advance_end`` is the one point where the
    state is whole. It is wrapped on this trainer's loop until :func:`unhook_epoch_boundary`.
    ``on_error`` runs instead when the epoch end raised (except for SIGTERM, raised once the
    epoch completed: then ``on_end`` runs and the signal propagates).
    """
    loop = trainer.fit_loop
    advance_end = loop.on_advance_end

    def on_advance_end() -> None:
        try:
            advance_end()
        except SIGTERMException:
            on_end()
            raise
        except BaseException:
            on_error()
            raise
        on_end()

    loop.on_advance_end = on_advance_end


def unhook_epoch_boundary(trainer: Trainer) -> None:
    vars(trainer.fit_loop).pop("on_advance_end", None)


#: The hooks Lightning hands every callback, then the LightningModule, once a fit's loop is done:
#: ``on_train_end`` from the fit loop's ``on_run_end``, ``on_fit_end`` from the Trainer's ``_run``.
FIT_END_HOOKS = ("on_train_end", "on_fit_end")


def skip_fit_end_hooks(trainer: Trainer) -> Callable[[], None]:
    """Keep the fit that is ending from handing :data:`FIT_END_HOOKS` to its callbacks and its
    LightningModule; returns what puts them back.

    Lightning calls both whatever stopped the fit, and ``on_fit_end`` comes between the Trainer's
    internal teardown and the ``teardown`` hooks, with no hook of its own to intercept it. So
    each one is shadowed on the instances by None until put back: the dispatch
    (``call._call_callback_hooks``, ``call._call_lightning_module_hook``) skips a hook that is
    not callable. The strategy's ``on_train_end``, the Trainer's internal teardown and every
    ``teardown`` hook still run.
    """
    absent = object()
    shadowed = [
        (vars(owner), name, vars(owner).get(name, absent))  # a FunctionProbe's own, say
        for owner in [*trainer.callbacks, trainer.lightning_module]
        for name in FIT_END_HOOKS
    ]
    for attributes, name, _ in shadowed:
        attributes[name] = None

    def restore() -> None:
        for attributes, name, before in shadowed:
            if before is absent:
                attributes.pop(name, None)
            else:
                attributes[name] = before

    return restore


def fit_ends_after_this_epoch(trainer: Trainer) -> bool:
    """Whether the fit loop stops after the epoch that is ending: ``max_steps`` or ``max_epochs``
    reached, or ``trainer.should_stop`` set (``EarlyStopping``, ``Timer``, the user) with
    ``min_epochs`` / ``min_steps`` met. The fit loop's ``done`` without the line it logs; right
    from ``on_train_epoch_end`` (the epoch is counted as processed before it) to the epoch
    boundary, and a stop requested by a later epoch-end hook is known only at the boundary."""
    loop = trainer.fit_loop
    return (
        _is_max_limit_reached(loop.epoch_loop.global_step, loop.max_steps)
        or _is_max_limit_reached(loop.epoch_progress.current.processed, loop.max_epochs)
        or (trainer.should_stop and loop._can_stop_early)
    )


def is_last_batch(trainer: Trainer) -> bool:
    """Whether the training batch that just ended is the epoch's last (iterable data included)."""
    return trainer.fit_loop.epoch_loop.batch_progress.is_last_batch


def batches_completed(trainer: Trainer) -> int:
    """Training batches the fit has completed (its per-epoch count is reset only after
    ``on_train_epoch_start``; inside ``on_train_batch_end`` the batch ending is not counted yet)."""
    return trainer.fit_loop.epoch_loop.batch_progress.total.completed


def current_hook(pl_module: LightningModule) -> str | None:
    """The LightningModule or callback hook running now (where a ``self.log`` call came from)."""
    return pl_module._current_fx_name


def log_position(trainer: Trainer, pl_module: LightningModule) -> Callable[[], tuple | None]:
    """A reader of where a ``self.log`` call lands: ``(current_epoch, global_step)``, or None
    while the sanity check runs (Lightning discards those values).

    Read from the progress trackers themselves, bound once per fit: inside a fit the public
    properties cost ~17 us a call (``sanity_checking`` compares enums by value, ``global_step``
    asks the strategy for the module), most of what capturing one value cost. The trackers stay
    the same objects for the whole fit (a resume loads them in place).
    """
    state = trainer.state
    epoch = trainer.fit_loop.epoch_progress.current
    loop = trainer.fit_loop.epoch_loop
    if pl_module.automatic_optimization:
        steps = loop.automatic_optimization.optim_progress.optimizer.step.total
    else:
        steps = loop.manual_optimization.optim_step_progress.total

    def position() -> tuple | None:
        if state.stage is RunningStage.SANITY_CHECKING:
            return None
        return epoch.completed, steps.completed

    return position


def intercept_log(pl_module: LightningModule, seen: Callable[..., None]) -> None:
    """Call ``seen(name, value)`` on every ``pl_module.log`` (and so ``log_dict``) call.

    Lightning's loggers receive values reduced per step or epoch; a record keeps every call. The
    module instance's ``log`` is shadowed until :func:`release_log`; the class is untouched.
    """
    original = pl_module.log

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        seen(name, value)
        return original(name, value, *args, **kwargs)

    pl_module.log = log


def release_log(pl_module: LightningModule) -> None:
    vars(pl_module).pop("log", None)


@contextlib.contextmanager
def silenced_log(pl_module: LightningModule) -> Iterator[None]:
    """Run ``training_step`` outside the loop (to score a checkpoint): its logging is dropped.

    Called outside a hook, Lightning's ``log`` raises; these values belong to no step anyway.
    What the instance had in their place before (a record's :func:`intercept_log`) is put back.
    """
    silent = lambda *args, **kwargs: None  # noqa: E731
    names = ("log", "log_dict")
    shadowed = {name: vars(pl_module)[name] for name in names if name in vars(pl_module)}
    pl_module.log, pl_module.log_dict = silent, silent
    try:
        yield
    finally:
        for name in names:
            vars(pl_module).pop(name, None)
        vars(pl_module).update(shadowed)


def replace_epoch_batches(
    trainer: Trainer, skip: Callable[[int], bool], restore: Callable[[int], None]
) -> None:
    """Epochs for which ``skip(epoch)`` holds run no training batch: ``restore(epoch)`` puts the
    state they would have produced in place, then validation runs as the epoch loop runs it
    after its last batch (the epoch-end hooks and LR step follow as usual).

    The training epoch loop's ``run`` is wrapped on this trainer until
    :func:`release_epoch_batches`. A replay's fit resumes from a record checkpoint, taken between
    epochs: it starts the next epoch afresh whatever ``max_steps`` is
    (:func:`resume_at_epoch_start`, released with the rest).
    """
    resume_at_epoch_start(trainer)
    epoch_loop = trainer.fit_loop.epoch_loop
    run_batches = epoch_loop.run

    def run(data_fetcher: Any) -> None:
        epoch = trainer.current_epoch
        # A fit restarted inside an epoch from a file the record did not write (a
        # ModelCheckpoint's: saved in on_train_epoch_end with max_steps set, or mid-epoch, e.g.
        # at validation end) runs only what that epoch had left after the file, as the record
        # did from the same file. If that was no batch, the record's checkpoint of the epoch
        # holds no state after a last batch to restore: Lightning's run it is.
        loop = trainer.fit_loop
        if not skip(epoch) or loop.restarted_on_epoch_end or loop.restarted_mid_epoch:
            return run_batches(data_fetcher)
        restore(epoch)
        # What running the batches leaves: a loop restarted from a file saved inside an epoch
        # (a ModelCheckpoint's, with max_steps set) restarts only the epoch it was saved in, and
        # the first training batch after it sets validation not to restart (else this epoch's
        # validation would resume the saved one's progress and skip its batches).
        _Loop.restarting.fset(epoch_loop, False)
        # Lightning's own decision after the epoch's last batch, on the restored counters: an
        # epoch that max_steps ended before its last batch validated only if that batch was a
        # validation check batch (or a stop was requested), not as a full epoch's end does.
        if epoch_loop._should_check_val_fx(data_fetcher) and trainer.limit_val_batches != 0:
            trainer.validating = True
            epoch_loop.val_loop.run()
            trainer.training = True
        return None

    epoch_loop.run = run


def release_epoch_batches(trainer: Trainer) -> None:
    vars(trainer.fit_loop.epoch_loop).pop("run", None)
    release_epoch_start(trainer)


def restore_loop_progress(trainer: Trainer, fit_loop_state: dict[str, Any]) -> None:
    """Set the training epoch loop's counters from a checkpoint's ``loops["fit_loop"]`` state,
    as they were after the epoch's last batch (before the epoch loop itself advanced)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    batch, optim, manual, scheduler = LOOP_PROGRESS_KEYS
    epoch_loop.batch_progress.load_state_dict(fit_loop_state[batch])
    epoch_loop.automatic_optimization.optim_progress.load_state_dict(fit_loop_state[optim])
    epoch_loop.manual_optimization.optim_step_progress.load_state_dict(fit_loop_state[manual])
    epoch_loop.scheduler_progress.load_state_dict(fit_loop_state[scheduler])
    steps = fit_loop_state["epoch_loop.state_dict"]["_batches_that_stepped"]
    epoch_loop._batches_that_stepped = steps


#: The ``self.log`` arguments a result collection entry keeps (``_Metadata``'s plain fields).
_LOG_FIELDS = (
    "fx",
    "name",
    "prog_bar",
    "logger",
    "on_step",
    "on_epoch",
    "enable_graph",
    "add_dataloader_idx",
    "dataloader_idx",
    "metric_attribute",
)

#: The reductions ``self.log(reduce_fx=...)`` accepts, by the name a record stores.
_REDUCTIONS = {
    f"{fn.__module__}.{fn.__name__}": fn
    for fn in (torch.mean, torch.sum, torch.max, torch.min, sum, max, min)
}

#: Logged only after the inner loop: its values are the epoch end's own, never restored.
_EPOCH_END_HOOK = "on_train_epoch_end"


def _copied(value: Any) -> Any:
    return apply_to_collection(value, Tensor, lambda t: t.detach().clone())


def _metric_states(metric: Metric) -> dict[str, dict]:
    """A torchmetrics ``Metric``'s accumulated states, and those of the metrics it is made of
    (a compositional metric keeps none of its own), by submodule name."""
    return {
        name: {
            "states": {state: _copied(getattr(m, state)) for state in m._defaults},
            "update_count": m._update_count,
            "forward_cache": _copied(m._forward_cache),
        }
        for name, m in metric.named_modules()
        if isinstance(m, Metric)
    }


def _load_metric_states(metric: Metric, saved: dict[str, dict]) -> None:
    for name, entry in saved.items():
        m = metric.get_submodule(name)
        for state, value in entry["states"].items():
            setattr(m, state, apply_to_collection(value, Tensor, Tensor.to, m.device))
        m._update_count = entry["update_count"]
        m._forward_cache = apply_to_collection(entry["forward_cache"], Tensor, Tensor.to, m.device)
        m._computed = None


def logged_in_training(trainer: Trainer) -> list[dict[str, Any]]:
    """What the epoch's training batches logged, as the training loop's result collection holds
    it: per ``self.log`` call site, its arguments, its running aggregate (sum or extremum and
    batch count) and its last per-step value, in tensors and plain values only (a checkpoint
    holding it loads with ``torch.load(weights_only=True)``).

    Read in ``on_train_epoch_end``, where every hook of the last batch has logged (the module's
    ``on_train_batch_end`` runs after the callbacks'). Validation logs into its own collection;
    what the epoch-end hooks have logged by then is left out (their entries are the epoch end's,
    reset when the epoch's metrics go out), and so is an entry synced over a custom process
    group, which cannot be stored.
    """
    saved = []
    for key, result in trainer.fit_loop.epoch_loop._results.items():
        meta = result.meta
        if result.has_reset or meta.fx.partition(".")[0] == _EPOCH_END_HOOK:
            continue
        if meta.sync.group is not None:
            continue
        entry = {
            "key": key,
            "log": {field: getattr(meta, field) for field in _LOG_FIELDS},
            "reduce_fx": f"{meta.reduce_fx.__module__}.{meta.reduce_fx.__name__}",
            "sync": {"should": meta.sync.should, "rank_zero_only": meta.sync.rank_zero_only},
            "is_tensor": result.is_tensor,
            "update_count": result._update_count,
            "forward_cache": _copied(result._forward_cache),
        }
        if result.is_tensor:
            entry["states"] = {state: _copied(getattr(result, state)) for state in result._defaults}
        else:  # a torchmetrics Metric of the module: its states are the aggregate
            entry["metric"] = _metric_states(result.value)
        saved.append(entry)
    return saved


def _result_entry(trainer: Trainer, entry: dict[str, Any]) -> _ResultMetric:
    """A result collection entry as ``LightningModule.log`` makes it for these arguments (a
    later ``self.log`` at the same call site finds the arguments it passes equal)."""
    meta = _Metadata(**entry["log"], reduce_fx=_REDUCTIONS[entry["reduce_fx"]])
    sync = entry["sync"]
    meta.sync = _Sync(
        fn=trainer.strategy.reduce, _should=sync["should"], rank_zero_only=sync["rank_zero_only"]
    )
    return _ResultMetric(meta, entry["is_tensor"])


def restore_logged_in_training(trainer: Trainer, saved: list[dict[str, Any]]) -> None:
    """Put back what :func:`logged_in_training` read, in place of a training epoch that did not
    run: the epoch-end aggregation, ``callback_metrics`` (a plateau scheduler, ``EarlyStopping``,
    a probe), progress-bar and logged metrics then see the recorded epoch's values.

    Called where the epoch's batches would have run: what earlier epochs of this fit logged was
    reset when their metrics went out, so the collection offers the recorded epoch's values (and
    a probe's own from ``on_train_epoch_start``). The last batch's per-step values are then handed
    on as Lightning hands them after every batch (``_LoggerConnector.on_batch_end``).
    """
    results = trainer.fit_loop.epoch_loop._results
    module = trainer.lightning_module
    for entry in saved:
        result = results.get(entry["key"])
        if result is None:
            result = results[entry["key"]] = _result_entry(trainer, entry)
        if entry["is_tensor"]:
            for state, value in entry["states"].items():
                setattr(result, state, value.to(module.device))
            cache = entry["forward_cache"]
            result._forward_cache = None if cache is None else cache.to(module.device)
        else:
            result.value = module.get_submodule(result.meta.metric_attribute)
            _load_metric_states(result.value, entry["metric"])
            result._forward_cache = result.value._forward_cache
        result._update_count = entry["update_count"]
        result._computed = None
        result.has_reset = False
    connector = trainer._logger_connector
    step = results.metrics(on_step=True)
    connector._callback_metrics.update(step["callback"])
    connector._logged_metrics.update(step["log"])
    connector._progress_bar_metrics.update(step["pbar"])


def detached_copy(obj: Any) -> Any:
    """A deep copy of a LightningModule or data module without the Trainer it is attached to.

    Every reference to that Trainer copies as None: a module holds it as ``_trainer``, a data
    module as its public ``trainer`` too, and a Trainer holds what cannot be copied (a recording
    callback's open store: the objects a fit used, passed to ``replay``, failed to copy).
    """
    if obj is None:
        return None
    attached = [vars(obj).get(name) for name in ("_trainer", "trainer")]
    memo = {id(trainer): None for trainer in attached if trainer is not None}
    return copy.deepcopy(obj, memo)


def writing_no_files(checkpoint: ModelCheckpoint) -> None:
    """Make a replay's ``ModelCheckpoint`` decide as the record's did, writing no file.

    User code reads ``trainer.checkpoint_callback`` (``best_model_score``, ``best_model_path``,
    ``last_model_path``) in its hooks, so a replay keeps it: its state is loaded from the
    segment's start (the record's checkpoint holds it) and its hooks rank each epoch's score as
    the record's did. But a replay must never write, link, rotate or delete the files in the
    record's checkpoint folder: saving only notes what it would have saved, and removing only
    forgets it. Which file names exist is answered from those notes, as the record's folder
    held them (so names get the record's ``-v1`` suffixes, not ones from the record's files).
    """
    noted: set[str] = set()

    def save(trainer: Trainer, filepath: str) -> None:
        checkpoint._last_global_step_saved = trainer.global_step
        checkpoint._last_checkpoint_saved = filepath
        noted.add(filepath)

    def load_state_dict(state: dict[str, Any]) -> None:
        # The record's folder, not one resolved from the replay's logger: Lightning restores
        # the scores only into the folder they were saved for, and the paths read as recorded.
        checkpoint.dirpath = state.get("dirpath", checkpoint.dirpath)
        ModelCheckpoint.load_state_dict(checkpoint, state)
        noted.update(
            path for path in [*checkpoint.best_k_models, checkpoint.last_model_path] if path
        )

    checkpoint._save_checkpoint = save
    checkpoint._link_checkpoint = lambda trainer, filepath, linkpath: noted.add(linkpath)
    checkpoint._remove_checkpoint = lambda trainer, filepath: noted.discard(filepath)
    checkpoint.file_exists = lambda filepath, trainer: filepath in noted
    checkpoint.load_state_dict = load_state_dict
    # The record's folder holds the record's files: no "not empty" warning about them.
    checkpoint._ModelCheckpoint__warn_if_dir_not_empty = lambda dirpath: None
