"""The parameter server: one loop for all five modes; the modes differ in three decisions.

1. Where a (re)started PS gets its weights: the store (stateless, and every mode's first start),
   the newest checkpoint on disk (checkpointing), or a replica's memory (chain replication).
2. What happens to gradients queued while it was down: the stateless PS applies every one of them
   exactly once (its cursors are committed atomically with the weights); a stateful PS lost them
   with its memory and skips to the queue heads.
3. Synchronous modes wait for one gradient per worker computed on the current weights and apply
   their mean; asynchronous modes apply whatever is pending.

Every update is committed the same way: write ``log/E/V`` (the audit record), write the weights
``state/E/V``, then move ``head`` by compare-and-set. A SIGKILL anywhere leaves ``head`` on the
previous complete state, so a restarted stateless PS re-executes the interrupted update.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from stalwart import durable
from stalwart.errors import CorruptCheckpointError, SplitBrainError, StalwartError
from stalwart.ps import layout
from stalwart.ps.config import PSConfig
from stalwart.ps.store import KeyValueStore
from stalwart.ps.trail import pending_trails, with_trails
from stalwart.ps.update import apply_update, backlog_scale, gradient_sum
from stalwart.ps.wire import pack, unpack, unpack_header, vector_view

#: Gradients fetched per store round trip while draining a backlog (bounds one message's size).
FETCH_CHUNK = 64
CHECKPOINT_FILE = "checkpoint.pt"


def save_checkpoint(path: str, version: int, ref: str, weights: torch.Tensor) -> None:
    """Write the PS checkpoint atomically and sealed: a crash mid-write leaves the previous one."""
    durable.save_torch({"version": version, "log": ref, "weights": weights}, path)


def load_checkpoint(path: str) -> tuple[int, str, torch.Tensor]:
    """The ``(version, log ref, weights)`` of the PS checkpoint at ``path``.

    Raises:
        CorruptCheckpointError: the file is torn, truncated or unreadable.
    """
    try:
        saved = durable.load_torch(path)
        return int(saved["version"]), str(saved["log"]), saved["weights"]
    except (CorruptCheckpointError, KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(
            f"{path} cannot be read ({exc}); delete it to restart from the initial weights."
        ) from exc


class ParameterServer:
    """Serve one incarnation of the parameter server until the run's ``stop`` key appears.

    Args:
        config: the run.
        store: the shared store.
        replicate: chain modes: called with the committed state blob every ``replicate_every``
            updates; it returns once the successor acknowledged.

    Example:
        >>> ps = ParameterServer(config, store)  # doctest: +SKIP
        >>> ps.recover("store"); ps.serve()  # doctest: +SKIP
    """

    def __init__(
        self,
        config: PSConfig,
        store: KeyValueStore,
        replicate: Callable[[bytes], object] | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.replicate = replicate
        self.sync = config.mode.endswith("-sync")
        self.stateless = config.mode == "stateless"
        self.epoch = 0
        self.version = 0
        self.ref = layout.INIT
        self.weights = torch.empty(0)
        self.cursors = [0] * config.workers
        self.head_raw = b""
        self.head_key = ""
        self.previous_keys: list[str] = []
        self.discarded = 0

    # -- recovery ------------------------------------------------------------------------------
    def recover(
        self,
        source: str,
        snapshot: bytes | None = None,
        detected_at: float | None = None,
        index: int = 0,
    ) -> bytes:
        """Take the next epoch, load the weights from ``source`` and publish them; the state blob.

        Args:
            source: ``"store"``, ``"checkpoint"`` or ``"memory"`` (then ``snapshot`` is the blob
                a replica received from its predecessor).
            snapshot: the replica's in-memory state blob.
            detected_at: when the failure was detected (chain takeover latency).
            index: the replica's position in the chain (0 for a plain PS).
        """
        started = time.time()
        self.epoch = self.store.add(layout.EPOCH, 1)
        self.head_raw = self.store.get(layout.HEAD) or b""
        counts = self._counts()
        if source == "store":
            head = json.loads(self.head_raw)
            blob = self.store.get(layout.state(head["key"]))
            if blob is None:
                raise StalwartError(
                    f"the store has a head {head['key']} but not its weights: the store lost its "
                    "state (was it restarted?). Start the run again from a fresh store."
                )
            header, self.weights = unpack(blob)
            self.version, self.ref = header["version"], header["log"]
            # Stateless: the committed cursors mark exactly what is applied; the rest is backlog.
            self.cursors = list(header["cursors"])
        elif source == "checkpoint":
            self.version, self.ref, self.weights = self._load_checkpoint()
        elif source == "memory":
            if snapshot is None:
                raise StalwartError("a replica took over without ever receiving the weights.")
            header, self.weights = unpack(snapshot)
            self.version, self.ref = header["version"], header["log"]
        else:
            raise ValueError(source)
        if source != "store":
            # A stateful PS held the queued gradients in its memory: they died with it.
            self.cursors = counts
        backlog = sum(c - k for c, k in zip(counts, self.cursors, strict=True))
        blob = self._commit(log_record=None)
        self.store.set(
            layout.event(self.epoch),
            json.dumps({
                "epoch": self.epoch, "source": source, "version": self.version, "log": self.ref,
                "backlog": backlog, "pid": os.getpid(), "started": started,
                "committed": time.time(), "detected": detected_at, "index": index,
            }).encode(),
        )  # fmt: skip
        return blob

    def _load_checkpoint(self) -> tuple[int, str, torch.Tensor]:
        path = os.path.join(self.config.run_dir, CHECKPOINT_FILE)
        if not os.path.exists(path):
            # Killed before the first checkpoint: start over from the run's initial weights.
            return 0, layout.INIT, unpack(self.store.get(layout.state(layout.INITIAL)))[1]
        return load_checkpoint(path)

    def _save_checkpoint(self) -> None:
        save_checkpoint(
            os.path.join(self.config.run_dir, CHECKPOINT_FILE), self.version, self.ref, self.weights
        )
        self.store.set(layout.CHECKPOINTED, self.ref.encode())

    # -- committing ----------------------------------------------------------------------------
    def _counts(self) -> list[int]:
        keys = [layout.count(w) for w in range(self.config.workers)]
        return [int(v) for v in self.store.get_many(keys)]

    def _commit(self, log_record: dict | None) -> bytes:
        key = layout.ref(self.epoch, self.version)
        if log_record is not None:
            self.store.set(layout.log(key), json.dumps(log_record).encode())
            self.ref = key
        blob = pack(
            {
                "version": self.version,
                "log": self.ref,
                "cursors": self.cursors,
                "epoch": self.epoch,
            },
            self.weights,
        )
        self.store.set(layout.state(key), blob)
        self._move_head(key)
        if key not in self.previous_keys:
            self.previous_keys.append(key)
        # Keep a few old states: a worker may have read the head just before it moved. An audited
        # run (keep_gradients) keeps them all.
        while len(self.previous_keys) > 3 and not self.config.keep_gradients:
            self.store.delete(layout.state(self.previous_keys.pop(0)))
        return blob

    def _move_head(self, key: str) -> None:
        desired = json.dumps({"key": key, "cursors": self.cursors}).encode()
        if not self.store.compare_set(layout.HEAD, self.head_raw, desired):
            raise SplitBrainError(
                f"PS epoch {self.epoch}: the head moved to {self.store.get(layout.HEAD)!r}; "
                "another parameter server is running against this store."
            )
        self.head_raw, self.head_key = desired, key

    def _apply(
        self,
        ids: list[list[int]],
        total: torch.Tensor,
        scale: float,
        merged: int = 0,
        sums: list[list[int]] | None = None,
    ) -> None:
        """Apply and commit one update; ``merged`` > 0 marks a backlog merged as the mean of
        that many workers' trajectories (the audit and the run's counters report it); ``sums``
        the spans of ``ids`` that came as workers' trails (the replay sums them alike)."""
        parent = self.ref
        self.weights = apply_update(self.weights, total, self.config.lr, scale)
        self.version += 1
        record = {
            "ids": ids, "lr": self.config.lr, "scale": scale, "parent": parent, "t": time.time(),
            "cursors": self.cursors,
        }  # fmt: skip
        if merged:
            record["merged"] = merged
        if sums:
            record["sums"] = sums
        blob = self._commit(record)
        mode = self.config.mode
        if mode.startswith("checkpoint") and self.version % self.config.checkpoint_every == 0:
            self._save_checkpoint()
        if self.replicate is not None and self.version % self.config.replicate_every == 0:
            self.replicate(blob)

    # -- serving -------------------------------------------------------------------------------
    def _fetch(self, keys: list[str]) -> Iterator[tuple[dict, bytes]]:
        """The gradients under ``keys`` (headers and raw bytes), a chunk per round trip; lazily,
        so that only one chunk of a large backlog is in memory at a time."""
        for start in range(0, len(keys), FETCH_CHUNK):
            for blob in self.store.get_many(keys[start : start + FETCH_CHUNK]):
                yield unpack_header(blob), blob

    def _accepts(self, header: dict) -> bool:
        if self.stateless:
            return True
        if self.sync:
            return header["base"] == self.head_key
        # Async stateful: a gradient computed on a previous incarnation's weights was sent to a
        # server that is gone.
        return layout.parse_ref(header["base"])[0] == self.epoch

    def _forget(self, keys: list[str]) -> None:
        if not self.config.keep_gradients:
            for key in keys:
                self.store.delete(key)

    def step_async(self, counts: list[int]) -> bool:
        counts = list(counts)
        pending = sum(c - k for c, k in zip(counts, self.cursors, strict=True))
        # Only an outage's backlog has trails (a worker starts one after trail.TRAIL_AFTER local
        # steps without a commit, more than an ordinary update lags by).
        trails = {}
        if self.stateless and pending > self.config.threshold:
            trails = pending_trails(self.store, self.cursors, counts)
        keys = [
            layout.gradient(w, k)
            for w in range(self.config.workers)
            for k in range(self.cursors[w], counts[w])
        ]
        if not keys:
            return False
        ids: list[list[int]] = []
        sums: list[list[int]] = []

        def singles(keys: list[str]) -> Iterator[np.ndarray]:
            for header, blob in self._fetch(keys):
                if self._accepts(header):
                    ids.append([header["w"], header["k"]])
                    yield vector_view(blob)

        # Without trails, one chunked fetch over every worker's queue.
        vectors = singles(keys)
        if trails:
            vectors = with_trails(singles, trails, self.cursors, counts, ids, sums)
        total = gradient_sum(vectors)
        self.discarded += len(keys) - len(ids)
        self.cursors = list(counts)
        if total is not None:
            workers = len({w for w, _ in ids})
            backlog = len(ids) > self.config.threshold
            scale = backlog_scale(len(ids), workers, self.config.threshold)
            self._apply(ids, total, scale, merged=workers if backlog else 0, sums=sums)
        else:
            self._move_head(self.head_key)  # acknowledge the discarded ones to waiting workers
        self._forget(keys)
        return True

    def step_sync(self, counts: list[int], held: dict[int, tuple[dict, bytes]]) -> bool:
        progressed = False
        for w in range(self.config.workers):
            while w not in held and self.cursors[w] < counts[w]:
                key = layout.gradient(w, self.cursors[w])
                header, blob = next(self._fetch([key]))
                self.cursors[w] += 1
                progressed = True
                if self._accepts(header):
                    held[w] = (header, blob)
                else:
                    self.discarded += 1
                    self._forget([key])
        missing = [w for w in range(self.config.workers) if w not in held]
        # A finished worker sends no more gradients: the round completes without it.
        if missing and any(self.store.get(layout.done(w)) is None for w in missing):
            return progressed
        if not held:
            return progressed
        order = sorted(held)
        total = gradient_sum(vector_view(held[w][1]) for w in order)
        assert total is not None
        self._apply(
            [[held[w][0]["w"], held[w][0]["k"]] for w in order], total, 1.0 / self.config.workers
        )
        self._forget([layout.gradient(held[w][0]["w"], held[w][0]["k"]) for w in order])
        held.clear()
        return True

    def serve(self) -> None:
        """Apply gradients until the runner sets ``stop`` and every queue is drained."""
        held: dict[int, tuple[dict, bytes]] = {}
        while True:
            counts = self._counts()
            busy = self.step_sync(counts, held) if self.sync else self.step_async(counts)
            if busy:
                continue
            if self.store.get(layout.STOP) is not None and self._counts() == self.cursors:
                return
            time.sleep(0.002)
