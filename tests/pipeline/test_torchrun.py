"""A torchrun launch on this machine: the store hosted outside the trainers, a rank SIGKILLed,
torchrun's elastic agent does not tear the job down, training completes with the same losses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed import PrefixStore, TCPStore

from stalwart.pipeline.faults import Fault
from stalwart.pipeline.job import PipelineJob
from stalwart.pipeline.launch import BOOT, collect_events, launch

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


def run_bounded(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; on timeout kill the whole session (agents and workers)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.timeout(300)
def test_torchrun_standalone_survives_a_sigkilled_rank(tmp_path):
    job = PipelineJob(num_stages=4, num_microbatches=4, steps=STEPS, failure_timeout=10.0,
                      checkpoint_dir=str(tmp_path / "ckpt"))  # fmt: skip
    job_file = tmp_path / "job.json"
    job_file.write_text(job.to_json())
    # The rendezvous store lives in this test process: not a trainer, not torchrun's agent.
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    faults = json.dumps([Fault(rank=2, step=2, phase="backward").to_dict()])
    done = run_bounded(
        # (`-m stalwart.pipeline.node` works the same; BOOT skips importing Lightning per rank.)
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
         "--no-python", sys.executable, "-c", BOOT, "stalwart.pipeline.node",
         "--job", str(job_file), "--store", f"127.0.0.1:{master.port}", "--faults", faults],
        timeout=240,
    )  # fmt: skip
    # torchrun saw four workers finish: rank 2's node agent reported its SIGKILLed worker and
    # left with 0, so the elastic agent did not stop (or restart) the other three.
    assert done.returncode == 0, done.stderr[-3000:]
    store = PrefixStore("run", master)
    assert "exit code -9" in store.get("dead/2").decode()
    assert [store.check([f"finished/{r}"]) for r in range(4)] == [True, True, False, True]
    (event,) = collect_events(store)
    assert event["kind"] == "failover" and event["lost"] == [2] and event["resume"] == 2
    losses = [float(store.get(f"loss/{s}")) for s in range(STEPS)]
    clean = launch(PipelineJob(**{**job.__dict__, "checkpoint_dir": None}), timeout=60)
    assert max(abs(a - b) for a, b in zip(losses, clean.losses, strict=True)) <= 1e-5
