"""The IDX file format of MNIST and its kin (Fashion-MNIST, KMNIST), plain or gzipped."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

# The third byte of the magic number says what the elements are (big-endian on disk).
_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class IdxFormatError(ValueError):
    """A file that is not a well-formed IDX file.

    Example:
        >>> import pathlib, tempfile, lamina as lm
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "notes.txt"
        >>> _ = path.write_bytes(b"not an IDX file")
        >>> try:
        ...     lm.data.read_idx(path)
        ... except lm.data.IdxFormatError as error:
        ...     print("bad magic number" in str(error))
        True
    """


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Reads one IDX file (``.gz`` files are decompressed) into a NumPy array.

    Args:
        path: The file.

    Returns:
        The array, with the shape the file's header declares, in native byte order.

    Raises:
        FileNotFoundError: No such file.
        IdxFormatError: A bad magic number, or fewer bytes than the header promises.

    Example:
        >>> import numpy as np, tempfile, pathlib, lamina as lm
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "x-idx1-ubyte"
        >>> _ = path.write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 3, 7, 8, 9]))
        >>> lm.data.read_idx(path)
        array([7, 8, 9], dtype=uint8)
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise IdxFormatError(
            f"{path}: cannot read it ({error}); is it a damaged download?"
        ) from error
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _DTYPES:
        raise IdxFormatError(
            f"{path}: not an IDX file (bad magic number {raw[:4].hex() or 'empty'}); MNIST-format "
            f"files start with 00 00 <type> <rank>."
        )
    dtype, rank = _DTYPES[raw[2]], raw[3]
    header = 4 + 4 * rank
    if len(raw) < header:
        raise IdxFormatError(f"{path}: truncated inside its header ({len(raw)} bytes).")
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=rank, offset=4))
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    got = len(raw) - header
    if got < expected:
        raise IdxFormatError(
            f"{path}: truncated: the header promises shape {shape} ({expected:,} bytes of "
            f"data) but the file holds {got:,}. Download or copy it again."
        )
    data = np.frombuffer(raw, dtype, count=int(np.prod(shape, dtype=np.int64)), offset=header)
    return data.reshape(shape).astype(dtype.newbyteorder("="))
