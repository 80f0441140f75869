"""Whole checkpoints: the optimizer state compressed under the continuation check, training
through restores from those files, and the byte-plane lossless floor."""

from __future__ import annotations

import io
import logging
import math
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from digits_cnn import DigitsCNN, DigitsCNNDataModule
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart import shrink
from stalwart.callbacks.shrink import ShrinkCheckpoint
from stalwart.errors import ConfigurationError, UnsafeCheckpointError
from stalwart.plugins.shrink_io import ShrinkCheckpointIO
from stalwart.shrink.chain import ChainWriter, ShrinkRequest
from stalwart.shrink.codec import encode_lossless
from stalwart.shrink.container import read_container
from stalwart.shrink.lossless import decode_grouped, encode_grouped
from stalwart.shrink.moments import (
    FIRST_MOMENT_CONFIGS,
    LADDER,
    Moment,
    MomentSetting,
    choose_setting,
    reconstruct,
)

EPOCHS = 6
FORMAT_4_FILE = Path(__file__).parent / "data" / "format4" / "adam.shrunk"


def _trainer(epochs: int, callbacks: list) -> L.Trainer:
    return L.Trainer(
        max_epochs=epochs, callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1,
        enable_checkpointing=bool(callbacks),
    )  # fmt: skip


@torch.no_grad()
def _test_accuracy(model: L.LightningModule, datamodule: DigitsCNNDataModule) -> float:
    # The workload's held-out metric (as in benchmarks/shrink_vs_baselines.py).
    model.eval()
    x, y = datamodule.test.tensors
    return float((model(x).argmax(-1) == y).float().mean())


