"""Inputs that used to pass unnoticed: non-finite numbers, repeated kill targets, experiment
options that mislabel or collide, Trainer-style arguments, hooks and dtypes the PS run does not
honour, and delays computed from runs that never reached the target. No process starts here."""

from __future__ import annotations

import math
import re

import lightning as L
import pytest
import torch

from stalwart import ParameterServerTrainer
from stalwart.cli import main
from stalwart.errors import ConfigurationError
from stalwart.loops.parameter_server import prepare_module
from stalwart.ps import experiment
from stalwart.ps.config import KillEvent, PSConfig
from stalwart.ps.experiment import format_ratios, time_to_target_ratios
from stalwart.ps.result import PSRunResult


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lr": math.nan}, "lr=nan: must be a finite number"),
        ({"lr": math.inf}, "lr=inf: must be a finite number"),
        ({"duration": math.nan}, "duration=nan"),
        ({"duration": math.inf}, "duration=inf"),
        ({"store_patience": math.nan}, "store_patience=nan"),
        ({"kills": [KillEvent(5, downtime=math.inf)]}, "downtime=inf must be a finite"),
        ({"kills": [KillEvent(5, downtime=math.nan)]}, "downtime=nan must be a finite"),
        ({"kills": [KillEvent(at_seconds=math.nan)]}, "at_seconds=nan must be a finite"),
        ({"kills": [KillEvent(at_seconds=math.inf)]}, "at_seconds=inf must be a finite"),
        ({"kills": [KillEvent(5, targets=("ps", "ps"))]}, "each at most once"),
        (
            {"mode": "chain-sync", "kills": [KillEvent(5, targets=("head", "head"))]},
            "each at most once",
        ),
    ],
)
def test_non_finite_numbers_and_repeated_targets_are_refused(changes, message):
    with pytest.raises(ConfigurationError, match=message):
        PSConfig(steps=10, **changes).validate()


def _no_run(config, **kwargs):
    raise AssertionError(f"the experiment started a run ({config.run_dir}) it should refuse")


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--kills=-1"], "kill counts are 0 or more"),
        (["--kills", "1,1"], "list each value once"),
        (["--modes", "stateless,stateless"], "list each value once"),
        (["--seconds", "nan"], "--seconds nan: must be a finite number"),
        (["--downtime", "inf"], "--downtime inf: must be a finite number"),
        (["--lr", "nan"], "--lr nan: must be a finite number"),
    ],
)
def test_experiment_options_that_would_mislabel_or_collide_are_refused(
    tmp_path, capsys, monkeypatch, options, said
):
    monkeypatch.setattr(experiment, "run_training", _no_run)
    out = tmp_path / "exp"
    assert main(["ps-experiment", "--quick", "--out", str(out), *options]) == 2
    assert said in capsys.readouterr().err
    assert not out.exists()  # refused before the first run


def test_experiment_out_that_is_a_file_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(experiment, "run_training", _no_run)
    out = tmp_path / "afile"
    out.write_text("mine")
    assert main(["ps-experiment", "--quick", "--out", str(out), "--modes", "stateless"]) == 2
    assert "is a file; choose a new directory" in capsys.readouterr().err
    assert out.read_text() == "mine"


def _result(mode: str, kills: int, crossing: float | None, seed: int = 0) -> PSRunResult:
    # Accuracy 0.5, then 0.95 from ``crossing`` on (three samples: the moving mean gets there).
    timeline = [{"t": t, "accuracy": 0.5} for t in (1.0, 2.0, 3.0)]
    if crossing is not None:
        timeline += [{"t": crossing + d, "accuracy": 0.95} for d in (-0.2, -0.1, 0.0)]
    wall = 20.0 + 0.01 * kills  # a run with kills lasts a little longer
    result = PSRunResult(PSConfig(mode=mode, seed=seed), wall, timeline=timeline)
    result.kills = [{"killed": 4.0 + 2 * k} for k in range(kills)]
    return result


def test_a_delay_from_runs_that_missed_the_target_is_a_bound_or_left_out():
    ratios = time_to_target_ratios(
        [
            _result("stateless", 0, None), _result("stateless", 2, None),  # both missed
            _result("checkpoint-async", 0, 6.0), _result("checkpoint-async", 2, None),
            _result("chain-async", 0, 5.0), _result("chain-async", 2, 7.0),
        ],
        0.9,
    )  # fmt: skip
    # Two durations subtracted say nothing about the kills (it read "-0.0" before).
    assert "stateless 2" not in ratios["delay_s"]
    # The killed run's whole duration counts: at least 14 s later.
    assert ratios["delay_s"]["checkpoint-async 2"] == 14.02
    assert ratios["delay_bounds"] == {"checkpoint-async 2": ">="}
    assert ratios["delay_s"]["chain-async 2"] == 2.0
    text = format_ratios(ratios, 0.9)
    assert ">= +14.0" in text and "-0.0" not in text
    # No number for it, but a word on why it is left out.
    assert "delay of stateless 2 kill(s)                  neither run reached the target" in text


class Fitted(L.LightningModule):
    """Hooks Lightning's fit calls and the PS run does not."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def validation_step(self, batch, batch_idx):
        return None

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, algorithm=None):
        pass

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_hooks_the_ps_does_not_call_and_float64_are_warned_about():
    with pytest.warns(UserWarning) as caught:
        prepare_module(Fitted().double(), lr=0.05)
    messages = [str(w.message) for w in caught]
    hooks = next(m for m in messages if "does not call these hooks" in m)
    assert "configure_optimizers (the parameter server applies plain SGD" in hooks
    assert "plain SGD at lr=0.05" in hooks
    assert "validation_step" in hooks and "configure_gradient_clipping" in hooks
    assert "training_step" not in hooks.split(":")[1].split(".")[0]  # it is called
    assert any("float64 parameters" in m and "float32" in m for m in messages)


def test_configure_optimizers_is_named_but_never_run():
    """A fine-tuning hook that freezes a layer must not run: the PS trains every parameter,
    and the warning says the hook is not called."""

    class Freezing(Fitted):
        ran = False

        def configure_optimizers(self):
            type(self).ran = True
            self.layer.requires_grad_(False)
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Freezing()
    with pytest.warns(UserWarning, match=r"does not call these hooks.*configure_optimizers"):
        prepare_module(module, lr=0.05)
    assert not Freezing.ran
    assert module.layer.weight.requires_grad


def test_a_plain_float32_module_gets_no_warning(recwarn):
    class Plain(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

    prepare_module(Plain())
    assert not [w for w in recwarn if "ParameterServerTrainer" in str(w.message)]


def test_trainer_style_arguments_are_a_clear_error():
    with pytest.raises(ConfigurationError, match=r"gradient_clip_val.*takes config=, metric=.*lr"):
        ParameterServerTrainer(gradient_clip_val=1.0)


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"workers": 1.5}, "workers=1.5: must be a finite whole number"),
        ({"steps": 2.5}, "steps=2.5: must be a finite whole number"),
        ({"lr": True}, "lr=True: must be a number"),
        ({"lr": "0.1"}, "lr='0.1': must be a number"),  # a TypeError before
        ({"backlog_threshold": -1}, "backlog_threshold=-1: must be >= 0"),
        ({"kills": [KillEvent(at_gradient=10.5)]}, "at_gradient=10.5: must be a finite whole"),
        ({"kills": [KillEvent(at_gradient=math.nan)]}, "at_gradient=nan: must be a finite whole"),
    ],
)
def test_counts_must_be_ints_and_rates_real_numbers(fields, said):
    with pytest.raises(ConfigurationError, match=re.escape(said)):
        PSConfig(**fields).validate()
