"""What a replay segment's Trainer gives the code it runs again: a log folder of its own where
the recorded Trainer had loggers, no stop from a time limit that never fired, the record's
``max_steps``, and no end of the fit where the recorded fit went on."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
from digits import DigitsClassifier, DigitsDataModule
from lightning.pytorch.loggers import CSVLogger

import stalwart
from tests.helpers import QUIET, EveryEpoch, GradProbe


def data() -> DigitsDataModule:
    return DigitsDataModule(batch_size=128, train_size=512)


def files_under(folder) -> dict[str, float]:
    return {str(path): path.stat().st_mtime_ns for path in folder.rglob("*") if path.is_file()}


#: Every log folder WritesIntoTheLogFolder wrote into (its replayed copies' too).
LOG_FOLDERS: list[str] = []


class WritesIntoTheLogFolder(L.Callback):
    """Saves a file into trainer.log_dir each epoch, named with the logger's version."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        LOG_FOLDERS.append(trainer.log_dir)
        name = f"weights_v{trainer.logger.version:02d}_{trainer.current_epoch}.txt"
        with open(os.path.join(trainer.log_dir, name), "w") as file:
            file.write(str(float(pl_module.net[0].weight.sum())))


def test_a_run_with_a_logger_replays_callbacks_that_use_its_folder(tmp_path):
    LOG_FOLDERS.clear()
    L.seed_everything(0)
    trainer = stalwart.Trainer(
        max_epochs=3, logger=CSVLogger(tmp_path / "logs"),
        callbacks=[WritesIntoTheLogFolder(), stalwart.HindsightCallback(str(tmp_path / "runs"))],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(DigitsClassifier(width=8), data())
    recorded = files_under(tmp_path / "logs")
    result = trainer.replay(
        DigitsClassifier(width=8), data(), probe=GradProbe(), epochs=[1, 2], loggers=None
    )
    assert result.mismatches == []
    assert files_under(tmp_path / "logs") == recorded  # nothing written into the record's
    # The replay's copy of the callback wrote into a folder of its own, removed since.
    replayed = LOG_FOLDERS[3:]
    assert replayed and not any(Path(folder).is_relative_to(tmp_path) for folder in replayed)
    assert not any(map(os.path.exists, replayed))


class LogsStopRequests(DigitsClassifier):
    def on_train_epoch_end(self) -> None:
        self.log("stop_requested", float(self.trainer.should_stop))

    def on_validation_epoch_end(self) -> None:
        self.log("stop_at_validation", float(self.trainer.should_stop))


def test_a_time_limit_that_never_fired_stops_no_replayed_epoch(tmp_path):
    kwargs = {"max_epochs": 3, "max_time": "00:01:00:00", **QUIET}
    L.seed_everything(0)
    trainer = stalwart.Trainer(callbacks=[stalwart.HindsightCallback(str(tmp_path))], **kwargs)
    trainer.fit(LogsStopRequests(width=8), data())
    result = trainer.replay(LogsStopRequests(width=8), data(), probe=GradProbe(), epochs=[2])
    assert result.mismatches == []  # the last epoch's hooks used to see a stop
    assert result.metrics("stop_requested").value.tolist() == [0.0]


def test_a_run_max_steps_stopped_replays_to_that_step_from_a_trainer_without_it(tmp_path):
    L.seed_everything(0)
    record = stalwart.HindsightCallback(str(tmp_path))
    trainer = stalwart.Trainer(max_epochs=5, max_steps=10, callbacks=[record], **QUIET)
    trainer.fit(DigitsClassifier(width=8), data())
    assert trainer.global_step == 10  # epoch 2 stopped after 2 of its 4 batches
    fresh = stalwart.Trainer(max_epochs=5, callbacks=[stalwart.HindsightCallback(str(tmp_path))])
    result = fresh.replay(DigitsClassifier(width=8), data(), probe=GradProbe(), epochs=[2])
    assert result.mismatches == []
    assert result.metrics("grad_norm").step.tolist() == [8, 9]


#: Where the end-of-fit hooks below note their calls (set by the test; a forked worker inherits
#: it): a file, since a worker's objects never come back and Lightning refuses ``self.log`` there.
END_NOTES: list[Path] = []


def note_end(hook: str, trainer, pl_module) -> None:
    with open(END_NOTES[0], "a") as file:
        file.write(f"{hook} {trainer.current_epoch} {float(pl_module.net[0].weight.norm())!r}\n")


class NotesItsEnd(DigitsClassifier):
    def on_train_end(self) -> None:
        note_end("module.on_train_end", self.trainer, self)

    def on_fit_end(self) -> None:
        note_end("module.on_fit_end", self.trainer, self)


class FinalWeightsProbe(GradProbe):
    """Inner-loop, and "logs the final weight norm" when the fit ends."""

    def on_train_end(self, trainer, pl_module) -> None:
        note_end("probe.on_train_end", trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        note_end("probe.on_fit_end", trainer, pl_module)


def end_notes() -> list[str]:
    notes = END_NOTES[0].read_text().splitlines() if END_NOTES[0].exists() else []
    END_NOTES[0].unlink(missing_ok=True)
    return sorted(notes)


def test_only_the_segment_that_ends_where_the_record_did_runs_the_end_of_fit_hooks(tmp_path):
    END_NOTES[:] = [tmp_path / "end_notes.txt"]

    def trainer(root, probes=()):
        record = EveryEpoch(dirpath=str(root))  # a fixed plan: segments [0, 1] and [2, 3]
        return stalwart.Trainer(max_epochs=4, callbacks=[*probes, record], **QUIET)

    L.seed_everything(0)
    trainer(tmp_path / "truth", [FinalWeightsProbe()]).fit(NotesItsEnd(width=8), data())
    truth = end_notes()  # the run with the probe from the start: each hook once, at epoch 4
    assert len(truth) == 4 and all(" 4 " in note for note in truth)
    L.seed_everything(0)
    trainer(tmp_path / "runs").fit(NotesItsEnd(width=8), data())
    end_notes()
    for workers in (2, 1):
        result = trainer(tmp_path / "runs").replay(
            NotesItsEnd(width=8), data(), probe=FinalWeightsProbe(), workers=workers
        )
        assert len(result.segments) == workers and result.mismatches == []
        # Segment [0, 1] stops where the recorded fit went on: no end of fit there.
        assert end_notes() == truth, workers
    # A replay that ends before the record did runs none of them.
    result = trainer(tmp_path / "runs").replay(
        NotesItsEnd(width=8), data(), probe=FinalWeightsProbe(), epochs=[1]
    )
    assert result.mismatches == [] and sorted(set(result.metrics("grad_norm").epoch)) == [1]
    assert end_notes() == []
