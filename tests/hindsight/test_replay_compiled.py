"""A ``torch.compile``'d LightningModule, recorded and replayed.

Lightning trains the LightningModule inside the compiled wrapper (``trainer.fit`` unwraps it), so
the record saved that module's state and fingerprinted its hooks; the replay used to look at the
wrapper instead (state names prefixed ``_orig_mod.``, hooks of torch's class) and refused it as
"a different model". The fits here compile with dynamo's ``eager`` backend: the same wrapper and
the same unwrapping by Lightning as inductor's, without its code generation, which takes longer
on a 2-core CPU than the rest of this file (a replay compiled with inductor reproduces a record
compiled with inductor bit for bit too; measured while fixing this, not repeated here).
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule

import stalwart
from stalwart.trainer import is_compiled, training_copy, uncompiled
from tests.helpers import QUIET, EpochProbe, EveryEpoch

EPOCHS = 3


class LossProbe(L.Callback):
    """Inner-loop: every batch's loss, as the training step returned it."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log("loss_seen", outputs["loss"].detach())


def compiled(module_class=DigitsClassifier):
    L.seed_everything(3)
    return torch.compile(module_class(width=16), backend="eager")


def data() -> DigitsDataModule:
    return DigitsDataModule(batch_size=128, train_size=384)


def trainer_for(dirpath, probes=()) -> stalwart.Trainer:
    callbacks = [EveryEpoch(dirpath=dirpath), *probes]
    return stalwart.Trainer(max_epochs=EPOCHS, callbacks=callbacks, deterministic=True, **QUIET)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """The record of a compiled fit, and the compiled module that fit trained."""
    root = tmp_path_factory.mktemp("compiled")
    model = compiled()
    trainer_for(root).fit(model, data())
    return root, model


def replay(root, model, probe, epochs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = trainer_for(root).replay(model, data(), probe=probe, epochs=epochs)
    said = [str(w.message) for w in caught if "does not reproduce" in str(w.message)]
    return result, said


def test_a_compiled_module_replays_as_the_module_lightning_trained(record):
    root, _ = record
    # An epoch-end probe restores the epochs from their checkpoints: the hooks' fingerprints
    # were compared on the module inside the wrapper, so nothing looks edited.
    result, said = replay(root, compiled(), EpochProbe(), [1, 2])
    assert result.level == "outer" and result.batches_executed == 0
    assert result.mismatches == [] and said == []
    assert len(result.metrics("w_norm")) == 2
    # Re-executed epochs reproduce every recorded loss.
    result, said = replay(root, compiled(), LossProbe(), [1, 2])
    assert result.level == "inner" and result.batches_executed == 2 * 3
    assert result.mismatches == [] and said == []


def test_the_module_a_compiled_fit_trained_replays_in_a_copy_of_its_own(record):
    """Lightning leaves the trained module with compiled wrappers of its step methods, bound
    to it; a copy sharing them would train and log the caller's (final) weights."""
    root, trained = record
    assert uncompiled(trained)._compiler_ctx is not None  # as Lightning left it
    result, said = replay(root, trained, LossProbe(), [1, 2])
    assert result.mismatches == [] and said == []
    recorded = result.run.metrics("train_loss", source="record")
    replayed = result.metrics("loss_seen")
    assert replayed.value.tolist() == recorded[recorded.epoch.isin([1, 2])].value.tolist()


def test_a_copy_for_a_segment_runs_its_own_weights(record):
    _, trained = record
    copy = uncompiled(training_copy(trained))
    assert copy is not uncompiled(trained)
    with torch.no_grad():
        for p in copy.parameters():
            p.zero_()
    x = torch.rand(2, 64)
    # Lightning compiles the copy again when a segment fits it; before, its forward is its own.
    assert torch.equal(copy(x), torch.zeros(2, 10))


def test_compiled_and_uncompiled_are_told_apart():
    module = DigitsClassifier(width=8)
    wrapped = torch.compile(module, backend="eager")
    assert uncompiled(wrapped) is module and uncompiled(module) is module
    assert is_compiled(wrapped) and not is_compiled(module)


class Rounded(DigitsClassifier):
    """Losses that differ from the record's in their last bits, as compiled kernels' may from
    eager ones (operations fused and reordered)."""

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * (1 + 2**-20)


def test_a_compiled_replay_that_differs_names_compiled_numerics_not_init(record):
    root, _ = record
    result, said = replay(root, compiled(Rounded), LossProbe(), [1])
    assert result.mismatches
    (warning,) = said
    assert "compiled (torch.compile)" in warning and "round differently" in warning
    assert "try init='strong'" not in warning


def test_the_record_notes_it_was_compiled_and_an_eager_replay_is_told_so(record):
    root, _ = record
    assert stalwart.hindsight.open(root).run().config["compiled"] is True
    # The same module uncompiled: eager kernels round differently from the record's compiled
    # ones; the hint says so even though the replayed module is not compiled.
    eager = compiled(Rounded)._orig_mod
    result, said = replay(root, eager, LossProbe(), [1])
    assert result.mismatches
    (warning,) = said
    assert "compiled (torch.compile)" in warning and "try init='strong'" not in warning
