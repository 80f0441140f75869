"""Multi-process mode: graph partitions owned by separate processes (graph servers).

Each process owns one partition (the graph split into ``world_size`` equal-size intervals),
holds a replica of the weights (like Dorylus' replicated parameter servers) and exchanges
with the others over ``torch.distributed`` (gloo on CPU):

* boundary rows: after an epoch, each process all-reduces a dense ``[N, width]`` tensor per layer
  holding only its own rows, so everyone receives everyone's rows of that epoch;
* gradients: each process' contribution to every vertex's ``dLoss/dH`` (its backward Gather),
  summed the same way; and the weight gradients, summed, so every replica applies the same
  weight update (WU) in the same order.

In ``sync`` mode each exchange is a blocking collective per layer (the barrier of *pipe*). With
``S >= 0`` the per-epoch exchange is posted asynchronously and the process goes on with the
rows it has; it may start epoch e only once every process has finished epoch ``e - S - 1``,
agreed through the c10d TCPStore (``done/<epoch>`` counters), and before starting it waits for
that epoch's exchange and applies it. A straggler knob slows one process down.

This mode pipelines at partition granularity (one graph task per layer per process); the
interval pipeline with separate graph/tensor pools inside one process is
:class:`stalwart.gnn.StaleGatherEngine`.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import deque
from datetime import timedelta
from multiprocessing import connection as mp_connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F

from stalwart.errors import ConfigurationError
from stalwart.flat import flatten, unflatten_grads
from stalwart.forking import describe_exit
from stalwart.gnn.gate import parse_staleness
from stalwart.gnn.ghost_buffer import VersionedGhostBuffer
from stalwart.gnn.graph import IntervalGraph
from stalwart.gnn.layers import StaleGCNConv, StaleGNN
from stalwart.gnn.stash import WeightStash

log = logging.getLogger(__name__)

POLL_SECONDS = 0.0005


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Exchange:
    """One epoch's asynchronous collectives (rows, gradient contributions, weight gradients)."""

    def __init__(self, epoch: int, tensors: list[torch.Tensor], async_op: bool) -> None:
        self.epoch = epoch
        self.tensors = tensors
        self.handles = [dist.all_reduce(t, async_op=async_op) for t in tensors]

    def done(self) -> bool:
        return all(h is None or h.is_completed() for h in self.handles)

    def wait(self) -> list[torch.Tensor]:
        for handle in self.handles:
            if handle is not None:
                handle.wait()
        return self.tensors


