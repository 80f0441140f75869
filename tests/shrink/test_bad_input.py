"""Torn, corrupted, missing or mismatched files: errors naming the file, never wrong tensors."""

import os
import warnings

import pytest
import torch

import stalwart.shrink as shrink
from stalwart.errors import ConfigurationError, CorruptCheckpointError
from stalwart.shrink.container import SectionWriter, read_container
from stalwart.shrink.scoring import live_evaluator


def _chain(tmp_path, n=3):
    torch.manual_seed(0)
    weights = {"layer.weight": torch.randn(128, 64), "layer.bias": torch.randn(128)}
    report = None
    for i in range(n):
        weights = {k: v + 0.01 * torch.randn_like(v) for k, v in weights.items()}
        report = shrink.save(weights, tmp_path / f"{i}.shrunk", previous=report)
    return weights


def test_truncated_file_is_named(tmp_path):
    _chain(tmp_path)
    path = tmp_path / "2.shrunk"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="2.shrunk.*torn"):
        shrink.load(path)


@pytest.mark.parametrize("where", [0.3, 0.6, 0.95])
def test_flipped_byte_is_detected(tmp_path, where):
    _chain(tmp_path)
    path = tmp_path / "1.shrunk"
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x40
    path.write_bytes(bytes(data))
    # Loading the delta after it goes through the corrupted base: the error names the base.
    for target in ("1.shrunk", "2.shrunk"):
        with pytest.raises(CorruptCheckpointError, match="1.shrunk"):
            shrink.load(tmp_path / target)


def test_missing_base_of_a_delta(tmp_path):
    _chain(tmp_path)
    os.remove(tmp_path / "0.shrunk")
    with pytest.raises(
        CorruptCheckpointError, match=r"1\.shrunk is a delta on .*0\.shrunk.*missing"
    ):
        shrink.load(tmp_path / "2.shrunk")


def test_replaced_base_is_detected(tmp_path):
    _chain(tmp_path)
    torch.manual_seed(1)
    other = {"layer.weight": torch.randn(128, 64), "layer.bias": torch.randn(128)}
    shrink.save(other, tmp_path / "1.shrunk")  # a different checkpoint under the base's name
    with pytest.raises(CorruptCheckpointError, match="replaced"):
        shrink.load(tmp_path / "2.shrunk")


def test_state_dict_that_differs_from_the_chain(tmp_path):
    weights = _chain(tmp_path)
    before = sorted(p.read_bytes() for p in tmp_path.iterdir())
    renamed = {"other.weight": weights["layer.weight"], "layer.bias": weights["layer.bias"]}
    reshaped = {"layer.weight": torch.randn(64, 128), "layer.bias": weights["layer.bias"]}
    for bad in (renamed, reshaped):
        with pytest.raises(ConfigurationError, match=r"2\.shrunk.*previous=None"):
            shrink.save(bad, tmp_path / "3.shrunk", previous=tmp_path / "2.shrunk")
    assert not (tmp_path / "3.shrunk").exists()
    assert sorted(p.read_bytes() for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"_use_new_zipfile_serialization": False},
        # A legacy file of another pickle protocol starts b"\x80\x04\x95", not as protocol 2's.
        {"_use_new_zipfile_serialization": False, "pickle_protocol": 4},
    ],
    ids=["zip", "legacy", "legacy-protocol-4"],
)
def test_a_plain_torch_save_file_is_named_as_such_not_as_torn(tmp_path, options):
    # What trainer.save_checkpoint writes by hand beside ShrinkCheckpoint: intact, but the error
    # said "truncated or changed after it was written. Restore from an earlier checkpoint".
    path = tmp_path / "plain.ckpt"
    torch.save({"a": torch.zeros(3)}, path, **options)
    with pytest.raises(CorruptCheckpointError, match="plain.ckpt is a plain torch.save") as error:
        shrink.load(path)
    assert "torch.load" in str(error.value) and "truncated" not in str(error.value)
    # Written over a delta's base, it is a replaced base, named from the delta.
    _chain(tmp_path)
    torch.save({"a": torch.zeros(3)}, tmp_path / "1.shrunk", **options)
    with pytest.raises(CorruptCheckpointError, match=r"2\.shrunk is a delta on .*replaced"):
        shrink.load(tmp_path / "2.shrunk")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tau": -0.1},
        {"coder": "lzma"},
        {"config": "16 bins"},
        {"small_tensors": "float8"},
    ],
)
def test_bad_arguments(tmp_path, kwargs):
    with pytest.raises((ConfigurationError, AttributeError)):
        shrink.save({"w": torch.randn(2000)}, tmp_path / "x.shrunk", **kwargs)
    assert not (tmp_path / "x.shrunk").exists()


