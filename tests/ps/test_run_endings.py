"""How a run ends when it cannot go as scheduled: a worker that crashes stops the run at once in
every mode (a synchronous round used to wait for its gradient forever), and a timed kill that a
steps-bound run ends before keeps the trained result instead of throwing it away."""

from __future__ import annotations

import subprocess
import sys
import time

import lightning as L
import psutil
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from stalwart import ParameterServerTrainer
from stalwart.errors import StalwartError
from stalwart.flat import flatten
from stalwart.ps import KillEvent
from stalwart.ps.processes import ChildProcess, ProcessSupervisor, describe_exit, describe_log
from stalwart.ps.runner import worker_failure_message

X = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def train_dataloader(self):
        return DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True)


class CrashesInWorkerOne(Tiny):
    def training_step(self, batch, batch_idx):
        # Each worker seeds torch with seed * 1000 + its index (seed 0 here): worker 1 sees 1.
        if torch.initial_seed() == 1 and batch_idx == 3:
            raise RuntimeError("bug in worker 1")
        return super().training_step(batch, batch_idx)


def _ps_children() -> list[psutil.Process]:
    children = psutil.Process().children(recursive=True)
    return [p for p in children if "stalwart.ps.launch" in " ".join(p.cmdline())]


@pytest.mark.timeout(120)  # without the fix a sync run never returns
@pytest.mark.parametrize("mode", ["checkpoint-sync", "chain-sync"])
def test_a_crashed_worker_stops_a_sync_run_with_its_error(tmp_path, mode):
    trainer = ParameterServerTrainer(
        mode=mode, workers=2, steps=30, lr=0.1, run_dir=str(tmp_path / "run")
    )
    started = time.monotonic()
    with pytest.raises(StalwartError, match=r"(?s)worker 1 \(exit code 1\).*bug in worker 1"):
        trainer.fit(CrashesInWorkerOne())
    assert time.monotonic() - started < 90
    assert _ps_children() == []  # the PS, the other worker, the spares and the store are gone


def test_a_timed_kill_a_steps_bound_run_ends_before_keeps_the_result(tmp_path):
    model = Tiny()
    initial = flatten(model.parameters())
    trainer = ParameterServerTrainer(
        mode="stateless", workers=1, steps=10, lr=0.1, run_dir=str(tmp_path / "run"),
        kills=[KillEvent(at_seconds=600.0, downtime=0.5)],
    )  # fmt: skip
    with pytest.warns(UserWarning, match=r"never fired.*result.unfired_kills"):
        result = trainer.fit(model)
    assert result.produced == result.applied == 10
    assert result.kills == []
    assert result.unfired_kills == [{"at_gradient": None, "at_seconds": 600.0, "targets": ["ps"]}]
    assert result.summary()["unfired_kills"] == 1
    # The trained weights are in the module, not thrown away with the run.
    assert torch.equal(flatten(model.parameters()), result.weights)
    assert not torch.equal(initial, result.weights)
    assert _ps_children() == []


def test_failure_messages_name_the_signal_every_failed_worker_and_the_logs():
    """A worker killed from outside (exit code -9) left the message empty after the colon."""
    message = worker_failure_message(
        [
            ("worker 1", -9, "/run/worker-1.log", ""),
            ("worker 2", 1, "/run/worker-2.log", "Traceback\nRuntimeError: bug in worker 2\n"),
        ]
    )
    assert "worker 1 (killed by SIGKILL from outside the run; the out-of-memory killer" in message
    assert "worker 2 (exit code 1)" in message
    assert "worker 1: its log /run/worker-1.log is empty" in message
    assert "worker 2: last lines of /run/worker-2.log:\nTraceback" in message
    assert message.endswith("RuntimeError: bug in worker 2")
    assert describe_exit(-15) == "killed by SIGTERM from outside the run"
    assert describe_exit(3) == "exit code 3"
    assert describe_log("/run/ps.log", " \n") == "its log /run/ps.log is empty"


def ended_child(supervisor: ProcessSupervisor, tmp_path) -> int:
    """A real child of the supervisor that has exited (code 0) and been reaped."""
    popen = subprocess.Popen([sys.executable, "-c", "pass"])
    log = str(tmp_path / "server.log")
    supervisor.procs[popen.pid] = ChildProcess("server", popen, time.time(), log)
    while supervisor.alive(popen.pid):
        time.sleep(0.01)
    return popen.pid


def test_waiting_for_a_process_to_exit_does_not_fail_when_it_exits_between_two_checks(tmp_path):
    # Seen once in the outage matrix's ~1,400 runs: the server was alive when the condition
    # (its exit) was checked and gone at the liveness check just after, which reported it dead.
    supervisor = ProcessSupervisor(str(tmp_path))
    pid = ended_child(supervisor, tmp_path)
    checks = []
    supervisor.wait_for(lambda: checks.append(1) or len(checks) > 1, "the server to exit", pid)
    assert len(checks) == 2
    # A process that dies while what it was awaited for never comes still fails, naming it.
    with pytest.raises(StalwartError, match=rf"process {pid} died while waiting for the end"):
        supervisor.wait_for(lambda: False, "the end", pid)