@pytest.fixture(scope="module")
def restored_run(tmp_path_factory):
    """The digits CNN (AdamW) trained for EPOCHS epochs twice: uninterrupted, and through a
    restore from its latest shrunken file after every epoch (new Trainer, model and callback)."""
    datamodule = DigitsCNNDataModule(seed=0)
    datamodule.setup()
    L.seed_everything(0, verbose=False)
    reference = DigitsCNN(max_epochs=EPOCHS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(EPOCHS, []).fit(reference, datamodule)
    directory = tmp_path_factory.mktemp("shrunk")
    latest, reports, references = None, [], []
    for epoch in range(EPOCHS):
        L.seed_everything(0, verbose=False)
        model = DigitsCNN(max_epochs=EPOCHS)
        callback = ShrinkCheckpoint(dirpath=directory, filename="{epoch:02d}")
        save = callback.io.save_checkpoint

        def measured(checkpoint, path, storage_options=None, save=save):
            save(checkpoint, path, storage_options)
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            references.append(buffer.getbuffer().nbytes)

        callback.io.save_checkpoint = measured
        L.seed_everything(epoch + 1, verbose=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _trainer(epoch + 1, [callback]).fit(model, datamodule, ckpt_path=latest)
        reports += callback.reports
        latest = directory / f"epoch={epoch:02d}.ckpt"
    return datamodule, reference, model, directory, reports, references


def test_training_through_five_restores_from_auto_files_ends_where_uninterrupted_training_does(
    restored_run,
):
    datamodule, reference, restored, directory, reports, references = restored_run
    assert len(reports) == EPOCHS  # EPOCHS - 1 restores, each from the latest shrunken file
    # The default is the checked setting, and it was checked: not lossless everywhere.
    settings_used = [report.optimizer.setting for report in reports]
    assert all(report.optimizer.degradation is not None for report in reports)
    assert any(not setting.lossless for setting in settings_used)
    for report in reports:
        assert report.optimizer.degradation <= 0.05 or report.optimizer.setting.lossless
    expected, got = _test_accuracy(reference, datamodule), _test_accuracy(restored, datamodule)
    assert got >= expected * 0.99, (got, expected)
    # The whole folder on disk against torch.save of the same checkpoints.
    on_disk = sum(path.stat().st_size for path in Path(directory).iterdir() if path.is_file())
    assert sum(references) / on_disk >= 20, (sum(references), on_disk)


def test_the_report_separates_weights_optimizer_and_whole_file(restored_run):
    *_, directory, reports, _ = restored_run
    for report in reports:
        assert report.total_stored == Path(report.path).stat().st_size
        assert report.optimizer_bytes > 0 and report.optimizer_stored > 0
        assert report.optimizer_stored < report.total_stored - report.weight_stored + 1


def test_optimizer_state_restores_to_what_the_setting_reconstructs(restored_run):
    *_, directory, reports, _ = restored_run
    report = reports[-1]
    _, extra, _ = shrink.load_with_extra(report.path)
    state = extra["optimizer_states"][0]["state"]
    setting = report.optimizer.setting
    for per_parameter in state.values():
        assert per_parameter["step"].dtype == torch.float32 and float(per_parameter["step"]) > 0
        pruned = FIRST_MOMENT_CONFIGS.get(setting.first)
        if pruned is not None and per_parameter["exp_avg"].numel() >= 1024:
            zeros = float((per_parameter["exp_avg"] == 0).float().mean())
            assert abs(zeros - pruned.prune) <= 0.05  # the smaller share pruned
        assert (per_parameter["exp_avg_sq"] >= 0).all()


def test_the_ladder_falls_back_to_lossless_when_no_setting_is_within_tau():
    v = torch.rand(8, 4)
    states = [{"state": {0: {"exp_avg": torch.randn(8, 4), "exp_avg_sq": v}}, "param_groups": []}]
    moments = [[Moment("exp_avg", 0, "first", states[0]["state"][0]["exp_avg"]),
                Moment("exp_avg_sq", 0, "second", v)]]  # fmt: skip
    exact = states[0]["state"][0]

    def continuation(candidate):  # "loss" = distance of the moments from the exact ones
        got = candidate[0]["state"][0]
        return (
            1.0
            + float((got["exp_avg"] - exact["exp_avg"]).abs().sum())
            + float((got["exp_avg_sq"] - exact["exp_avg_sq"]).abs().sum())
        )

    choice = choose_setting(states, moments, continuation, tau=0.0)
    assert choice.setting.lossless and len(choice.tried) == len(LADDER) - 1
    assert choose_setting(states, moments, lambda c: 1.0, tau=0.0).setting == LADDER[0]


def test_second_moment_forms_keep_the_step_size_close():
    v = torch.rand(64, 32) ** 4 * 1e-6
    v[3] = 0.0  # a row that never had a gradient
    log = reconstruct(Moment("exp_avg_sq", 0, "second", v), "log")
    ratio = (log[v > 0] / v[v > 0]).sqrt()
    assert float((ratio - 1).abs().max()) <= 2 ** (1 / 8) - 1 + 1e-6
    assert not log[3].any()
    rank_one = torch.outer(torch.rand(64), torch.rand(32))
    factored = reconstruct(Moment("exp_avg_sq", 0, "second", rank_one), "factored")
    # Exact up to the sums' bfloat16 rounding (2**-8 each, three of them in r_i c_j / sum(r)).
    assert torch.allclose(factored, rank_one, rtol=3 * 2**-8, atol=1e-12)
    assert not torch.allclose(factored, rank_one, rtol=1e-5, atol=1e-12)  # they are rounded
    with pytest.raises(ValueError):
        MomentSetting("fp8", "log")


# --- bad input: unknown optimizers, a changed optimizer, untrusted files -------------------------


class Scaled(torch.optim.Optimizer):
    """A custom optimizer: a non-tensor state entry and a per-parameter tensor of another shape."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state.setdefault("calls", 0)
                state["calls"] += 1
                state["row_scale"] = p.grad.abs().mean(dim=-1)  # not the parameter's shape
                state["exp_avg"] = p.grad.abs().mean(dim=0)  # a known name, the wrong shape
                p.add_(p.grad, alpha=-group["lr"])


def _model_and_state(optimizer_class, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    optimizer = optimizer_class(model.parameters(), **kwargs)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(16, 64)).pow(2).mean().backward()
        optimizer.step()
    shapes = [dict(enumerate(tuple(p.shape) for p in model.parameters()))]
    return model, optimizer.state_dict(), shapes


def test_a_factored_second_moment_stores_bfloat16_sums_and_restores_what_the_check_saw(tmp_path):
    model, adam, shapes = _model_and_state(torch.optim.Adam, lr=1e-3)
    seen = []

    def continue_training(weights, states):
        seen.append(states[0]["state"][0]["exp_avg_sq"].clone())
        return 1.0

    report = shrink.save(
        model.state_dict(), tmp_path / "a.shrunk", extra={"optimizer_states": [adam]},
        compress_optimizer="auto", continue_training=continue_training, parameter_shapes=shapes,
    )  # fmt: skip
    assert report.optimizer.setting.second == "factored"
    container = read_container(tmp_path / "a.shrunk")
    assert container.header["format"] == 5  # format 4 readers would take the sums for float32
    (entry,) = [e for e in container.header["extra"]["tensors"] if e["encoding"] == "factored"]
    assert entry["sums"] == "bfloat16"
    exact = adam["state"][0]["exp_avg_sq"]
    in_float32 = len(encode_grouped(exact.sum(dim=1))) + len(encode_grouped(exact.sum(dim=0)))
    assert entry["rows"][1] + entry["columns"][1] < 0.75 * in_float32
    _, extra, _ = shrink.load_with_extra(tmp_path / "a.shrunk")
    restored = extra["optimizer_states"][0]["state"][0]["exp_avg_sq"]
    assert torch.equal(restored, seen[-1])  # the check measured exactly what a restore gets


def test_a_format_4_file_with_float32_sums_still_reads_as_written():
    # Written by the format-4 stalwart (0fd431c): an Adam state, second moment factored with its
    # sums in float32, and what that version decoded the file to.
    expected = torch.load(FORMAT_4_FILE.parent / "decoded.pt", weights_only=True)
    assert FORMAT_4_FILE.read_bytes()[8:10] == (4).to_bytes(2, "little")
    weights, extra, _ = shrink.load_with_extra(FORMAT_4_FILE)
    assert all(torch.equal(weights[k], v) for k, v in expected["weights"].items())
    got, want = extra["optimizer_states"][0]["state"], expected["optimizer"]["state"]
    assert got.keys() == want.keys()
    for index, per_parameter in want.items():
        for key, value in per_parameter.items():
            assert torch.equal(got[index][key], value), (index, key)


def test_an_unknown_optimizer_state_is_stored_losslessly_with_a_note(tmp_path):
    model, state, shapes = _model_and_state(Scaled)
    with pytest.warns(UserWarning, match="stored losslessly"):
        shrink.save(
            model.state_dict(), tmp_path / "a.shrunk", extra={"optimizer_states": [state]},
            compress_optimizer="auto", continue_training=lambda w, s: 1.0,
            parameter_shapes=shapes,
        )  # fmt: skip
    _, extra, _ = shrink.load_with_extra(tmp_path / "a.shrunk")
    loaded = extra["optimizer_states"][0]["state"]
    for index, per_parameter in state["state"].items():
        assert loaded[index]["calls"] == per_parameter["calls"] == 2
        for key in ("row_scale", "exp_avg"):
            assert torch.equal(loaded[index][key], per_parameter[key])


def test_a_chain_whose_optimizer_changed_class_starts_a_keyframe(tmp_path, caplog):
    model, adam, _ = _model_and_state(torch.optim.Adam, lr=1e-3)
    _, sgd, _ = _model_and_state(torch.optim.SGD, lr=0.1, momentum=0.9)
    writer = ChainWriter()
    first = writer.save(model.state_dict(), {"optimizer_states": [adam]}, tmp_path / "0.shrunk")
    same = writer.save(model.state_dict(), {"optimizer_states": [adam]}, tmp_path / "1.shrunk")
    assert (first.kind, same.kind) == ("keyframe", "delta")
    with caplog.at_level(logging.WARNING, logger="stalwart.shrink.chain"):
        changed = writer.save(
            model.state_dict(), {"optimizer_states": [sgd]}, tmp_path / "2.shrunk"
        )
    assert changed.kind == "keyframe"
    assert "optimizer changed" in caplog.text and "new keyframe" in caplog.text
    # Every file restores on its own terms; the changed one needs no base.
    (tmp_path / "1.shrunk").unlink()
    _, extra, _ = shrink.load_with_extra(tmp_path / "2.shrunk")
    assert "momentum_buffer" in extra["optimizer_states"][0]["state"][0]


def _checked_saves(tmp_path, increase: float, saves: int, **writer_args) -> list:
    """Which of ``saves`` saves ran the continuation check, each candidate ``increase`` above
    the exact state's continuation; the reports."""
    model, adam, shapes = _model_and_state(torch.optim.Adam, lr=1e-3)
    writer = ChainWriter(**writer_args)
    checked, reports = [], []
    for index in range(saves):
        calls = []

        def continue_training(weights, states, calls=calls):
            calls.append(len(calls))
            return 1.0 if len(calls) == 1 else 1.0 + increase  # the first call is the reference

        request = ShrinkRequest(continue_training=continue_training, parameter_shapes=shapes)
        reports.append(writer.save(
            model.state_dict(), {"optimizer_states": [adam]}, tmp_path / f"{index}.shrunk", request
        ))  # fmt: skip
        if calls:
            checked.append(index)
    return checked, reports


def test_a_setting_that_passed_by_a_wide_margin_is_reused_until_the_next_check(tmp_path):
    checked, reports = _checked_saves(tmp_path, 0.001, 7, recheck_optimizer_every=3)
    assert checked == [0, 3, 6]
    first = reports[0].optimizer
    assert first.degradation == pytest.approx(0.001) and not first.setting.lossless
    for report in (reports[i] for i in (1, 2, 4, 5)):
        assert report.kind == "delta" and report.optimizer.setting == first.setting
        assert report.optimizer.degradation is None and report.optimizer.reused
        assert "reused" in report.optimizer.describe()
        _, extra, _ = shrink.load_with_extra(report.path)  # and the file restores
        assert set(extra["optimizer_states"][0]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    listing = subprocess.run(
        [sys.executable, "-m", "stalwart.cli", "shrink", "inspect", str(tmp_path)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rows = {line.split()[0]: line for line in listing.splitlines() if ".shrunk" in line}
    assert [name for name, line in sorted(rows.items()) if " reused " in line] == [
        f"{i}.shrunk" for i in (1, 2, 4, 5)
    ]


def test_a_setting_close_to_tau_and_every_keyframe_are_checked_again(tmp_path):
    close, _ = _checked_saves(tmp_path / "close", 0.03, 4, recheck_optimizer_every=5)
    assert close == [0, 1, 2, 3]  # within tau (0.05), not within tau / 4: checked every save
    keyframes, reports = _checked_saves(
        tmp_path / "kf", 0.001, 4, keyframe_every=2, recheck_optimizer_every=5
    )
    assert [r.kind for r in reports] == ["keyframe", "delta", "keyframe", "delta"]
    assert keyframes == [0, 2]
    every, _ = _checked_saves(tmp_path / "every", 0.001, 3, recheck_optimizer_every=1)
    assert every == [0, 1, 2]
    with pytest.raises(ConfigurationError, match="recheck_optimizer_every must be >= 1"):
        ChainWriter(recheck_optimizer_every=0)


def test_moments_the_last_check_did_not_see_are_checked_before_they_are_stored(tmp_path):
    # A layer unfrozen (or a parameter group added) mid-run: its new moments were stored in the
    # setting reused from a check that never saw them.
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    model.bias.requires_grad_(False)  # no gradient: Adam keeps no state for it yet
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    shapes = [dict(enumerate(tuple(p.shape) for p in model.parameters()))]
    writer = ChainWriter(recheck_optimizer_every=5)
    checked = []
    for index in range(4):
        if index == 2:
            model.bias.requires_grad_(True)
        adam.zero_grad()
        model(torch.randn(16, 64)).pow(2).mean().backward()
        adam.step()
        calls = []

        def continue_training(weights, states, calls=calls):
            calls.append(len(calls))
            return 1.0  # every setting passes: only the moments decide whether to check

        request = ShrinkRequest(continue_training=continue_training, parameter_shapes=shapes)
        report = writer.save(model.state_dict(), {"optimizer_states": [adam.state_dict()]},
                             tmp_path / f"{index}.shrunk", request)  # fmt: skip
        assert report.kind == ("keyframe" if index == 0 else "delta")
        checked += [index] if calls else []
    assert checked == [0, 2]  # the bias's moments appeared at 2; 3 reuses that check


class Payload:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path(self.marker).write_text, ("ran",))


def test_a_file_whose_skeleton_runs_code_raises_and_runs_nothing(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "evil.shrunk"
    weights = {"w": torch.randn(64, 64)}
    shrink.save(weights, path, extra={"hyper_parameters": {"x": Payload(str(marker))}})
    with pytest.raises(UnsafeCheckpointError, match="weights_only=False"):
        shrink.load_with_extra(path)
    with pytest.raises(UnsafeCheckpointError):
        ShrinkCheckpointIO().load_checkpoint(path)
    assert not marker.exists()
    # The same file, trusted explicitly, runs the payload: the check above can fail.
    ShrinkCheckpointIO().load_checkpoint(path, weights_only=False)
    assert marker.read_text() == "ran"


# --- the lossless floor ---------------------------------------------------------------------------

SPECIALS = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, -1e-45, 5e-324, 65504.0, 1e-7]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    values=st.lists(
        st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(SPECIALS)),
        min_size=0, max_size=300,
    ),
    shape_split=st.integers(1, 4),
)  # fmt: skip
def test_the_lossless_path_round_trips_every_float_dtype_bit_for_bit(dtype, values, shape_split):
    tensor = torch.tensor(values, dtype=torch.float64).to(dtype)
    if tensor.numel() % shape_split == 0 and tensor.numel():
        tensor = tensor.reshape(shape_split, -1)
    back = decode_grouped(encode_grouped(tensor), dtype, list(tensor.shape))
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back.view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def test_special_values_survive_a_lossless_file_in_every_dtype(tmp_path):
    for dtype in DTYPES:
        tensor = torch.tensor(SPECIALS * 200, dtype=torch.float64).to(dtype).reshape(40, -1)
        path = tmp_path / f"{dtype}.shrunk"
        shrink.save({"t": tensor}, path, small_tensors="lossless", min_numel=10**9)
        back = shrink.load(path)["t"]
        assert torch.equal(back.view(torch.uint8), tensor.view(torch.uint8))


def test_the_lossless_floor_is_above_one_on_trained_weights(restored_run):
    _, reference, *_ = restored_run
    weights = [t for t in reference.state_dict().values() if t.is_floating_point()]
    raw = sum(t.numel() * t.element_size() for t in weights)
    grouped = sum(len(encode_grouped(t)) for t in weights)
    shuffled = sum(len(encode_lossless(t)) for t in weights)
    assert raw / grouped >= 1.1
    assert grouped < shuffled  # the planes beat the older one-stream shuffle
    bf16 = [t.to(torch.bfloat16) for t in weights]
    assert sum(t.numel() * 2 for t in bf16) / sum(len(encode_grouped(t)) for t in bf16) >= 1.3


def test_a_torn_lossless_section_is_detected():
    blob = encode_grouped(torch.randn(1000))
    for broken in (blob[:-3], blob[:1], blob + b"x"):
        with pytest.raises(Exception) as raised:
            decode_grouped(broken, torch.float32, [1000])
        assert "lossless" in str(raised.value) or "section" in str(raised.value)
    assert np.array_equal(
        decode_grouped(blob, torch.float32, [1000]).numpy(),
        decode_grouped(blob, torch.float32, [1000]).numpy(),
    )


def test_inspect_shows_weights_optimizer_and_whole_file_with_their_checks(restored_run):
    import subprocess
    import sys

    *_, directory, reports, _ = restored_run
    shown = subprocess.run(
        [sys.executable, "-m", "stalwart.cli", "shrink", "inspect", str(directory)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert "optim." in lines[0] and "cont." in lines[0]
    for report, line in zip(reports, lines[1:], strict=False):
        assert f"{report.optimizer_ratio:.1f}x" in line
        assert report.optimizer.setting.describe() in line
        assert f"{report.optimizer.degradation:+.3f}" in line
    assert "whole files" in shown.stdout
