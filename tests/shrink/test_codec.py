"""The lossless layer: index deltas, run lengths, entropy coders, byte-shuffled tensors."""

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stalwart.shrink as shrink
from stalwart.errors import CorruptCheckpointError
from stalwart.shrink.codec import (
    decode_chain,
    decode_lossless,
    encode_lossless,
    format_version,
    join_constant_rows,
    split_constant_rows,
)
from stalwart.shrink.container import read_container
from stalwart.shrink.delta import (
    delta_indices,
    run_length_decode,
    run_length_encode,
    undelta_indices,
)
from stalwart.shrink.entropy import decode_stream, encode_stream, grouped_ans_decode
from stalwart.shrink.partition import QuantConfig
from stalwart.shrink.quantize import PROTECTED, PRUNED

alphabets = st.integers(min_value=3, max_value=128)  # up to MAX_BINS + 2
# A keyframe (8 bins, 10% pruned) and a delta (12 bins) written by the format-1 stalwart (b04b595),
# with what that version decoded them to.
FORMAT_1_CHAIN = Path(__file__).parent / "data" / "format1"


@st.composite
def index_pairs(draw):
    """(q_prev, alphabet_prev, q_cur, alphabet_cur): bin counts change either way, mostly-equal
    streams with runs, and the pruned (0) / protected (1) levels present."""
    n = draw(st.integers(min_value=0, max_value=3000))
    a_prev, a_cur = draw(alphabets), draw(alphabets)
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    prev = rng.integers(0, a_prev, n).astype(np.uint8)
    cur = np.minimum(prev, a_cur - 1).astype(np.uint8)
    change = rng.random(n) < draw(st.floats(0.0, 1.0))
    cur[change] = rng.integers(0, a_cur, int(change.sum()))
    cur[rng.random(n) < 0.05] = PRUNED
    cur[rng.random(n) < 0.02] = PROTECTED
    return torch.from_numpy(prev), a_prev, torch.from_numpy(cur), a_cur


@settings(max_examples=150, deadline=None)
@given(index_pairs(), st.sampled_from(["zstd", "huffman", "ans"]))
def test_delta_and_coding_round_trip_exactly(pair, coder):
    prev, a_prev, cur, a_cur = pair
    alphabet = max(a_prev, a_cur)
    for base in (prev, None):
        deltas = delta_indices(cur, base, alphabet)
        stream = run_length_encode(deltas)
        assert stream.dtype == np.int8 and (stream[stream > 0] <= 127).all()
        decoded = run_length_decode(decode_stream(encode_stream(stream, coder), coder))
        assert torch.equal(undelta_indices(decoded, base, alphabet), cur)
        # Without run lengths (how "ans" stores deltas).
        direct = decode_stream(encode_stream(deltas.view(np.int8), coder), coder).view(np.uint8)
        assert torch.equal(undelta_indices(direct, base, alphabet), cur)


@settings(max_examples=150, deadline=None)
@given(index_pairs())
def test_grouped_ans_round_trips_deltas_grouped_by_previous_level(pair):
    prev, a_prev, cur, a_cur = pair
    alphabet = max(a_prev, a_cur)
    deltas = delta_indices(cur, prev, alphabet)
    groups = np.bincount(prev.numpy(), minlength=alphabet)
    blob = encode_stream(deltas.view(np.int8), "ans-grouped", groups)
    decoded = decode_stream(blob, "ans-grouped", groups).view(np.uint8)
    assert torch.equal(undelta_indices(decoded, prev, alphabet), cur)
    # A keyframe is one group; decoding with other groups than were encoded is refused, never a
    # silently different stream.
    keyframe = cur.numpy()
    one = np.array([keyframe.size])
    assert np.array_equal(decode_stream(encode_stream(keyframe, "ans-grouped"), "ans-grouped", one)
                          .view(np.uint8), keyframe)  # fmt: skip
    if keyframe.size:
        with pytest.raises(CorruptCheckpointError):
            grouped_ans_decode(blob, np.append(groups, 1))


