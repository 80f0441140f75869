"""Tensors to sections and back: quantized (delta-coded indices), optimizer moments in their
cheaper forms (:mod:`stalwart.shrink.moments`), or lossless (byte planes, :mod:`.lossless`).

A file's tensor table maps each name to an entry. Quantized entries hold the codebook, the coded
delta stream and the protected values; decoding one needs the previous checkpoint's indices, which
is why :func:`decode_chain` walks from the keyframe forward. Lossless entries (integer buffers,
step counts, everything when no quantization met the bound) are coded by byte plane: grouping the
bytes of equal significance exposes the repetition in exponents that interleaved floats hide.
Bfloat16 entries (small float32 tensors such as biases and norms, next to quantized weights) are
the same with the two low bytes of each value dropped. Files up to format 3 stored lossless bytes
shuffled into one zstd stream (``encode_lossless``); they are still read.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stalwart.errors import CorruptCheckpointError, UnsafeCheckpointError
from stalwart.shrink.container import (
    Container,
    SectionWriter,
    is_torch_save_file,
    read_container,
)
from stalwart.shrink.delta import (
    delta_indices,
    run_length_decode,
    run_length_encode,
    undelta_indices,
)
from stalwart.shrink.entropy import (
    DEFAULT_CODER,
    GROUPED_CODERS,
    decode_stream,
    encode_stream,
    zstd_compress,
    zstd_decompress,
)
from stalwart.shrink.lossless import decode_grouped, encode_grouped
from stalwart.shrink.moments import (
    FIRST_MOMENT_CONFIGS,
    factored,
    from_log_indices,
    log_indices,
    unfactored,
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
    """Format <= 3 lossless bytes (shuffled, one zstd stream); kept for benchmarks and readers."""
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
# Format 3 added the grouped rANS coder of index streams. Format 4 added byte-plane lossless
# coding ("grouped", and "bytes": "grouped" on bfloat16 and protected values) and the optimizer
# moments' forms (zeros, factored, log). Format 5 stores a factored moment's sums in bfloat16
# ("sums": "bfloat16"; format 4 read them as float32).
ENCODING_FORMATS = {
    "lossless": 1, "quantized": 1, "bfloat16": 2, "grouped": 4, "zeros": 4, "factored": 4,
    "log": 4,
}  # fmt: skip
CODER_FORMATS = {"ans-grouped": 3}
GROUPED = "grouped"


def format_version(entries: Mapping[Any, dict], config: QuantConfig | None) -> int:
    """The file format a table of entries and a configuration need."""
    version = 2 if config is not None and config.type_bins else 1
    return max(
        [
            version,
            *(ENCODING_FORMATS[entry["encoding"]] for entry in entries.values()),
            *(CODER_FORMATS.get(entry.get("coder"), 1) for entry in entries.values()),
            *(4 for entry in entries.values() if entry.get("bytes") == GROUPED),
            *(5 for entry in entries.values() if entry.get("sums") not in (None, "float32")),
        ]
    )


def _head(tensor: torch.Tensor, encoding: str) -> dict:
    return {"encoding": encoding, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)}


def bfloat16_entry(tensor: torch.Tensor, sections: SectionWriter) -> dict:
    """A float32 tensor rounded to bfloat16 (restored as float32)."""
    data = sections.add(encode_grouped(tensor.to(torch.bfloat16)))
    return {**_head(tensor, "bfloat16"), "bytes": GROUPED, "data": data}


def lossless_entry(tensor: torch.Tensor, sections: SectionWriter) -> dict:
    return {**_head(tensor, GROUPED), "data": sections.add(encode_grouped(tensor))}


def moment_entry(tensor: torch.Tensor, form: str, coder: str, sections: SectionWriter) -> dict:
    """An optimizer moment in one of :mod:`stalwart.shrink.moments`' forms."""
    if form == "zero":
        return _head(tensor, "zeros")
    if form == "factored":
        rows, columns = factored(tensor)
        return {
            **_head(tensor, "factored"),
            "sums": dtype_name(rows.dtype),
            "rows": sections.add(encode_grouped(rows)),
            "columns": sections.add(encode_grouped(columns)),
        }
    if form == "log":
        indices, offset = log_indices(tensor)
        stream = encode_stream(indices.view(np.int8), "ans")
        return {**_head(tensor, "log"), "offset": offset, "stream": sections.add(stream)}
    if form in FIRST_MOMENT_CONFIGS:
        quantized = TensorAnalysis(tensor).quantize(FIRST_MOMENT_CONFIGS[form])
        return quantized_entry(quantized, None, coder, sections, "other")
    return lossless_entry(tensor, sections)


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
    # Delta streams are ordered by the previous level; a grouped coder codes each level's group
    # under its own frequencies (the decoder counts the groups from the previous indices itself).
    if keyframe:
        groups = np.array([deltas.size])
    else:
        groups = np.bincount(previous[0].numpy(), minlength=alphabet)
    if coder == "auto":
        # Measured, none wins everywhere: rANS per previous level codes a delta at its conditional
        # entropy (char transformer chain: 6.6% fewer stream bytes than the other two; one
        # distribution per tensor still wins on small tensors, where the per-level tables cost
        # more than they save), while run lengths +
        # zstd also exploit runs of equal non-zero deltas, as when the bin count changes and a
        # whole group of the previous level shifts alike (digits CNN: 28.0x cumulative vs 19.7x).
        options = [("ans-grouped", False)] + ([] if keyframe else [("ans", False)])
        options += [("zstd", True)] if runs else []
        if keyframe:
            options.append(("zstd", False))
    elif coder in ("ans", "ans-grouped"):
        options = [(coder, False)]
    else:
        options = ([(coder, True)] if runs else []) + ([(coder, False)] if keyframe else [])
    encoded = []
    for option_coder, run_length in options:
        symbols = run_length_encode(deltas) if run_length else deltas.view(np.int8)
        blob = encode_stream(symbols, option_coder, groups)
        encoded.append((len(blob), blob, option_coder, run_length, None))
    if keyframe and coder in ("auto", "ans-grouped"):
        rows = split_constant_rows(deltas, quantized.shape)
        if rows is not None:
            side, rest = rows
            blob = encode_stream(rest.view(np.int8), "ans-grouped")
            encoded.append((len(blob) + len(side), blob, "ans-grouped", False, side))
    _, stream, stream_coder, run_length, side = min(encoded, key=lambda option: option[0])
    return {
        **({} if side is None else {"constant_rows": sections.add(side)}),
        "encoding": "quantized",
        "dtype": dtype_name(quantized.dtype),
        "shape": list(quantized.shape),
        "layer_type": layer_type,
        "alphabet": quantized.alphabet,
        "delta_alphabet": alphabet if previous is not None else None,
        "levels": sections.add(quantized.levels.float().numpy().tobytes()),
        "protected": sections.add(encode_grouped(quantized.protected)),
        "bytes": GROUPED,
        "protected_count": int(quantized.protected.numel()),
        "stream": sections.add(stream),
        "run_length": run_length,
        "coder": stream_coder,
    }


