"""Replaying with the very model and data module objects the fit used (what a user in a notebook
does): they are still attached to the recording Trainer, whose open store cannot be copied, and
each replay segment copies them. It used to fail in every worker ("cannot pickle
'sqlite3.Connection' object")."""

from __future__ import annotations

import lightning as L
import torch
from digits import DigitsClassifier, DigitsDataModule

import stalwart
from tests.helpers import QUIET, GradProbe


def test_a_replay_takes_the_objects_the_fit_trained(tmp_path):
    L.seed_everything(5)
    model, data = DigitsClassifier(width=16), DigitsDataModule(batch_size=256, train_size=512)
    trainer = stalwart.Trainer(
        max_epochs=3, callbacks=[stalwart.HindsightCallback(dirpath=str(tmp_path))],
        deterministic=True, **QUIET,
    )  # fmt: skip
    trainer.fit(model, data)
    assert data.trainer is trainer  # still attached
    trained = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    for workers in (1, 2):
        result = trainer.replay(model, data, probe=GradProbe(), epochs=[1, 2], workers=workers)
        assert result.mismatches == []
        assert sorted(set(result.metrics("grad_norm").epoch)) == [1, 2]
    # The caller's objects are left as they were.
    assert data.trainer is trainer
    assert all(torch.equal(trained[n], t) for n, t in model.state_dict().items())