class PartitionWorker:
    """The training loop of one graph server (one process, one partition).

    Args:
        graph: the graph split into ``world_size`` intervals (one per process).
        model: the layers (same initial weights on every process).
        staleness: ``"sync"`` or ``S >= 0``.
        rank: this process' partition.
        world_size: number of processes.
        store: the c10d store shared by the processes (the gate's ``min_epoch``).
        lr: Adam learning rate (weight decay 5e-4).
        straggler_delay: seconds this process sleeps per graph task (0: not a straggler).

    Example:
        >>> worker = PartitionWorker(graph, model, 1, rank, world, store)
        >>> for epoch in range(100):
        ...     worker.run_epoch(epoch)
        >>> worker.drain()
    """

    def __init__(
        self,
        graph: IntervalGraph,
        model: StaleGNN,
        staleness: int | str | None,
        rank: int,
        world_size: int,
        store: dist.Store,
        lr: float = 0.01,
        straggler_delay: float = 0.0,
    ) -> None:
        self.graph, self.model, self.rank, self.world = graph, model, rank, world_size
        self.staleness = parse_staleness(staleness)
        self.sync = self.staleness is None
        self.bound = 0 if self.sync else self.staleness
        self.store = store
        self.delay = straggler_delay
        self.block = graph.blocks[rank]
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=5e-4)
        self.stash = WeightStash(dict(model.named_parameters()))
        self.widths = [layer.out_channels for layer in model.layers]
        n, dtype = graph.num_nodes, graph.x.dtype
        self.buffer = VersionedGhostBuffer(n, self.widths, dtype)
        self.remote_grads = [torch.zeros(n, w, dtype=dtype) for w in self.widths[:-1]]
        self.remote_grad_epoch = -1
        self.own_contrib: dict[int, list[torch.Tensor]] = {}
        self.pending: deque[_Exchange] = deque()
        self.completed = 0
        self.others = torch.ones(n, dtype=torch.bool)
        self.others[self.block.nodes] = False
        train = graph.train_mask[self.block.nodes]
        self.train_local = torch.nonzero(train).flatten()
        self.num_train = int(graph.train_mask.sum())
        #: ``(epoch, min_epoch)`` at every start; ``(epoch, layer, kind, oldest, newest)`` reads.
        self.gate_log: list[tuple[int, int]] = []
        self.reads: list[tuple[int, int, str, int, int]] = []
        self.waited = 0.0

    # -- the gate (min_epoch agreed through the store) ----------------------------------------

    def _finished_by_all(self, epoch: int) -> bool:
        return epoch < 0 or self.store.add(f"done/{epoch}", 0) >= self.world

    def min_epoch(self) -> int:
        low = self.completed - self.bound - 1
        while self._finished_by_all(low):
            low += 1
            if low >= self.completed:
                break
        return min(low, self.completed)

    def _wait_gate(self, epoch: int) -> None:
        started = time.perf_counter()
        while not self._finished_by_all(epoch - self.bound - 1):
            time.sleep(POLL_SECONDS)
        self.waited += time.perf_counter() - started
        self.gate_log.append((epoch, self.min_epoch()))
        while self.pending and (
            self.pending[0].epoch <= epoch - self.bound - 1 or self.pending[0].done()
        ):
            self._apply(self.pending.popleft())

    # -- exchanges -------------------------------------------------------------------------

    def _own_rows(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        dense = torch.zeros(self.graph.num_nodes, rows.shape[1], dtype=rows.dtype)
        dense[self.block.nodes] = rows.detach()
        return dense

    def _write_remote(self, layer: int, reduced: torch.Tensor, epoch: int) -> None:
        others = torch.nonzero(self.others).flatten()
        self.buffer.write(layer, others, reduced[others], epoch)

    def _apply(self, exchange: _Exchange) -> None:
        tensors = exchange.wait()
        layers = len(self.widths)
        rows, grads, weight_grads = tensors[:layers], tensors[layers:-1], tensors[-1]
        for layer, reduced in enumerate(rows, start=1):
            self._write_remote(layer, reduced, exchange.epoch)
        own = self.own_contrib.pop(exchange.epoch)
        for index, reduced in enumerate(grads):
            self.remote_grads[index] = reduced - own[index]
        self.remote_grad_epoch = exchange.epoch
        self._weight_update(weight_grads)

    def _weight_update(self, flat: torch.Tensor) -> None:
        unflatten_grads(self.model.parameters(), flat)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.stash.publish(dict(self.model.named_parameters()))

    # -- one epoch -------------------------------------------------------------------------

    def run_epoch(self, epoch: int) -> float:
        """Train this partition for ``epoch``; returns its share of the loss."""
        self._wait_gate(epoch)
        version, params = self.stash.acquire()
        block, model = self.block, self.model
        gathered, leaves, outputs = {}, {}, {}
        for layer in range(1, model.num_layers + 1):
            self._straggle()
            conv = model.layers[layer - 1]
            if layer == 1:
                gathered[1] = conv.gather(block, self.graph.x, whole=True)
            else:
                rows, produced = self.buffer.read(layer - 1, block.neighbors)
                self.reads.append(
                    (epoch, layer - 1, "act", int(produced.min()), int(produced.max()))
                )
                leaves[layer] = rows.requires_grad_(True)
                with torch.enable_grad():
                    gathered[layer] = conv.gather(block, leaves[layer])
            with torch.no_grad():
                lp = model.layer_params(params, layer)
                out = model.activate(layer, conv.apply_vertex(block, gathered[layer], lp))
            outputs[layer] = out
            self.buffer.write(layer, block.nodes, out, epoch)
            if self.sync:  # pipe: everyone's layer-l rows of this epoch before the next Gather
                reduced = _Exchange(epoch, [self._own_rows(layer, out)], async_op=False).wait()[0]
                self._write_remote(layer, reduced, epoch)
        loss_value = 0.0
        contributions: list[torch.Tensor] = [None] * (model.num_layers - 1)
        weight_grads: dict[str, torch.Tensor] = {}
        stashed = self.stash.get(version)  # backward on the forward's weights
        for layer in range(model.num_layers, 0, -1):
            self._straggle()
            conv = model.layers[layer - 1]
            lp = {
                k: v.detach().requires_grad_(True)
                for k, v in model.layer_params(stashed, layer).items()
            }
            agg = gathered[layer].detach().requires_grad_(layer > 1)
            with torch.enable_grad():
                out = model.activate(layer, conv.apply_vertex(block, agg, lp))
                if layer == model.num_layers:
                    logits = out[self.train_local]
                    labels = self.graph.y[block.nodes][self.train_local]
                    target = F.cross_entropy(logits, labels, reduction="sum") / self.num_train
                    loss_value, upstream = float(target), None
                else:
                    target, upstream = out, self._upstream(layer, contributions[layer - 1], epoch)
                inputs = list(lp.values()) + ([agg] if layer > 1 else [])
                grads = torch.autograd.grad(target, inputs, grad_outputs=upstream)
            for name, grad in zip(lp, grads, strict=False):
                weight_grads[f"layers.{layer - 1}.{name}"] = grad
            if layer > 1:
                (d_rows,) = torch.autograd.grad(gathered[layer], [leaves[layer]], grads[-1])
                dense = torch.zeros(self.graph.num_nodes, d_rows.shape[1], dtype=d_rows.dtype)
                dense.index_add_(0, block.neighbors, d_rows)
                contributions[layer - 2] = dense
        self.stash.release(version)
        # One vector in parameter order: the summed gradients go back by unflatten_grads.
        flat = flatten(
            (weight_grads[name] for name, _ in model.named_parameters()), dtype=self.graph.x.dtype
        )
        self.completed = epoch + 1
        if self.sync:
            self._weight_update(_Exchange(epoch, [flat], async_op=False).wait()[0])
        else:
            self.own_contrib[epoch] = contributions
            rows = [self._own_rows(layer, outputs[layer]) for layer in outputs]
            self.pending.append(_Exchange(epoch, [*rows, *contributions, flat], async_op=True))
        self.store.add(f"done/{epoch}", 1)
        return loss_value

    def _upstream(self, layer: int, own: torch.Tensor, epoch: int) -> torch.Tensor:
        """``dLoss/dH_layer`` of this partition's rows: its own contribution of this epoch plus
        the others' (this epoch's in sync, else the latest exchanged)."""
        nodes = self.block.nodes
        if self.sync:
            total = _Exchange(epoch, [own.clone()], async_op=False).wait()[0]
            self.reads.append((epoch, layer, "grad", epoch, epoch))
            return total[nodes]
        source = self.remote_grad_epoch
        self.reads.append((epoch, layer, "grad", min(source, epoch), epoch))
        return own[nodes] + self.remote_grads[layer - 1][nodes]

    def _straggle(self) -> None:
        if self.delay > 0:
            time.sleep(self.delay)

    def drain(self) -> None:
        """Wait for and apply every exchange still in flight (end of training)."""
        while self.pending:
            self._apply(self.pending.popleft())

    def accuracy(self, mask: torch.Tensor) -> float:
        with torch.no_grad():
            pred = self.model.full_forward(self.graph.full_block, self.graph.x).argmax(1)
        return float((pred[mask] == self.graph.y[mask]).float().mean())


def _worker(
    rank: int, world: int, port: int, tensors: dict, staleness: Any, epochs: int, hidden: int,
    seed: int, straggler: tuple[int, float], dtype: torch.dtype, evaluate: bool, results: Any,
) -> None:  # fmt: skip
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world
    )
    try:
        graph = IntervalGraph.build(**tensors, num_intervals=world, dtype=dtype)
        torch.manual_seed(seed)
        model = StaleGNN(
            [StaleGCNConv(graph.num_features, hidden), StaleGCNConv(hidden, graph.num_classes)]
        ).to(dtype)
        delay = straggler[1] if straggler[0] == rank else 0.0
        worker = PartitionWorker(graph, model, staleness, rank, world, store, straggler_delay=delay)
        seconds, losses, val, test = [], [], [], []
        for epoch in range(epochs):
            started = time.perf_counter()
            losses.append(worker.run_epoch(epoch))
            seconds.append(time.perf_counter() - started)
            if evaluate:
                val.append(worker.accuracy(graph.val_mask))
                test.append(worker.accuracy(graph.test_mask))
        worker.drain()
        if not evaluate:
            val.append(worker.accuracy(graph.val_mask))
            test.append(worker.accuracy(graph.test_mask))
        dist.barrier()
        results.send({
            "rank": rank, "seconds": seconds, "loss": losses, "val": val, "test": test,
            "gate_log": worker.gate_log, "reads": worker.reads, "waited": worker.waited,
            # numpy, not tensors: a tensor would travel as a shared-memory handle that dies
            # with this process
            "params": {k: v.detach().numpy().copy() for k, v in model.named_parameters()},
        })  # fmt: skip
    finally:
        dist.destroy_process_group()


