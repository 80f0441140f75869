"""EagerFRC: layer-by-layer forward redundancy gives the owner's exact output and gradients,
run by the caller in its waits or by a SCHED_IDLE thread that stops for the optimizer step."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch import nn

from stalwart.pipeline.redundancy import EagerFRC, idle_class_available


def stages() -> dict[int, nn.Sequential]:
    torch.manual_seed(0)
    return {
        0: nn.Sequential(nn.Linear(8, 16), nn.Tanh()),
        1: nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)),
    }


def assert_frc_equals_owner(out1, leaf1, replica, owner, x) -> None:
    """Stage 1's FRC output equals the owner's forward, and a backward through the FRC graph
    gives the owner's gradients, bit for bit."""
    want = owner[1](owner[0](x))
    assert torch.equal(out1, want)
    out1.sum().backward()
    want.sum().backward()
    for a, b in zip(replica[1].parameters(), owner[1].parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert leaf1.grad is not None


def test_sliced_frc_equals_the_owner_forward_and_backward_bit_for_bit():
    replica = stages()
    owner = stages()  # same seed: the owner's copy of the same stages
    x = torch.randn(5, 8)
    frc = EagerFRC(replica, load_input=lambda stage, mb: x)
    frc.post(0, 0, None)  # stage 0: the input is loaded (the wrap-around replica)
    frc.post(1, 0, None)  # stage 1: fed by the FRC of stage 0 (queue order)
    steps = 0
    while frc.pending:
        frc.advance()  # one layer at a time, as in a receive wait
        steps += 1
    assert steps == 5  # 2 + 3 layers
    assert frc.completed == frc.posted == 2
    (_, out0), (leaf1, out1) = frc.take(0, 0), frc.take(1, 0)
    # The saved graph is what a shadow's backward (lazy BRC) runs on: same gradients.
    assert_frc_equals_owner(out1, leaf1, replica, owner, x)
    assert out0.grad_fn is not None


def test_post_skips_cached_and_forget_keeps_only_named_stages():
    modules = stages()
    frc = EagerFRC(modules, load_input=lambda stage, mb: torch.randn(2, 8))
    frc.post(0, 0, None)
    frc.finish()
    frc.post(0, 0, None)  # already cached from an interrupted attempt: not redone
    assert not frc.pending and frc.posted == 1
    frc.post(1, 0, torch.randn(2, 16))
    frc.post(0, 1, None)
    frc.forget(keep=[1])
    assert [t.stage for t in frc.queue] == [1] and frc.take(0, 0) is None
    frc.finish(stages=[0])  # only stage 0's queued work would run: stage 1's is dropped
    assert not frc.pending and frc.take(1, 0) is None


idle_only = pytest.mark.skipif(
    not idle_class_available(), reason="SCHED_IDLE is Linux-only (the main-thread executor is used)"
)


def wait_until(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


class Gate(nn.Module):
    """Identity whose forward blocks until released: a layer held in flight on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        assert self.release.wait(20)
        return x * 1.0


def thread_ids() -> set[int]:
    """This process's live threads (kernel ids). A set, not a count: a thread an earlier test
    joined can still be listed for a moment after its join, then vanish mid-test."""
    return {int(name) for name in os.listdir("/proc/self/task")}


@idle_only
@pytest.mark.timeout(60)
def test_idle_thread_runs_frc_in_sched_idle_and_its_graph_backprops_bit_for_bit():
    replica, owner = stages(), stages()
    x = torch.randn(5, 8)
    threads_before = thread_ids()
    frc = EagerFRC(replica, load_input=lambda stage, mb: x, executor="idle_thread")
    try:
        assert frc.executor == "idle_thread" and frc.background
        frc.post(0, 0, x)
        frc.post(1, 0, None)  # fed by the FRC of stage 0, inside the idle thread
        wait_until(lambda: frc.completed == 2)
        # Only the FRC thread itself was added (no intra-op threads of its own), it is in
        # SCHED_IDLE, and the thread that created it kept the normal class.
        assert thread_ids() - threads_before == {frc._thread.native_id}
        assert os.sched_getscheduler(frc._thread.native_id) == os.SCHED_IDLE
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
        assert frc.thread_clock[2] == 5  # layers run by the idle thread
        frc.pause()
        leaf1, out1 = frc.take(1, 0)
    finally:
        frc.close()
    # The graph was recorded in the idle thread; the failover backward runs in this one.
    assert_frc_equals_owner(out1, leaf1, replica, owner, x)


@idle_only
@pytest.mark.timeout(60)
def test_pause_waits_for_the_layer_in_flight_and_no_layer_runs_until_resume():
    gate = Gate()
    linear = nn.Linear(4, 4)
    frc = EagerFRC({1: nn.Sequential(gate, linear)}, lambda s, k: None, executor="idle_thread")
    try:
        x = torch.randn(3, 4)
        frc.post(1, 0, x)
        assert gate.entered.wait(20)  # the idle thread is inside layer 0
        pausing = threading.Thread(target=frc.pause)
        pausing.start()
        pausing.join(0.2)
        assert pausing.is_alive()  # pause() waits for the layer in flight...
        gate.release.set()
        pausing.join(20)
        assert not pausing.is_alive()
        task = frc.queue[0]
        assert task.layer == 1  # ...which completed,
        time.sleep(0.2)
        assert task.layer == 1 and frc.completed == 0  # and nothing more runs while paused.
        with torch.no_grad():
            linear.weight.mul_(2.0)  # the optimizer step the pause protects
        frc.resume()
        wait_until(lambda: frc.completed == 1)
        _, out = frc.take(1, 0)
        assert torch.equal(out, linear(x))  # the layer after the pause saw the new weights
    finally:
        gate.release.set()
        frc.close()


@idle_only
@pytest.mark.timeout(60)
def test_an_error_in_the_idle_thread_surfaces_at_the_next_pause():
    broken = nn.Sequential(nn.Linear(8, 4))
    frc = EagerFRC({1: broken}, lambda s, k: None, executor="idle_thread")
    try:
        frc.post(1, 0, torch.randn(2, 5))  # wrong width: the layer raises in the idle thread
        wait_until(lambda: frc._error is not None)
        with pytest.raises(RuntimeError, match="eager FRC failed in the idle thread"):
            frc.pause()
    finally:
        frc.close()


def test_without_sched_idle_the_main_thread_executor_is_used(monkeypatch):
    def refuse(*args):
        raise PermissionError("not allowed here")

    monkeypatch.setattr(os, "sched_setscheduler", refuse, raising=False)
    monkeypatch.setattr(os, "SCHED_IDLE", 5, raising=False)
    monkeypatch.setattr(os, "sched_param", lambda priority: priority, raising=False)
    frc = EagerFRC(stages(), lambda s, k: torch.randn(2, 8), executor="idle_thread")
    assert frc.executor == "main_thread" and not frc.background
    frc.post(0, 0, None)
    frc.advance()  # the caller advances the queue itself, as in its waits
    frc.advance()
    assert frc.completed == 1 and frc.pause() == 0.0
