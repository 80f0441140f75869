"""How ShrinkCheckpoint and ShrinkCheckpointIO are set up: settings that could not take effect
are refused when the Trainer starts (not silently dropped, nor found only at the first save), and
what a callback keeps in its state comes back from a shrunken file as it was saved."""

import collections
import datetime
import pickle

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule
from lightning.pytorch.callbacks import ModelCheckpoint

import stalwart.shrink as shrink
from stalwart import ShrinkCheckpoint
from stalwart.errors import ConfigurationError, UnsafeCheckpointError
from stalwart.plugins import ShrinkCheckpointIO
from stalwart.shrink.container import is_shrunk_file
from tests.helpers import QUIET

WITH_CHECKPOINTS = {**QUIET, "enable_checkpointing": True}


class EpochsTrained(L.Callback):
    """Counts the training epochs a fit finished before it stopped."""

    def __init__(self) -> None:
        self.epochs = 0

    def on_train_epoch_end(self, trainer, module) -> None:
        self.epochs += 1


def _trainer(callbacks, epochs=2, **kwargs) -> L.Trainer:
    return L.Trainer(max_epochs=epochs, callbacks=callbacks, **{**WITH_CHECKPOINTS, **kwargs})


def _fit(callbacks, epochs=2, *, ckpt_path=None, weights_only=None, **kwargs) -> L.Trainer:
    trainer = _trainer(callbacks, epochs, **kwargs)
    trainer.fit(
        DigitsClassifier(width=8),
        DigitsDataModule(batch_size=500),
        ckpt_path=ckpt_path,
        weights_only=weights_only,
    )
    return trainer


# --- one ShrinkCheckpoint, and one checkpoint IO, per Trainer ----------------------------------


def test_two_shrink_checkpoints_in_one_trainer_are_refused_before_training(tmp_path):
    # The second one's saves went through the first one's IO: no search, its tau never applied.
    first = ShrinkCheckpoint(dirpath=tmp_path, filename="a-{epoch}", monitor="val_loss")
    second = ShrinkCheckpoint(dirpath=tmp_path, filename="b-{epoch}", monitor="val_acc", mode="max")
    trained = EpochsTrained()
    with pytest.raises(ConfigurationError, match="One ShrinkCheckpoint per Trainer"):
        _fit([trained, first, second])
    assert trained.epochs == 0 and not list(tmp_path.iterdir())


def test_a_users_shrink_io_plugin_beside_shrink_checkpoint_is_refused(tmp_path):
    # Its keyframe_every=1 and lossless optimizer were silently replaced by the callback's own.
    plugin = ShrinkCheckpointIO(keyframe_every=1, compress_optimizer="lossless")
    with pytest.raises(ConfigurationError, match="Pass them to ShrinkCheckpoint instead"):
        _fit([ShrinkCheckpoint(dirpath=tmp_path)], plugins=[plugin])
    assert not list(tmp_path.iterdir())


def test_shrink_checkpoint_beside_a_plain_model_checkpoint_and_fitted_twice(tmp_path):
    # What the refusal says to do works: the plain callback writes ordinary Lightning files; and
    # a second fit of the same Trainer finds the callback's own IO installed and goes on.
    shrunk = ShrinkCheckpoint(dirpath=tmp_path / "shrunk")
    plain = ModelCheckpoint(dirpath=tmp_path / "plain", save_top_k=-1)
    trainer = _trainer([shrunk, plain], epochs=2)
    model, data = DigitsClassifier(width=8), DigitsDataModule(batch_size=500)
    trainer.fit(model, data)
    trainer.fit_loop.max_epochs = 3
    trainer.fit(model, data, ckpt_path=shrunk.reports[-1].path)
    assert [r.kind for r in shrunk.reports] == ["keyframe", "delta", "delta"]
    assert all(r.search is not None for r in shrunk.reports)
    plain_files = sorted((tmp_path / "plain").iterdir())
    assert len(plain_files) == 3 and not any(is_shrunk_file(p) for p in plain_files)
    torch.load(plain_files[-1], weights_only=True)


# --- arguments checked when made, not at the first save ----------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"coder": "bogus"},
        {"tau": -0.1},
        {"tau": float("nan")},
        {"keyframe_every": 1.5},
        {"keyframe_every": 0},
    ],
)
@pytest.mark.parametrize("adapter", [ShrinkCheckpointIO, ShrinkCheckpoint])
def test_bad_arguments_are_refused_at_construction(tmp_path, adapter, kwargs):
    if adapter is ShrinkCheckpoint:
        kwargs = {"dirpath": tmp_path, **kwargs}
    with pytest.raises(ConfigurationError):
        adapter(**kwargs)


def test_validation_switched_off_is_named_before_training(tmp_path):
    # Dataloaders given to fit are not loaded when limit_val_batches=0: the error said "this fit
    # has no validation dataloader; add one" after the first epoch's training.
    data = DigitsDataModule(batch_size=500)
    data.setup("fit")
    trained = EpochsTrained()
    trainer = _trainer([trained, ShrinkCheckpoint(dirpath=tmp_path)], limit_val_batches=0)
    with pytest.raises(ConfigurationError, match=r"limit_val_batches=0.*evaluate="):
        trainer.fit(DigitsClassifier(width=8), data.train_dataloader(), data.val_dataloader())
    assert trained.epochs == 0


def test_validation_switched_off_still_scores_on_a_datamodules_data(tmp_path):
    callback = ShrinkCheckpoint(dirpath=tmp_path)
    _fit([callback], epochs=1, limit_val_batches=0)
    assert [r.search for r in callback.reports] == ["full"]


