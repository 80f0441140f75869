"""The Dorylus training pipeline over vertex intervals with bounded-staleness Gather.

Per interval and epoch the engine runs, for an L-layer model (thesis 2.4, figure 2.3):

    forward   GA_1 AV_1 SC_1  GA_2 AV_2 SC_2 ... GA_L AV_L(+loss) SC_L
    backward  dAV_L dGA_L  dAV_L-1 dGA_L-1 ... dAV_1

GA/SC/dGA are graph tasks, AV/dAV tensor tasks, each on its own pool. A coordinator (the
calling thread) dispatches every task whose inputs are ready, and applies the weight update
(WU) once every interval has finished an epoch, summing their gradients in interval order.

* ``sync`` (the thesis' *pipe*): GA_l of epoch e waits until every interval has scattered
  layer l-1 of epoch e, and dAV_l waits for every interval's dGA_l+1: exactly full-graph
  training with one weight update per epoch.
* ``S >= 0``: no barrier inside an epoch; Gather reads whatever the ghost buffers hold; an
  interval starts epoch e only if e <= min_epoch + S (:class:`StalenessGate`). Every epoch
  restarts from the input features, so nothing travels more than L hops.
* Weight stashing: an interval takes the latest weights at AV_1 and its dAV tasks fetch that
  same version from the :class:`WeightStash` (a Lambda is stateless: it recomputes AV on the
  stashed weights and differentiates it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from stalwart.errors import ConfigurationError
from stalwart.gnn.gate import StalenessGate, parse_staleness
from stalwart.gnn.ghost_buffer import GradientGhostBuffer, VersionedGhostBuffer
from stalwart.gnn.graph import IntervalGraph
from stalwart.gnn.layers import StaleGNN
from stalwart.gnn.record import StalenessRecord
from stalwart.gnn.scheduler import GRAPH, TENSOR, InlinePools, Straggler, WorkerPools
from stalwart.gnn.stash import WeightStash

#: ``update(epoch, summed_grads) -> new parameters`` applies WU and returns the latest weights.
UpdateFn = Callable[[int, dict[str, torch.Tensor]], Mapping[str, torch.Tensor]]


@dataclass
class _Flight:
    """One interval's progress through one epoch (touched by one task at a time)."""

    epoch: int
    stage: int = 0
    busy: bool = False
    version: int = -1
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # leaf rows read by GA_l
    gathered: dict[int, torch.Tensor] = field(default_factory=dict)  # GA_l output (graph kept)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # AV_l output rows
    upstream: dict[int, torch.Tensor] = field(default_factory=dict)  # dLoss/d gathered_l
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    loss: float = 0.0


@dataclass(frozen=True)
class EpochResult:
    """What one epoch (finished by every interval) produced.

    Args:
        epoch: the epoch.
        loss: training loss summed over intervals (the full-graph mean loss in sync mode).
        seconds: wall time since the previous epoch was finished by every interval.
    """

    epoch: int
    loss: float
    seconds: float


def checksum(params: Mapping[str, torch.Tensor]) -> float:
    """A fingerprint of a weight version (for the stashing record)."""
    return float(
        sum(float(p.double().sum()) + float(p.double().abs().sum()) for p in params.values())
    )