def split_constant_rows(
    indices: np.ndarray, shape: tuple[int, ...]
) -> tuple[bytes, np.ndarray] | None:
    """(side section, the other rows' indices) when some rows of a matrix are one index throughout.

    Whole rows pruned is what dead units look like (a ReLU unit that never fires has no gradient,
    so sensitivity pruning removes its row): 20% of the digits CNN's hidden layer at its second
    keyframe. A zero-order coder pays ~4 bits for each of their elements; stored as a row mask and
    one index per row they cost a bit per row. (In a delta such a row is zeros anyway.)
    """
    if len(shape) < 2 or shape[0] < 2 or indices.size == 0:
        return None
    rows = indices.reshape(shape[0], -1)
    constant = (rows == rows[:, :1]).all(axis=1)
    if not constant.any():
        return None
    side = zstd_compress(np.packbits(constant).tobytes() + rows[constant, 0].tobytes())
    return side, np.ascontiguousarray(rows[~constant]).reshape(-1)


def constant_rows_of(side: bytes, shape: list[int], path: Path) -> tuple[int, int, np.ndarray]:
    """(rows, row width, constant-row mask) from a :func:`split_constant_rows` side section."""
    raw = np.frombuffer(zstd_decompress(side), np.uint8)
    rows = int(shape[0]) if shape else 0
    mask_bytes = (rows + 7) // 8
    constant = np.unpackbits(raw[:mask_bytes], count=rows).astype(bool) if rows else raw[:0]
    if len(shape) < 2 or raw.size != mask_bytes + int(constant.sum()):
        raise CorruptCheckpointError(f"{path}: a constant-rows section does not match its tensor")
    return rows, int(np.prod(shape[1:], dtype=np.int64)), constant


