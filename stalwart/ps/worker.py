"""A data-parallel worker: read the newest weights, compute a gradient, queue it in the store.

How a worker waits is the mode's consistency model:
- synchronous modes: after pushing, wait until the PS has published weights newer than the ones
  the gradient was computed on (a PS that is down leaves the worker idle);
- asynchronous checkpoint/chain modes: wait until the PS has taken the gradient (the reply of a
  push to a stateful server; a dead server never replies, so the worker idles);
- stateless: never wait. Each gradient is also applied to the worker's own copy of the weights
  (a local SGD step), and the next one is computed there, until the PS commits new weights, which
  replace the copy. While the PS is down the copy walks a real SGD trajectory from the last
  committed weights; the recovered PS applies every queued gradient exactly once, merging the
  workers' trajectories as their mean (:func:`stalwart.ps.update.backlog_scale`). Once a worker
  has walked alone for a few steps it also keeps the running sum of its gradients
  in the store (its trail, :mod:`stalwart.ps.trail`), so the recovered PS reads one vector
  instead of the whole outage's.

Every gradient carries its id ``(worker, step)``; the worker's report lists when each was pushed,
the seconds it spent waiting for the PS and how often it had to retry the store.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time

import torch

from stalwart import durable
from stalwart.errors import StoreUnavailableError
from stalwart.flat import flatten_grads, unflatten_into
from stalwart.ps import layout
from stalwart.ps.config import PSConfig
from stalwart.ps.store import RetryingStore
from stalwart.ps.trail import WorkerTrail
from stalwart.ps.wire import pack, unpack
from stalwart.ps.workload import PSWorkload

log = logging.getLogger(__name__)

#: Seconds between polls of the head while waiting for the PS.
POLL = 0.002
#: The exit code of a worker that gave up on an unreachable store.
STORE_GAVE_UP = 3
#: The run's :class:`PSWorkload`, pickled by the runner into the run directory.
WORKLOAD_FILE = "workload.pkl"


def load_workload(run_dir: str) -> PSWorkload:
    """The workload the runner saved for this run."""
    import cloudpickle

    with open(os.path.join(run_dir, WORKLOAD_FILE), "rb") as handle:
        return cloudpickle.load(handle)


def report_path(run_dir: str, worker: int) -> str:
    """Where worker ``worker`` writes its report (JSON)."""
    return os.path.join(run_dir, f"worker-{worker}.json")


def buffers_path(run_dir: str, worker: int) -> str:
    """Where worker ``worker`` writes its model's buffers at the end of its run (torch, sealed)."""
    return os.path.join(run_dir, f"worker-{worker}-buffers.pt")


