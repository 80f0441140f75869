"""Baseline checkpoint formats that ``shrink_vs_baselines.py`` measures stalwart's shrink against.

Each is a Lightning :class:`~lightning.fabric.plugins.CheckpointIO`, so a Trainer saves with it and
``trainer.fit(ckpt_path=...)`` resumes from it exactly as from stalwart's files:

- :class:`TorchSaveIO`: plain ``torch.save`` (Lightning's own format; the uncompressed reference).
- :class:`ZstdTorchSaveIO`: ``torch.save`` bytes compressed with zstd (lossless).
- :class:`Bf16WeightsIO`: float weights cast to bfloat16 (a relative rounding error of at most
  2**-9 each), the rest ``torch.save`` + zstd. Not a contender: the smallest perturbation a lossy
  restore makes, i.e. the floor of how far a final metric moves when training goes on from
  weights that are not bit-exact.
- :class:`UniformDeltaIO` (QD-compressor-style, Jin et al. 2023): every float weight tensor
  quantized uniformly to 8 bits between its min and max; the integer codes are delta-coded against
  the previous checkpoint's codes, ``(q_cur - q_prev) mod 2**bits`` (QD's cyclic buffer), then
  zstd; a full (keyframe) checkpoint every ``keyframe_every`` saves, as stalwart does.
- :class:`ByteGroupedIO` (ZipNN-style, Hershcovitch et al. 2024): every tensor of the checkpoint
  (weights and optimizer state) lossless, bytes grouped by significance and entropy-coded per
  plane (stalwart's own coder, :mod:`stalwart.shrink.lossless`: the floor for anything kept
  lossless).
- :class:`ExcpStyleIO` (ExCP-style, Li et al. 2024): weight residuals against the previous
  (reconstructed) checkpoint and Adam's moments pruned jointly (a residual is kept where
  ``|dW| > alpha / sqrt(v) * median|W|``; a moment where ``|m| > beta * mean|m|`` and its residual
  is kept), then the kept values uniformly quantized to 4 bits (ExCP quantizes non-uniformly;
  this baseline is the issue's "residual + joint pruning + uniform quantization"); a keyframe
  (residual against zero, weights at 8 bits unpruned) every ``keyframe_every`` saves.
- :class:`AdaptiveUniformIO` (Check-N-Run-style, Eisenman et al. 2022): per tensor, the fewest bits
  of {2, 3, 4, 8} whose relative L2 error is <= ``threshold``, with the clipping range found by
  Guan et al.'s (2019) greedy range search (the quantizer Check-N-Run uses); no delta (Check-N-Run's
  delta scheme is specific to recommendation embeddings, as the Inshrinkerator paper notes).

Quantized methods keep tensors with fewer than ``min_numel`` elements (biases, norms) and integer
buffers lossless, like stalwart, and store everything but ``checkpoint["state_dict"]``
(optimizer, loops, callbacks) as ``torch.save`` + zstd. Codes are stored one per byte and
zstd-compressed: zstd's Huffman literals bring them to about their entropy.

Every IO records, per save, the raw and stored bytes of the weights and of the whole checkpoint and
the seconds spent (serialise + compress + write), and, per load, the seconds spent.
"""

from __future__ import annotations

import io
import json
import os
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard
from lightning.fabric.plugins import CheckpointIO

from stalwart.errors import CorruptCheckpointError
from stalwart.shrink.lossless import decode_grouped, encode_grouped

ZSTD_LEVEL = 3  # the level stalwart's shrink uses
MIN_QUANTIZED_NUMEL = 1024  # stalwart's default: smaller tensors stay lossless
MAGIC = b"SHRBASE1"
FRAME = struct.Struct("<8sQQ")  # magic, weights section length, rest section length
WEIGHTS = struct.Struct("<QQQ")  # header, codes, raw stream lengths


