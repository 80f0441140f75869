"""What a record and a replay say about DataLoaders that keep their worker processes.

Framework-neutral wording shared by the Lightning and Composer adapters. Persistent workers are
seeded once, when their loader is first iterated, and their random state then runs on from epoch
to epoch inside the worker processes, where no checkpoint can hold it: a fit resumed from an
epoch checkpoint (every replay is one) draws other data than the record did, and no ``init``
changes that.
"""

from __future__ import annotations


def persistent_workers_warning(name: str, kinds: list[str]) -> str:
    """The record's one-line warning for the ``kinds`` of DataLoader (e.g. ``["training"]``)."""
    return (
        f"{name}: the {' and '.join(kinds)} DataLoader uses persistent_workers=True: its worker "
        "processes are seeded once and keep their random state from epoch to epoch, which no "
        "checkpoint holds, so a replay or a resume from this record will not reproduce its data "
        "(order and augmentation) bit for bit (a replay reports the differences as mismatches); "
        "pass persistent_workers=False to the DataLoader for a record that replays exactly."
    )


def persistent_workers_cause(kinds: list[str]) -> str | None:
    """A replay's explanation of its mismatches where ``kinds`` of DataLoader keep their
    workers; None where none does."""
    if not kinds:
        return None
    return (
        f"The {' and '.join(kinds)} DataLoader keeps its worker processes from epoch to "
        "epoch (persistent_workers=True): their random state (e.g. a dataset's random "
        "augmentation) is in no checkpoint, so an epoch replayed from one draws other data than "
        "the record did, and init='strong' does not change that. Record with "
        "persistent_workers=False (workers are then seeded from the checkpointed RNG each epoch) "
        "to replay such epochs exactly."
    )
