"""The example YAML config (examples/configs/pipeline_lm.yaml) runs, shortened, with its fault."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from stalwart.pipeline.faults import Fault
from stalwart.pipeline.job import PipelineJob
from stalwart.pipeline.launch import launch

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "pipeline_lm.yaml"


@pytest.mark.timeout(300)
def test_pipeline_lm_config_trains_through_its_fault():
    config = yaml.safe_load(CONFIG.read_text())
    faults = [Fault.parse(f) if isinstance(f, str) else f for f in config.pop("faults", [])]
    config.update(steps=4, checkpoint_every=2)
    config["workload_kwargs"] = {**config.get("workload_kwargs", {}), "max_chars": 20000}
    job = PipelineJob(**config)
    faults = [Fault(rank=f.rank, step=min(f.step, 2), phase=f.phase) for f in faults]
    result = launch(job, faults=faults, timeout=240)
    assert len(result.losses) == 4
    assert [event["kind"] for event in result.events] == (["failover"] if faults else [])
