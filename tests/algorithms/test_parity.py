"""The Lightning and Composer adapters of each capability take the same arguments.

Every framework-specific difference is listed here, with its reason; anything else that differs
(a name, a default, an order, a missing docstring entry) fails.
"""

from __future__ import annotations

import inspect

import pytest

from stalwart import HindsightCallback, ShrinkCheckpoint, Trainer
from stalwart.algorithms import Hindsight, Shrink, replay

#: Arguments only the Lightning ShrinkCheckpoint has: it is a ModelCheckpoint, which decides when
#: and where to save; Composer's Trainer decides that (save_folder, save_interval...) for Shrink.
#: ``background`` too: Composer's saver links, archives or uploads each file right after its write
#: returns, so a file a forked child is still writing would break it; not built for Composer yet.
LIGHTNING_SHRINK_ONLY = {"dirpath", "every_n_epochs", "save_top_k", "background", "kwargs"}
#: Parameters whose annotation names the framework's own type.
FRAMEWORK_TYPED = {"evaluate", "probe", "loggers"}


def _parameters(fn, skip: set[str] = frozenset()) -> dict[str, inspect.Parameter]:
    return {
        name: p
        for name, p in inspect.signature(fn).parameters.items()
        if name != "self" and name not in skip
    }


def _same(lightning: dict, composer: dict) -> None:
    assert list(lightning) == list(composer)  # names, in order
    for name in lightning:
        ours, theirs = lightning[name], composer[name]
        assert ours.kind == theirs.kind, name
        assert ours.default == theirs.default, name
        if name not in FRAMEWORK_TYPED:
            assert ours.annotation == theirs.annotation, name


def _documented(cls_or_fn) -> list[str]:
    """The names under a docstring's ``Args:``, in order."""
    doc = inspect.getdoc(cls_or_fn) or ""
    args = doc.split("Args:", 1)[1].split("\n\n")[0] if "Args:" in doc else ""
    names = []
    for line in args.splitlines():
        if line.startswith("    ") and not line.startswith("     ") and ":" in line:
            names += [n.strip().lstrip("*") for n in line.strip().split(":", 1)[0].split(",")]
    return names


def test_hindsight_callback_and_hindsight_take_the_same_arguments():
    _same(_parameters(HindsightCallback), _parameters(Hindsight))
    assert _documented(HindsightCallback) == _documented(Hindsight) == list(_parameters(Hindsight))


def test_shrink_checkpoint_and_shrink_take_the_same_arguments():
    lightning = _parameters(ShrinkCheckpoint, skip=LIGHTNING_SHRINK_ONLY)
    composer = _parameters(Shrink)
    _same(lightning, composer)
    assert set(_parameters(ShrinkCheckpoint)) - set(composer) == LIGHTNING_SHRINK_ONLY
    documented = _documented(Shrink)
    assert documented == list(composer)
    assert [n for n in _documented(ShrinkCheckpoint) if n in composer] == documented


def test_the_two_replays_take_the_same_keyword_arguments():
    def keyword_only(fn) -> dict[str, inspect.Parameter]:
        return {
            name: p
            for name, p in _parameters(fn).items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }

    lightning, composer = keyword_only(Trainer.replay), keyword_only(replay)
    _same(lightning, composer)
    for name in ("probe", "run", "epochs", "workers", "init", "dirpath", "dry_run", "loggers"):
        assert name in lightning, name
    # What comes before them says what is replayed: the module and data, or a Trainer factory.
    positional = {
        n for n, p in _parameters(Trainer.replay).items() if n not in lightning
    }  # fmt: skip
    assert positional == {"model", "datamodule"}
    assert [n for n in _parameters(replay) if n not in composer] == ["trainer_factory"]
    assert _documented(Trainer.replay) == list(_parameters(Trainer.replay))
    assert _documented(replay) == list(_parameters(replay))


@pytest.mark.parametrize("fn", [Trainer.replay, replay], ids=["lightning", "composer"])
def test_the_two_replays_return_the_same_result_type(fn):
    from stalwart.hindsight.estimate import ReplayEstimate
    from stalwart.hindsight.replay import ReplayResult

    hints = inspect.get_annotations(fn, eval_str=True)
    assert hints["return"] == ReplayResult | ReplayEstimate
