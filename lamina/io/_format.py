"""The safetensors format: its dtype codes, and the header `lm.save` writes.

A safetensors file is three parts (https://github.com/huggingface/safetensors, "Format"):

- 8 bytes: ``N``, the header's length, an unsigned little-endian 64-bit integer;
- ``N`` bytes: the header, a UTF-8 JSON object ``{name: {"dtype": "F32", "shape": [2, 3],
  "data_offsets": [begin, end]}, ...}`` with an optional ``"__metadata__"`` entry of
  string-to-string pairs, padded with spaces to a multiple of 8 bytes;
- the data: every tensor's bytes, row-major and little-endian, at ``data_offsets`` counted from
  the end of the header; the tensors cover the data exactly, without gaps or overlaps.

Reading is validated by the `safetensors` package itself (`checkpoint.load`); this module only
builds headers (so that `save` can stream one array shard at a time into a preallocated file,
which the package's writers cannot: they take whole host arrays) and reads back the offsets of
a header that package has already accepted.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

import jax.numpy as jnp
import numpy as np

from .._core.types import Shape

# The format's dtype codes and the NumPy (ml_dtypes) types they hold: every type both the
# format and JAX know, in the order of the package's `Dtype` enum (which orders the data).
# `tests/test_checkpoint.py` checks this table against the package's own
# (`safetensors.TensorSpec`). Complex128, int4, float4 and the other float8 variants have no
# code in the format, so they cannot be saved (an error before anything is written).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "F8_E5M2": np.dtype(jnp.float8_e5m2),
    "F8_E4M3": np.dtype(jnp.float8_e4m3fn),
    "F8_E8M0": np.dtype(jnp.float8_e8m0fnu),
    "F8_E4M3FNUZ": np.dtype(jnp.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(jnp.float8_e5m2fnuz),
    "I16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(jnp.bfloat16),
    "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32),
    "F32": np.dtype(np.float32),
    "C64": np.dtype(np.complex64),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "U64": np.dtype(np.uint64),
}
CODES: dict[np.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}
_RANK = {code: rank for rank, code in enumerate(DTYPES)}

METADATA_KEY = "__metadata__"
EMPTY_DICTS_KEY = "lamina.empty_dicts"  # the paths of empty dicts, which have no tensors
# Each tensor's checksum, ``{name: 8 hex digits}`` as JSON: CRC-32 (zlib's) of the tensor's
# dtype code and shape (`checksum_seed`), then of its bytes as they lie in the file. Fixed-width
# values, so that `save` can write the header before the data and rewrite it in place after.
CHECKSUMS_KEY = "lamina.crc32"
RESERVED_PREFIX = "lamina."
MAX_HEADER_BYTES = 100_000_000  # the `safetensors` package refuses longer headers


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a file: its name, type, shape and place in the data section."""

    name: str
    code: str
    shape: Shape
    begin: int  # byte offset from the start of the data section
    end: int

    @property
    def dtype(self) -> np.dtype:
        """The NumPy dtype of the tensor's elements, little-endian."""
        return DTYPES[self.code].newbyteorder("<")


def checksum_seed(code: str, shape: Shape) -> int:
    """The CRC-32 a tensor's checksum starts from: its type code and shape.

    So a header edit that reinterprets the same bytes (``F32`` read as ``I32``, a shape
    transposed) does not match the checksum either.
    """
    return zlib.crc32(json.dumps([code, list(shape)]).encode())


def format_checksum(value: int) -> str:
    """A CRC-32 as it is stored: 8 lowercase hex digits."""
    return f"{value:08x}"


def unsupported_dtype_hint(dtype: np.dtype) -> str:
    """What to do about a dtype the format cannot hold."""
    if dtype == np.complex128:
        return "cast it to complex64, or store its real and imaginary parts as two float64 arrays"
    if dtype.itemsize == 1 or "4" in dtype.name or "2" in dtype.name:
        return "cast it to a type the format holds (int8, uint8, float16, bfloat16, float32)"
    return "cast it to a type the format holds"


def layout(
    tensors: Sequence[tuple[str, np.dtype, Shape]], metadata: Mapping[str, str]
) -> tuple[bytes, list[TensorInfo]]:
    """Places tensors in a file: the header's bytes (length prefix included) and the offsets.

    Tensors are ordered as the `safetensors` package orders them (by its dtype enum,
    decreasing, then by name), so that the bytes are the ones its own writer produces and each
    tensor starts at a multiple of its element size: the header is padded to 8 bytes, and
    element sizes never grow along that order.

    Args:
        tensors: ``(name, dtype, shape)`` per tensor; dtypes must be keys of `CODES`.
        metadata: The ``__metadata__`` entry (omitted when empty).

    Returns:
        The bytes that start the file, and each tensor's `TensorInfo`.
    """
    ordered = sorted(tensors, key=lambda t: (-_RANK[CODES[t[1]]], t[0]))
    infos, offset = [], 0
    for name, dtype, shape in ordered:
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        infos.append(TensorInfo(name, CODES[dtype], shape, offset, offset + size))
        offset += size
    header: dict[str, object] = {METADATA_KEY: dict(metadata)} if metadata else {}
    for info in infos:
        header[info.name] = {
            "dtype": info.code,
            "shape": list(info.shape),
            "data_offsets": [info.begin, info.end],
        }
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, infos


def read_entries(file: IO[bytes], size: int) -> tuple[int, dict[str, TensorInfo]]:
    """Reads where the data starts and each tensor's `TensorInfo` from a file's header.

    Only for a file the `safetensors` package has accepted (it validates everything); the
    offsets are checked again against the file's size, so that a file replaced in between
    cannot send a read outside it.

    Args:
        file: The file, opened for binary reading.
        size: Its size in bytes.

    Returns:
        The data section's start, and the tensors by name.

    Raises:
        ValueError: If the header is unreadable or an offset lies outside the data.
    """
    file.seek(0)
    (length,) = struct.unpack("<Q", file.read(8))
    header = json.loads(file.read(length).decode("utf-8"))
    start = 8 + length
    entries = {}
    for name, entry in header.items():
        if name == METADATA_KEY:
            continue
        begin, end = (int(v) for v in entry["data_offsets"])
        if not 0 <= begin <= end <= size - start:
            raise ValueError(f"the offsets of {name!r} lie outside the file")
        shape = tuple(int(n) for n in entry["shape"])
        entries[name] = TensorInfo(name, str(entry["dtype"]), shape, begin, end)
    return start, entries