def test_no_validation_data_at_all_is_named_before_training(tmp_path):
    data = DigitsDataModule(batch_size=500)
    data.setup("fit")
    trained = EpochsTrained()
    trainer = _trainer([trained, ShrinkCheckpoint(dirpath=tmp_path)])
    with pytest.raises(ConfigurationError, match="given no validation dataloader"):
        trainer.fit(DigitsClassifier(width=8), data.train_dataloader())
    assert trained.epochs == 0


def test_saves_by_train_time_interval_write_restorable_shrunken_files(tmp_path):
    # ModelCheckpoint's train_time_interval was refused as clashing with every_n_epochs=1, which
    # the user never passed.
    callback = ShrinkCheckpoint(
        dirpath=tmp_path, train_time_interval=datetime.timedelta(milliseconds=1)
    )
    _fit([callback], epochs=2)
    assert len(callback.reports) >= 2 and callback.reports[0].search == "full"
    for report in callback.reports:
        assert is_shrunk_file(report.path)
        shrink.load(report.path)
    with pytest.raises(Exception, match="mutually exclusive"):
        ShrinkCheckpoint(dirpath=tmp_path, every_n_epochs=2, every_n_train_steps=3)


# --- a callback's state in a shrunken file --------------------------------------------------------


class Counting(L.Callback):
    """A callback whose state is a dict subclass: a Counter, a defaultdict..."""

    def __init__(self, counts) -> None:
        self.counts = counts

    def on_train_batch_end(self, *args) -> None:
        self.counts["batches"] += 1

    def state_dict(self):
        return {"counts": self.counts}

    def load_state_dict(self, state_dict) -> None:
        self.counts = state_dict["counts"]


@pytest.mark.parametrize(
    "make, weights_only",
    [
        (collections.Counter, None),  # torch's weights_only loading allows a Counter
        (lambda: collections.defaultdict(int), False),  # not a defaultdict: trusted files only
    ],
)
def test_dict_subclasses_in_callback_state_resume_as_saved(tmp_path, make, weights_only):
    # A Counter came back as {(('batches', 3), 1): 1}; a defaultdict failed the first save.
    callback = ShrinkCheckpoint(dirpath=tmp_path / "run")
    _fit([callback, Counting(make())], epochs=1)
    resumed = Counting(make())
    path = callback.reports[-1].path
    _fit([ShrinkCheckpoint(dirpath=tmp_path / "resumed"), resumed], epochs=1, ckpt_path=path,
         weights_only=weights_only)  # fmt: skip
    assert type(resumed.counts) is type(make()) and resumed.counts == {"batches": 3}
    if weights_only is False:  # as torch.load refuses it, unless the file is trusted
        assert resumed.counts.default_factory is int
        with pytest.raises(UnsafeCheckpointError, match="weights_only=False"):
            shrink.load_with_extra(path)


def test_a_plain_checkpoint_resumes_with_the_weights_only_the_fit_was_given(tmp_path):
    # A plain file was loaded with torch.load's default (weights_only=True) whatever the fit
    # said: one that only loads with weights_only=False resumed without ShrinkCheckpoint and
    # failed with it.
    plain = ModelCheckpoint(dirpath=tmp_path / "plain")
    _fit([plain, Counting(collections.defaultdict(int))], epochs=1)
    resumed = Counting(collections.defaultdict(int))
    _fit([ShrinkCheckpoint(dirpath=tmp_path / "shrunk"), resumed], epochs=2,
         ckpt_path=plain.best_model_path, weights_only=False)  # fmt: skip
    assert resumed.counts == {"batches": 6} and resumed.counts.default_factory is int
    with pytest.raises(pickle.UnpicklingError, match="weights_only"):  # and refused when asked
        ShrinkCheckpointIO().load_checkpoint(plain.best_model_path, weights_only=True)


NamedPair = collections.namedtuple("NamedPair", "first second")


class Tagged(tuple):
    """A tuple subclass whose constructor does not take an iterable."""

    def __new__(cls, tag, *items):
        made = super().__new__(cls, items)
        made.tag = tag
        return made

    def __reduce__(self):
        return (Tagged, (self.tag, *self))


def test_containers_of_every_kind_keep_their_type_and_tensors(tmp_path):
    tensor = torch.randn(2000)
    extra = {
        "ordered": collections.OrderedDict([("z", tensor), ("a", 1)]),
        "counter": collections.Counter({"seen": 3}),
        "lists": collections.defaultdict(list, {"x": [tensor]}),
        "pair": NamedPair(tensor, 2),
        "tagged": Tagged("t", tensor, 2),
        "size": torch.Size([3, 4]),
    }
    shrink.save({"w": torch.randn(2000)}, tmp_path / "x.shrunk", extra=extra)
    _, loaded, _ = shrink.load_with_extra(tmp_path / "x.shrunk", weights_only=False)
    assert list(loaded["ordered"]) == ["z", "a"] and torch.equal(loaded["ordered"]["z"], tensor)
    assert type(loaded["counter"]) is collections.Counter and loaded["counter"] == {"seen": 3}
    assert loaded["lists"].default_factory is list
    assert torch.equal(loaded["lists"]["x"][0], tensor)
    assert type(loaded["pair"]) is NamedPair and torch.equal(loaded["pair"].first, tensor)
    assert loaded["tagged"].tag == "t" and torch.equal(loaded["tagged"][0], tensor)
    assert loaded["size"] == torch.Size([3, 4]) and type(loaded["size"]) is torch.Size
