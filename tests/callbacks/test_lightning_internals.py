"""The private Lightning API in ``stalwart/callbacks/lightning_internals.py`` exists, and behaves
as that module relies on, in the installed Lightning; the dependency is bounded to this range.

A failure here names what changed: update the internals module (and its tested range in
``pyproject.toml`` and ``constraints.txt``), never the adapters.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from pathlib import Path

import lightning as L
import pytest
import tomllib
import torch
from digits import DigitsClassifier, DigitsDataModule
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loops.loop import _Loop
from packaging.requirements import Requirement
from packaging.version import Version

from stalwart.callbacks import lightning_internals as internals
from stalwart.callbacks.shrink import SAVING_HOOKS, ShrinkCheckpoint
from tests.helpers import QUIET, SectionNames, callback_hooks_called

ROOT = Path(__file__).resolve().parents[2]


def _bound(text: str) -> Requirement:
    return next(req for req in map(Requirement, text) if req.name == "lightning")


def test_lightning_is_bounded_to_the_installed_tested_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _bound(project["dependencies"])
    constrained = _bound(
        line for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )  # fmt: skip
    installed = Version(importlib.metadata.version("lightning"))
    assert declared.specifier == constrained.specifier
    assert installed in declared.specifier, f"lightning {installed} is outside {declared}"
    # An upper bound: a new minor release must be tested here before users get it.
    assert any(spec.operator in ("<", "<=", "==", "~=") for spec in declared.specifier)


def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


@pytest.fixture(scope="module")
def fitted():
    """A Trainer after one epoch, and the fit loop's state at the epoch boundary."""
    seen: dict = {}

    class AtBoundary(Callback):
        def setup(self, trainer, pl_module, stage):
            internals.hook_epoch_boundary(
                trainer,
                on_end=lambda: seen.setdefault("checkpoint", internals.dump_checkpoint(trainer)),
                on_error=lambda: None,
            )

        def on_train_batch_end(self, trainer, *args):
            seen.setdefault("mid_epoch", internals.dump_checkpoint(trainer))

    trainer = L.Trainer(max_epochs=1, callbacks=[AtBoundary()], **QUIET)
    trainer.fit(DigitsClassifier(width=8), DigitsDataModule(batch_size=500))
    assert internals.EPOCH_START_KEY not in seen["mid_epoch"]["loops"]["fit_loop"]
    return trainer, seen["checkpoint"]


