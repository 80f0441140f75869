"""Per-layer-type bin counts: chosen where a type tolerates them, never coarser than before per
type, bound held, and carried through the file, the chain state and ``inspect``."""

import argparse

import pytest
import torch

import stalwart.shrink as shrink
from stalwart.errors import ConfigurationError
from stalwart.shrink.codec import decode_chain, format_version
from stalwart.shrink.container import read_container
from stalwart.shrink.inspect import describe, inspect
from stalwart.shrink.partition import QuantConfig

TYPES = {"attn.weight": "attention", "fc.weight": "linear"}


def _weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(96, 96, generator=generator) for name in TYPES}


def _loss(reference: dict[str, torch.Tensor], sensitivity: dict[str, float]):
    """1 + sensitivity-weighted mean squared quantization error per tensor: how much each
    layer type's precision matters is set by the test."""

    def evaluate(candidate) -> float:
        return 1.0 + sum(
            weight * float(((candidate[name] - reference[name]) ** 2).mean())
            for name, weight in sensitivity.items()
        )

    return evaluate


def _save(tmp_path, name, weights, sensitivity, search, previous=None, tau=0.05):
    evaluate = _loss(weights, sensitivity)
    report = shrink.save(
        weights, tmp_path / name, previous=previous, evaluate=evaluate, tau=tau,
        search=search, layer_types=TYPES,
    )  # fmt: skip
    written = evaluate(shrink.load(report.path)) - 1.0  # reference loss is exactly 1
    return report, written


def test_a_tolerant_type_gets_fewer_bins_within_the_bound(tmp_path):
    weights = _weights(0)
    sensitivity = {"fc.weight": 60.0, "attn.weight": 0.05}
    refined = shrink.ConfigSearch(per_type=True)
    report, written = _save(tmp_path, "a.shrunk", weights, sensitivity, refined)
    shared, _ = _save(
        tmp_path, "b.shrunk", weights, sensitivity, shrink.ConfigSearch(per_type=False)
    )
    config = report.config
    assert config.bins_for("attention") < config.bins_for("linear") == shared.config.bins
    assert written <= 0.05 + 1e-9 and report.degradation <= 0.05 + 1e-9
    assert report.ratio > 1.2 * shared.ratio


def test_the_neighbourhood_ceiling_holds_per_type_and_the_bound_at_every_checkpoint(tmp_path):
    search = shrink.ConfigSearch(per_type=True)
    weights = _weights(0)
    report, written = _save(
        tmp_path, "0.shrunk", weights, {"fc.weight": 60.0, "attn.weight": 0.05}, search
    )
    configs = [report.config]
    assert written <= 0.05 + 1e-9
    # Now attention grows more sensitive (the search must move, within reach of its
    # neighbourhood) and the linear layer tolerant: a refinement that ignored the per-type
    # ceiling would give the linear layer fewer bins. (A jump out of the neighbourhood's reach
    # would send it to the full search, which has no ceiling.)
    for step, sensitivity in enumerate(
        [{"fc.weight": 0.05, "attn.weight": 0.5}, {"fc.weight": 0.05, "attn.weight": 1.0}]
    ):
        weights = {k: v + 0.01 * torch.randn_like(v) for k, v in weights.items()}
        report, written = _save(
            tmp_path, f"{step + 1}.shrunk", weights, sensitivity, search, previous=report
        )
        assert written <= 0.05 + 1e-9 and report.search == "neighbourhood"
        configs.append(report.config)
    for before, after in zip(configs, configs[1:], strict=False):
        assert after.at_most_as_aggressive_as(before), (before, after)
        assert after.bins_for("linear") >= before.bins_for("linear")
    assert configs[-1].bins_for("attention") > configs[0].bins_for("attention")


def test_per_type_config_round_trips_through_file_chain_and_inspect(tmp_path, capsys):
    config = QuantConfig(bins=12, type_bins={"attention": 6, "linear": 12})
    assert config.type_bins == (("attention", 6),)  # an override equal to bins is dropped
    assert config == QuantConfig(bins=12, type_bins=(("attention", 6),))
    # The per-type config needs format 2 (the file is format 4: its protected values are coded
    # by byte plane); format_version says what the config alone needs.
    first = shrink.save(
        _weights(0), tmp_path / "0.shrunk", config=config, layer_types=TYPES, coder="zstd"
    )
    report = shrink.save(
        _weights(1), tmp_path / "1.shrunk", previous=first, config=config, layer_types=TYPES,
        coder="zstd",
    )  # fmt: skip
    container = read_container(report.path)
    assert container.header["format"] == 4
    assert format_version({}, config) == 2
    assert container.header["config"]["type_bins"] == {"attention": 6}
    assert container.header["tensors"]["attn.weight"]["alphabet"] == 6 + 2
    assert container.header["tensors"]["fc.weight"]["alphabet"] == 12 + 2
    assert decode_chain(report.path)[2].config == config
    assert "12 bins (attention 6)" in describe(tmp_path / "1.shrunk")["config"]
    inspect(argparse.Namespace(path=str(tmp_path)))
    assert "12 bins (attention 6)" in capsys.readouterr().out
    # The search's state (kept in Lightning and Composer checkpoints) carries it too.
    search = shrink.ConfigSearch()
    search.previous = config
    restored = shrink.ConfigSearch()
    restored.load_state_dict(search.state_dict())
    assert restored.previous == config


def test_a_config_without_overrides_reads_and_writes_as_before(tmp_path):
    old = {"bins": 8, "prune": 0.1, "prune_metric": "magnitude", "protect": 0.005}
    config = QuantConfig.from_dict(old)
    assert config.to_dict() == old and config.type_bins == ()
    report = shrink.save(
        _weights(0), tmp_path / "x.shrunk", config=config, small_tensors="lossless", coder="ans"
    )
    assert read_container(report.path).header["config"] == old
    assert format_version({}, config) == 1  # the config alone needs no newer format


@pytest.mark.parametrize(
    "type_bins", [{"mlp": 8}, {"linear": 1}, {"attention": 200}, {"conv": "8"}]
)
def test_bad_type_bins(type_bins):
    with pytest.raises(ConfigurationError):
        QuantConfig(bins=12, type_bins=type_bins)


def test_more_aggressive_in_one_type_is_more_aggressive():
    plain = QuantConfig(bins=12)
    coarse_attention = QuantConfig(bins=12, type_bins={"attention": 8})
    assert plain.at_most_as_aggressive_as(coarse_attention)
    assert not coarse_attention.at_most_as_aggressive_as(plain)
    assert not QuantConfig(bins=8, type_bins={"linear": 16}).at_most_as_aggressive_as(plain)
