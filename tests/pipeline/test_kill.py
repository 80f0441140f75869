"""Real worker processes on CPU/gloo, killed with real signals (P = 4, tiny MLP on digits)."""

from __future__ import annotations

import pytest
import torch

from stalwart.pipeline.faults import Fault
from stalwart.pipeline.job import PipelineJob
from stalwart.pipeline.launch import launch
from stalwart.pipeline.workloads import DigitsMLP

STEPS = 6
# Hang guards, not measurements: the ranks poll the store (2 ms sleeps), so on a loaded CI machine
# a step can take seconds. Every kill here is detected by the agent's dead/<rank> report (and the
# dead peer's closed sockets), never by failure_timeout, which only bounds how long a *live* rank
# may take to reach the commit or the rendezvous: at 10 s a slow live rank could be left out of a
# recovery (an extra or wrong event). A ~5 s unloaded run is no slower for either limit.
FAILURE_TIMEOUT = 60.0
LAUNCH_TIMEOUT = 240
TEST_TIMEOUT = 2 * LAUNCH_TIMEOUT + 60  # the module's clean run and the test's own launch
BASE = dict(num_stages=4, num_microbatches=4, steps=STEPS, failure_timeout=FAILURE_TIMEOUT)


def run(faults=(), **overrides):
    return launch(PipelineJob(**{**BASE, **overrides}), faults=faults, timeout=LAUNCH_TIMEOUT)


@pytest.fixture(scope="module")
def clean():
    return run(verify_replicas=True)


def assert_same_losses(result, reference):
    assert len(result.losses) == STEPS
    assert max(abs(a - b) for a, b in zip(result.losses, reference.losses, strict=True)) <= 1e-5


def single_process_losses(steps: int) -> list[float]:
    """The same training without a pipeline: one model, one process."""
    job = PipelineJob(**BASE).validate()
    workload = DigitsMLP()
    torch.manual_seed(job.seed)
    model = torch.nn.Sequential(*workload.layers())
    opt = torch.optim.Adam(model.parameters(), lr=job.lr)
    losses = []
    for step in range(steps):
        total = 0.0
        for k in range(job.num_microbatches):
            x, y = workload.microbatch(step, k, job.num_microbatches, job.batch_size)
            loss = workload.loss(model(x), y) / job.num_microbatches
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.timeout(TEST_TIMEOUT)
def test_replica_equals_owner_bit_for_bit_after_every_step(clean):
    assert not clean.events
    # Every stage has a replica (stage 0's on the last node) and each one was compared after
    # every optimizer step: parameters and Adam state, SHA-256 over the raw bytes.
    assert sorted(clean.digests) == [(s, n) for s in range(STEPS) for n in range(4)]
    for key, pair in clean.digests.items():
        assert pair["owner"] == pair["replica"], key
    # The states do change from step to step (the comparison is not between constants).
    assert len({clean.digests[(s, 1)]["owner"] for s in range(STEPS)}) == STEPS


@pytest.mark.timeout(TEST_TIMEOUT)
def test_pipeline_matches_single_process_training(clean):
    reference = single_process_losses(STEPS)
    assert max(abs(a - b) for a, b in zip(clean.losses, reference, strict=True)) <= 1e-5
    assert clean.losses[-1] < clean.losses[0]


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize(
    "fault",
    [
        Fault(rank=2, step=2, phase="forward", microbatch=1),
        Fault(rank=1, step=3, phase="backward", microbatch=1),
        Fault(rank=3, step=2, phase="backward"),  # the last stage: its shadow computes the loss
        Fault(rank=0, step=2, phase="forward"),  # stage 0: the last node's wrap-around replica
    ],
    ids=["middle-forward", "middle-backward", "last-stage", "first-stage-wraparound"],
)
def test_sigkill_one_stage_training_continues_without_restart(clean, fault):
    result = run([fault], verify_replicas=True)
    assert result.exit_codes[fault.rank] == -9
    assert all(code == 0 for rank, code in result.exit_codes.items() if rank != fault.rank)
    assert_same_losses(result, clean)
    (event,) = result.events
    # Failover: same step re-run by the survivors, no checkpoint load (resume == failed step).
    assert event["kind"] == "failover" and event["lost"] == [fault.rank]
    assert event["resume"] == event["step"] == fault.step
    shadow = (fault.rank - 1) % 4
    # The shadow took the victim's forwards from its eager-FRC cache instead of recomputing.
    assert result.frc_reused[shadow] > 0
    # Replicas that survive stay bit-identical after the failover too.
    after = [pair for (step, _), pair in result.digests.items() if step >= fault.step]
    assert after and all(pair["owner"] == pair["replica"] for pair in after if len(pair) == 2)


@pytest.mark.timeout(TEST_TIMEOUT)
def test_main_thread_frc_executor_fails_over_the_same(clean):
    # The executor used where there is no SCHED_IDLE: FRC advanced by the stage's own thread in
    # its waits. Same failover, same losses, same bit-identical replicas, FRC reused.
    fault = Fault(rank=1, step=3, phase="backward", microbatch=1)
    result = run([fault], verify_replicas=True, frc_executor="main_thread")
    assert_same_losses(result, clean)
    assert [e["kind"] for e in result.events] == ["failover"]
    assert result.frc_reused[0] > 0
    pairs = [pair for pair in result.digests.values() if len(pair) == 2]
    assert pairs and all(pair["owner"] == pair["replica"] for pair in pairs)


@pytest.mark.timeout(TEST_TIMEOUT)
def test_sigterm_preempted_rank_leaves_and_the_rest_continue(clean):
    result = run([Fault(rank=2, step=1, phase="backward", signal="SIGTERM")], redundancy="lazy")
    assert result.exit_codes[2] == 128 + 15
    assert_same_losses(result, clean)
    assert [e["kind"] for e in result.events] == ["failover"]
    assert result.frc_reused[1] == 0  # lazy: the shadow recomputes the victim's forward


@pytest.mark.timeout(TEST_TIMEOUT)
def test_two_consecutive_stages_killed_fall_back_to_checkpoint(clean):
    every = 2
    faults = [Fault(rank=1, step=3, phase="forward"), Fault(rank=2, step=3, phase="forward")]
    result = run(faults, checkpoint_every=every)
    (event,) = result.events
    assert event["kind"] == "fallback" and sorted(event["lost"]) == [1, 2]
    lost_steps = event["step"] - event["resume"]
    assert 0 <= lost_steps <= every  # lost work <= steps since the last checkpoint
    assert event["resume"] == 2
    assert_same_losses(result, clean)  # training completed all steps, same losses


@pytest.mark.timeout(TEST_TIMEOUT)
def test_second_failure_after_failover(clean):
    faults = [Fault(rank=2, step=1, phase="forward"), Fault(rank=0, step=3, phase="backward")]
    result = run(faults, checkpoint_every=2)
    assert [e["kind"] for e in result.events] == ["failover", "failover"]
    assert_same_losses(result, clean)


@pytest.mark.timeout(LAUNCH_TIMEOUT)  # the CLI launches with its own 600 s limit
def test_cli_pipeline_with_fault_injection(capsys):
    from stalwart.cli import main

    argv = ["pipeline", "--steps", "3", "--failure-timeout", str(FAILURE_TIMEOUT)]
    assert main([*argv, "--fault", "2:1:backward:SIGKILL"]) == 0
    out = capsys.readouterr().out
    assert "'kind': 'failover'" in out and "replica mismatches: 0" in out
    assert main(["pipeline", "--fault", "2"]) == 2  # bad fault spec: a clear error