def test_private_attributes_the_internals_use_exist(fitted):
    trainer, _ = fitted
    missing = []
    connector = getattr(trainer, "_checkpoint_connector", None)
    if connector is None or "weights_only" not in _params(connector.dump_checkpoint):
        missing.append("Trainer._checkpoint_connector.dump_checkpoint(weights_only=...)")
    loop = trainer.fit_loop
    if _params(loop.on_advance_end):
        missing.append("_FitLoop.on_advance_end() taking no argument")
    if not isinstance(getattr(loop, "_can_stop_early", None), bool):
        missing.append("_FitLoop._can_stop_early (a bool property)")
    # ShrinkCheckpoint overrides it: its last.ckpt is a side save (stalwart/callbacks/shrink.py).
    save_last = getattr(ModelCheckpoint, "_save_last_checkpoint", None)
    if not callable(save_last) or _params(save_last) != ["trainer", "monitor_candidates"]:
        missing.append("ModelCheckpoint._save_last_checkpoint(trainer, monitor_candidates)")
    # stalwart/cli.py overrides it: a shrunken --ckpt_path's hyperparameters are read by stalwart.
    if not callable(getattr(LightningCLI, "_parse_ckpt_path", None)):
        missing.append("LightningCLI._parse_ckpt_path")
    load_states = getattr(loop, "_load_combined_loader_states", None)
    if not callable(load_states) or _params(load_states):
        missing.append("_FitLoop._load_combined_loader_states() taking no argument")
    if _params(loop.load_state_dict) != ["state_dict", "prefix"]:
        missing.append("_FitLoop.load_state_dict(state_dict, prefix)")
    if getattr(vars(_Loop).get("restarting"), "fset", None) is None:
        missing.append("_Loop.restarting (a property with a setter)")
    if not all(
        hasattr(loop.epoch_progress.current, name)
        for name in ("ready", "started", "processed", "completed")
    ):
        missing.append("_FitLoop.epoch_progress.current.{ready,started,processed,completed}")
    epoch_loop = loop.epoch_loop
    if _params(epoch_loop.run) != ["data_fetcher"]:
        missing.append("_TrainingEpochLoop.run(data_fetcher)")
    for name in ("_should_check_val_epoch", "_batches_that_stepped", "val_loop", "batch_progress"):
        if not hasattr(epoch_loop, name):
            missing.append(f"_TrainingEpochLoop.{name}")
    if not hasattr(epoch_loop.val_loop, "run"):
        missing.append("_EvaluationLoop.run")
    if not hasattr(epoch_loop.batch_progress, "is_last_batch"):
        missing.append("_BatchProgress.is_last_batch")
    trackers = {
        "epoch_loop.batch_progress": epoch_loop.batch_progress,
        "epoch_loop.automatic_optimization.optim_progress": (
            epoch_loop.automatic_optimization.optim_progress
        ),
        "epoch_loop.manual_optimization.optim_step_progress": (
            epoch_loop.manual_optimization.optim_step_progress
        ),
        "epoch_loop.scheduler_progress": epoch_loop.scheduler_progress,
    }
    assert tuple(trackers) == internals.LOOP_PROGRESS_KEYS
    missing += [
        f"{key}.load_state_dict" for key, t in trackers.items() if not hasattr(t, "load_state_dict")
    ]
    # What a memoized epoch's batches logged (logged_in_training / restore_logged_in_training).
    results = getattr(epoch_loop, "_results", None)
    if not isinstance(results, dict) or "training_step.train_loss" not in results:
        missing.append("_TrainingEpochLoop._results (the training _ResultCollection by key)")
    else:
        if _params(results.metrics) != ["on_step"]:
            missing.append("_ResultCollection.metrics(on_step)")
        result = results["training_step.train_loss"]
        for name in ("meta", "is_tensor", "has_reset", "_forward_cache", "_update_count"):
            if not hasattr(result, name):
                missing.append(f"_ResultMetric.{name}")
        if set(result._defaults) != {"value", "cumulated_batch_size"}:
            missing.append("_ResultMetric._defaults (value, cumulated_batch_size)")
    fields = internals._Metadata.__dataclass_fields__
    missing += [f"_Metadata.{name}" for name in internals._LOG_FIELDS if name not in fields]
    if {"fn", "_should", "rank_zero_only", "_group"} - set(internals._Sync.__dataclass_fields__):
        missing.append("_Sync(fn, _should, rank_zero_only, _group)")
    logger_connector = trainer._logger_connector
    for name in ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics"):
        if not isinstance(getattr(logger_connector, name, None), dict):
            missing.append(f"_LoggerConnector.{name} (a dict)")
    # writing_no_files: a replay's ModelCheckpoint writes, links and deletes through these only.
    checkpoint_methods = {
        "_save_checkpoint": ["trainer", "filepath"],
        "_link_checkpoint": ["trainer", "filepath", "linkpath"],
        "_remove_checkpoint": ["trainer", "filepath"],
        "file_exists": ["filepath", "trainer"],
        "_ModelCheckpoint__warn_if_dir_not_empty": ["dirpath"],
    }
    for name, params in checkpoint_methods.items():
        method = getattr(ModelCheckpoint, name, None)
        if not callable(method) or _params(method) != params:
            missing.append(f"ModelCheckpoint.{name}({', '.join(params)})")
    saver = ModelCheckpoint()
    for name in ("_last_global_step_saved", "_last_checkpoint_saved"):
        if not hasattr(saver, name):
            missing.append(f"ModelCheckpoint.{name}")
    for name in ("restarted_on_epoch_end", "restarted_mid_epoch"):
        if not isinstance(getattr(loop, name, None), bool):
            missing.append(f"_FitLoop.{name} (a bool)")
    # replace_epoch_batches: a memoized epoch validates when Lightning's own decision says so.
    if _params(getattr(epoch_loop, "_should_check_val_fx", lambda: None)) != ["data_fetcher"]:
        missing.append("_TrainingEpochLoop._should_check_val_fx(data_fetcher)")
    module = DigitsClassifier(width=8)
    for name in ("_current_fx_name", "_trainer"):
        if name not in vars(module):
            missing.append(f"LightningModule.{name}")
    assert missing == [], f"Lightning {L.__version__} changed: {missing}"


