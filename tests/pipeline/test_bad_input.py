"""Bad input fails with a clear error before any worker process starts."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from torch import nn

from stalwart.errors import ConfigurationError
from stalwart.pipeline.faults import Fault
from stalwart.pipeline.job import PipelineJob
from stalwart.pipeline.launch import launch
from stalwart.pipeline.partition import partition


def launch_fails(match, faults=(), **job):
    before = len(multiprocessing.active_children())
    with pytest.raises(ConfigurationError, match=match):
        launch(PipelineJob(**job), faults=faults, timeout=5)
    assert len(multiprocessing.active_children()) == before  # nothing was started


def test_model_that_cannot_be_split():
    # DigitsMLP(depth=1) has 3 layers: Linear, Tanh, Linear.
    launch_fails("3 layers and cannot be split into 4", workload_kwargs={"depth": 1})
    with pytest.raises(ConfigurationError, match="nn.Sequential"):
        partition(nn.Linear(3, 3), 2)


def test_more_stages_than_world_size():
    launch_fails("larger than the world size 2", num_stages=4, num_nodes=2)


def test_zero_timeout():
    launch_fails("failure_timeout=0", failure_timeout=0)
    launch_fails("failure_timeout=-1", failure_timeout=-1)


def test_other_bad_fields():
    launch_fails("redundancy", redundancy="sometimes")
    launch_fails("frc_executor='gpu_idle'", frc_executor="gpu_idle")
    launch_fails("multiple of", batch_size=30)
    launch_fails("P x D", num_nodes=5)
    launch_fails("only 4 ranks", faults=[Fault(rank=7, step=0)])
    if not torch.cuda.is_available():
        launch_fails("no CUDA device", device="cuda")
    launch_fails("num_pipelines", num_pipelines=0)
    launch_fails("multiple of num_microbatches x num_pipelines", num_pipelines=3)
    with pytest.raises(ConfigurationError, match="phase"):
        Fault(rank=0, step=0, phase="sideways")
    with pytest.raises(ConfigurationError, match="rank:step"):
        Fault.parse("3")


def test_forked_workers_are_refused_while_this_process_holds_a_cuda_context(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    launch_fails("start_method='spawn'", device="cuda")


def test_partition_balances_parameters():
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 1000), nn.ReLU())
    assert partition(model, 2) == [(0, 2), (2, 4)]
    bounds = partition(nn.Sequential(*[nn.Linear(4, 4) for _ in range(7)]), 3)
    sizes = [end - start for start, end in bounds]
    assert sum(sizes) == 7 and max(sizes) == 3