def tensor_bytes(obj: Any) -> int:
    """Raw bytes of every tensor inside ``obj`` (dicts, lists, tuples), as stalwart counts them."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(value) for value in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(value) for value in obj)
    return 0


def torch_save_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def torch_load_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)


def unzstd(data: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(data)


def write_atomic(path: Path, data: bytes) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_bytes(data)
    os.replace(temp, path)


@dataclass
class SaveRecord:
    """Sizes and time of one checkpoint a baseline wrote."""

    path: str
    kind: str  # "snapshot", "keyframe" or "delta"
    weight_bytes: int
    weight_stored: int
    total_bytes: int
    total_stored: int
    seconds: float
    detail: dict = field(default_factory=dict)
    torch_save_bytes: int = 0  # the same checkpoint as a torch.save file (the reference)

    @property
    def ratio(self) -> float:
        return self.weight_bytes / max(self.weight_stored, 1)

    @property
    def total_ratio(self) -> float:
        return self.total_bytes / max(self.total_stored, 1)


class MeasuredCheckpointIO(CheckpointIO):
    """A CheckpointIO that records what each save and load cost; subclasses choose the format.

    The file is ``FRAME`` + the weights section (``encode_weights``) + the rest of the checkpoint
    as ``torch.save`` + zstd. ``saves`` and ``load_seconds`` accumulate over the IO's life.
    """

    name = "measured"

    def __init__(self) -> None:
        self.saves: list[SaveRecord] = []
        self.load_seconds: list[float] = []

    # --- what subclasses provide ---------------------------------------------------------------

    def encode_weights(
        self, state_dict: Mapping[str, torch.Tensor], path: Path
    ) -> tuple[bytes, str, dict]:
        raise NotImplementedError

    def decode_weights(self, blob: bytes, path: Path) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def encode_rest(self, rest: dict[str, Any], path: Path) -> bytes:
        """Everything but the weights; default ``torch.save`` + zstd."""
        return zstd(torch_save_bytes(rest))

    def decode_rest(self, blob: bytes, path: Path) -> dict[str, Any]:
        return torch_load_bytes(unzstd(blob))

    # --- CheckpointIO ----------------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        weights = checkpoint["state_dict"]
        rest = {key: value for key, value in checkpoint.items() if key != "state_dict"}
        weight_blob, kind, detail = self.encode_weights(weights, path)
        rest_blob = self.encode_rest(rest, path)
        data = FRAME.pack(MAGIC, len(weight_blob), len(rest_blob)) + weight_blob + rest_blob
        write_atomic(path, data)
        seconds = time.perf_counter() - start
        self.saves.append(
            SaveRecord(
                path=str(path),
                kind=kind,
                weight_bytes=tensor_bytes(weights),
                weight_stored=FRAME.size + len(weight_blob),
                total_bytes=tensor_bytes(checkpoint),
                total_stored=len(data),
                seconds=seconds,
                detail=detail,
                torch_save_bytes=len(torch_save_bytes(checkpoint)),  # outside the timed save
            )
        )

    def _sections(self, path: Path) -> tuple[bytes, bytes]:
        data = path.read_bytes()
        if len(data) < FRAME.size:
            raise CorruptCheckpointError(f"{path} is truncated ({len(data)} bytes)")
        magic, weights_len, rest_len = FRAME.unpack_from(data)
        if magic != MAGIC or len(data) != FRAME.size + weights_len + rest_len:
            raise CorruptCheckpointError(f"{path} is not a complete {self.name} checkpoint")
        weights = data[FRAME.size : FRAME.size + weights_len]
        return weights, data[FRAME.size + weights_len :]

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = Path(path)
        start = time.perf_counter()
        weight_blob, rest_blob = self._sections(path)
        checkpoint = self.decode_rest(rest_blob, path)
        checkpoint["state_dict"] = self.decode_weights(weight_blob, path)
        self.load_seconds.append(time.perf_counter() - start)
        return checkpoint

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        Path(path).unlink(missing_ok=True)


class TorchSaveIO(MeasuredCheckpointIO):
    """Plain ``torch.save`` of the whole checkpoint: Lightning's own file, the reference.

    The weights' share of the file is measured by ``torch.save`` of the state_dict alone, outside
    the timed save.
    """

    name = "torch.save"

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        data = torch_save_bytes(checkpoint)
        write_atomic(path, data)
        seconds = time.perf_counter() - start
        self.saves.append(
            SaveRecord(
                path=str(path),
                kind="snapshot",
                weight_bytes=tensor_bytes(checkpoint["state_dict"]),
                weight_stored=len(torch_save_bytes(checkpoint["state_dict"])),
                total_bytes=tensor_bytes(checkpoint),
                total_stored=len(data),
                seconds=seconds,
                torch_save_bytes=len(data),
            )
        )

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        start = time.perf_counter()
        checkpoint = torch_load_bytes(Path(path).read_bytes())
        self.load_seconds.append(time.perf_counter() - start)
        return checkpoint


class ZstdTorchSaveIO(MeasuredCheckpointIO):
    """``torch.save`` + zstd: the weights and the rest as two zstd-compressed sections."""

    name = "torch.save+zstd"

    def encode_weights(
        self, state_dict: Mapping[str, torch.Tensor], path: Path
    ) -> tuple[bytes, str, dict]:
        return zstd(torch_save_bytes(dict(state_dict))), "snapshot", {}

    def decode_weights(self, blob: bytes, path: Path) -> dict[str, torch.Tensor]:
        return torch_load_bytes(unzstd(blob))


class Bf16WeightsIO(MeasuredCheckpointIO):
    """Float weights as bfloat16 (see the module docstring); other tensors as they are."""

    name = "bf16 weights"

    def encode_weights(
        self, state_dict: Mapping[str, torch.Tensor], path: Path
    ) -> tuple[bytes, str, dict]:
        dtypes = {name: str(t.dtype).removeprefix("torch.") for name, t in state_dict.items()}
        cast = {n: t.bfloat16() if t.is_floating_point() else t for n, t in state_dict.items()}
        return zstd(torch_save_bytes({"dtypes": dtypes, "weights": cast})), "snapshot", {}

    def decode_weights(self, blob: bytes, path: Path) -> dict[str, torch.Tensor]:
        saved = torch_load_bytes(unzstd(blob))
        dtypes = saved["dtypes"]
        return {name: t.to(getattr(torch, dtypes[name])) for name, t in saved["weights"].items()}


def _grouped_pack(obj: Any) -> bytes:
    """``obj`` with every tensor byte-grouped (:func:`encode_grouped`), the rest pickled."""
    blobs: list[bytes] = []

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu()
            blobs.append(encode_grouped(tensor))
            return ("__grouped__", len(blobs) - 1, str(tensor.dtype).removeprefix("torch."),
                    list(tensor.shape))  # fmt: skip
        if isinstance(value, dict):
            return {key: strip(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(strip(item) for item in value)
        return value

    skeleton = zstd(torch_save_bytes(strip(obj)))
    lengths = [len(skeleton), *(len(blob) for blob in blobs)]
    return struct.pack(f"<Q{len(lengths)}Q", len(lengths), *lengths) + skeleton + b"".join(blobs)


def _grouped_unpack(data: bytes) -> Any:
    (count,) = struct.unpack_from("<Q", data)
    lengths = struct.unpack_from(f"<{count}Q", data, 8)
    offsets = np.cumsum([8 + 8 * count, *lengths])
    parts = [data[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    skeleton, blobs = torch_load_bytes(unzstd(parts[0])), parts[1:]

    def fill(value: Any) -> Any:
        if isinstance(value, tuple) and len(value) == 4 and value[0] == "__grouped__":
            return decode_grouped(blobs[value[1]], getattr(torch, value[2]), value[3])
        if isinstance(value, dict):
            return {key: fill(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(fill(item) for item in value)
        return value

    return fill(skeleton)


class ByteGroupedIO(MeasuredCheckpointIO):
    """ZipNN-style lossless: every tensor (weights, optimizer state) byte-grouped and entropy-coded
    per plane (stalwart's coder); the rest pickled + zstd."""

    name = "byte-grouped lossless"

    def encode_weights(
        self, state_dict: Mapping[str, torch.Tensor], path: Path
    ) -> tuple[bytes, str, dict]:
        return _grouped_pack(dict(state_dict)), "snapshot", {}

    def decode_weights(self, blob: bytes, path: Path) -> dict[str, torch.Tensor]:
        return _grouped_unpack(blob)

    def encode_rest(self, rest: dict[str, Any], path: Path) -> bytes:
        return _grouped_pack(rest)

    def decode_rest(self, blob: bytes, path: Path) -> dict[str, Any]:
        return _grouped_unpack(blob)


# --- uniform quantization ------------------------------------------------------------------------


def quantize_uniform(
    x: torch.Tensor, low: float, high: float, bits: int
) -> tuple[torch.Tensor, float]:
    """uint8 codes of ``x`` (flat float32) on ``2**bits`` evenly spaced levels from low to high."""
    top = 2**bits - 1
    scale = (high - low) / top if high > low else 1.0
    codes = torch.clamp(torch.round((x - low) / scale), 0, top).to(torch.uint8)
    return codes, scale


def dequantize_uniform(codes: torch.Tensor, low: float, scale: float) -> torch.Tensor:
    return codes.float() * scale + low


def squared_error(x: torch.Tensor, low: float, high: float, bits: int) -> float:
    codes, scale = quantize_uniform(x, low, high, bits)
    return float(torch.sum((dequantize_uniform(codes, low, scale) - x) ** 2))


def greedy_range(
    x: torch.Tensor, bits: int, steps: int = 50, max_shrink: float = 0.5
) -> tuple[float, float, float]:
    """Guan et al. (2019)'s greedy clipping range: shrink [min, max] one step at a time from the
    side that lowers the L2 error more, up to ``max_shrink`` of the range; keep the best seen.

    Returns (low, high, squared error). The loop runs over at most ``steps * max_shrink`` range
    steps, each a vectorised pass over the tensor.
    """
    low, high = float(x.min()), float(x.max())
    best = (low, high, squared_error(x, low, high, bits))
    if high <= low:
        return best
    step = (high - low) / steps
    for _ in range(int(steps * max_shrink)):
        left = squared_error(x, low + step, high, bits)
        right = squared_error(x, low, high - step, bits)
        if left < right:
            low, error = low + step, left
        else:
            high, error = high - step, right
        if error < best[2]:
            best = (low, high, error)
    return best


class _QuantizedIO(MeasuredCheckpointIO):
    """Shared layout of the quantized baselines' weights section.

    ``zstd(json header)`` + ``zstd(codes)`` + ``zstd(raw bytes of the lossless tensors)``, where
    codes are the uint8 codes of every quantized tensor, concatenated in state_dict order.
    """

    def __init__(self, min_numel: int = MIN_QUANTIZED_NUMEL) -> None:
        super().__init__()
        self.min_numel = min_numel

    def quantize(self, name: str, flat: torch.Tensor) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    def _split(
        self, state_dict: Mapping[str, torch.Tensor]
    ) -> tuple[list[dict], torch.Tensor, bytes]:
        entries: list[dict] = []
        codes: list[torch.Tensor] = []
        raw: list[bytes] = []
        code_offset = raw_offset = 0
        for name, tensor in state_dict.items():
            tensor = tensor.detach().cpu().contiguous()
            entry = {"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                     "shape": list(tensor.shape)}  # fmt: skip
            if tensor.is_floating_point() and tensor.numel() >= self.min_numel:
                tensor_codes, params = self.quantize(name, tensor.reshape(-1).float())
                entry.update(params, mode="q", offset=code_offset)
                codes.append(tensor_codes)
                code_offset += tensor_codes.numel()
            else:
                data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
                entry.update(mode="raw", offset=raw_offset, nbytes=len(data))
                raw.append(data)
                raw_offset += len(data)
            entries.append(entry)
        flat_codes = torch.cat(codes) if codes else torch.empty(0, dtype=torch.uint8)
        return entries, flat_codes, b"".join(raw)

    def _pack(self, header: dict, codes: torch.Tensor, raw: bytes) -> bytes:
        parts = [zstd(json.dumps(header).encode()), zstd(codes.numpy().tobytes()), zstd(raw)]
        return WEIGHTS.pack(*(len(p) for p in parts)) + b"".join(parts)

    @staticmethod
    def _unpack(blob: bytes, path: Path) -> tuple[dict, torch.Tensor, bytes]:
        if len(blob) < WEIGHTS.size:
            raise CorruptCheckpointError(f"{path}: weights section truncated")
        lengths = WEIGHTS.unpack_from(blob)
        offsets = np.cumsum([WEIGHTS.size, *lengths])
        header_z, codes_z, raw_z = (
            blob[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)
        )
        header = json.loads(unzstd(header_z))
        codes = torch.frombuffer(bytearray(unzstd(codes_z)), dtype=torch.uint8)
        return header, codes, unzstd(raw_z)

    @staticmethod
    def _tensors(header: dict, codes: torch.Tensor, raw: bytes) -> dict[str, torch.Tensor]:
        raw_bytes = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else None
        tensors = {}
        for entry in header["tensors"]:
            dtype = getattr(torch, entry["dtype"])
            count = int(np.prod(entry["shape"], dtype=np.int64))
            if entry["mode"] == "q":
                part = codes[entry["offset"] : entry["offset"] + count]
                values = dequantize_uniform(part, entry["low"], entry["scale"]).to(dtype)
            else:
                part = raw_bytes[entry["offset"] : entry["offset"] + entry["nbytes"]]
                values = part.clone().view(dtype)
            tensors[entry["name"]] = values.reshape(entry["shape"])
        return tensors


class UniformDeltaIO(_QuantizedIO):
    """QD-style: 8-bit per-tensor min/max uniform codes, delta against the previous checkpoint.

    Args:
        bits: bits per code (QD's quantizer at its 8-bit setting).
        keyframe_every: a full checkpoint every this many saves (stalwart's default: 10).
        min_numel: smaller tensors are stored losslessly.
    """

    name = "QD-style uniform+delta"

    def __init__(self, bits: int = 8, keyframe_every: int = 10, min_numel: int = 1024) -> None:
        super().__init__(min_numel)
        self.bits = bits
        self.keyframe_every = keyframe_every
        # (path, chain position, concatenated codes) of the last checkpoint written or loaded.
        self.previous: tuple[Path, int, torch.Tensor] | None = None

    def quantize(self, name: str, flat: torch.Tensor) -> tuple[torch.Tensor, dict]:
        low, high = float(flat.min()), float(flat.max())
        codes, scale = quantize_uniform(flat, low, high, self.bits)
        return codes, {"low": low, "scale": scale, "bits": self.bits}

    def encode_weights(
        self, state_dict: Mapping[str, torch.Tensor], path: Path
    ) -> tuple[bytes, str, dict]:
        entries, codes, raw = self._split(state_dict)
        previous = self.previous
        if previous is not None and (
            previous[1] + 1 >= self.keyframe_every
            or previous[2].numel() != codes.numel()
            or not previous[0].exists()
            or previous[0].resolve() == path.resolve()
        ):
            previous = None
        header: dict[str, Any] = {"tensors": entries, "base": None, "position": 0}
        stored = codes
        if previous is not None:
            # Cyclic difference of the integer codes (QD's delta); uint8 arithmetic wraps mod 256.
            stored = codes - previous[2]
            header.update(base=os.path.relpath(previous[0], path.parent), position=previous[1] + 1)
        self.previous = (path, header["position"], codes)
        kind = "keyframe" if previous is None else "delta"
        return self._pack(header, stored, raw), kind, {"bits": self.bits}

    def _decode_chain(
        self, blob: bytes, path: Path, depth: int = 0
    ) -> tuple[dict, torch.Tensor, bytes]:
        header, stored, raw = self._unpack(blob, path)
        if header["base"] is None:
            return header, stored, raw
        base = path.parent / header["base"]
        if not base.exists():
            raise CorruptCheckpointError(f"{path} is a delta against {base}, which is missing")
        if depth > self.keyframe_every:
            raise CorruptCheckpointError(f"{path}: delta chain longer than keyframe_every")
        base_blob, _ = self._sections(base)
        _, base_codes, _ = self._decode_chain(base_blob, base, depth + 1)
        return header, stored + base_codes, raw

    def decode_weights(self, blob: bytes, path: Path) -> dict[str, torch.Tensor]:
        header, codes, raw = self._decode_chain(blob, path)
        # A resumed fit continues the chain it was restored from.
        self.previous = (path, header["position"], codes)
        return self._tensors(header, codes, raw)


class AdaptiveUniformIO(_QuantizedIO):
    """Check-N-Run-style adaptive uniform quantization, no delta.

    Per tensor, the fewest bits of ``bit_choices`` whose greedy-range quantization has relative L2
    error ``||w - q(w)|| / ||w|| <= threshold`` (the last choice if none does).

    Args:
        threshold: largest relative L2 error a tensor may get.
        bit_choices: candidate bit widths, ascending.
        steps: range steps of the greedy search (Guan et al.).
        max_shrink: largest fraction of the range the greedy search may clip.
        min_numel: smaller tensors are stored losslessly.
    """

    name = "CNR-style adaptive uniform"

    def __init__(
        self,
        threshold: float = 0.1,
        bit_choices: tuple[int, ...] = (2, 3, 4, 8),
        steps: int = 50,
        max_shrink: float = 0.5,
        min_numel: int = 1024,
    ) -> None:
        super().__init__(min_numel)
        self.threshold = threshold
        self.bit_choices = bit_choices
        self.steps = steps
        self.max_shrink = max_shrink

    def quantize(self, name: str, flat: torch.Tensor) -> tuple[torch.Tensor, dict]:
        norm2 = float(torch.sum(flat**2))
        for bits in self.bit_choices:
            low, high, error = greedy_range(flat, bits, self.steps, self.max_shrink)
            relative = (error / norm2) ** 0.5 if norm2 > 0 else 0.0
            if relative <= self.threshold:
                break
        codes, scale = quantize_uniform(flat, low, high, bits)
        return codes, {"low": low, "scale": scale, "bits": bits, "rel_error": relative}

    def encode_weights(
        self, state_dict: Mapping[str, torch.Tensor], path: Path
    ) -> tuple[bytes, str, dict]:
        entries, codes, raw = self._split(state_dict)
        header = {"tensors": entries, "base": None, "position": 0}
        bits: dict[int, int] = {}
        for entry in entries:
            if entry["mode"] == "q":
                bits[entry["bits"]] = bits.get(entry["bits"], 0) + 1
        return self._pack(header, codes, raw), "snapshot", {"bits": bits}

    def decode_weights(self, blob: bytes, path: Path) -> dict[str, torch.Tensor]:
        header, codes, raw = self._unpack(blob, path)
        return self._tensors(header, codes, raw)


class ExcpStyleIO(MeasuredCheckpointIO):
    """ExCP-style weight-momentum joint pruning of residuals + uniform quantization (see the module
    docstring). Needs ``parameter_names`` (the optimizer's parameter order; set by the caller) to
    pair each weight with its Adam moments; a checkpoint without Adam state stores weights only.

    Args:
        alpha, beta: ExCP's pruning thresholds (its paper's defaults).
        bits: bits of the kept residuals and moments.
        keyframe_every: a residual against zero (8-bit weights, unpruned) every this many saves.
    """

    name = "ExCP-style"

    def __init__(
        self, alpha: float = 5e-5, beta: float = 2.0, bits: int = 4, keyframe_every: int = 10
    ) -> None:
        super().__init__()
        self.alpha, self.beta, self.bits, self.keyframe_every = alpha, beta, bits, keyframe_every
        self.parameter_names: list[str] = []
        # (path, chain position, reconstructed weights) of the last checkpoint written or loaded
        self.previous: tuple[Path, int, dict[str, torch.Tensor]] | None = None
        self._moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        # The moments decide the weights' pruning: found before the weights are encoded.
        self._moments = {}
        for state in checkpoint.get("optimizer_states", [])[:1]:
            for index, per_parameter in state["state"].items():
                if "exp_avg_sq" in per_parameter and index < len(self.parameter_names):
                    self._moments[self.parameter_names[index]] = (
                        per_parameter["exp_avg"], per_parameter["exp_avg_sq"]
                    )  # fmt: skip
        super().save_checkpoint(checkpoint, path, storage_options)

    def _code(self, values: torch.Tensor, mask: torch.Tensor, bits: int, parts: list) -> dict:
        kept = values.reshape(-1)[mask.reshape(-1)].float()
        low = float(kept.min()) if kept.numel() else 0.0
        high = float(kept.max()) if kept.numel() else 0.0
        codes, scale = quantize_uniform(kept, low, high, bits)
        parts.append(np.packbits(mask.reshape(-1).numpy()).tobytes())
        parts.append(codes.numpy().tobytes())
        return {"low": low, "scale": scale, "kept": int(kept.numel())}

    @staticmethod
    def _uncode(entry: dict, mask_blob: bytes, code_blob: bytes, shape) -> torch.Tensor:
        count = int(np.prod(shape, dtype=np.int64))
        mask = torch.from_numpy(np.unpackbits(np.frombuffer(mask_blob, np.uint8), count=count))
        codes = torch.tensor(np.frombuffer(code_blob, np.uint8))  # may be empty: all pruned
        out = torch.zeros(count)
        out[mask.bool()] = dequantize_uniform(codes, entry["low"], entry["scale"])
        return out.reshape(shape)

    def encode_weights(
        self, state_dict: Mapping[str, torch.Tensor], path: Path
    ) -> tuple[bytes, str, dict]:
        previous = self.previous
        if previous is not None and (
            previous[1] + 1 >= self.keyframe_every
            or not previous[0].exists()
            or previous[0].resolve() == path.resolve()
        ):
            previous = None
        header: dict[str, Any] = {"tensors": [], "base": None, "position": 0}
        if previous is not None:
            header.update(base=os.path.relpath(previous[0], path.parent), position=previous[1] + 1)
        parts: list[bytes] = []
        self._coded: set[str] = set()  # weights whose moments this section holds
        restored: dict[str, torch.Tensor] = {}
        kept = total = 0
        for name, tensor in state_dict.items():
            tensor = tensor.detach().cpu()
            dtype = str(tensor.dtype).removeprefix("torch.")
            entry: dict[str, Any] = {"name": name, "dtype": dtype, "shape": list(tensor.shape)}
            if not tensor.is_floating_point() or tensor.numel() < MIN_QUANTIZED_NUMEL:
                entry["mode"] = "raw"
                parts.append(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                restored[name] = tensor
            else:
                base = torch.zeros_like(tensor) if previous is None else previous[2][name]
                residual = tensor.float() - base.float()
                if previous is None or name not in self._moments:
                    mask = torch.ones_like(residual, dtype=torch.bool)
                    bits = 8 if previous is None else self.bits
                else:
                    _, v = self._moments[name]
                    threshold = (
                        self.alpha / v.float().sqrt().clamp_min(1e-30) * tensor.abs().median()
                    )
                    mask, bits = residual.abs() > threshold, self.bits
                entry.update(mode="residual", **self._code(residual, mask, bits, parts))
                restored[name] = (
                    base.float() + self._uncode(entry, parts[-2], parts[-1], tensor.shape)
                ).to(tensor.dtype)
                if name in self._moments:
                    m, v = self._moments[name]
                    moment_mask = (m.abs() > self.beta * m.abs().mean()) & mask
                    entry["m"] = self._code(m, moment_mask, self.bits, parts)
                    entry["v"] = self._code(v.sqrt(), moment_mask, self.bits, parts)
                    self._coded.add(name)
                    kept += int(moment_mask.sum())
                    total += moment_mask.numel()
            header["tensors"].append(entry)
        self.previous = (path, header["position"], restored)
        lengths = [len(part) for part in parts]
        header["lengths"] = lengths
        blob = zstd(json.dumps(header).encode())
        body = zstd(b"".join(parts))
        kind = "keyframe" if previous is None else "delta"
        detail = {"moments kept": f"{kept / max(total, 1):.1%}"}
        return struct.pack("<QQ", len(blob), len(body)) + blob + body, kind, detail

    def encode_rest(self, rest: dict[str, Any], path: Path) -> bytes:
        # The moments are in the weights section: the rest keeps Adam's step counts only.
        rest = dict(rest)
        states = []
        for state in rest.get("optimizer_states", []):
            coded = {
                index for index, name in enumerate(self.parameter_names) if name in self._coded
            }
            slim = {index: {key: value for key, value in per.items()
                            if index not in coded or key not in ("exp_avg", "exp_avg_sq")}
                    for index, per in state["state"].items()}  # fmt: skip
            states.append({**state, "state": slim})
        rest["optimizer_states"] = states
        return super().encode_rest(rest, path)

    def _read(self, blob: bytes) -> tuple[dict, list[bytes]]:
        header_len, body_len = struct.unpack_from("<QQ", blob)
        header = json.loads(unzstd(blob[16 : 16 + header_len]))
        body = unzstd(blob[16 + header_len : 16 + header_len + body_len])
        offsets = np.cumsum([0, *header["lengths"]])
        return header, [body[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]

    def _decode(self, blob: bytes, path: Path, depth: int = 0):
        header, parts = self._read(blob)
        base: dict[str, torch.Tensor] | None = None
        if header["base"] is not None:
            base_path = path.parent / header["base"]
            if not base_path.exists() or depth > self.keyframe_every:
                raise CorruptCheckpointError(f"{path}: its base {base_path} is missing")
            base = self._decode(self._sections(base_path)[0], base_path, depth + 1)[0]
        weights: dict[str, torch.Tensor] = {}
        moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        position = 0
        for entry in header["tensors"]:
            dtype, shape = getattr(torch, entry["dtype"]), entry["shape"]
            if entry["mode"] == "raw":
                weights[entry["name"]] = (
                    torch.frombuffer(bytearray(parts[position]), dtype=torch.uint8)
                    .view(dtype)
                    .reshape(shape)
                    .clone()
                )
                position += 1
                continue
            residual = self._uncode(entry, parts[position], parts[position + 1], shape)
            position += 2
            start = torch.zeros(shape) if base is None else base[entry["name"]].float()
            weights[entry["name"]] = (start + residual).to(dtype)
            if "m" in entry:
                m = self._uncode(entry["m"], parts[position], parts[position + 1], shape)
                root = self._uncode(entry["v"], parts[position + 2], parts[position + 3], shape)
                moments[entry["name"]] = (m, root**2)
                position += 4
        return weights, moments, header

    def decode_weights(self, blob: bytes, path: Path) -> dict[str, torch.Tensor]:
        weights, self._moments, header = self._decode(blob, path)
        self.previous = (path, header["position"], weights)
        return weights

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(path, map_location, weights_only)
        for state in checkpoint.get("optimizer_states", [])[:1]:
            for index, per_parameter in state["state"].items():
                name = self.parameter_names[index] if index < len(self.parameter_names) else None
                if name in self._moments:
                    per_parameter["exp_avg"], per_parameter["exp_avg_sq"] = self._moments[name]
        return checkpoint
