"""A torchrun launch on this machine: the store hosted outside the trainers (``python -m
stalwart.store_host``), a rank SIGKILLed, torchrun's elastic agent does not tear the job down,
training completes with the same losses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed import PrefixStore, TCPStore

from stalwart.pipeline import keys
from stalwart.pipeline.faults import Fault
from stalwart.pipeline.job import PipelineJob
from stalwart.pipeline.launch import collect_events, launch

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
# Hang guards, not measurements: on a loaded CI machine a step of the polling ranks can take
# seconds. The kill is detected by the node agent's dead/<rank> report, never by failure_timeout,
# which only bounds how long a *live* rank may take to reach the commit or the rendezvous (at
# 10 s a slow one could be left out of the recovery). Unloaded runs are no slower.
FAILURE_TIMEOUT = 60.0
LAUNCH_TIMEOUT = 240
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def host_store(port_file: Path) -> tuple[subprocess.Popen, int]:
    """Start ``python -m stalwart.store_host`` on a free port; its process and the port."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "stalwart.store_host", "--port", "0", "--port-file", str(port_file)],
        env=ENV,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the store host did not start"
        time.sleep(0.05)
    return proc, int(port_file.read_text())


def run_bounded(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; on timeout kill the whole session (agents and workers)."""
    proc = subprocess.Popen(
        cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# The torchrun run and the clean launch, plus the store host's start (60 s) and stop (30 s).
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 90)
def test_torchrun_standalone_survives_a_sigkilled_rank(tmp_path):
    job = PipelineJob(num_stages=4, num_microbatches=4, steps=STEPS,
                      failure_timeout=FAILURE_TIMEOUT,
                      checkpoint_dir=str(tmp_path / "ckpt"))  # fmt: skip
    job_file = tmp_path / "job.json"
    job_file.write_text(job.to_json())
    # The rendezvous store lives in a process of its own: not a trainer, not torchrun's agent.
    host, port = host_store(tmp_path / "store.port")
    try:
        master = TCPStore("127.0.0.1", port, is_master=False)
        faults = json.dumps([Fault(rank=2, step=2, phase="backward").to_dict()])
        done = run_bounded(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
             "-m", "stalwart.pipeline.node",
             "--job", str(job_file), "--store", f"127.0.0.1:{port}", "--faults", faults],
            timeout=LAUNCH_TIMEOUT,
        )  # fmt: skip
        check_run(done, PrefixStore(keys.RUN_PREFIX, master), job)
    finally:
        host.terminate()
        assert host.wait(timeout=30) == 0  # the store host exits cleanly on SIGTERM


def check_run(done: subprocess.CompletedProcess, store: PrefixStore, job: PipelineJob) -> None:
    # torchrun saw four workers finish: rank 2's node agent reported its SIGKILLed worker and
    # left with 0, so the elastic agent did not stop (or restart) the other three.
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exit code -9" in store.get(keys.dead(2)).decode()
    assert [store.check([keys.finished(r)]) for r in range(4)] == [True, True, False, True]
    (event,) = collect_events(store)
    assert event["kind"] == "failover" and event["lost"] == [2] and event["resume"] == 2
    losses = [float(store.get(keys.loss(s))) for s in range(STEPS)]
    clean = launch(PipelineJob(**{**job.__dict__, "checkpoint_dir": None}), timeout=LAUNCH_TIMEOUT)
    assert max(abs(a - b) for a, b in zip(losses, clean.losses, strict=True)) <= 1e-5
