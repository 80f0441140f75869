"""Composer-specific misuse gets a specific StalwartError that says what to do."""

from __future__ import annotations

import pytest
from composer import Callback
from composer_digits import WeightNormProbe, make_trainer

from stalwart import ConfigurationError, ReplayError
from stalwart.algorithms import Hindsight, Shrink, replay


class EveryEpoch(Hindsight):
    def should_checkpoint(self, state, policy_says: bool) -> bool:
        return True


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input-record")
    make_trainer(epochs=2, algorithms=[EveryEpoch(root)]).fit()
    return root


def test_shrink_without_a_checkpoint_folder(tmp_path):
    with pytest.raises(ConfigurationError, match="save_folder="):
        make_trainer(epochs=1, algorithms=[Shrink()])


def test_shrink_without_held_out_data(tmp_path):
    trainer = make_trainer(
        epochs=1, algorithms=[Shrink()], save_folder=str(tmp_path), save_interval="1ep",
        eval_dataloader=None, eval_interval=1,
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match="no eval_dataloader"):
        trainer.fit()
    assert not list(tmp_path.glob("ep*.pt"))  # nothing half-written


def test_shrink_into_an_archive_filename(tmp_path):
    trainer = make_trainer(
        epochs=1, algorithms=[Shrink()], save_folder=str(tmp_path), save_interval="1ep",
        save_filename="ep{epoch}.tar.gz",
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match="plain save_filename"):
        trainer.fit()


@pytest.mark.parametrize(
    "kwargs", [{"tau": -0.1}, {"eval_batches": 0}, {"grad_window": -1}, {"grad_beta": 1.5},
               {"keyframe_every": 0}, {"compress_optimizer": "gzip"}, {"continue_steps": 0},
               {"screen_fraction": 1.0}, {"screen_accept": 1.5}]
)  # fmt: skip
def test_shrink_arguments_out_of_range(kwargs):
    with pytest.raises(ConfigurationError):
        Shrink(**kwargs)


def test_replay_with_a_different_model(record):
    def wider(**overrides):
        return make_trainer(epochs=2, width=48, algorithms=[Hindsight(record)], **overrides)

    with pytest.raises(ReplayError, match="different model"):
        replay(wider, probe=WeightNormProbe())


def test_replay_without_knowing_where_the_record_is(record):
    with pytest.raises(ConfigurationError, match=r"Hindsight\(dirpath=...\)"):
        replay(lambda **overrides: make_trainer(epochs=2, **overrides), probe=WeightNormProbe())


def test_replay_with_a_probe_that_is_not_a_composer_callback(record):
    from lightning.pytorch.callbacks import Callback as LightningCallback

    def factory(**overrides):
        return make_trainer(epochs=2, algorithms=[Hindsight(record)], **overrides)

    with pytest.raises(ConfigurationError, match="not a Composer Callback"):
        replay(factory, probe=LightningCallback())
    with pytest.raises(ReplayError, match=r"epochs \[7\]"):
        replay(factory, probe=WeightNormProbe(), epochs=[7])
    assert isinstance(WeightNormProbe(), Callback)


def test_replay_of_a_lightning_record_with_composer(tmp_path):
    from stalwart import HindsightCallback
    from tests.helpers import fit_digits

    fit_digits([HindsightCallback(dirpath=tmp_path)], epochs=1)

    def factory(**overrides):
        return make_trainer(epochs=1, algorithms=[Hindsight(tmp_path)], **overrides)

    with pytest.raises(ReplayError, match="not recorded by Composer"):
        replay(factory, probe=WeightNormProbe())


@pytest.mark.parametrize("options", [{"epsilon": 3.0}, {"materializer": "thread"}])
def test_hindsight_arguments_are_checked_before_anything_is_created(tmp_path, options):
    with pytest.raises(ConfigurationError):
        Hindsight(tmp_path / "runs", **options)
    assert not (tmp_path / "runs").exists()