#: Seconds a partition process may take to exit once it has sent its result.
EXIT_GRACE_SECONDS = 30.0


def _collect(processes: list, receivers: list) -> list[dict]:
    """Each rank's result; raises as soon as a process ends without sending one (its peers would
    otherwise wait for it in a collective, and this process for them, forever)."""
    outputs: list[dict] = []
    waiting = dict(zip(receivers, range(len(processes)), strict=True))
    while waiting:
        alive = [processes[rank].sentinel for rank in waiting.values()]
        for ready in mp_connection.wait([*waiting, *alive]):
            rank = waiting.get(ready)
            if rank is not None:
                try:
                    outputs.append(ready.recv())
                except EOFError:  # the child died; its exit code is read below
                    continue
                del waiting[ready]
        for receiver, rank in list(waiting.items()):
            if processes[rank].exitcode is not None and not receiver.poll():
                codes = ", ".join(
                    f"rank {r}: "
                    + ("still running" if p.exitcode is None else describe_exit(p.exitcode))
                    for r, p in enumerate(processes)
                )
                raise RuntimeError(f"partition process {rank} ended without a result ({codes}); "
                                   "its error, if it raised one, is printed above.")  # fmt: skip
    return outputs


def _reap(processes: list, grace: float) -> list[int]:
    """Join every process within ``grace`` seconds (all together); kill the rest. Returns the
    ranks that had to be killed."""
    deadline = time.monotonic() + grace
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    lingering = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for rank in lingering:
        processes[rank].kill()
        processes[rank].join()
    return lingering