@pytest.mark.parametrize(
    "config", [dict(bins=1), dict(prune=0.7, protect=0.4), dict(prune_metric="random")]
)
def test_bad_configs(config):
    with pytest.raises(ConfigurationError):
        shrink.QuantConfig(**config)


def test_an_entry_encoding_this_version_does_not_know_is_refused(tmp_path):
    # A newer writer's encoding must never be read as a lossless tensor of the wrong size.
    path = tmp_path / "newer.shrunk"
    shrink.save({"w": torch.randn(2000), "b": torch.randn(8)}, path)
    container = read_container(path)
    header = dict(container.header)
    header["tensors"] = {
        name: {**entry, "encoding": "float8"} if entry["encoding"] == "bfloat16" else entry
        for name, entry in header["tensors"].items()
    }
    sections = SectionWriter()
    sections.add(bytes(container._body))  # the same sections at the same addresses
    sections.write(path, header)
    with pytest.raises(CorruptCheckpointError, match="newer.shrunk.*unknown tensor encoding"):
        shrink.load(path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_stored_exactly_through_a_chain(tmp_path, bad):
    # An inf used to size an 8 GiB histogram (the process was killed); a NaN came back as an
    # ordinary number, so a diverged model's checkpoint looked healthy after a restore.
    torch.manual_seed(0)
    weights = {"layer.weight": torch.randn(128, 64), "layer.bias": torch.randn(128)}
    first = shrink.save(weights, tmp_path / "0.shrunk")
    broken = {name: tensor.clone() for name, tensor in weights.items()}
    broken["layer.weight"][3, 5] = bad
    with pytest.warns(UserWarning, match=r"NaN or inf values, stored exactly.*layer.weight"):
        second = shrink.save(broken, tmp_path / "1.shrunk", previous=first)
    restored = shrink.load(tmp_path / "1.shrunk")
    # Bit for bit, the NaN's payload and the sign of an inf included.
    as_bits = restored["layer.weight"].view(torch.int32)
    assert torch.equal(as_bits, broken["layer.weight"].view(torch.int32))
    # The chain goes on once the values are finite again.
    third = shrink.save(weights, tmp_path / "2.shrunk", previous=second)
    assert third.kind == "delta"
    again = shrink.load(tmp_path / "2.shrunk")
    assert torch.isfinite(again["layer.weight"]).all()
    assert (again["layer.weight"] - weights["layer.weight"]).abs().max() < 0.5


def test_a_delta_over_its_own_base_and_meta_tensors_are_refused(tmp_path):
    weights = {"layer.weight": torch.randn(128, 64)}
    first = shrink.save(weights, tmp_path / "0.shrunk")
    before = (tmp_path / "0.shrunk").read_bytes()
    with pytest.raises(ConfigurationError, match="as a delta on itself"):
        shrink.save(weights, tmp_path / "0.shrunk", previous=first)
    assert (tmp_path / "0.shrunk").read_bytes() == before  # still restorable
    with pytest.raises(ConfigurationError, match="meta device.*layer.weight"):
        shrink.save({"layer.weight": torch.empty(4, 4, device="meta")}, tmp_path / "m.shrunk")


def test_an_evaluate_that_returns_no_number_is_a_clear_error(tmp_path):
    model = torch.nn.Linear(64, 128, bias=False)
    evaluate = live_evaluator(model, lambda module: None)
    with pytest.raises(ConfigurationError, match="must return a number"):
        shrink.save(model.state_dict(), tmp_path / "0.shrunk", evaluate=evaluate)
    assert not (tmp_path / "0.shrunk").exists()


@pytest.mark.parametrize("mode", ["lossy", "auto"])
def test_non_finite_optimizer_moments_are_stored_exactly(tmp_path, mode):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 128)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    state["state"][0]["exp_avg"][3, 5] = float("nan")
    state["state"][0]["exp_avg_sq"][0, 0] = float("inf")
    check = {}
    if mode == "auto":  # every candidate passes the continuation check
        shapes = [{0: (128, 64), 1: (128,)}]
        check = {"continue_training": lambda weights, states: 1.0, "parameter_shapes": shapes}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shrink.save(
            model.state_dict(), tmp_path / "0.shrunk", extra={"optimizer": state},
            compress_optimizer=mode, **check,
        )  # fmt: skip
    if mode == "auto":  # the moments' note (the lossy mode quantizes unchecked, notes nothing)
        assert any("NaN or inf values: stored exactly" in str(w.message) for w in caught)
    _, extra, _ = shrink.load_with_extra(tmp_path / "0.shrunk")
    restored = extra["optimizer"]["state"][0]
    assert torch.isnan(restored["exp_avg"][3, 5]) and restored["exp_avg_sq"][0, 0] == float("inf")