def test_an_epoch_checkpoint_holds_the_loop_state_restore_reads(fitted):
    _, checkpoint = fitted
    fit_loop = checkpoint["loops"]["fit_loop"]
    for key in internals.LOOP_PROGRESS_KEYS:
        assert key in fit_loop, key
    assert "_batches_that_stepped" in fit_loop["epoch_loop.state_dict"]
    assert fit_loop[internals.EPOCH_START_KEY] is True


@pytest.mark.parametrize(
    ("max_steps", "marked"), [(-1, True), (100, True), (100, False)], ids=["-1", "set", "unmarked"]
)
def test_a_state_taken_between_epochs_loads_without_restarting_whatever_max_steps(
    fitted, max_steps, marked
):
    # Lightning restarts the loops from any state once max_steps is set (so the epoch the state
    # finished is read as still running); from the record's state between epochs it must not.
    _, checkpoint = fitted
    state = dict(checkpoint["loops"]["fit_loop"])
    if not marked:
        del state[internals.EPOCH_START_KEY]
    trainer = L.Trainer(max_epochs=3, max_steps=max_steps, **QUIET)
    internals.resume_at_epoch_start(trainer)
    trainer.fit_loop.load_state_dict(state)
    restarting = max_steps != -1 and not marked  # Lightning's own, for a state it cannot place
    assert trainer.fit_loop.restarting is restarting
    assert trainer.fit_loop.epoch_loop.restarting is restarting
    assert trainer.fit_loop.epoch_loop.val_loop.restarting is restarting
    assert trainer.fit_loop.epoch_progress.current.completed == 1  # the load itself unchanged
    internals.release_epoch_start(trainer)
    assert "load_state_dict" not in vars(trainer.fit_loop)


@pytest.mark.parametrize(
    "limits",
    [
        {"max_epochs": 3},
        {"max_epochs": -1, "max_steps": 7},  # mid-epoch: 3 batches an epoch
        {"max_epochs": 5, "early_stop": True},
        {"max_epochs": 5, "early_stop": True, "min_epochs": 3},
    ],
    ids=["max_epochs", "max_steps", "early_stop", "early_stop_min_epochs"],
)
def test_the_stop_test_agrees_with_the_fit_loops_own_at_every_epoch_boundary(limits):
    from lightning.pytorch.callbacks import EarlyStopping

    seen: list[tuple[bool, bool]] = []

    class AtBoundary(Callback):
        def setup(self, trainer, pl_module, stage):
            internals.hook_epoch_boundary(
                trainer,
                on_end=lambda: seen.append(
                    (internals.fit_ends_after_this_epoch(trainer), trainer.fit_loop.done)
                ),
                on_error=lambda: None,
            )

    callbacks: list[Callback] = [AtBoundary()]
    if limits.pop("early_stop", False):  # stops when asked after epoch 1 (nothing improves 1e9)
        callbacks.append(EarlyStopping("val_loss", patience=1, min_delta=1e9))
    trainer = L.Trainer(callbacks=callbacks, **limits, **QUIET)
    trainer.fit(DigitsClassifier(width=8), DigitsDataModule(batch_size=500))
    assert [ours for ours, _ in seen] == [loops for _, loops in seen]
    assert seen[-1][0] and not any(ours for ours, _ in seen[:-1])


def test_the_epoch_boundary_comes_after_the_module_hook_and_the_plateau_lr_step():
    order: list[tuple] = []

    def lr(trainer) -> float:
        return trainer.optimizers[0].param_groups[0]["lr"]

    class Module(DigitsClassifier):
        def training_step(self, batch, batch_idx):
            self.log("constant", 1.0)  # never improves: the plateau scheduler halves the LR
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
                optimizer, factor=0.5, patience=0, threshold=0
            )
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": plateau, "monitor": "constant"},
            }

        def on_train_epoch_end(self):
            order.append(("module", lr(self.trainer)))

    class Boundary(Callback):
        def setup(self, trainer, pl_module, stage):
            completed = lambda: trainer.fit_loop.epoch_progress.current.completed  # noqa: E731
            internals.hook_epoch_boundary(
                trainer,
                on_end=lambda: order.append(("boundary", lr(trainer), completed())),
                on_error=lambda: order.append(("error",)),
            )

        def teardown(self, trainer, pl_module, stage):
            internals.unhook_epoch_boundary(trainer)
            assert "on_advance_end" not in vars(trainer.fit_loop)

    trainer = L.Trainer(max_epochs=2, callbacks=[Boundary()], **QUIET)
    trainer.fit(Module(width=8), DigitsDataModule(batch_size=500))
    # After the module's own epoch-end hook and the plateau step, with the epoch counted done.
    assert order == [
        ("module", 0.1), ("boundary", 0.1, 1), ("module", 0.1), ("boundary", 0.05, 2)
    ]  # fmt: skip