class PSWorker:
    """Worker ``index`` of a run.

    Args:
        config: the run.
        store: the shared store (a :class:`RetryingStore`, so outages are retried and counted).
        index: this worker's id, 0 <= index < config.workers.

    Example:
        >>> PSWorker(config, store, 0).run()  # doctest: +SKIP
    """

    def __init__(self, config: PSConfig, store: RetryingStore, index: int) -> None:
        self.config = config
        self.store = store
        self.index = index
        self.workload = load_workload(config.run_dir)
        self.model = self.workload.model()
        torch.manual_seed(config.seed * 1000 + index)  # dropout masks differ per worker
        self.batches = self.workload.batches(index, config.seed)
        self.head_key = ""
        #: The audit ref of the committed weights the local copy started from, and how many local
        #: steps it has taken since (stateless mode).
        self.base_ref = ""
        self.local_steps = 0
        self.trail = WorkerTrail(store, index)
        self.idle = 0.0
        self.pushed: list[list] = []

    def _head(self) -> dict:
        return json.loads(self.store.get(layout.HEAD))

    def _refresh(self) -> bool:
        """Load the newest committed weights; False if they were collected under our feet."""
        head = self._head()
        if head["key"] == self.head_key:
            return True
        blob = self.store.get(layout.state(head["key"]))
        if blob is None:
            return False
        header, weights = unpack(blob)
        self.head_key = head["key"]
        if header["log"] == self.base_ref:
            # A recovered PS re-published the weights we started from (a new key, no new update):
            # keep the local steps taken since, they are queued to be merged.
            return True
        unflatten_into(self.model.parameters(), weights)
        self.base_ref, self.local_steps = header["log"], 0
        self.trail.reset()
        return True

    def _local_step(self) -> None:
        """SGD on the local copy with this run's rate, as the PS would apply the gradient."""
        lr = self.config.lr
        with torch.no_grad():
            for parameter in self.model.parameters():
                if parameter.grad is not None:
                    parameter.add_(parameter.grad, alpha=-lr)
        self.local_steps += 1

    def _wait(self, ready) -> None:
        started = time.monotonic()
        last_stop_check = started
        while not ready(self._head()):
            time.sleep(POLL)
            if time.monotonic() - last_stop_check > 0.05:
                last_stop_check = time.monotonic()
                if self.store.get(layout.HALT) is not None:
                    break
        self.idle += time.monotonic() - started

    def _gradient(self) -> torch.Tensor:
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        self.workload.loss(self.model, next(self.batches)).backward()
        # A parameter the loss does not reach has no gradient: it contributes zeros. The wire
        # carries float32 whatever the model's dtype.
        return flatten_grads(self.model.parameters()).to(torch.float32)

    def run(self) -> None:
        """Compute ``config.steps`` gradients (or fewer if the run is stopped)."""
        mode = self.config.mode
        # Start together: the clock of the accuracy-vs-time plot starts when all are ready.
        self.store.set(layout.ready(self.index), b"1")
        while self.store.get(layout.GO) is None:
            time.sleep(0.01)
        step = 0
        while step < self.config.steps:
            if self.store.get(layout.HALT) is not None:
                break
            if not self._refresh():
                continue
            base = self.head_key
            grad = self._gradient()
            header = {
                "w": self.index, "k": step, "base": base, "local": self.local_steps,
                "t": time.time(),
            }  # fmt: skip
            self.store.set(layout.gradient(self.index, step), pack(header, grad))
            # Only this worker writes its count, so a retried set cannot double-count.
            self.store.set(layout.count(self.index), str(step + 1).encode())
            # Stamped once it is in the queue: whatever reads the queue later sees it.
            self.pushed.append([step, time.time(), base])
            k = step
            step += 1
            if mode.endswith("-sync"):
                self._wait(lambda head, base=base: head["key"] != base)
            elif mode != "stateless":
                self._wait(lambda head, k=k: head["cursors"][self.index] > k)
            else:
                self._local_step()
                self.trail.add(k, grad, self.local_steps)
        self.store.set(layout.done(self.index), b"1")

    def save_buffers(self) -> None:
        """Write the model's buffers (BatchNorm's running statistics, ...) if it has any.

        Only parameters travel through the PS: each worker's buffers were updated by its own
        batches alone, and nobody else has them; the caller merges the workers' files
        (:func:`stalwart.loops.parameter_server.load_worker_buffers`).
        """
        buffers = {name: b.detach().cpu() for name, b in self.model.named_buffers()}
        if buffers:
            durable.save_torch(buffers, buffers_path(self.config.run_dir, self.index))

    def report(self, error: str | None = None) -> dict:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "worker": self.index, "pushed": self.pushed, "idle": self.idle,
            "retries": self.store.retries, "outage": self.store.outage_seconds, "error": error,
            "cpu": usage.ru_utime + usage.ru_stime,
        }  # fmt: skip


def main(config: PSConfig, store: RetryingStore, index: int) -> int:
    """Run worker ``index`` and write its report; the exit code (:data:`STORE_GAVE_UP` if the
    store stayed unreachable)."""
    worker = PSWorker(config, store, index)
    path = report_path(config.run_dir, index)
    try:
        worker.run()
    except StoreUnavailableError as exc:
        durable.write_json(path, worker.report(error=str(exc)))
        log.error("worker %d: giving up: %s", index, exc)
        return STORE_GAVE_UP
    worker.save_buffers()
    durable.write_json(path, worker.report())
    return 0
