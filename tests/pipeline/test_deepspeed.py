"""DeepSpeed users: a real deepspeed.pipe.PipelineModule (or a LayerSpec list) is accepted as the
model description, partitioned by DeepSpeed's own code, and trains through a SIGKILL exactly like
the native model."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from stalwart.errors import ConfigurationError
from stalwart.pipeline.faults import Fault
from stalwart.pipeline.job import PipelineJob
from stalwart.pipeline.launch import launch
from stalwart.pipeline.workloads import IN_MEMORY, DigitsMLP

deepspeed_pipe = pytest.importorskip("deepspeed.pipe")
from stalwart.pipeline.deepspeed_model import (  # noqa: E402
    DeepSpeedWorkload,
    deepspeed_bounds,
    single_process_deepspeed,
)


def digits_specs():
    """The layers of the native DigitsMLP (4 hidden Linear+Tanh blocks), as LayerSpecs."""
    LayerSpec = deepspeed_pipe.LayerSpec
    specs = []
    for _ in range(4):
        specs += [LayerSpec(nn.Linear, 64, 64), LayerSpec(nn.Tanh)]
    return [*specs, LayerSpec(nn.Linear, 64, 10)]


@pytest.fixture(scope="module")
def pipeline_module(tmp_path_factory):
    # A real PipelineModule, built the way a DeepSpeed script builds one, in this process; no
    # DeepSpeed op may be compiled on the way (an empty extensions dir stays empty).
    extensions = tmp_path_factory.mktemp("torch_extensions")
    saved = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions)
    try:
        with single_process_deepspeed():
            assert torch.distributed.get_world_size() == 1
            module = deepspeed_pipe.PipelineModule(
                layers=digits_specs(), num_stages=1, loss_fn=nn.CrossEntropyLoss(),
                partition_method="type:Linear",
            )  # fmt: skip
    finally:
        if saved is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR")
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = saved
    assert not any(extensions.iterdir())
    assert not torch.distributed.is_initialized()  # forked workers start without a group
    return module


# Hang guards, not measurements: on a loaded CI machine a step of the polling ranks can take
# seconds. The kill is detected by the agent's dead/<rank> report, never by failure_timeout, which
# only bounds how long a *live* rank may take to reach the commit or the rendezvous (at the
# default 10 s a slow one could be left out of the recovery). Unloaded runs are no slower.
FAILURE_TIMEOUT = 60.0
LAUNCH_TIMEOUT = 240
TEST_TIMEOUT = 2 * LAUNCH_TIMEOUT + 60  # the module's native run and the test's own launch


@pytest.fixture(scope="module")
def native():
    job = PipelineJob(num_stages=4, steps=4, failure_timeout=FAILURE_TIMEOUT)
    return launch(job, timeout=LAUNCH_TIMEOUT)


def _run_killed(workload: DeepSpeedWorkload, bounds: list[list[int]]):
    IN_MEMORY["in-memory:ds"] = workload
    try:
        job = PipelineJob(num_stages=4, steps=4, workload="in-memory:ds", bounds=bounds,
                          failure_timeout=FAILURE_TIMEOUT)  # fmt: skip
        faults = [Fault(rank=2, step=2, phase="backward")]
        return launch(job, faults=faults, timeout=LAUNCH_TIMEOUT)
    finally:
        IN_MEMORY.pop("in-memory:ds")


@pytest.mark.timeout(TEST_TIMEOUT)  # includes the module fixtures
def test_pipeline_module_trains_through_a_kill_like_the_native_model(pipeline_module, native):
    assert [int(p) for p in pipeline_module.parts] == [0, 9]  # built for one stage here ...
    assert deepspeed_bounds(pipeline_module, 1) == [[0, 9]]  # ... and its own parts are kept
    # For 4 stages DeepSpeed's 'type:Linear' method balances the 5 Linear layers (2+1+1+1).
    bounds = deepspeed_bounds(pipeline_module, 4, partition_method="type:Linear")
    assert bounds == [[0, 4], [4, 6], [6, 8], [8, 9]]
    workload = DeepSpeedWorkload(pipeline_module, data=DigitsMLP())
    assert isinstance(workload.loss_fn, nn.CrossEntropyLoss)  # the module's loss_fn
    killed = _run_killed(workload, bounds)
    # Same layers built in the same order under the same seed: the same training, and the
    # SIGKILLed stage's shadow took over without a restart.
    assert len(killed.losses) == len(native.losses) == 4
    assert max(abs(a - b) for a, b in zip(killed.losses, native.losses, strict=True)) <= 1e-6
    assert [e["kind"] for e in killed.events] == ["failover"]


@pytest.mark.timeout(TEST_TIMEOUT)  # includes the module fixtures
def test_layerspec_list_trains_through_a_kill_like_the_native_model(native):
    specs = digits_specs()
    bounds = deepspeed_bounds(specs, 4)  # DeepSpeed's default method: parameter counts
    assert bounds == [[0, 2], [2, 4], [4, 6], [6, 9]]
    assert deepspeed_bounds(specs, 3, partition_method="uniform") == [[0, 3], [3, 6], [6, 9]]
    killed = _run_killed(DeepSpeedWorkload(specs, data=DigitsMLP()), bounds)
    assert max(abs(a - b) for a, b in zip(killed.losses, native.losses, strict=True)) <= 1e-6
    assert [e["kind"] for e in killed.events] == ["failover"]


def test_counting_parameters_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    deepspeed_bounds(digits_specs(), 4)
    assert torch.equal(torch.rand(3), expected)


def test_bad_deepspeed_descriptions():
    with pytest.raises(ConfigurationError, match="not a DeepSpeed pipeline description"):
        DeepSpeedWorkload(nn.Linear(2, 2), data=DigitsMLP())
    tied = deepspeed_pipe.TiedLayerSpec("emb", nn.Linear, 4, 4)
    with pytest.raises(ConfigurationError, match="TiedLayerSpec"):
        DeepSpeedWorkload([tied], data=DigitsMLP())
    with pytest.raises(ConfigurationError, match="cannot be split"):
        deepspeed_bounds(digits_specs()[:3], 4)
    with pytest.raises(ConfigurationError, match="'parameters', 'uniform' or 'type:"):
        deepspeed_bounds(digits_specs(), 4, partition_method="profile")
    with pytest.raises(ConfigurationError, match="found no valid layers"):
        deepspeed_bounds(digits_specs(), 4, partition_method="type:Conv2d")
    with pytest.raises(ConfigurationError, match="contiguous"):
        PipelineJob(num_stages=2, bounds=[[0, 4], [5, 9]]).validate()
