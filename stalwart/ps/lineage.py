"""The audit trail: which gradients made the current weights, and a bit-exact replay of them.

Each committed state names the log record that produced it (``log``); each record names its
parent. Walking back from the head gives the lineage of the weights: every gradient id on it was
applied exactly once to these weights (an id that appears twice was applied twice; a produced id
that does not appear was lost). Records a crashed PS wrote but never committed, and updates a
checkpoint restart rolled back, are not on the lineage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from stalwart.ps import layout
from stalwart.ps.store import KeyValueStore
from stalwart.ps.update import apply_update, gradient_sum_with_trails
from stalwart.ps.wire import unpack, unpack_header, vector_view


@dataclass
class Record:
    """One committed update: its ref ``epoch/version``, gradient ids, lr, scale, and the queue
    cursors after it (gradients ``(w, k)`` with ``k < cursors[w]`` were taken); ``merged`` > 0
    marks a backlog merged as the mean of that many workers' local trajectories; ``sums`` lists
    the ``[start, end)`` spans of ``ids`` that arrived as a worker's trail (pre-summed)."""

    ref: str
    ids: list[tuple[int, int]]
    lr: float
    scale: float
    parent: str
    t: float
    cursors: list[int]
    merged: int = 0
    sums: list[list[int]] = field(default_factory=list)


def head_state(store: KeyValueStore) -> tuple[str, dict, torch.Tensor]:
    """The committed head: its key, state header and weights."""
    key = json.loads(store.get(layout.HEAD))["key"]
    header, weights = unpack(store.get(layout.state(key)))
    return key, header, weights


def walk(store: KeyValueStore, ref: str) -> list[Record]:
    """The records from the initial weights to ``ref``, oldest first."""
    records: list[Record] = []
    while ref != layout.INIT:
        raw = store.get(layout.log(ref))
        if raw is None:
            raise LookupError(f"audit record {layout.log(ref)} is missing from the store")
        data = json.loads(raw)
        records.append(
            Record(ref, [tuple(i) for i in data["ids"]], data["lr"], data["scale"],
                   data["parent"], data["t"], data["cursors"], data.get("merged", 0),
                   data.get("sums", []))
        )  # fmt: skip
        ref = data["parent"]
    return records[::-1]


def state_weights(store: KeyValueStore, key: str) -> torch.Tensor:
    """The weights committed under ``key`` (all of them are kept by audited runs)."""
    blob = store.get(layout.state(key))
    if blob is None:
        raise LookupError(
            f"{layout.state(key)} is not in the store (only audited runs keep every state)"
        )
    return unpack(blob)[1]


def head_lineage(store: KeyValueStore) -> list[Record]:
    """The lineage of the committed head."""
    key = json.loads(store.get(layout.HEAD))["key"]
    return walk(store, unpack_header(store.get(layout.state(key)))["log"])


def replay(store: KeyValueStore, records: list[Record]) -> torch.Tensor:
    """The weights obtained by applying ``records`` to the run's initial weights.

    Needs the gradients, so the run must have been made with ``keep_gradients=True``.
    """
    weights = state_weights(store, layout.INITIAL)
    for record in records:
        keys = [layout.gradient(w, k) for w, k in record.ids]
        vectors = [vector_view(blob) for blob in store.get_many(keys)]
        total = gradient_sum_with_trails(vectors, record.sums)
        assert total is not None, "an audit record always lists at least one gradient"
        weights = apply_update(weights, total, record.lr, record.scale)
    return weights
