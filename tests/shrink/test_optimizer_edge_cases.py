"""Optimizer states with nothing to compress: scalar and empty parameters, optimizers without
known moments (Adagrad)."""

import argparse
import warnings

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule
from torch import nn

import stalwart.shrink as shrink
from stalwart import ShrinkCheckpoint
from stalwart.plugins import ShrinkCheckpointIO
from stalwart.shrink.inspect import inspect
from stalwart.shrink.moments import LOSSLESS, moments_of
from tests.helpers import QUIET

WITH_CHECKPOINTS = {**QUIET, "enable_checkpointing": True}


class _WithOddParameters(DigitsClassifier):
    """The digits MLP with a scalar parameter (a learnable temperature) and an empty one (a
    zero-width slot), trained with Adam."""

    def __init__(self) -> None:
        super().__init__(width=8)
        self.temperature = nn.Parameter(torch.tensor(1.0))
        self.empty = nn.Parameter(torch.zeros(8, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) / self.temperature + self.empty.sum()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class _WithAdagrad(DigitsClassifier):
    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.05)  # state: "sum", "step"


def _fit(module, callback, epochs, ckpt_path=None):
    trainer = L.Trainer(max_epochs=epochs, callbacks=[callback], **WITH_CHECKPOINTS)
    trainer.fit(module, DigitsDataModule(batch_size=500), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("compress_optimizer", ["auto", "lossy"])
def test_scalar_and_empty_parameters_are_saved_with_their_moments_exact(
    tmp_path, compress_optimizer
):
    callback = ShrinkCheckpoint(dirpath=tmp_path, compress_optimizer=compress_optimizer)
    module = _WithOddParameters()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(module, callback, epochs=2)
    notes = [str(w.message) for w in caught if "optimizer" in str(w.message)]
    if compress_optimizer == "auto":
        assert callback.reports[-1].optimizer.setting != LOSSLESS  # the others' are compressed
        assert any("of scalar (0-dim) or empty parameters" in note for note in notes), notes
        assert not any("exp_avg" in note and "not a known moment" in note for note in notes)
    # The last save came after the last step: the live state is what was saved.
    live = trainer.optimizers[0].state_dict()["state"]
    path = callback.reports[-1].path
    saved = ShrinkCheckpointIO().load_checkpoint(path)["optimizer_states"][0]["state"]
    order = [name for name, _ in module.named_parameters()]
    for name in ("temperature", "empty"):
        index = order.index(name)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(saved[index][key], live[index][key]), (name, key)
    assert saved[order.index("empty")]["exp_avg"].shape == (8, 0)
    # A fresh run resumes from it.
    resumed = ShrinkCheckpoint(dirpath=tmp_path, compress_optimizer=compress_optimizer)
    _fit(_WithOddParameters(), resumed, epochs=3, ckpt_path=path)
    assert len(resumed.reports) == 1


def test_an_optimizer_without_known_moments_is_reported_as_stored_losslessly(tmp_path, capsys):
    # Adagrad keeps "sum": nothing the ladder compresses. Checking its settings anyway compared
    # the exact state with itself and reported "first sparse, second factored (+0.0000)".
    callback = ShrinkCheckpoint(dirpath=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "['sum'] is not a known moment: stored losslessly"
        _fit(_WithAdagrad(width=8), callback, epochs=2)
    for report in callback.reports:
        choice = report.optimizer
        assert choice.setting == LOSSLESS and choice.degradation is None and choice.tried == []
        assert "nothing to compress" in choice.describe()
    inspect(argparse.Namespace(path=str(tmp_path)))
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch=")]
    assert len(rows) == 2 and all(row.endswith("| lossless") for row in rows), rows


def test_the_note_on_a_scalar_parameters_moments_says_why_they_are_kept_exact():
    scalar = nn.Parameter(torch.tensor(2.0))
    matrix = nn.Parameter(torch.randn(4, 4))
    optimizer = torch.optim.Adam([scalar, matrix])
    (scalar * matrix).sum().backward()
    optimizer.step()
    moments, notes = moments_of(optimizer.state_dict(), None)
    assert [m.parameter for m in moments] == [1, 1]  # the matrix's two moments
    assert notes == [
        "optimizer moments ['exp_avg', 'exp_avg_sq'] of scalar (0-dim) or empty parameters: "
        "stored losslessly (nothing to compress)"
    ]


def _optimizer_after_steps(steps: int = 3) -> dict:
    layer = nn.Linear(64, 64)
    optimizer = torch.optim.RMSprop(layer.parameters(), lr=1e-3, momentum=0.9)
    for _ in range(steps):
        optimizer.zero_grad()
        layer(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
    return {"weights": layer.state_dict(), "optimizer": optimizer.state_dict()}


@pytest.mark.parametrize("mode", ["lossless", "lossy"])
def test_the_listing_names_the_optimizer_states_form_in_every_mode(tmp_path, capsys, mode):
    # compress_optimizer="lossy" quantizes the moments, unchecked; the listing said "lossless".
    trained = _optimizer_after_steps()
    path = tmp_path / "epoch=0.ckpt"
    shrink.save(trained["weights"], path, extra=trained, compress_optimizer=mode)
    inspect(argparse.Namespace(path=str(tmp_path)))
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch=")]
    restored = shrink.load_with_extra(path)[1]["optimizer"]["state"][0]["square_avg"]
    exact = torch.equal(restored, trained["optimizer"]["state"][0]["square_avg"])
    assert exact == (mode == "lossless")
    assert row.endswith("| lossless" if mode == "lossless" else "| lossy (32 levels, unchecked)")


def test_lossy_with_no_optimizer_tensors_to_quantize_is_listed_lossless(tmp_path, capsys):
    # SGD without momentum keeps no state tensors: "lossy" quantized nothing, yet the listing
    # said "lossy (32 levels, unchecked)".
    layer = nn.Linear(64, 64)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer(torch.randn(8, 64)).square().mean().backward()
    optimizer.step()
    extra = {"optimizer": optimizer.state_dict()}
    shrink.save(
        layer.state_dict(), tmp_path / "epoch=0.ckpt", extra=extra, compress_optimizer="lossy"
    )
    inspect(argparse.Namespace(path=str(tmp_path)))
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch=")]
    assert row.endswith("| lossless")
