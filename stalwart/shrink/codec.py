"""Tensors to sections and back: quantized (delta-coded indices) or lossless (byte-shuffled zstd).

A file's tensor table maps each name to an entry. Quantized entries hold the codebook, the coded
delta stream and the protected values; decoding one needs the previous checkpoint's indices, which
is why :func:`decode_chain` walks from the keyframe forward. Lossless entries (integer buffers,
optimizer state, everything when no quantization met the bound) are byte-shuffled first: grouping
the bytes of equal significance lets zstd find the repetition in exponents that interleaved floats
hide. Bfloat16 entries (small float32 tensors such as biases and norms, next to quantized weights)
are the same with the two low bytes of each value dropped.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stalwart.errors import CorruptCheckpointError
from stalwart.shrink.container import Container, SectionWriter, read_container
from stalwart.shrink.delta import (
    delta_indices,
    run_length_decode,
    run_length_encode,
    undelta_indices,
)
from stalwart.shrink.entropy import (
    DEFAULT_CODER,
    decode_stream,
    encode_stream,
    zstd_compress,
    zstd_decompress,
)
from stalwart.shrink.partition import QuantConfig
from stalwart.shrink.quantize import FIRST_LEVEL, PROTECTED, QuantizedTensor, TensorAnalysis

TENSOR_MARKER = "__stalwart_tensor__"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in a shrunken checkpoint")
    return dtype


def encode_lossless(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().reshape(flat.numel(), flat.element_size())
    return zstd_compress(np.ascontiguousarray(raw.T).tobytes())


def decode_lossless(blob: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = np.frombuffer(bytearray(zstd_decompress(blob)), dtype=np.uint8)
    count = raw.size // itemsize if itemsize else 0
    unshuffled = np.ascontiguousarray(raw.reshape(itemsize, count).T).reshape(-1)
    return torch.from_numpy(unshuffled).view(dtype).reshape(shape).clone()


# The oldest file format that can read each entry encoding. A file declares the oldest format
# that reads all of it, so a stalwart too old for one of its parts refuses the file instead of
# misreading it. Format 2 added bfloat16 entries and per-layer-type bin counts in the config.
ENCODING_FORMATS = {"lossless": 1, "quantized": 1, "bfloat16": 2}


def format_version(entries: Mapping[str, dict], config: QuantConfig | None) -> int:
    """The file format a table of entries and a configuration need."""
    version = 2 if config is not None and config.type_bins else 1
    return max([version, *(ENCODING_FORMATS[entry["encoding"]] for entry in entries.values())])


def bfloat16_entry(tensor: torch.Tensor, sections: SectionWriter) -> dict:
    """A float32 tensor rounded to bfloat16 (restored as float32)."""
    return {
        "encoding": "bfloat16",
        "dtype": dtype_name(tensor.dtype),
        "shape": list(tensor.shape),
        "data": sections.add(encode_lossless(tensor.to(torch.bfloat16))),
    }


def lossless_entry(tensor: torch.Tensor, sections: SectionWriter) -> dict:
    return {
        "encoding": "lossless",
        "dtype": dtype_name(tensor.dtype),
        "shape": list(tensor.shape),
        "data": sections.add(encode_lossless(tensor)),
    }


def quantized_entry(
    quantized: QuantizedTensor,
    previous: tuple[torch.Tensor, int] | None,
    coder: str,
    sections: SectionWriter,
    layer_type: str,
) -> dict:
    alphabet = quantized.alphabet if previous is None else max(quantized.alphabet, previous[1])
    deltas = delta_indices(quantized.indices, None if previous is None else previous[0], alphabet)
    keyframe = previous is None
    # Run-length coding pays off on long runs: deltas (mostly zero), not a keyframe's indices
    # when they change value more often than every fourth element.
    runs = not keyframe or np.count_nonzero(deltas[1:] != deltas[:-1]) <= deltas.size // 4
    if coder == "auto":
        # Measured, neither wins everywhere: rANS codes a delta at its zero-order entropy (char
        # transformer: 0.89 bits/element vs 1.30 for run lengths + zstd), while run lengths + zstd
        # also exploit runs of equal non-zero deltas, as when the bin count changes and a whole
        # group of the previous level shifts alike (digits CNN: 28.0x cumulative vs 19.7x).
        options = [("ans", False)] + ([("zstd", True)] if runs else [])
        if keyframe:
            options.append(("zstd", False))
    elif coder == "ans":
        options = [("ans", False)]
    else:
        options = ([(coder, True)] if runs else []) + ([(coder, False)] if keyframe else [])
    encoded = []
    for option_coder, run_length in options:
        symbols = run_length_encode(deltas) if run_length else deltas.view(np.int8)
        encoded.append(
            (len(blob := encode_stream(symbols, option_coder)), blob, option_coder, run_length)
        )
    _, stream, stream_coder, run_length = min(encoded, key=lambda option: option[0])
    return {
        "encoding": "quantized",
        "dtype": dtype_name(quantized.dtype),
        "shape": list(quantized.shape),
        "layer_type": layer_type,
        "alphabet": quantized.alphabet,
        "delta_alphabet": alphabet if previous is not None else None,
        "levels": sections.add(quantized.levels.float().numpy().tobytes()),
        "protected": sections.add(encode_lossless(quantized.protected)),
        "protected_count": int(quantized.protected.numel()),
        "stream": sections.add(stream),
        "run_length": run_length,
        "coder": stream_coder,
    }


def decode_quantized(
    container: Container, entry: dict, previous: torch.Tensor | None, coder: str
) -> QuantizedTensor:
    numel = int(np.prod(entry["shape"], dtype=np.int64))
    delta_alphabet = entry.get("delta_alphabet")
    if delta_alphabet is not None and previous is None:
        raise CorruptCheckpointError(
            f"{container.path}: a tensor is delta-coded but its base holds no indices for it"
        )
    stream = decode_stream(container.section(entry["stream"]), entry.get("coder", coder))
    deltas = run_length_decode(stream) if entry.get("run_length", True) else stream.view(np.uint8)
    if deltas.size != numel:
        raise CorruptCheckpointError(
            f"{container.path}: a tensor stream decodes to {deltas.size} values, expected {numel}"
        )
    indices = undelta_indices(deltas, previous if delta_alphabet else None, delta_alphabet or 0)
    levels = torch.from_numpy(np.frombuffer(container.section(entry["levels"]), np.float32).copy())
    protected = decode_lossless(
        container.section(entry["protected"]), torch.bfloat16, [entry["protected_count"]]
    )
    largest = int(indices.max()) if numel else 0
    if largest >= FIRST_LEVEL + levels.numel() or int((indices == PROTECTED).sum()) != int(
        protected.numel()
    ):
        raise CorruptCheckpointError(f"{container.path}: indices do not match the codebook")
    return QuantizedTensor(
        indices, levels, protected, tuple(entry["shape"]), dtype_of(entry["dtype"])
    )


def pack_object(
    obj: Any,
    sections: SectionWriter,
    *,
    lossy: QuantConfig | None = None,
    min_numel: int = 1024,
    coder: str = DEFAULT_CODER,
) -> dict:
    """Pack any checkpoint object: tensors byte-shuffled (or, with ``lossy``, quantized
    without delta when floating and at least ``min_numel`` elements), the rest pickled."""
    tensors: list[dict] = []

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if lossy is not None and value.is_floating_point() and value.numel() >= min_numel:
                quantized = TensorAnalysis(value).quantize(lossy)
                tensors.append(quantized_entry(quantized, None, coder, sections, "other"))
            else:
                tensors.append(lossless_entry(value, sections))
            return {TENSOR_MARKER: len(tensors) - 1}
        if isinstance(value, dict):
            return type(value)((key, strip(item)) for key, item in value.items())
        if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
            return type(value)(strip(item) for item in value)
        return value

    skeleton = io.BytesIO()
    torch.save(strip(obj), skeleton)
    return {"skeleton": sections.add(zstd_compress(skeleton.getvalue())), "tensors": tensors}


def decode_entry(
    container: Container,
    entry: dict,
    previous: torch.Tensor | None = None,
    *,
    values: bool = True,
) -> tuple[torch.Tensor | None, QuantizedTensor | None]:
    """One table entry back to a tensor (and its quantized form when it has one); with
    ``values=False`` a quantized entry is decoded to indices only (for a chain's inner files)."""
    if entry["encoding"] == "quantized":
        quantized = decode_quantized(container, entry, previous, container.header["coder"])
        return (quantized.dequantize() if values else None), quantized
    data = container.section(entry["data"])
    if entry["encoding"] == "bfloat16":
        rounded = decode_lossless(data, torch.bfloat16, entry["shape"])
        return rounded.to(dtype_of(entry["dtype"])), None
    if entry["encoding"] != "lossless":
        raise CorruptCheckpointError(
            f"{container.path}: unknown tensor encoding {entry['encoding']!r}; it was written by a "
            "newer stalwart. Upgrade stalwart to read it."
        )
    return decode_lossless(data, dtype_of(entry["dtype"]), entry["shape"]), None


def unpack_object(container: Container, packed: dict) -> Any:
    tensors = [decode_entry(container, entry)[0] for entry in packed["tensors"]]

    def fill(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {TENSOR_MARKER}:
                return tensors[value[TENSOR_MARKER]]
            return type(value)((key, fill(item)) for key, item in value.items())
        if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
            return type(value)(fill(item) for item in value)
        return value

    # The skeleton is the checkpoint's own non-tensor content (hyperparameters, loop state), as
    # trusted as the checkpoint a plain torch.load would read.
    skeleton = torch.load(
        io.BytesIO(zstd_decompress(container.section(packed["skeleton"]))), weights_only=False
    )
    return fill(skeleton)


@dataclass
class ChainState:
    """What the next delta needs from the last file of a chain (kept in memory between saves)."""

    path: Path
    crc32: int
    position: int
    since_keyframe: int
    shapes: dict[str, tuple[int, ...]]
    indices: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)
    config: QuantConfig | None = None
    levels: dict[str, torch.Tensor] = field(default_factory=dict)


def chain_files(path: str | Path) -> list[Container]:
    """The verified files from the chain's keyframe up to ``path``."""
    files = [read_container(path)]
    while files[-1].header["base"] is not None:
        base = files[-1].header["base"]
        base_path = files[-1].path.parent / base["file"]
        if not base_path.exists():
            raise CorruptCheckpointError(
                f"{files[-1].path} is a delta on {base_path}, which is missing. A delta cannot be "
                "restored without its base; restore the nearest keyframe or a later one instead "
                "(`stalwart shrink inspect` lists the chain)."
            )
        container = read_container(base_path)
        if container.crc32 != base["crc32"]:
            raise CorruptCheckpointError(
                f"{files[-1].path} is a delta on {base_path}, but that file was replaced by a "
                "different checkpoint (checksum differs); the delta cannot be restored."
            )
        files.append(container)
    return files[::-1]


def decode_chain(path: str | Path) -> tuple[Container, dict[str, torch.Tensor], ChainState]:
    """Decode ``path``: its tensors, and the chain state a following delta would need."""
    files = chain_files(path)
    indices: dict[str, tuple[torch.Tensor, int]] = {}
    tensors: dict[str, torch.Tensor] = {}
    levels: dict[str, torch.Tensor] = {}
    for position, container in enumerate(files):
        header = container.header
        current: dict[str, tuple[torch.Tensor, int]] = {}
        tensors = {}
        last = position == len(files) - 1
        for name, entry in header["tensors"].items():
            previous = indices.get(name)
            if not last and entry["encoding"] != "quantized":
                continue  # an inner file's lossless tensors are not needed by what follows
            tensors[name], quantized = decode_entry(
                container, entry, None if previous is None else previous[0], values=last
            )
            if quantized is not None:
                current[name] = (quantized.indices, quantized.alphabet)
                levels[name] = quantized.levels
        indices = current
    last = files[-1]
    config = last.header.get("config")
    state = ChainState(
        path=last.path,
        crc32=last.crc32,
        position=last.header["chain_position"],
        since_keyframe=len(files) - 1,
        shapes={name: tuple(entry["shape"]) for name, entry in last.header["tensors"].items()},
        indices=indices,
        config=None if config is None else QuantConfig.from_dict(config),
        levels=levels,
    )
    ordered = {name: tensors[name] for name in last.header["order"]}
    return last, ordered, state


def entries_bytes(entries: Mapping[str, dict]) -> int:
    total = 0
    for entry in entries.values():
        for key in ("data", "levels", "protected", "stream"):
            if key in entry:
                total += entry[key][1]
    return total
