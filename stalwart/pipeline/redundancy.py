"""Eager forward redundant computation (FRC), run on CPU time no other work wants.

A node that holds its successor's replica runs the successor's forward on the same input, so
that after a failure it already has the successor's outputs and saved intermediates (the
autograd graph) for the backward it must then take over (lazy BRC, thesis §3.5.1).

When: the schedule (:func:`stalwart.pipeline.schedule.add_eager_frc`) marks the earliest point
an FRC can start — right after the node sends its own output to the successor. The runtime
does not run it there: that point is on the critical path of a 1F1B steady state, where the
successor is waiting for the node's next activation. Instead the FRC is queued, and the queue is
worked off one layer at a time by one of two executors:

* ``"idle_thread"`` (the default where the OS has it, i.e. Linux): a worker thread per node that
  puts itself into the ``SCHED_IDLE`` scheduling class once, when it starts. The kernel then
  gives it a core only when no normal thread of any process wants that core — the CPU analogue
  of the thesis' "FRC runs in the GPU's idle bubble" (§3.5.2, Figure 3.9). Stages share cores
  (more stages than cores), so what matters is not whether *this* stage waits but whether a core
  is idle: with the main-thread executor a waiting stage's FRC takes the core from another
  stage that is on the critical path, and the scheduler cannot tell the two apart. Scheduling
  policy is per thread on Linux, and an unprivileged thread may always lower itself to
  ``SCHED_IDLE`` (it can never raise itself back, and never needs to). torch ops release the
  GIL, so this thread's layers run alongside the main thread's communication and compute; the
  intra-op thread count is process-wide (the worker sets it to 1), so the thread spawns no
  intra-op threads of its own.
* ``"main_thread"`` (the fallback elsewhere, and on a GPU): the node's own thread advances the
  queue layer by layer while it is *blocked* on a receive or waits for the slowest stage at the
  end of the step (the runtime calls :meth:`EagerFRC.advance` there). Layer-sized slices keep a
  node from starting a long FRC just before its input arrives.

Correctness at the optimizer step: the replica's weights must not change under an FRC that is
mid-forward. :meth:`EagerFRC.pause` stops the thread from taking new work and waits for the layer
in flight (at most one layer); the runtime pauses before every optimizer step and before it
touches the queue or cache after a failure, and :meth:`EagerFRC.resume` lets the thread go on in
the next step. Every method other than :meth:`post`, :meth:`take`, :meth:`pause` and
:meth:`resume` pauses the thread itself first.

Example:
    >>> frc = EagerFRC(modules={2: stage2}, load_input=lambda s, k: batch(k))  # doctest: +SKIP
    >>> frc.post(2, k, own_output)           # after SendActivation(1, k)      # doctest: +SKIP
    >>> frc.pause(); opt.step(); frc.forget(); frc.resume()  # at the commit  # doctest: +SKIP
    >>> leaf, out = frc.take(2, k)           # failover: reuse, do not recompute # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from stalwart.pipeline.op_profile import OpProfile
from stalwart.pipeline.schedule import Op
from stalwart.pipeline.threadclock import ThreadClock

EXECUTORS = ("idle_thread", "main_thread")


def idle_class_available() -> bool:
    """Whether this OS has a per-thread ``SCHED_IDLE`` scheduling class (Linux only)."""
    return hasattr(os, "SCHED_IDLE") and hasattr(os, "sched_setscheduler")


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
        load_input: ``(stage, mb) -> tensor`` for an FRC posted without its input and not fed
            by the previous FRC in the queue (the wrap-around replica of stage 0). With the
            idle thread it is called from that thread, so it must not touch state the main
            thread changes; the runtime passes stage 0's input at posting time instead.
        executor: ``"idle_thread"`` or ``"main_thread"`` (see the module docstring). If the OS
            refuses ``SCHED_IDLE``, the idle thread is not used and :attr:`executor` reads
            ``"main_thread"``: the caller must then advance the queue in its waits.
    """

    def __init__(
        self,
        modules: dict[int, nn.Module],
        load_input: Callable[[int, int], torch.Tensor],
        executor: str = "main_thread",
    ) -> None:
        if executor not in EXECUTORS:
            raise ValueError(f"executor={executor!r}: use one of {EXECUTORS}")
        self.modules = modules
        self.load_input = load_input
        self.queue: deque[_Task] = deque()
        self.cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.posted = self.completed = 0  # counters the runtime resets per step
        # [CPU s, wall s, layers, run-queue s] of the idle thread (the caller's clock does not
        # see them).
        self.thread_clock = [0.0, 0.0, 0, 0.0]
        self._cv = threading.Condition()
        self._paused = False
        self._busy = False  # the idle thread is running a layer
        self._closed = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.executor = "main_thread"
        if executor == "idle_thread" and idle_class_available():
            started = threading.Event()
            self._thread = threading.Thread(
                target=self._serve, args=(started,), name="frc-idle", daemon=True
            )
            self._thread.start()
            started.wait()
            if self.executor != "idle_thread":
                # The OS refused SCHED_IDLE: a normal-priority thread would only contend.
                self._thread.join()
                self._thread = None

    @property
    def pending(self) -> bool:
        return bool(self.queue)

    @property
    def background(self) -> bool:
        """True when the idle thread works off the queue (the caller must not advance it)."""
        return self._thread is not None

    def post(self, stage: int, mb: int, source: torch.Tensor | None) -> None:
        """Queue the FRC of ``stage`` for micro-batch ``mb``; ``source`` is its input if the
        node holds it now (it is referenced, not copied: the node never writes it in place).
        An FRC still cached from an interrupted attempt of the same step is not redone."""
        with self._cv:
            if (stage, mb) in self.cache:
                return
            self.posted += 1
            self.queue.append(_Task(stage, mb, None if source is None else source.detach()))
            self._cv.notify_all()

    def advance(self) -> None:
        """Run the next layer of the oldest queued FRC in the calling thread (queue order =
        dependency order). With the idle thread, pause it first."""
        self._run_layer(self.queue[0])
        self._finish_layer(self.queue[0])

    def pause(self) -> float:
        """Stop the idle thread from taking new work and wait for the layer in flight; return
        the seconds waited. No-op (0.0) with the main-thread executor."""
        if self._thread is None:
            return 0.0
        started = time.perf_counter()
        with self._cv:
            self._paused = True
            while self._busy:
                self._cv.wait()
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"eager FRC failed in the idle thread: {error}") from error
        return time.perf_counter() - started

    def resume(self) -> None:
        """Let the idle thread work off the queue again (after :meth:`pause`)."""
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def finish(self, stages: Iterable[int] | None = None) -> None:
        """Run every queued FRC to the end in the calling thread (of ``stages`` only,
        dropping the others)."""
        self.pause()
        if stages is not None:
            keep = set(stages)
            self.queue = deque(t for t in self.queue if t.stage in keep)
        while self.queue:
            self.advance()

    def take(self, stage: int, mb: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (input leaf, output) of a finished FRC, removed from the cache; ``None`` if the
        FRC did not run (then the caller computes the forward itself — same result)."""
        with self._cv:
            return self.cache.pop((stage, mb), None)

    def forget(self, keep: Iterable[int] | None = None) -> None:
        """Drop queued and cached FRC, except for the stages in ``keep``."""
        self.pause()
        stages = set(keep or ())
        self.queue = deque(t for t in self.queue if t.stage in stages)
        self.cache = {key: v for key, v in self.cache.items() if key[0] in stages}

    def close(self) -> None:
        """Stop the idle thread (after the layer in flight)."""
        if self._thread is None:
            return
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
        self._thread = None

    # ----------------------------------------------------------------- execution
    def _run_layer(self, task: _Task) -> None:
        """One layer of ``task``; touches only ``task`` and the modules (no lock needed)."""
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

    def _finish_layer(self, task: _Task) -> None:
        if task.layer >= len(self.modules[task.stage]):
            self.queue.popleft()
            self.cache[(task.stage, task.mb)] = (task.leaf, task.act)
            self.completed += 1

    def _serve(self, started: threading.Event) -> None:
        """The idle thread: lower its own scheduling class, then run queued layers whenever
        not paused. The lock is held only between layers, never while one runs."""
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            started.set()  # the constructor sees ``executor`` unchanged and falls back
            return
        self.executor = "idle_thread"
        clock = ThreadClock()
        started.set()
        with self._cv:
            while True:
                while not self._closed and (self._paused or not self.queue):
                    self._cv.wait()
                if self._closed:
                    clock.close()
                    return
                task = self.queue[0]
                self._busy = True
                self._cv.release()
                wall, (cpu, queued) = time.perf_counter(), clock.read()
                try:
                    self._run_layer(task)
                except BaseException as exc:  # handed to the main thread at the next pause
                    error: BaseException | None = exc
                else:
                    error = None
                finally:
                    self._cv.acquire()
                self._busy = False
                cpu_now, queued_now = clock.read()
                self.thread_clock[0] += cpu_now - cpu
                self.thread_clock[1] += time.perf_counter() - wall
                self.thread_clock[2] += 1
                self.thread_clock[3] += queued_now - queued
                if error is not None:
                    self._error, self._paused = error, True
                else:
                    self._finish_layer(task)
                self._cv.notify_all()

    def _input(self, task: _Task) -> torch.Tensor:
        previous = self.cache.get((task.stage - 1, task.mb))
        if previous is not None:
            return previous[1]
        return self.load_input(task.stage, task.mb)


def frc_filler(
    frc: EagerFRC, profile: OpProfile | None = None, label: str = ""
) -> Callable[[], bool] | None:
    """What a waiting main thread runs in its bubble: one layer of queued FRC per call,
    returning False once the queue is empty. None when the idle thread works off the queue.

    Args:
        frc: the node's FRC.
        profile: if given, the wait so far is charged to ``label`` and the layer to ``FRC``.
        label: what the thread is waiting in (e.g. ``"RecvActivation"``, ``"Commit"``).
    """
    if frc.background:
        return None

    def fill() -> bool:
        if not frc.pending:
            return False
        if profile is not None:
            profile.tick(label)
        frc.advance()
        if profile is not None:
            profile.tick(Op.FRC.value)
        return True

    return fill
