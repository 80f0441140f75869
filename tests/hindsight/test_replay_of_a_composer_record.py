"""Lightning's replay refuses a record Composer's Hindsight made, before loading any of it.

It used to load the Composer run's ``init.ckpt`` as a Lightning checkpoint and report the file
as corrupt or unsafe (a weights-only load of Composer's state fails), though the file is fine
and Composer's own replay runs it.
"""

from __future__ import annotations

import pytest
from digits import DigitsClassifier, DigitsDataModule

import stalwart
from stalwart.errors import ReplayError
from tests.helpers import QUIET, GradProbe


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry_run", "replay"])
def test_a_composer_record_is_refused_with_the_replay_to_use(tmp_path, dry_run):
    pytest.importorskip("composer")
    from composer_digits import make_trainer

    from stalwart.algorithms import Hindsight

    make_trainer(epochs=1, algorithms=[Hindsight(tmp_path)]).fit()
    trainer = stalwart.Trainer(max_epochs=1, **QUIET)
    with pytest.raises(
        ReplayError, match=r"run_0001 .*recorded by Composer's Hindsight.*stalwart\.algorithms\."
    ):
        trainer.replay(
            DigitsClassifier(), DigitsDataModule(), probe=GradProbe(), dirpath=tmp_path,
            dry_run=dry_run,
        )  # fmt: skip
