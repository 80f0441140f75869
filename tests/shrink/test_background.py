"""Background saves (``ChainWriter(background=True)``, ``ShrinkCheckpoint(background=True)``):
real forked children write the chain while the caller goes on; failures and SIGKILLed children
are reported at the next call, and the chain goes on from the last file written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from stalwart import BackgroundSaveError, shrink
from stalwart.shrink.chain import ChainWriter, ShrinkRequest
from stalwart.shrink.partition import QuantConfig

CONFIG = QuantConfig(bins=16, prune=0.1)


def _weights(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    start = {
        "a": torch.randn(300, 40, generator=generator),
        "b": torch.randn(5000, generator=generator),
    }
    moved = torch.Generator().manual_seed(step)
    return {k: v + 0.01 * step * torch.randn(v.shape, generator=moved) for k, v in start.items()}


def test_a_background_chain_writes_the_same_files_as_one_written_in_the_foreground(tmp_path):
    foreground = ChainWriter(config=CONFIG, keyframe_every=3, compress_optimizer="lossless")
    background = ChainWriter(
        config=CONFIG, keyframe_every=3, compress_optimizer="lossless", background=True
    )
    for step in range(5):
        weights, extra = _weights(step), {"epoch": step}
        kept = foreground.save(weights, extra, tmp_path / "fg" / f"{step}.shrunk")
        assert background.save(weights, extra, tmp_path / "bg" / f"{step}.shrunk") is None
        for name in weights:  # the caller goes on, and changes its tensors, while the child writes
            weights[name].add_(1.0)
        report = background.wait()
        assert (report.kind, report.chain_position) == (kept.kind, kept.chain_position)
        assert (tmp_path / "bg" / f"{step}.shrunk").read_bytes() == (
            tmp_path / "fg" / f"{step}.shrunk"
        ).read_bytes().replace(b"/fg/", b"/bg/")
    assert [r.kind for r in background.reports] == [
        "keyframe",
        "delta",
        "delta",
        "keyframe",
        "delta",
    ]
    assert background.chain.path == tmp_path / "bg" / "4.shrunk"
    restored, extra = shrink.load_with_extra(tmp_path / "bg" / "4.shrunk")[:2]
    assert extra == {"epoch": 4}
    assert all(
        torch.equal(restored[k], shrink.load(tmp_path / "fg" / "4.shrunk")[k]) for k in restored
    )


def _failing(weights):
    raise ZeroDivisionError("the scorer broke")


def test_a_failed_background_save_is_raised_at_the_next_call_and_the_chain_keeps_its_last_file(
    tmp_path,
):
    writer = ChainWriter(tau=0.05, compress_optimizer="lossless", background=True)
    writer.save(_weights(0), None, tmp_path / "0.shrunk", ShrinkRequest(evaluate=lambda w: 1.0))
    writer.save(_weights(1), None, tmp_path / "1.shrunk", ShrinkRequest(evaluate=_failing))
    with pytest.raises(
        BackgroundSaveError, match=r"1\.shrunk failed: ZeroDivisionError: the scorer broke\n"
    ):
        writer.wait()
    assert not (tmp_path / "1.shrunk").exists()
    assert writer.chain.path == tmp_path / "0.shrunk" and len(writer.reports) == 1
    writer.save(_weights(2), None, tmp_path / "2.shrunk", ShrinkRequest(evaluate=lambda w: 1.0))
    assert writer.wait().base == str(tmp_path / "0.shrunk")  # a delta on the last file written


def _slow(weights):
    time.sleep(60)
    return 1.0


@pytest.mark.timeout(60)
def test_a_background_save_killed_by_sigkill_is_reported_and_leaves_no_file(tmp_path):
    writer = ChainWriter(tau=0.05, compress_optimizer="lossless", background=True)
    writer.save(_weights(0), None, tmp_path / "0.shrunk", ShrinkRequest(evaluate=lambda w: 1.0))
    writer.save(_weights(1), None, tmp_path / "1.shrunk", ShrinkRequest(evaluate=_slow))
    assert writer.busy()
    os.kill(writer._pending[0].pid, signal.SIGKILL)
    with pytest.raises(BackgroundSaveError, match=r"exited with -9 and left no result"):
        writer.save(_weights(2), None, tmp_path / "2.shrunk")  # the next call reports it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.shrunk"]
    assert writer.chain.path == tmp_path / "0.shrunk"


_SAVE_AND_EXIT = """
import sys, time
import torch
from stalwart.shrink.chain import ChainWriter, ShrinkRequest

def slow_once(weights, slept=[]):
    if not slept:  # the child's first scoring takes a while; the parent exits meanwhile
        slept.append(time.sleep(float(sys.argv[2])))
    return 1.0

writer = ChainWriter(tau=0.05, compress_optimizer="lossless", background=True)
weights = {"w": torch.randn(200, 30, generator=torch.Generator().manual_seed(0))}
writer.save(weights, {"epoch": 3}, sys.argv[1], ShrinkRequest(evaluate=slow_once))
saved_at = time.monotonic()
import os
helper = os.fork()  # e.g. a helper process the script starts: its exit must not wait or reap
if helper == 0:
    sys.exit(0)  # a normal exit: atexit handlers run in it
os.waitpid(helper, 0)
print("parent done; saved at", saved_at, flush=True)
"""


@pytest.mark.timeout(60)
def test_a_process_that_exits_with_a_save_in_flight_waits_for_its_file(tmp_path):
    # A save made by hand with nothing after it (no next save, no fit teardown to collect it):
    # when the process is gone, its file must be there, whole. A process forked from it meanwhile
    # exits without waiting for (or reaping) a child that is not its own.
    path = tmp_path / "last.shrunk"
    script = tmp_path / "save_and_exit.py"
    script.write_text(_SAVE_AND_EXIT)
    output = tmp_path / "output.txt"
    with output.open("w") as sink:  # not a pipe: the child would hold it open, and run() wait
        done = subprocess.run(
            [sys.executable, str(script), str(path), "1.5"], stdout=sink, stderr=subprocess.STDOUT
        )
    assert done.returncode == 0, output.read_text()
    text = output.read_text()
    assert "No child processes" not in text and "ERROR" not in text.upper(), text
    saved_at = float(text.split("saved at")[1].split()[0])
    assert time.monotonic() - saved_at >= 1.5  # its exit waited for the child's slow scoring
    weights, extra = shrink.load_with_extra(path)[:2]
    assert extra == {"epoch": 3} and weights["w"].shape == (200, 30)
    assert not list(tmp_path.glob("*.tmp*"))