def run_partitions(
    tensors: dict[str, torch.Tensor],
    world_size: int = 2,
    staleness: int | str = "sync",
    epochs: int = 50,
    *,
    hidden: int = 16,
    seed: int = 0,
    straggler_rank: int = -1,
    straggler_delay: float = 0.0,
    dtype: torch.dtype = torch.float32,
    evaluate: bool = True,
) -> list[dict]:
    """Train a 2-layer GCN with ``world_size`` processes, one partition each.

    Args:
        tensors: ``x, y, edge_index, train_mask, val_mask, test_mask``.
        world_size: processes (>= 2).
        staleness: ``"sync"`` or ``S >= 0``.
        epochs: epochs every process runs.
        hidden: hidden width.
        seed: weight initialisation seed (the same on every process).
        straggler_rank: the slow process (-1: none).
        straggler_delay: seconds it sleeps per layer task.
        dtype: floating dtype.
        evaluate: val/test accuracy after every epoch (else only after the last).

    Returns:
        Per rank: epoch seconds, losses, val/test accuracy per epoch, the gate log, the reads
        (producing epochs), seconds spent waiting at the gate and the final parameters.

    Example:
        >>> out = run_partitions(tensors, world_size=2, staleness=0, epochs=20)
        >>> out[0]["test"][-1]
    """
    if world_size < 2:
        raise ConfigurationError(f"world_size={world_size}: multi-process mode needs >= 2.")
    parse_staleness(staleness)
    port = _free_port()
    # fork, not spawn: a spawned child would re-import torch and Lightning (seconds each); the
    # children are forked before the store's server thread exists and connect to it with retry.
    # Daemons: a child left behind must never hold up this interpreter's exit.
    context = mp.get_context("fork")
    pipes = [context.Pipe(duplex=False) for _ in range(world_size)]
    args = (world_size, port, tensors, staleness, epochs, hidden, seed,
            (straggler_rank, straggler_delay), dtype, evaluate)  # fmt: skip
    processes = [
        context.Process(target=_worker, args=(rank, *args, sender), daemon=True)
        for rank, (_, sender) in enumerate(pipes)
    ]
    for process in processes:
        process.start()
    for _, sender in pipes:
        sender.close()
    try:
        # The store outlives the children: their teardown may still talk to it.
        master = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=True,
                               timeout=timedelta(seconds=120), wait_for_workers=False)  # fmt: skip
        outputs = _collect(processes, [receiver for receiver, _ in pipes])
        lingering = _reap(processes, EXIT_GRACE_SECONDS)
    finally:
        _reap(processes, 0.0)  # a failed run leaves no process waiting in a collective
    if lingering:
        # Every rank sent its result after the last barrier, so the results are whole; what hung
        # is torch.distributed's teardown (pytorch/pytorch#75097), seen once in CI.
        log.warning("partition process(es) %s did not exit within %.0f s of sending their "
                    "results and were killed; the results are complete.",
                    lingering, EXIT_GRACE_SECONDS)  # fmt: skip
    del master
    for out in outputs:
        out["params"] = {k: torch.from_numpy(v) for k, v in out["params"].items()}
    return sorted(outputs, key=lambda out: out["rank"])