def join_constant_rows(
    side: bytes, constant: np.ndarray, rest: np.ndarray, width: int
) -> np.ndarray:
    """Inverse of :func:`split_constant_rows`: the full index matrix, flat."""
    values = np.frombuffer(zstd_decompress(side), np.uint8)[(constant.size + 7) // 8 :]
    if rest.size != int((~constant).sum()) * width:
        raise CorruptCheckpointError(
            f"a tensor stream decodes to {rest.size} values, its non-constant rows hold "
            f"{int((~constant).sum()) * width}"
        )
    out = np.empty((constant.size, width), dtype=np.uint8)
    out[constant] = values[:, None]
    out[~constant] = rest.reshape(-1, width)
    return out.reshape(-1)


def decode_quantized(
    container: Container, entry: dict, previous: torch.Tensor | None, coder: str
) -> QuantizedTensor:
    numel = int(np.prod(entry["shape"], dtype=np.int64))
    delta_alphabet = entry.get("delta_alphabet")
    if delta_alphabet is not None and previous is None:
        raise CorruptCheckpointError(
            f"{container.path}: a tensor is delta-coded but its base holds no indices for it"
        )
    stream_coder = entry.get("coder", coder)
    groups = None
    if stream_coder in GROUPED_CODERS:
        groups = (
            np.array([numel])
            if delta_alphabet is None
            else np.bincount(previous.numpy(), minlength=delta_alphabet)
        )
    side = entry.get("constant_rows")
    if side is not None:
        side = container.section(side)
        rows, width, constant = constant_rows_of(side, entry["shape"], container.path)
        groups = np.array([(rows - int(constant.sum())) * width])
    stream = decode_stream(container.section(entry["stream"]), stream_coder, groups)
    deltas = run_length_decode(stream) if entry.get("run_length", True) else stream.view(np.uint8)
    if side is not None:
        deltas = join_constant_rows(side, constant, deltas, width)
    if deltas.size != numel:
        raise CorruptCheckpointError(
            f"{container.path}: a tensor stream decodes to {deltas.size} values, expected {numel}"
        )
    indices = undelta_indices(deltas, previous if delta_alphabet else None, delta_alphabet or 0)
    levels = torch.from_numpy(np.frombuffer(container.section(entry["levels"]), np.float32).copy())
    protected = _decode_bytes(
        container.section(entry["protected"]), entry, torch.bfloat16, [entry["protected_count"]]
    )
    largest = int(indices.max()) if numel else 0
    if largest >= FIRST_LEVEL + levels.numel() or int((indices == PROTECTED).sum()) != int(
        protected.numel()
    ):
        raise CorruptCheckpointError(f"{container.path}: indices do not match the codebook")
    return QuantizedTensor(
        indices, levels, protected, tuple(entry["shape"]), dtype_of(entry["dtype"])
    )


def map_items(value: Any, convert: Callable[[Any], Any]) -> Any:
    """``value`` with ``convert`` applied to each item when it is a dict, list or tuple, of the
    same type; any other value as it is.

    A subclass's constructor need not take what its base's does (``Counter(pairs)`` counts the
    pairs, ``defaultdict`` takes a factory first, a namedtuple its fields one by one), so a dict
    or list subclass is copied, which keeps its type and what it carries (a defaultdict's factory,
    an OrderedDict's order), and its items replaced; a tuple subclass is rebuilt only when its
    constructor gives back the items it is given, and otherwise kept whole (pickled as
    ``torch.save`` does, tensors in it included).
    """
    kind = type(value)
    if kind is dict:
        return {key: convert(item) for key, item in value.items()}
    if kind is list or kind is tuple:
        return kind(convert(item) for item in value)
    if isinstance(value, dict):
        rebuilt = copy.copy(value)
        for key, item in value.items():
            rebuilt[key] = convert(item)
        return rebuilt
    if isinstance(value, list):
        rebuilt = copy.copy(value)
        rebuilt[:] = [convert(item) for item in value]
        return rebuilt
    if isinstance(value, tuple) and _rebuilds_from_items(value):
        return kind([convert(item) for item in value])
    return value


def _rebuilds_from_items(value: tuple) -> bool:
    """Whether ``type(value)(items)`` makes a ``value`` of the same items (torch.Size, a
    structseq; not a namedtuple, whose constructor takes its fields as arguments)."""
    try:
        probe = type(value)(list(value))
    except Exception:  # any constructor of a user's class may refuse a list in its own way
        return False
    return (
        type(probe) is type(value)
        and len(probe) == len(value)
        and all(new is old for new, old in zip(probe, value, strict=True))
    )


def pack_object(
    obj: Any,
    sections: SectionWriter,
    *,
    lossy: QuantConfig | None = None,
    min_numel: int = 1024,
    coder: str = DEFAULT_CODER,
    forms: Mapping[int, str] | None = None,
    ids: list[int] | None = None,
) -> dict:
    """Pack any checkpoint object: tensors in byte planes (or, with ``lossy``, quantized
    without delta when floating and at least ``min_numel`` elements), the rest pickled.

    ``forms`` maps ``id(tensor)`` of optimizer moments to their form (see
    :mod:`stalwart.shrink.moments`); those are stored in it whatever ``lossy`` says. ``ids``,
    when given, receives ``id(tensor)`` of each stored tensor in entry order (for accounting).
    """
    tensors: list[dict] = []
    forms = forms or {}

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            form = forms.get(id(value))  # before detach(): that makes a new tensor object
            if ids is not None:
                ids.append(id(value))
            value = value.detach().cpu()
            if form is not None:
                tensors.append(moment_entry(value, form, coder, sections))
            elif (
                lossy is not None
                and value.is_floating_point()
                and value.numel() >= min_numel
                and bool(torch.isfinite(value).all())  # NaN/inf stay exact (api._non_finite)
            ):
                quantized = TensorAnalysis(value).quantize(lossy)
                tensors.append(quantized_entry(quantized, None, coder, sections, "other"))
            else:
                tensors.append(lossless_entry(value, sections))
            return {TENSOR_MARKER: len(tensors) - 1}
        return map_items(value, strip)

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
    encoding, dtype, shape = entry["encoding"], dtype_of(entry["dtype"]), entry["shape"]
    if encoding == "zeros":
        return torch.zeros(tuple(shape), dtype=dtype), None
    if encoding == "factored":
        sums = dtype_of(entry.get("sums", "float32"))  # format 4 stored them in float32
        rows = decode_grouped(container.section(entry["rows"]), sums, [shape[0]])
        width = int(np.prod(shape[1:], dtype=np.int64))
        columns = decode_grouped(container.section(entry["columns"]), sums, [width])
        return unfactored(rows, columns, shape, dtype), None
    if encoding == "log":
        indices = decode_stream(container.section(entry["stream"]), "ans").view(np.uint8)
        if indices.size != int(np.prod(shape, dtype=np.int64)):
            raise CorruptCheckpointError(
                f"{container.path}: a second-moment stream decodes to {indices.size} values"
            )
        return from_log_indices(indices, int(entry["offset"]), shape, dtype), None
    if encoding not in ("bfloat16", "lossless", GROUPED):
        raise CorruptCheckpointError(
            f"{container.path}: unknown tensor encoding {entry['encoding']!r}; it was written by a "
            "newer stalwart. Upgrade stalwart to read it."
        )
    data = container.section(entry["data"])
    if encoding == "bfloat16":
        return _decode_bytes(data, entry, torch.bfloat16, shape).to(dtype), None
    if encoding == GROUPED:
        return decode_grouped(data, dtype, shape), None
    return decode_lossless(data, dtype, shape), None


def _decode_bytes(blob: bytes, entry: dict, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """Lossless bytes of an entry: byte planes (format 4) or the older shuffled zstd stream."""
    if entry.get("bytes") == GROUPED:
        return decode_grouped(blob, dtype, shape)
    return decode_lossless(blob, dtype, shape)


def skeleton_safe_globals() -> list:
    """Plain data types a checkpoint's non-tensor part may hold besides what ``weights_only``
    allows by itself: Composer's checkpoints keep numpy RNG states (arrays), a run's duration
    (timedelta) and the torch version. None of them runs code when unpickled."""
    import datetime

    try:
        reconstruct = np._core.multiarray._reconstruct  # numpy >= 2
    except AttributeError:  # pragma: no cover - numpy 1.x
        reconstruct = np.core.multiarray._reconstruct
    dtypes = [type(np.dtype(kind)) for kind in ("u1", "u4", "i8", "f4", "f8", "b1")]
    return [
        reconstruct, np.ndarray, np.dtype, *dtypes, datetime.timedelta,
        torch.torch_version.TorchVersion,
    ]  # fmt: skip


def unpack_object(container: Container, packed: dict, *, weights_only: bool = True) -> Any:
    """The object :func:`pack_object` stored.

    Its non-tensor part (the skeleton: hyperparameters, loop state) is unpickled like
    ``torch.load`` does: with ``weights_only=True`` (the default, as torch's since 2.6) only
    plain containers and numbers load, so a file from someone else cannot run code; ``False``
    loads anything, for files you trust.
    """
    tensors = [decode_entry(container, entry)[0] for entry in packed["tensors"]]

    def fill(value: Any) -> Any:
        if isinstance(value, dict) and set(value) == {TENSOR_MARKER}:
            return tensors[value[TENSOR_MARKER]]
        return map_items(value, fill)

    blob = io.BytesIO(zstd_decompress(container.section(packed["skeleton"])))
    try:
        with torch.serialization.safe_globals(skeleton_safe_globals()):
            skeleton = torch.load(blob, weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if "global" in line.lower()]
        raise UnsafeCheckpointError(
            f"{container.path}: its non-tensor part holds objects that loading with "
            f"weights_only=True refuses ({lines[0] if lines else type(exc).__name__}). Nothing "
            "was run. If you trust where this file "
            "comes from, load it with weights_only=False (stalwart.shrink.load_with_extra(path, "
            "weights_only=False), or trainer.fit(..., ckpt_path=path, weights_only=False)); or "
            "allow the types with torch.serialization.add_safe_globals([...])."
        ) from None
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
    # Per optimizer state: its moment keys and hyperparameter names (a change starts a keyframe).
    optimizer_signature: list | None = None


def superseded_path(base_path: Path, crc32: int) -> Path:
    """Where a file that was overwritten while a live delta still needed it is kept: hidden,
    beside the new file, named by the content's CRC-32 that the delta records (see
    :class:`~stalwart.shrink.chain.ChainWriter`)."""
    return base_path.parent / f".{base_path.name}.superseded-{crc32:08x}"


def _read_base(delta: Path, base_path: Path, crc32: int) -> Container:
    """The base a delta was written against: the file at its path, or the copy kept aside when
    that path was written again."""
    kept = superseded_path(base_path, crc32)
    if base_path.exists():
        # A plain checkpoint written over the base (a save without ShrinkCheckpoint's request)
        # is a replacement like any other: the copy kept aside, if any, is the base.
        if not is_torch_save_file(base_path):
            container = read_container(base_path)
            if container.crc32 == crc32:
                return container
        if not kept.exists():
            raise CorruptCheckpointError(
                f"{delta} is a delta on {base_path}, but that file was replaced by a "
                "different checkpoint (checksum differs); the delta cannot be restored."
            )
    elif not kept.exists():
        raise CorruptCheckpointError(
            f"{delta} is a delta on {base_path}, which is missing. A delta cannot be "
            "restored without its base; restore the nearest keyframe or a later one instead "
            "(`stalwart shrink inspect` lists the chain)."
        )
    container = read_container(kept)
    if container.crc32 != crc32:
        raise CorruptCheckpointError(
            f"{delta} is a delta on {base_path}, kept as {kept.name}, but that copy's checksum "
            "differs; the delta cannot be restored."
        )
    return container


def real_file(path: str | Path) -> Path:
    """The file a link at ``path`` points to (``path`` itself when it is no link).

    A chain is the real file's: its bases lie beside it, and a run resumed through a link
    (Lightning's ``save_last="link"``, a user's ``latest.ckpt``) extends the file, not the link,
    which its next save moves. In the link's own folder the folder keeps the spelling it was
    given, so a base's name stays relative to it; elsewhere it is the resolved path.
    """
    path = Path(path)
    if not path.is_symlink():
        return path
    real = path.resolve()
    if real.parent == path.parent.resolve():
        return path.parent / real.name
    return real


def chain_files(path: str | Path) -> list[Container]:
    """The verified files from the chain's keyframe up to ``path`` (the file a link points to)."""
    files = [read_container(real_file(path))]
    seen = {files[0].crc32}
    while files[-1].header["base"] is not None:
        base = files[-1].header["base"]
        base_path = files[-1].path.parent / base["file"]
        container = _read_base(files[-1].path, base_path, base["crc32"])
        if container.crc32 in seen:  # only files made by hand can loop: a base is older
            raise CorruptCheckpointError(
                f"{path} cannot be restored: its chain of bases loops back at {base_path}. "
                "Restore another file of the chain (`stalwart shrink inspect` lists them)."
            )
        seen.add(container.crc32)
        files.append(container)
    return files[::-1]


def _chain_state(
    container: Container,
    indices: dict[str, tuple[torch.Tensor, int]],
    levels: dict[str, torch.Tensor],
    since_keyframe: int,
) -> ChainState:
    header = container.header
    config = header.get("config")
    return ChainState(
        path=container.path,
        crc32=container.crc32,
        position=header["chain_position"],
        since_keyframe=since_keyframe,
        shapes={name: tuple(entry["shape"]) for name, entry in header["tensors"].items()},
        indices=indices,
        config=None if config is None else QuantConfig.from_dict(config),
        levels=levels,
        optimizer_signature=(header.get("optimizer") or {}).get("signature"),
    )


def decode_chain(
    path: str | Path,
) -> tuple[Container, dict[str, torch.Tensor], ChainState | None]:
    """Decode ``path``: its tensors, and the chain state a following delta would need.

    That state is ``path``'s own, except for a side file (written with ``side=True``, such as a
    ``last.ckpt`` rewritten at every save): nothing may extend a file that will be overwritten,
    so a following delta extends its base (None when it is a keyframe: a following save is one
    too).
    """
    files = chain_files(path)
    side = bool(files[-1].header.get("side"))
    indices: dict[str, tuple[torch.Tensor, int]] = {}
    tensors: dict[str, torch.Tensor] = {}
    levels: dict[str, torch.Tensor] = {}
    follow: ChainState | None = None
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
        if side and position == len(files) - 2:
            follow = _chain_state(container, indices, dict(levels), position)
    last = files[-1]
    if not side:
        follow = _chain_state(last, indices, levels, len(files) - 1)
    ordered = {name: tensors[name] for name in last.header["order"]}
    return last, ordered, follow


def entries_bytes(entries: Mapping[str, dict]) -> int:
    total = 0
    for entry in entries.values():
        for key in ("data", "levels", "protected", "stream", "constant_rows", "rows", "columns"):
            if key in entry:
                total += entry[key][1]
    return total
