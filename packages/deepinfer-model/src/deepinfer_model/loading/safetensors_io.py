"""Reading and writing safetensors shards by byte range, without pickle and without intermediate copies.

File layout (the safetensors format)::

    [0, 8)            u64 little-endian N = header length
    [8, 8 + N)        JSON header: {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}
    [8 + N, EOF)      tensor bytes; offsets are relative to 8 + N, row-major, little-endian

``read_header`` validates the whole header against the file size so that a truncated or corrupt shard fails before
any tensor is read, with an error naming the file. ``read_tensor_into`` fills a caller-allocated tensor straight from
the file (``readinto``), so loading holds each tensor's bytes exactly once. ``write_shard`` streams tensors to disk.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer_model.loading.catalogue import DTYPE_BYTES
from deepinfer_model.loading.errors import CheckpointError

SAFETENSORS_TO_TORCH: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}
TORCH_TO_SAFETENSORS = {v: k for k, v in SAFETENSORS_TO_TORCH.items()}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own upper bound on the header
_HEADER_ALIGN = 8


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of a shard header.

    Attributes:
        dtype: safetensors dtype string.
        shape: stored shape.
        offset: absolute byte offset of the first byte in the file.
        num_bytes: stored size in bytes.
    """

    dtype: str
    shape: tuple[int, ...]
    offset: int
    num_bytes: int


@dataclass(frozen=True)
class ShardHeader:
    """A validated shard header: where each tensor's bytes are."""

    path: Path
    tensors: Mapping[str, TensorRecord]
    metadata: Mapping[str, str]


def _corrupt(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"shard {path} is not a readable safetensors file: {why}")


def _parse_record(path: Path, name: str, raw: object, data_start: int, data_size: int) -> TensorRecord:
    if not isinstance(raw, dict):
        raise _corrupt(path, f"header entry {name!r} is not an object")
    dtype, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise _corrupt(path, f"tensor {name!r} has unsupported dtype {dtype!r}; accepted: {sorted(DTYPE_BYTES)}")
    if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise _corrupt(path, f"tensor {name!r} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or any(isinstance(o, bool) or not isinstance(o, int) for o in offsets)
    ):
        raise _corrupt(path, f"tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if not 0 <= begin <= end or end - begin != expected:
        raise _corrupt(path, f"tensor {name!r}: data_offsets {offsets} do not hold {expected} bytes of {dtype}{shape}")
    if end > data_size:
        raise _corrupt(
            path, f"tensor {name!r} ends at byte {end} but the data section has {data_size} bytes (truncated)"
        )
    return TensorRecord(dtype=dtype, shape=tuple(shape), offset=data_start + begin, num_bytes=expected)


def read_header(path: Path) -> ShardHeader:
    """Read and validate a shard header.

    Raises:
        CheckpointError: the file cannot be opened, the header is malformed, or a tensor lies outside the file.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _corrupt(path, f"file has {size} bytes, fewer than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(_MAX_HEADER_BYTES, size - 8):
                raise _corrupt(path, f"header length {header_len} exceeds the file size {size}")
            header_bytes = f.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"cannot read shard {path}: {exc}") from exc
    try:
        header = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _corrupt(path, f"header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict):
        raise _corrupt(path, "__metadata__ is not an object")
    data_start = 8 + header_len
    records = {name: _parse_record(path, name, raw, data_start, size - data_start) for name, raw in header.items()}
    spans = sorted((r.offset, r.offset + r.num_bytes, n) for n, r in records.items() if r.num_bytes)
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise _corrupt(path, f"tensors {first!r} and {second!r} overlap")
    return ShardHeader(path=path, tensors=records, metadata={str(k): str(v) for k, v in metadata.items()})


def read_tensor_into(f: io.BufferedReader, path: Path, name: str, record: TensorRecord, out: torch.Tensor) -> None:
    """Copy one tensor's stored bytes into ``out``.

    Args:
        f: the shard opened for binary reading.
        path: the shard's path (for error messages).
        name: the tensor's name in the shard (for error messages).
        record: its header record.
        out: contiguous CPU tensor with exactly ``record.num_bytes`` bytes (any dtype; bytes are copied verbatim).
    """
    if not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"destination for {name!r} must be a contiguous CPU tensor")
    if out.numel() * out.element_size() != record.num_bytes:
        raise ValueError(
            f"destination for {name!r} has {out.numel() * out.element_size()} bytes, the shard holds {record.num_bytes}"
        )
    if record.num_bytes == 0:
        return
    view = out.view(-1).view(torch.uint8).numpy().data.cast("B")
    f.seek(record.offset)
    filled = 0
    while filled < record.num_bytes:
        got = f.readinto(view[filled:])
        if not got:
            raise _corrupt(path, f"unexpected end of file while reading {name!r}")
        filled += got


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


def write_shard(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> int:
    """Write CPU tensors to one safetensors file in the given order.

    Args:
        path: destination file (overwritten).
        tensors: name → CPU tensor of a dtype in ``TORCH_TO_SAFETENSORS``.
        metadata: optional string map stored as ``__metadata__``.

    Returns:
        Bytes of tensor data written.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in TORCH_TO_SAFETENSORS:
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": TORCH_TO_SAFETENSORS[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % _HEADER_ALIGN)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for tensor in tensors.values():
            if tensor.numel():
                f.write(_tensor_bytes(tensor))
    return offset
