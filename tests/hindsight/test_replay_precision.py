"""A ``precision="64-true"`` run replays bit for bit from its epoch checkpoints.

Lightning loads ``ckpt_path`` into the module before the precision plugin converts it to
float64, so a resumed fit loads float64 weights into float32 parameters, rounding them (a plain
``fit(ckpt_path=...)`` does too). Every value a replay from an epoch checkpoint computed used to
differ from the record by ~1e-9. A run the record itself resumed did load its file rounded, and
its first epochs still replay as it ran them.
"""

from __future__ import annotations

import lightning as L
from digits import DigitsClassifier, DigitsDataModule

import stalwart
from tests.helpers import QUIET, EveryEpoch, GradProbe

DOUBLE = {"precision": "64-true", "deterministic": True, **QUIET}


def data() -> DigitsDataModule:
    return DigitsDataModule(batch_size=256, train_size=512)


def test_a_float64_run_replays_exactly_from_its_epoch_checkpoints(tmp_path):
    L.seed_everything(0)
    trainer = stalwart.Trainer(max_epochs=3, callbacks=[EveryEpoch(str(tmp_path))], **DOUBLE)
    trainer.fit(DigitsClassifier(width=8), data())
    result = trainer.replay(DigitsClassifier(width=8), data(), probe=GradProbe(), epochs=[2])
    assert result.segments[0].resume_from == 1
    assert result.mismatches == []


def test_a_resumed_float64_run_replays_its_first_epoch_as_it_loaded_it(tmp_path):
    L.seed_everything(0)
    first = stalwart.Trainer(max_epochs=2, callbacks=[EveryEpoch(str(tmp_path))], **DOUBLE)
    first.fit(DigitsClassifier(width=8), data())
    start = stalwart.hindsight.open(tmp_path).run().checkpoint(0).path
    resumed = stalwart.Trainer(max_epochs=3, callbacks=[EveryEpoch(str(tmp_path))], **DOUBLE)
    resumed.fit(DigitsClassifier(width=8), data(), ckpt_path=str(start))
    for epochs in ([1], [2]):  # from the file it resumed from, then from its own checkpoint
        result = resumed.replay(DigitsClassifier(width=8), data(), probe=GradProbe(), epochs=epochs)
        assert result.mismatches == []
