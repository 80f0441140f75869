"""The configuration search: the bound holds at every checkpoint; precision only increases."""

import torch
from torch import nn

import stalwart.shrink as shrink
from stalwart.shrink.partition import QuantConfig


def _model_and_data(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4)
    )
    x = torch.randn(1024, 32)
    y = (x[:, :4] @ torch.randn(4, 4)).argmax(1)
    return model, x, y


def _train_and_save(tmp_path, checkpoints: int, tau: float, **save_kwargs):
    """Train the model 25 steps per checkpoint and save each through one ConfigSearch; yield
    (report, loss of the live weights, loss of what the file decodes to) per checkpoint."""
    model, x, y = _model_and_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)

    def loss_of(state):
        with torch.no_grad():
            out = torch.func.functional_call(model, dict(state), (x[:512],))
            return float(nn.functional.cross_entropy(out, y[:512]))

    search = shrink.ConfigSearch(tau=tau)
    report = None
    for step in range(checkpoints):
        for _ in range(25):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[512:]), y[512:]).backward()
            optimizer.step()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        report = shrink.save(
            model.state_dict(), tmp_path / f"{step}.shrunk", previous=report,
            evaluate=loss_of, search=search, tau=tau, gradients=grads, **save_kwargs,
        )  # fmt: skip
        yield report, loss_of(model.state_dict()), loss_of(shrink.load(report.path))


def test_bound_holds_and_neighbourhood_never_more_aggressive(tmp_path):
    configs = []
    for report, reference, written in _train_and_save(tmp_path, 6, 0.05):
        # The bound holds for what was actually written (decoded from the file), not only for
        # the search's own bookkeeping.
        assert report.degradation <= 0.05 + 1e-9
        assert (written - reference) / reference <= 0.05 + 1e-6
        configs.append(report.config)
    assert report.evaluations <= 8  # steady state: a handful, not the full search
    for before, after in zip(configs, configs[1:], strict=False):
        assert after.at_most_as_aggressive_as(before), (before, after)


def test_nothing_qualifies_stores_losslessly(tmp_path):
    model, _, _ = _model_and_data()
    state = model.state_dict()
    exact = {k: v.clone() for k, v in state.items()}

    def only_exact(candidate):
        return 0.0 if all(torch.equal(candidate[k], exact[k]) for k in exact) else 1.0

    report = shrink.save(state, tmp_path / "x.shrunk", evaluate=only_exact, tau=0.0)
    assert report.config is None
    loaded = shrink.load(report.path)
    assert all(torch.equal(loaded[k], exact[k]) for k in exact)


def test_the_bound_covers_the_small_tensors_rounded_to_bfloat16(tmp_path):
    # A loss that bfloat16 rounding of the biases alone pushes past tau: no configuration may
    # qualify, so everything is stored exactly. (If candidates were scored with exact biases,
    # a quantization would be chosen and the written biases would break the bound.)
    model, x, y = _model_and_data()
    state = model.state_dict()
    biases = {k: v.clone() for k, v in state.items() if k.endswith("bias")}

    def bias_sensitive(candidate):
        return 1.0 + 10 * sum(float((candidate[k] - v).abs().sum()) for k, v in biases.items())

    report = shrink.save(state, tmp_path / "x.shrunk", evaluate=bias_sensitive, tau=0.05)
    assert report.config is None
    loaded = shrink.load(report.path)
    assert all(torch.equal(loaded[k], v) for k, v in biases.items())
    # With the biases stored exactly, the same bound admits a quantization of the weights.
    exact = shrink.save(
        state, tmp_path / "y.shrunk", evaluate=bias_sensitive, tau=0.05, small_tensors="lossless"
    )
    assert exact.config is not None and exact.degradation <= 0.05


def test_fixed_config_skips_search(tmp_path):
    model, _, _ = _model_and_data()
    config = QuantConfig(bins=6, prune=0.3, protect=0.0005)
    report = shrink.save(model.state_dict(), tmp_path / "x.shrunk", config=config)
    assert report.config == config and report.evaluations == 0 and report.ratio > 6


def test_a_screen_only_guides_the_bound_holds_on_the_scoring_batches(tmp_path):
    # A screen that calls every candidate harmless: the search must still write only what meets
    # tau on the full scoring function, and still never get more aggressive.
    configs = []
    for report, reference, written in _train_and_save(tmp_path, 4, 0.01, screen=lambda s: 1.0):
        assert report.screenings > 0
        assert (written - reference) / reference <= 0.01 + 1e-6
        configs.append(report.config)
    for before, after in zip(configs, configs[1:], strict=False):
        assert after.at_most_as_aggressive_as(before), (before, after)
