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


class _Marks:
    """Writes a file when destroyed: shows whether a destructor ran at the process's end."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __del__(self) -> None:
        with open(self.path, "w") as handle:
            handle.write("destroyed")


def _finish_worker(path: str, code: int) -> None:
    from stalwart.pipeline.runtime import end_process

    held = _Marks(path)  # stands for the worker and its gloo groups
    print("trained", flush=False)
    end_process(code)
    del held  # not reached


def test_a_finished_worker_exits_with_its_code_and_runs_no_destructor(tmp_path, capfd):
    # Destroying the last generation's gloo groups while the peers exit aborted a surviving
    # rank once (free(): invalid pointer); a finished worker leaves them to the kernel.
    import multiprocessing

    marker = tmp_path / "destroyed"
    process = multiprocessing.get_context("fork").Process(
        target=_finish_worker, args=(str(marker), 7)
    )
    process.start()
    process.join(30)
    assert process.exitcode == 7
    assert not marker.exists()
    assert "trained" in capfd.readouterr().out  # flushed before leaving
