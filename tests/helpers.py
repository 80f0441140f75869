"""Small helpers shared by the tests."""

from __future__ import annotations

import ctypes
import mmap
import os

import lightning as L
import pytest
from digits import DigitsClassifier, DigitsDataModule
from lightning.pytorch.profilers import PassThroughProfiler

from stalwart import HindsightCallback, durable

#: Trainer arguments that keep a test's fit from writing logs, checkpoints or progress output.
QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def fit_digits(callbacks: list, *, epochs: int, width: int = 8, batch_size: int = 500) -> L.Trainer:
    """Fit a small digits MLP quietly with ``callbacks``."""
    trainer = L.Trainer(max_epochs=epochs, callbacks=callbacks, **QUIET)
    trainer.fit(DigitsClassifier(width=width), DigitsDataModule(batch_size=batch_size))
    return trainer


class SectionNames(PassThroughProfiler):
    """A profiler that keeps the name of every section Lightning opens."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: list[str] = []

    def start(self, action_name: str) -> None:
        self.sections.append(action_name)


def callback_hooks_called(profiler: SectionNames, callback) -> list[str]:
    """The hooks Lightning handed ``callback``, in order, as its profiler sections name them."""
    prefix = f"[Callback]{callback.state_key}."
    return [name[len(prefix) :] for name in profiler.sections if name.startswith(prefix)]


class EveryEpoch(HindsightCallback):
    """A record that checkpoints every epoch, whatever the policy says: a fixed replay plan."""

    def should_checkpoint(self, trainer, policy_says: bool) -> bool:
        return True


class GradProbe(L.Callback):
    """Inner-loop: the first layer's gradient norm before every optimizer step (digits MLP)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        pl_module.log("grad_norm", pl_module.net[0].weight.grad.norm())


class EpochProbe(L.Callback):
    """Outer-loop: the first layer's weight norm at each epoch's end (digits MLP)."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pl_module.log("w_norm", pl_module.net[0].weight.norm())


def pages_in_page_cache(path) -> tuple[int, int]:
    """(pages of ``path`` the page cache holds, pages in all), by mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    resident = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)
    anchor = ctypes.c_char.from_buffer(mapped)
    try:
        if libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), resident):
            pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
    finally:
        del anchor
        mapped.close()
    return sum(flag & 1 for flag in resident), pages


def require_direct_io(directory) -> None:
    """Skip the test where ``directory``'s file system (or the platform) refuses O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    with durable.DirectFile(directory / ".direct-probe") as handle:
        direct = handle.direct
    (directory / ".direct-probe").unlink()
    if not direct:
        pytest.skip(f"{directory} refuses O_DIRECT")