class StaleGatherEngine:
    """Trains a :class:`StaleGNN` on an :class:`IntervalGraph` with bounded-staleness Gather.

    Args:
        graph: the graph, split into intervals.
        model: the layers; its parameters are the latest weights.
        staleness: ``"sync"``, or ``S >= 0``.
        update: applies WU: given the epoch and the summed gradient per parameter name, step the
            optimizer on ``model`` and return its new parameters.
        workers: threads per pool (graph and tensor); ``0`` runs tasks inline in a seeded
            random order (reproducible interleavings).
        straggler: an optional slow worker (threaded pools only).
        seed: seed of dropout masks and of the inline order.
        weight_stashing: ``False`` makes backward tasks use the latest weights instead of the
            stashed version (the statistically inefficient variant stashing avoids).
        record: keep a :class:`StalenessRecord` of every read and weight use.
        start_epoch: the first epoch to run (when resuming; earlier epochs count as done).

    Example:
        >>> engine = StaleGatherEngine(graph, gnn, staleness=1, update=adam_step, workers=2)
        >>> for epoch in range(200):
        ...     result = engine.run_epoch(epoch, last_epoch=199)
        >>> engine.close()
    """

    def __init__(
        self,
        graph: IntervalGraph,
        model: StaleGNN,
        staleness: int | str | None,
        update: UpdateFn,
        *,
        workers: int = 2,
        straggler: Straggler | None = None,
        seed: int = 0,
        weight_stashing: bool = True,
        record: bool = True,
        start_epoch: int = 0,
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ConfigurationError(
                f"workers={workers!r}: pass 0 (inline) or a whole number >= 1."
            )
        if workers == 0 and straggler is not None:
            raise ConfigurationError("a straggler needs worker threads: pass workers >= 1.")
        self.graph = graph
        self.model = model
        self.staleness = parse_staleness(staleness)
        self.sync = self.staleness is None
        self.update = update
        self.seed = seed
        self.weight_stashing = weight_stashing
        layers = model.num_layers
        self.stages: list[tuple[str, int]] = []
        for layer in range(1, layers + 1):
            self.stages += [("GA", layer), ("AV", layer), ("SC", layer)]
        for layer in range(layers, 0, -1):
            self.stages += [("dAV", layer)] + ([("dGA", layer)] if layer > 1 else [])
        widths = [model.layers[i].out_channels for i in range(layers)]
        k = graph.intervals.num_intervals
        self.gate = StalenessGate(k, self.staleness)
        self.gate.completed.fill_(start_epoch)
        self.gate.started.fill_(start_epoch - 1)
        self.buffer = VersionedGhostBuffer(graph.num_nodes, widths, graph.x.dtype)
        self.grad_buffer = GradientGhostBuffer(graph.blocks, widths[:-1], graph.x.dtype)
        self.stash = WeightStash(dict(model.named_parameters()))
        self.record = StalenessRecord() if record else None
        self.pools = InlinePools(seed) if workers == 0 else WorkerPools(workers, workers, straggler)
        self._flights: list[_Flight | None] = [None] * k
        self._done: dict[tuple[int, str, int], int] = {}
        self._grads: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        self._losses: dict[int, float] = {}
        self._results: dict[int, EpochResult] = {}
        self._masks: dict[tuple[int, int], torch.Tensor] = {}
        self._clock = time.perf_counter()
        self._nonzero = torch.nonzero(graph.x, as_tuple=True)
        train = graph.train_mask
        self._num_train = int(train.sum())
        self._train_local = [torch.nonzero(train[b.nodes]).flatten() for b in graph.blocks]
        self._train_labels = [
            graph.y[b.nodes][t] for b, t in zip(graph.blocks, self._train_local, strict=True)
        ]

    # -- the coordinator -------------------------------------------------------------------

    def run_epoch(self, epoch: int, last_epoch: int) -> EpochResult:
        """Run tasks until every interval has finished ``epoch``; intervals may start epochs up
        to ``last_epoch`` as the gate allows (work of later epochs carries over)."""
        if epoch > last_epoch:
            raise ConfigurationError(f"epoch {epoch} is after last_epoch {last_epoch}.")
        while self.gate.min_epoch <= epoch:
            self._dispatch(last_epoch)
            if not len(self.pools):
                raise RuntimeError(f"pipeline stalled in epoch {epoch}: no task can run")
            for interval, _ in self.pools.wait():
                self._complete(interval)
        return self._results.pop(epoch)

    @property
    def idle(self) -> bool:
        """No interval is inside an epoch."""
        return all(flight is None for flight in self._flights)

    def refresh_weights(self) -> None:
        """Publish the model's current parameters as the latest version: after something
        outside the engine changed them (e.g. a checkpoint was loaded). Only while idle."""
        if not self.idle:
            raise RuntimeError("cannot replace the weights while intervals are in flight")
        self.stash.publish(dict(self.model.named_parameters()))

    def close(self) -> None:
        """Stop the worker pools (work in flight is dropped)."""
        self.pools.close()

    def _ready(self, interval: int, last_epoch: int) -> bool:
        flight = self._flights[interval]
        if flight is None:
            epoch = int(self.gate.completed[interval])
            return epoch <= last_epoch and self.gate.may_start(interval, epoch)
        if flight.busy:
            return False
        if not self.sync:
            return True
        op, layer = self.stages[flight.stage]
        k = self.graph.intervals.num_intervals
        if op == "GA" and layer > 1:
            return self._done.get((flight.epoch, "SC", layer - 1), 0) == k
        if op == "dAV" and layer < self.model.num_layers:
            return self._done.get((flight.epoch, "dGA", layer + 1), 0) == k
        return True

    def _dispatch(self, last_epoch: int) -> None:
        for interval in range(len(self._flights)):
            if not self._ready(interval, last_epoch):
                continue
            flight = self._flights[interval]
            if flight is None:
                epoch = int(self.gate.completed[interval])
                self.gate.start(interval, epoch)
                flight = self._flights[interval] = _Flight(epoch)
            op, layer = self.stages[flight.stage]
            if op == "AV" and layer == 1:
                flight.version, _ = self.stash.acquire()
            flight.busy = True
            task = getattr(self, f"_task_{op}")
            kind = TENSOR if op in ("AV", "dAV") else GRAPH
            self.pools.submit(
                kind, interval, lambda t=task, i=interval, f=flight, ly=layer: t(i, f, ly)
            )

    def _complete(self, interval: int) -> None:
        flight = self._flights[interval]
        op, layer = self.stages[flight.stage]
        flight.busy = False
        key = (flight.epoch, op, layer)
        self._done[key] = self._done.get(key, 0) + 1
        flight.stage += 1
        if flight.stage < len(self.stages):
            return
        epoch = flight.epoch
        self.stash.release(flight.version)
        self._grads.setdefault(epoch, {})[interval] = flight.grads
        self._losses[epoch] = self._losses.get(epoch, 0.0) + flight.loss
        self._flights[interval] = None
        before = self.gate.min_epoch
        self.gate.finish(interval, epoch)
        for finished in range(before, self.gate.min_epoch):
            self._weight_update(finished)

    def _weight_update(self, epoch: int) -> None:
        per_interval = self._grads.pop(epoch)
        names = [name for name, _ in self.model.named_parameters()]
        summed = {}
        for name in names:
            parts = [g[name] for _, g in sorted(per_interval.items()) if name in g]
            summed[name] = torch.stack(parts).sum(0) if parts else None
        self.stash.publish(self.update(epoch, summed))
        now = time.perf_counter()
        self._results[epoch] = EpochResult(epoch, self._losses.pop(epoch), now - self._clock)
        self._clock = now
        for key in [k for k in self._done if k[0] <= epoch]:
            del self._done[key]
        with_masks = list(self._masks)
        for key in with_masks:
            if key[0] <= epoch:
                self._masks.pop(key, None)

    # -- tasks (run on the pools) ------------------------------------------------------------

    def _dropout(
        self, rows: torch.Tensor, epoch: int, layer: int, nodes: torch.Tensor | None
    ) -> torch.Tensor:
        """Drop ``rows`` (of ``nodes``, or of every vertex if None) with the (epoch, layer) mask.

        One mask per (epoch, layer) over all vertices, so a vertex's row is dropped the same way
        whichever interval reads it, whatever the schedule.
        """
        p = self.model.dropout
        if p == 0.0 or not self.model.training:
            return rows
        mask = self._masks.get((epoch, layer))
        if mask is None:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 1_009 + layer)
            draw = torch.rand(self.graph.num_nodes, rows.shape[1], generator=generator)
            mask = self._masks.setdefault((epoch, layer), (draw >= p).to(rows.dtype) / (1.0 - p))
        return rows * (mask if nodes is None else mask[nodes])

    def _features(self, epoch: int) -> torch.Tensor:
        """Every vertex's input features with this epoch's dropout (computed once per epoch).

        Dropping a zero is a no-op, so only the nonzero entries draw a random number (input
        features are mostly sparse, e.g. bag-of-words).
        """
        p = self.model.dropout
        if p == 0.0 or not self.model.training:
            return self.graph.x
        key = (epoch, -1)
        dropped = self._masks.get(key)
        if dropped is None:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 1_009)
            rows, cols = self._nonzero
            kept = torch.rand(rows.numel(), generator=generator) >= p
            dropped = torch.zeros_like(self.graph.x)
            dropped[rows[kept], cols[kept]] = self.graph.x[rows[kept], cols[kept]] / (1.0 - p)
            dropped = self._masks.setdefault(key, dropped)
        return dropped

    def _task_GA(self, interval: int, flight: _Flight, layer: int) -> None:
        block = self.graph.blocks[interval]
        conv = self.model.layers[layer - 1]
        if layer == 1:
            flight.gathered[layer] = conv.gather(block, self._features(flight.epoch), whole=True)
            return
        rows, produced = self.buffer.read(layer - 1, block.neighbors)
        if self.record is not None:
            self.record.read(interval, flight.epoch, layer - 1, "act", produced)
        rows.requires_grad_(True)
        flight.rows[layer] = rows
        with torch.enable_grad():
            dropped = self._dropout(rows, flight.epoch, layer, block.neighbors)
            flight.gathered[layer] = conv.gather(block, dropped)

    def _weights(
        self, flight: _Flight, layer: int, phase: str, interval: int
    ) -> dict[str, torch.Tensor]:
        if phase == "backward" and not self.weight_stashing:
            version, params = self.stash.acquire()
            self.stash.release(version)
        else:
            version, params = flight.version, self.stash.get(flight.version)
        mine = self.model.layer_params(params, layer)
        if self.record is not None:
            self.record.weight_use(
                interval, flight.epoch, layer, phase, version, self.stash.latest, checksum(mine)
            )
        return mine

    def _apply(
        self, interval: int, layer: int, gathered: torch.Tensor, params: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        block = self.graph.blocks[interval]
        out = self.model.layers[layer - 1].apply_vertex(block, gathered, params)
        return self.model.activate(layer, out)

    def _loss(self, interval: int, logits: torch.Tensor) -> torch.Tensor:
        local = self._train_local[interval]
        picked = logits[local]
        return (
            F.cross_entropy(picked, self._train_labels[interval], reduction="sum") / self._num_train
        )

    def _task_AV(self, interval: int, flight: _Flight, layer: int) -> None:
        params = self._weights(flight, layer, "forward", interval)
        with torch.no_grad():
            out = self._apply(interval, layer, flight.gathered[layer].detach(), params)
            if layer == self.model.num_layers:
                flight.loss = float(self._loss(interval, out))
            flight.outputs[layer] = out

    def _task_SC(self, interval: int, flight: _Flight, layer: int) -> None:
        self.buffer.write(
            layer, self.graph.blocks[interval].nodes, flight.outputs.pop(layer), flight.epoch
        )

    def _task_dAV(self, interval: int, flight: _Flight, layer: int) -> None:
        stashed = self._weights(flight, layer, "backward", interval)
        params = {name: p.detach().requires_grad_(True) for name, p in stashed.items()}
        gathered = flight.gathered[layer].detach().requires_grad_(layer > 1)
        with torch.enable_grad():
            out = self._apply(interval, layer, gathered, params)
            if layer == self.model.num_layers:
                target, upstream = self._loss(interval, out), None
            else:
                upstream, produced = self.grad_buffer.gather(layer, interval)
                if self.record is not None:
                    self.record.read(interval, flight.epoch, layer, "grad", produced)
                target = out
            inputs = list(params.values()) + ([gathered] if layer > 1 else [])
            grads = torch.autograd.grad(target, inputs, grad_outputs=upstream, allow_unused=True)
        prefix = f"layers.{layer - 1}."
        for name, grad in zip(params, grads, strict=False):
            if grad is not None:
                flight.grads[prefix + name] = grad
        if layer > 1:
            flight.upstream[layer] = grads[-1]
        else:
            flight.gathered.clear()

    def _task_dGA(self, interval: int, flight: _Flight, layer: int) -> None:
        gathered, rows = flight.gathered.pop(layer), flight.rows.pop(layer)
        (grad,) = torch.autograd.grad(gathered, [rows], grad_outputs=flight.upstream.pop(layer))
        self.grad_buffer.scatter(layer - 1, interval, grad, flight.epoch)