def test_grouped_ans_codes_the_delta_given_the_previous_level():
    # Two levels: an element at the lower one can only move up, at the upper one only down. Per
    # tensor a move is up or down (H(delta) = 1.5 bits: stay, +1, -1), per previous level the
    # direction is known (H(delta | previous level) = 1 bit: stay or move).
    rng = np.random.default_rng(0)
    prev = rng.integers(2, 4, 200_000).astype(np.uint8)
    moves = rng.random(prev.size) < 0.5
    cur = prev.copy()
    cur[moves] = 5 - prev[moves]
    deltas = delta_indices(torch.from_numpy(cur), torch.from_numpy(prev), 4)
    groups = np.bincount(prev, minlength=4)
    grouped = len(encode_stream(deltas.view(np.int8), "ans-grouped", groups))
    flat = len(encode_stream(deltas.view(np.int8), "ans"))
    assert grouped < 0.7 * flat


def test_constant_rows_of_a_keyframe_cost_a_bit_each(tmp_path):
    torch.manual_seed(0)
    weights = {"hidden": torch.randn(256, 512), "out": torch.randn(10, 256)}
    dead = torch.rand(256) < 0.25
    weights["hidden"][dead] = 0.0  # dead units: whole rows zero
    indices = torch.randint(0, 9, (256, 512), dtype=torch.uint8).numpy()
    indices[dead.numpy()] = 0
    side, rest = split_constant_rows(indices.reshape(-1), (256, 512))
    constant = dead.numpy()
    assert np.array_equal(join_constant_rows(side, constant, rest, 512), indices.reshape(-1))
    assert split_constant_rows(indices.reshape(-1), (256 * 512,)) is None  # not a matrix
    config = QuantConfig(bins=16, protect=0.01)
    stripped = shrink.save(weights, tmp_path / "rows.shrunk", config=config)
    plain = shrink.save(weights, tmp_path / "plain.shrunk", config=config, coder="ans")
    entry = read_container(stripped.path).header["tensors"]["hidden"]
    assert "constant_rows" in entry
    assert stripped.weight_stored < 0.85 * plain.weight_stored
    loaded, expected = shrink.load(stripped.path), shrink.load(plain.path)
    assert all(torch.equal(loaded[name], expected[name]) for name in weights)
    assert (loaded["hidden"][dead] == loaded["hidden"][dead][0, 0]).all()
    # A delta on it: dead rows stay dead, the chain decodes to the same values as without.
    moved = {name: w + 0.01 * torch.randn_like(w) * (w != 0) for name, w in weights.items()}
    delta = shrink.save(moved, tmp_path / "rows1.shrunk", previous=stripped, config=config)
    again = shrink.save(moved, tmp_path / "plain1.shrunk", previous=plain, config=config)
    loaded, expected = shrink.load(delta.path), shrink.load(again.path)
    assert all(torch.equal(loaded[name], expected[name]) for name in weights)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=600), st.integers(1, 400))
def test_run_length_handles_long_runs(values, repeat):
    data = np.repeat(np.array(values, dtype=np.uint8), repeat % 300 + 1)
    assert np.array_equal(run_length_decode(run_length_encode(data)), data)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(7, 13),
        torch.randn(100).to(torch.bfloat16),
        torch.randint(-5, 5, (3, 4, 5)),
        torch.rand(10) > 0.5,
        torch.randn(0, 4),
        torch.tensor(3.5, dtype=torch.float64),
    ],
)
def test_lossless_tensors_round_trip_bit_exact(tensor):
    back = decode_lossless(encode_lossless(tensor), tensor.dtype, list(tensor.shape))
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def _chain_state(tmp_path, steps=4, bins=(8, 32, 4, 16)):
    torch.manual_seed(0)
    weights = {
        "a.weight": torch.randn(64, 64),
        "b.weight": torch.randn(3000),
        "bias": torch.randn(5),
    }
    saved = []
    previous = None
    for step, b in enumerate(bins[:steps]):
        weights = {k: v + 0.01 * torch.randn_like(v) for k, v in weights.items()}
        config = shrink.QuantConfig(bins=b, prune=0.2 * (step % 2), protect=0.01)
        previous = shrink.save(
            weights, tmp_path / f"{step}.shrunk", previous=previous, config=config
        )
        saved.append((weights, previous))
    return saved