def test_every_model_checkpoint_hook_that_saves_is_one_shrink_checkpoint_wraps():
    hooks = [
        name for name in vars(ModelCheckpoint)
        if name.startswith("on_") and callable(getattr(Callback, name, None))
    ]  # fmt: skip
    saving = {
        name for name in hooks if "_save_" in inspect.getsource(getattr(ModelCheckpoint, name))
    }
    assert saving <= set(SAVING_HOOKS), (
        f"ModelCheckpoint now also saves in {saving - set(SAVING_HOOKS)}"
    )
    for name in SAVING_HOOKS:
        assert name in vars(ShrinkCheckpoint), name
        assert _params(getattr(ShrinkCheckpoint, name)) == _params(getattr(ModelCheckpoint, name))


def test_dispatch_skips_the_hooks_a_callback_leaves_unused(tmp_path):
    # ShrinkCheckpoint (a ModelCheckpoint) sets Callback's no-op hooks to None: Lightning must
    # skip them rather than call None, and still hand it the hooks it and ModelCheckpoint define.
    callback = ShrinkCheckpoint(dirpath=tmp_path, keyframe_every=1)
    profiler = SectionNames()
    quiet = {key: value for key, value in QUIET.items() if key != "enable_checkpointing"}
    trainer = L.Trainer(
        max_epochs=1, limit_train_batches=3, limit_val_batches=1, callbacks=[callback],
        profiler=profiler, **quiet,
    )  # fmt: skip
    trainer.fit(DigitsClassifier(width=8), DigitsDataModule(batch_size=64))
    called = callback_hooks_called(profiler, callback)
    assert called.count("on_train_batch_end") == 3 and "on_validation_end" in called
    assert "on_before_backward" not in called and callback.on_before_backward is None
    unused = {name for name in called if getattr(Callback, name) is getattr(ShrinkCheckpoint, name)}
    assert unused <= set(internals._CALLED_DIRECTLY), unused


class _LogsEverywhere(DigitsClassifier):
    """Logs from the training and validation steps and an epoch-end hook, and notes at each
    call where ``log_position`` says it lands and where the trainer's public properties do."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__(width=8)
        self.automatic_optimization = not manual
        self.position = None
        self.calls: list[tuple] = []

    def log(self, name, value, *args, **kwargs):
        trainer = self.trainer
        public = None if trainer.sanity_checking else (trainer.current_epoch, trainer.global_step)
        self.calls.append((name, self.position(), public))
        return super().log(name, value, *args, **kwargs)

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        if batch_idx % 2:  # a step every other batch: global_step is not the batch count
            optimizer.step()
        return loss

    def on_train_epoch_end(self):
        self.log("epoch_end", 1.0)


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_log_position_agrees_with_the_trainers_own_properties_at_every_log_call(tmp_path, manual):
    class Bind(Callback):
        def setup(self, trainer, pl_module, stage):
            pl_module.position = internals.log_position(trainer, pl_module)

    def fit(module, epochs, **kwargs):
        trainer = L.Trainer(
            max_epochs=epochs,
            callbacks=[Bind(), ModelCheckpoint(dirpath=tmp_path / str(epochs), save_last=True)],
            num_sanity_val_steps=2,
            limit_train_batches=6,
            accumulate_grad_batches=1 if manual else 2,
            **{**QUIET, "enable_checkpointing": True},
        )
        trainer.fit(module, DigitsDataModule(batch_size=64), **kwargs)
        return module.calls

    first = fit(_LogsEverywhere(manual), epochs=2)
    # Resumed from the last checkpoint: the trackers are loaded in place, the reader still reads.
    resumed = fit(_LogsEverywhere(manual), epochs=4, ckpt_path=str(tmp_path / "2" / "last.ckpt"))
    for calls in (first, resumed):
        assert [position for _, position, _ in calls] == [public for _, _, public in calls]
    assert [public for _, _, public in first[:4]] == [None] * 4  # the sanity check's two steps
    assert {public[0] for _, _, public in resumed if public} == {2, 3}
    steps = [public[1] for _, _, public in first + resumed if public]
    assert steps == sorted(steps) and steps[-1] == 12 and len(set(steps)) == 13
