"""Composer replays that fail say why and keep nothing; a replay never creates a record.

The same behaviour as Lightning's (tests/hindsight/test_replay_failures.py): one core runs both.
"""

from __future__ import annotations

import pytest
from composer import Callback
from composer_digits import WeightNormProbe, make_trainer

import stalwart.hindsight
from stalwart.algorithms import Hindsight, replay
from stalwart.errors import ReplayError, RunNotFoundError

EPOCHS = 3


class EveryEpoch(Hindsight):
    def should_checkpoint(self, state, policy_says: bool) -> bool:
        return True


class BuggyProbe(Callback):
    """Logs every batch, then fails in the fourth batch of epoch 1."""

    def batch_end(self, state, logger) -> None:
        logger.log_metrics({"probe/value": 1.0})
        if int(state.timestamp.epoch) == 1 and int(state.timestamp.batch_in_epoch) == 3:
            raise RuntimeError("probe bug: no such layer")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    root = tmp_path_factory.mktemp("composer-record")
    hindsight = EveryEpoch(root)

    def factory(**overrides):
        return make_trainer(epochs=EPOCHS, algorithms=[hindsight], **overrides)

    trainer = factory()
    trainer.fit()
    trainer.close()
    return root, factory


def test_a_probe_raising_in_a_worker_fails_the_replay_with_its_cause_and_keeps_nothing(recorded):
    root, factory = recorded
    with pytest.raises(ReplayError) as info:
        replay(factory, probe=BuggyProbe(), epochs=[0, 1, 2], workers=2)
    said = str(info.value)
    # Not a normal result blaming the record ("epoch 1 ran 0 of the 11 training batches").
    assert "segment 0 (epochs 0..1) raised RuntimeError: probe bug: no such layer" in said
    assert __file__ in said and "batch_end" in said
    store = stalwart.hindsight.open(root)
    assert store.query("SELECT count(*) AS n FROM metrics WHERE source = 'replay'").n[0] == 0
    assert store.query("SELECT count(*) AS n FROM replay_work").n[0] == 0


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry_run", "replay"])
def test_a_replay_of_a_directory_without_a_record_writes_nothing_there(recorded, tmp_path, dry_run):
    _, factory = recorded
    typo = tmp_path / "record_typo"
    with pytest.raises(RunNotFoundError) as info:
        replay(factory, probe=WeightNormProbe(), epochs=[1], dirpath=typo, dry_run=dry_run)
    assert f"no hindsight record in {typo}" in str(info.value)
    assert not typo.exists()
