"""A small transformer LM split into 4 pipeline stages on CPU, trained through a preemption.

The character LM (stalwart.pipeline.workloads.CharLM, text of the Python standard library)
runs as 4 worker processes with eager redundant computation. Mid-run, stage 2's process is
SIGKILLed during a backward pass: its predecessor (the shadow, which holds a replica of stage 2)
takes over without a restart or a checkpoint load, and training finishes every step. The same
run without the fault is trained first, and the two loss sequences are compared.

Run: ``.venv/bin/python examples/pipeline_lm.py --config examples/configs/pipeline_lm.yaml``
(the fault can also be given as ``--fault rank:step:phase[:SIGKILL|SIGTERM]``).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import yaml

from stalwart.pipeline.faults import Fault
from stalwart.pipeline.job import PipelineJob
from stalwart.pipeline.launch import launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(Path(__file__).parent / "configs/pipeline_lm.yaml"))
    parser.add_argument("--fault", action="append", help="rank:step:phase[:signal]")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # launch's per-step losses
    config = yaml.safe_load(Path(args.config).read_text())
    faults = [Fault.parse(f) for f in (args.fault or config.pop("faults", []))]
    config.pop("faults", None)
    job = PipelineJob(**config)
    print(f"training {job.steps} steps without faults ...")
    clean = launch(job, timeout=900)
    print(f"training again with faults {faults} ...")
    faulty = launch(job, faults=faults, timeout=900, progress=True)
    for event in faulty.events:
        print(
            f"recovery: {event['kind']} after losing rank(s) {event['lost']} at step "
            f"{event['step']}, resumed at step {event['resume']} in {event['seconds']:.3f}s"
        )
    diff = max(abs(a - b) for a, b in zip(clean.losses, faulty.losses, strict=True))
    pairs = [v for v in faulty.digests.values() if len(v) == 2]
    same = sum(v["owner"] == v["replica"] for v in pairs)
    print(
        f"loss {faulty.losses[0]:.4f} -> {faulty.losses[-1]:.4f}; max |loss difference| vs the "
        f"run without faults: {diff:.2e}; replicas bit-identical after {same}/{len(pairs)} "
        f"owner/replica checks; exit codes {faulty.exit_codes}"
    )


if __name__ == "__main__":
    main()
