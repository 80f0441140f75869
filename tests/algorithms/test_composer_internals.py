"""What ``stalwart/algorithms/composer_internals.py`` replaces exists in the installed Composer,
with the signatures it relies on; a failure names what changed."""

from __future__ import annotations

import inspect

from composer.callbacks import CheckpointSaver
from composer.trainer import Trainer
from composer.utils import checkpoint as composer_checkpoint


def _params(fn) -> list[str]:
    return [name for name in inspect.signature(fn).parameters if name != "self"]


def test_composer_has_what_the_internals_replace():
    expected = {
        "checkpoint._write_checkpoint_file": (
            getattr(composer_checkpoint, "_write_checkpoint_file", None),
            ["state_dict", "filename"],
        ),
        "checkpoint.safe_torch_load": (
            getattr(composer_checkpoint, "safe_torch_load", None),
            ["composer_states_filepath"],
        ),
        "CheckpointSaver._save_checkpoint": (
            getattr(CheckpointSaver, "_save_checkpoint", None),
            ["state", "logger"],
        ),
        "CheckpointSaver._rotate_checkpoints": (
            getattr(CheckpointSaver, "_rotate_checkpoints", None),
            ["sharding_enabled"],
        ),
    }
    changed = [
        name for name, (fn, params) in expected.items()
        if fn is None or _params(fn)[: len(params)] != params
    ]  # fmt: skip
    for name in ("is_tar", "is_compressed_pt"):
        if not callable(getattr(composer_checkpoint, name, None)):
            changed.append(f"checkpoint.{name}")
    saver = inspect.getsource(CheckpointSaver)
    for used in (
        "self.saved_checkpoints",
        "self.num_checkpoints_to_keep",
        "self._rotate_checkpoints(",
    ):
        if used not in saver:
            changed.append(f"CheckpointSaver: {used}")
    assert changed == [], f"Composer changed: {changed}"


def test_a_trainer_loads_its_load_path_between_init_and_after_load():
    source = inspect.getsource(Trainer.__init__)
    init = source.index("run_event(Event.INIT)")
    load = source.index("checkpoint.load_checkpoint(")
    after = source.index("run_event(Event.AFTER_LOAD)")
    assert init < load < after


def test_composer_has_the_engine_methods_hindsight_times():
    # stalwart.algorithms.hindsight.CallbackDispatch runs these on a stand-in engine.
    from composer.core import Engine

    assert _params(Engine._run_callbacks)[:2] == ["event", "callbacks"]
    assert _params(Engine._debug_log) == ["event", "msg"]
    body = inspect.getsource(Engine._run_callbacks)
    for used in (
        "self.state.profiler",
        "self._debug_log(",
        "cb.run_event(event, self.state, self.logger)",
    ):
        assert used in body, f"Composer changed Engine._run_callbacks: {used}"
    assert "self.state.timestamp" in inspect.getsource(Engine._debug_log)
