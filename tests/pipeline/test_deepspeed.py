"""DeepSpeed users: a PipelineModule / LayerSpec list is accepted as the model description."""

from __future__ import annotations

import pytest
from torch import nn

from stalwart.errors import ConfigurationError
from stalwart.pipeline.faults import Fault
from stalwart.pipeline.job import PipelineJob
from stalwart.pipeline.launch import launch
from stalwart.pipeline.workloads import IN_MEMORY, DigitsMLP

deepspeed_pipe = pytest.importorskip("deepspeed.pipe")
from stalwart.pipeline.deepspeed_model import DeepSpeedWorkload, deepspeed_bounds  # noqa: E402


def digits_specs():
    LayerSpec = deepspeed_pipe.LayerSpec
    specs = []
    for _ in range(4):
        specs += [LayerSpec(nn.Linear, 64, 64), LayerSpec(nn.Tanh)]
    return [*specs, LayerSpec(nn.Linear, 64, 10)]


@pytest.mark.timeout(120)
def test_layerspec_pipeline_trains_through_a_kill_like_the_native_model():
    specs = digits_specs()
    bounds = deepspeed_bounds(specs, 4)  # DeepSpeed's own partition_balanced
    assert bounds == [[0, 2], [2, 4], [4, 6], [6, 9]]
    IN_MEMORY["in-memory:ds"] = DeepSpeedWorkload(specs, data=DigitsMLP())
    try:
        job = PipelineJob(num_stages=4, steps=4, workload="in-memory:ds", bounds=bounds)
        ds = launch(job, faults=[Fault(rank=2, step=2, phase="backward")], timeout=60)
    finally:
        IN_MEMORY.pop("in-memory:ds")
    native = launch(PipelineJob(num_stages=4, steps=4), timeout=60)
    # Same layers built in the same order under the same seed: the same training.
    assert max(abs(a - b) for a, b in zip(ds.losses, native.losses, strict=True)) <= 1e-6
    assert [e["kind"] for e in ds.events] == ["failover"]


def test_bad_deepspeed_descriptions():
    with pytest.raises(ConfigurationError, match="not a DeepSpeed pipeline description"):
        DeepSpeedWorkload(nn.Linear(2, 2), data=DigitsMLP())
    tied = deepspeed_pipe.TiedLayerSpec("emb", nn.Linear, 4, 4)
    with pytest.raises(ConfigurationError, match="TiedLayerSpec"):
        DeepSpeedWorkload([tied], data=DigitsMLP())
    with pytest.raises(ConfigurationError, match="cannot be split"):
        deepspeed_bounds(digits_specs()[:3], 4)
    with pytest.raises(ConfigurationError, match="contiguous"):
        PipelineJob(num_stages=2, bounds=[[0, 4], [5, 9]]).validate()
