"""The worker and node entry points start as plain ``python -m`` modules, without Lightning."""

from __future__ import annotations

import pytest

from stalwart.pipeline.job import PipelineJob
from stalwart.pipeline.launch import launch


@pytest.mark.timeout(180)
def test_spawned_workers_run_python_m_runtime_and_train_like_forked_ones():
    job = PipelineJob(num_stages=2, num_microbatches=2, steps=2, batch_size=8)
    spawned = launch(job, timeout=150, start_method="spawn")
    forked = launch(job, timeout=60)
    assert spawned.exit_codes == {0: 0, 1: 0}
    assert spawned.losses == forked.losses
