"""The per-node agent for multi-machine launches under ``torchrun`` (TorchElastic).

torchrun's elastic agent treats any worker that exits non-zero as a failed group: it stops
every worker of the job and restarts them all (``--max-restarts``) or gives up — the opposite of
what a redundant pipeline wants. So torchrun does not start the training worker directly; it
starts this small agent, one per rank, which forks the worker, watches it, and when the worker
dies (SIGKILL, OOM, a preemption's SIGTERM) reports ``dead/<rank>`` in the rendezvous store — the
same fast-path report the one-machine agent makes — and exits 0: "this node left". torchrun sees
a worker that finished, not one that failed, and leaves the others running. (A worker that
crashes with an ordinary error is a bug: its exit code is passed on and torchrun stops the job.)

The store is not torchrun's: it is a c10d ``TCPStore`` hosted by a process that is not a trainer
(``python -m stalwart.store_host``, :mod:`stalwart.store_host`), so it survives any of them —
including the machine whose torchrun agent hosts torchrun's own rendezvous.

One machine, four ranks (each torchrun worker is one pipeline node)::

    python -m stalwart.store_host --port 29600 &
    torchrun --standalone --nproc-per-node=4 -m stalwart.pipeline.node \\
        --job job.json --store 127.0.0.1:29600

Many machines: the same ``node`` command under ``torchrun --nnodes=N --nproc-per-node=K
--rdzv-backend=static --node-rank=i --master-addr=HOST0 --master-port=PORT``, the store on a
machine that is not preempted (static rendezvous: the survivors' torchrun agents never contact a
lost machine's agent again until their exit barrier, which waits up to 300 s after training).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import signal
import sys
from pathlib import Path

from torch.distributed import PrefixStore, TCPStore

from stalwart.errors import ConfigurationError
from stalwart.pipeline import keys
from stalwart.pipeline.job import PipelineJob

# A worker that left by a signal (-9 SIGKILL, -15 or 143 after its own SIGTERM handler) or by
# the survivors' decision (0) is a node that left; anything else is a crash.
_LEFT = {0, -signal.SIGKILL, -signal.SIGTERM, 128 + signal.SIGTERM}


def _worker(job_json: str, rank: int, host: str, port: int, faults_json: str) -> None:
    from stalwart.pipeline.runtime import run_worker

    run_worker(job_json, rank, port, faults_json, host)


def run_node(job: PipelineJob, rank: int, host: str, port: int, faults_json: str = "[]") -> int:
    """Fork the worker of ``rank``, wait for it, report it if it died; the exit code to use."""
    job = job.validate()
    # Fork before this process opens its own store connection (no store threads to inherit).
    ctx = multiprocessing.get_context("fork")
    args = (job.to_json(), rank, host, port, faults_json)
    worker = ctx.Process(target=_worker, args=args, daemon=True)
    worker.start()

    def forward(signum: int, frame: object) -> None:
        # torchrun stopping the job, or this machine's preemption notice: the worker leaves.
        if worker.pid is not None:
            os.kill(worker.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    timeout = datetime.timedelta(seconds=max(30.0, job.failure_timeout))
    store = PrefixStore(keys.RUN_PREFIX, TCPStore(host, port, is_master=False, timeout=timeout))
    worker.join()
    code = worker.exitcode if worker.exitcode is not None else -signal.SIGKILL
    if not store.check([keys.finished(rank)]):
        store.set(keys.dead(rank), f"exit code {code} (reported by its node agent)")
    return 0 if code in _LEFT else code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one pipeline node under torchrun")
    parser.add_argument("--job", required=True, help="job JSON file (PipelineJob fields)")
    parser.add_argument("--store", required=True, help="host:port of the external TCPStore")
    parser.add_argument("--rank", type=int, help="default: $RANK (set by torchrun)")
    parser.add_argument("--faults", default="[]", help="JSON list of Fault dicts")
    args = parser.parse_args(argv)
    host, _, port = args.store.rpartition(":")
    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", "-1"))
    job = PipelineJob(**json.loads(Path(args.job).read_text()))
    world = int(os.environ.get("WORLD_SIZE", job.num_nodes or job.num_stages))
    nodes = job.num_nodes or job.num_stages
    if not 0 <= rank < nodes or world != nodes:
        raise ConfigurationError(
            f"rank {rank} of world size {world}: the job has {nodes} nodes; launch it with "
            f"torchrun --nproc-per-node/--nnodes giving exactly {nodes} workers."
        )
    return run_node(job, rank, host or "127.0.0.1", int(port), args.faults)


if __name__ == "__main__":
    sys.exit(main())