def test_chain_decodes_each_checkpoint_to_its_own_quantization(tmp_path):
    # Bin counts go 8 -> 32 -> 4 -> 16 and pruning toggles: every file decodes to exactly the
    # quantized tensor its save produced (the delta layer adds no error of its own).
    for weights, report in _chain_state(tmp_path):
        loaded = shrink.load(report.path)
        for name, (indices, _) in report.chain.indices.items():
            expected_levels = report.chain.levels[name]
            table = torch.cat([torch.zeros(2), expected_levels])
            expected = table[indices.long()]
            got = loaded[name].reshape(-1)
            protected = indices == PROTECTED
            assert torch.equal(got[~protected], expected[~protected])
            # Protected values come back exactly as bf16(w).
            original = weights[name].reshape(-1)
            assert torch.equal(got[protected], original[protected].to(torch.bfloat16).float())
        # Small float32 tensors: exactly bf16(w), like protected values.
        assert torch.equal(loaded["bias"], weights["bias"].to(torch.bfloat16).float())
    assert report.kind == "delta" and report.chain_position == 3


def test_small_tensors_are_rounded_or_exact_and_the_file_says_which_format(tmp_path):
    torch.manual_seed(0)
    weights = {
        "w": torch.randn(64, 64),
        "bias": torch.randn(7),
        "steps": torch.tensor(12),
        "scale": torch.randn(3, dtype=torch.float64),
    }
    rounded = shrink.save(weights, tmp_path / "rounded.shrunk")
    exact = shrink.save(weights, tmp_path / "exact.shrunk", small_tensors="lossless")
    loaded = shrink.load(rounded.path)
    assert loaded["bias"].dtype == torch.float32
    assert torch.equal(loaded["bias"], weights["bias"].to(torch.bfloat16).float())
    # Only float32 is rounded: integer and float64 tensors come back bit-exact.
    assert torch.equal(loaded["steps"], weights["steps"])
    assert torch.equal(loaded["scale"], weights["scale"])
    assert torch.equal(shrink.load(exact.path)["bias"], weights["bias"])
    assert exact.weight_stored > rounded.weight_stored
    # A file declares the oldest format that reads it: every lossless section (the int and
    # float64 tensors here, protected values) is coded by byte plane, which needs format 4.
    zstd_exact = shrink.save(
        weights, tmp_path / "zstd_exact.shrunk", coder="zstd", small_tensors="lossless"
    )
    for report in (rounded, exact, zstd_exact):
        container = read_container(report.path)
        assert container.header["format"] == 4
        assert Path(report.path).read_bytes()[8:10] == (4).to_bytes(2, "little")
    assert format_version({"t": {"encoding": "lossless"}}, None) == 1
    assert format_version({"t": {"encoding": "bfloat16"}}, None) == 2
    assert format_version({"t": {"encoding": "quantized", "coder": "ans-grouped"}}, None) == 3
    assert format_version({"t": {"encoding": "bfloat16", "bytes": "grouped"}}, None) == 4


def test_a_chain_written_in_format_1_still_loads_and_can_be_extended(tmp_path):
    expected = torch.load(FORMAT_1_CHAIN / "decoded.pt")
    for name, tensors in expected.items():
        assert (FORMAT_1_CHAIN / name).read_bytes()[8:10] == (1).to_bytes(2, "little")
        loaded = shrink.load(FORMAT_1_CHAIN / name)
        assert list(loaded) == list(tensors)
        assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert decode_chain(FORMAT_1_CHAIN / "1.shrunk")[2].config == QuantConfig(12, 0.0, protect=0.01)
    for name in ("0.shrunk", "1.shrunk"):
        (tmp_path / name).write_bytes((FORMAT_1_CHAIN / name).read_bytes())
    weights = expected["1.shrunk"]
    config = QuantConfig(bins=12, protect=0.01, type_bins={"linear": 8})
    previous = tmp_path / "1.shrunk"
    report = shrink.save(weights, tmp_path / "2.shrunk", previous=previous, config=config)
    assert report.kind == "delta" and report.chain_position == 2
    loaded = shrink.load(report.path)
    assert torch.equal(loaded["steps"], weights["steps"])
    assert loaded["layer.weight"].unique().numel() <= 8 + 1 + int(0.02 * 2048)
