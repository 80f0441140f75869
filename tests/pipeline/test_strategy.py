"""The Lightning adapter: Trainer(strategy=RedundantPipelineStrategy(...)).fit survives a kill."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from stalwart.errors import ConfigurationError
from stalwart.pipeline.faults import Fault
from stalwart.pipeline.workloads import DigitsMLP
from stalwart.strategies import RedundantPipelineStrategy


class DigitsModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(
            nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 10)
        )


def loader() -> DataLoader:
    digits = DigitsMLP()
    return DataLoader(TensorDataset(digits.x[:256], digits.y[:256]), batch_size=32)


def fit(faults=()):
    module = DigitsModule()
    strategy = RedundantPipelineStrategy(num_stages=4, num_microbatches=4, lr=1e-2, faults=faults)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=6, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader())
    return module, strategy, trainer


@pytest.mark.timeout(120)
def test_lightning_fit_survives_a_killed_stage():
    clean_module, clean, trainer = fit()
    assert trainer.state.finished
    faulty_module, faulty, _ = fit([Fault(rank=1, step=3, phase="backward")])
    assert faulty.result.exit_codes[1] == -9
    assert [e["kind"] for e in faulty.result.events] == ["failover"]
    assert len(faulty.result.losses) == 6
    diffs = [abs(a - b) for a, b in zip(clean.result.losses, faulty.result.losses, strict=True)]
    assert max(diffs) <= 1e-5
    # The trained weights came back into the LightningModule, and both runs agree.
    start = DigitsModule().model[0].weight
    assert not torch.equal(clean_module.model[0].weight, start)
    for a, b in zip(clean_module.parameters(), faulty_module.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(clean.result.losses[-1])


def test_bad_strategy_arguments_fail_before_any_process():
    with pytest.raises(ConfigurationError, match="failure_timeout"):
        RedundantPipelineStrategy(failure_timeout=0)
    with pytest.raises(ConfigurationError, match="redundancy"):
        RedundantPipelineStrategy(redundancy="maybe")
    with pytest.raises(ConfigurationError, match="D=1"):
        RedundantPipelineStrategy(num_pipelines=2)
