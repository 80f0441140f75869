"""The accuracy of the committed weights against wall-clock time, sampled while a run trains."""

from __future__ import annotations

import json

import torch

from stalwart.flat import unflatten_into
from stalwart.ps import layout
from stalwart.ps.store import KeyValueStore
from stalwart.ps.wire import unpack
from stalwart.ps.workload import PSWorkload


class AccuracyTimeline:
    """Score each newly committed set of weights with the workload's ``evaluate``.

    It also keeps the newest committed weights it read, so a run whose store vanishes can still
    save them.

    Args:
        store: the run's store.
        workload: builds the model the weights go into and scores it.

    Example:
        >>> timeline = AccuracyTimeline(store, workload)  # doctest: +SKIP
        >>> timeline.sample(t=1.5, produced=40); timeline.points[-1]["accuracy"]  # doctest: +SKIP
        0.42
    """

    def __init__(self, store: KeyValueStore, workload: PSWorkload) -> None:
        self.store = store
        self.workload = workload
        self.model = workload.model()
        #: ``{"t", "accuracy", "version", "epoch", "produced"}`` per newly committed state.
        self.points: list[dict] = []
        #: The state key and weights of the newest committed state read.
        self.last_key = ""
        self.last_weights = torch.empty(0)

    def sample(self, t: float, produced: int) -> None:
        """Score the committed head if it is new; ``t`` seconds into the run."""
        key = json.loads(self.store.get(layout.HEAD))["key"]
        if key == self.last_key:
            return
        blob = self.store.get(layout.state(key))
        if blob is None:
            return  # collected: the PS committed newer weights since we read the head
        header, weights = unpack(blob)
        self.last_key, self.last_weights = key, weights
        unflatten_into(self.model.parameters(), weights)
        accuracy = self.workload.evaluate(self.model)
        if accuracy is None:
            return
        self.points.append({
            "t": t, "accuracy": accuracy, "version": header["version"],
            "epoch": header["epoch"], "produced": produced,
        })  # fmt: skip

    @property
    def final_accuracy(self) -> float:
        """The newest score (0.0 when the workload scores nothing)."""
        return self.points[-1]["accuracy"] if self.points else 0.0
