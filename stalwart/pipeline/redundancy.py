"""Eager forward redundant computation (FRC) run in the pipeline bubble, one layer at a time.

A node that holds its successor's replica runs the successor's forward on the same input, so
that after a failure it already has the successor's outputs and saved intermediates (the
autograd graph) for the backward it must then take over (lazy BRC, thesis §3.5.1).

When: the schedule (:func:`stalwart.pipeline.schedule.add_eager_frc`) marks the earliest point
an FRC can start — right after the node sends its own output to the successor. The runtime
does not run it there: that point is on the critical path of a 1F1B steady state, where the
successor is waiting for the node's next activation. Instead the FRC is queued and advanced
one layer at a time while the node is *blocked* on a receive (the bubble, thesis §3.5.2 and
Figure 3.9); whatever is left when the node's program ends is finished then. Layer-sized slices
keep a node from starting a long FRC just before its input arrives.

Example:
    >>> frc = EagerFRC(modules={2: stage2}, load_input=lambda s, k: batch(k))  # doctest: +SKIP
    >>> frc.post(2, k, own_output)           # after SendActivation(1, k)      # doctest: +SKIP
    >>> while frc.pending and not arrived(): frc.advance()                    # doctest: +SKIP
    >>> leaf, out = frc.take(2, k)           # failover: reuse, do not recompute # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class _Task:
    stage: int
    mb: int
    source: torch.Tensor | None  # the input, when known at posting time
    leaf: torch.Tensor | None = None
    act: torch.Tensor | None = None
    layer: int = 0


class EagerFRC:
    """Queue, layer-by-layer executor and cache of a node's forward redundant computation.

    Args:
        modules: stage -> the node's module for it (the replica stages are looked up here).
        load_input: ``(stage, mb) -> tensor`` for an FRC whose input is not a tensor the node
            holds: stage 0's input (the wrap-around replica loads it), or the previous FRC's
            output when the node holds several consecutive replicas.
    """

    def __init__(
        self,
        modules: dict[int, nn.Module],
        load_input: Callable[[int, int], torch.Tensor],
    ) -> None:
        self.modules = modules
        self.load_input = load_input
        self.queue: deque[_Task] = deque()
        self.cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.posted = self.completed = 0  # counters the runtime resets per step

    @property
    def pending(self) -> bool:
        return bool(self.queue)

    def post(self, stage: int, mb: int, source: torch.Tensor | None) -> None:
        """Queue the FRC of ``stage`` for micro-batch ``mb``; ``source`` is its input if the
        node holds it now (it is referenced, not copied: the node never writes it in place).
        An FRC still cached from an interrupted attempt of the same step is not redone."""
        if (stage, mb) in self.cache:
            return
        self.posted += 1
        self.queue.append(_Task(stage, mb, None if source is None else source.detach()))

    def advance(self) -> None:
        """Run the next layer of the oldest queued FRC (queue order = dependency order)."""
        task = self.queue[0]
        module = self.modules[task.stage]
        if task.leaf is None:
            source = task.source if task.source is not None else self._input(task)
            task.leaf = source.detach().requires_grad_(source.is_floating_point())
            task.act = task.leaf
        # The intermediates are only needed if this node must run the successor's backward
        # after a failure, so on an accelerator they go to host memory as they are saved. On a
        # CPU they already are in host memory and the pack hooks would only add copies.
        offload = torch.autograd.graph.save_on_cpu() if task.leaf.device.type != "cpu" else None
        with offload or contextlib.nullcontext():
            task.act = module[task.layer](task.act)
        task.layer += 1
        if task.layer >= len(module):
            self.queue.popleft()
            self.cache[(task.stage, task.mb)] = (task.leaf, task.act)
            self.completed += 1

    def finish(self, stages: Iterable[int] | None = None) -> None:
        """Run every queued FRC to the end (of ``stages`` only, dropping the others)."""
        if stages is not None:
            keep = set(stages)
            self.queue = deque(t for t in self.queue if t.stage in keep)
        while self.queue:
            self.advance()

    def take(self, stage: int, mb: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (input leaf, output) of a finished FRC, removed from the cache; ``None`` if the
        FRC did not run (then the caller computes the forward itself — same result)."""
        return self.cache.pop((stage, mb), None)

    def forget(self, keep: Iterable[int] | None = None) -> None:
        """Drop queued and cached FRC, except for the stages in ``keep``."""
        stages = set(keep or ())
        self.queue = deque(t for t in self.queue if t.stage in stages)
        self.cache = {key: v for key, v in self.cache.items() if key[0] in stages}

    def _input(self, task: _Task) -> torch.Tensor:
        previous = self.cache.get((task.stage - 1, task.mb))
        if previous is not None:
            return previous[1]
        return self.load_input(task.stage, task.mb)
