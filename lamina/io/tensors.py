"""Reading arrays out of safetensors files: whole, one device's slice, or layers stacked.

The readers `lm.load` and `lamina.models.from_pretrained` share. A tensor is read through a
memory map of its file (`memmap`), so a read touches only the bytes it copies: `read_array`
reads one tensor whole or, given a sharding, one device's slice per callback of
`jax.make_array_from_callback`. `read_stacked` builds one array from many per-layer tensors
(a Hugging Face checkpoint's ``model.layers.{i}....`` into a `Stack`'s leading layer axis),
each reshaped by a `Relayout` (a transpose and a reshape) and cast on the host one block at a
time; with a sharding each device's callback reads only its layers and the rows and columns
its slice maps back to, so no tensor passes whole through one device or the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import jax
import numpy as np

from .._core.types import Shape
from ._format import TensorInfo

__all__ = ["Relayout", "memmap", "read_array", "read_block", "read_stacked"]


def memmap(file: IO[bytes], offset: int, info: TensorInfo) -> np.ndarray:
    """A read-only memory map of one tensor of an open safetensors file.

    Args:
        file: The file, open for binary reading (it must stay open while the map is read).
        offset: Where the tensor's bytes start, from the start of the file.
        info: The tensor's entry of the header.

    Returns:
        An array of the tensor's shape and (little-endian) dtype; nothing is read yet.
    """
    if info.begin == info.end:
        return np.zeros(info.shape, info.dtype)  # no bytes to map
    return np.memmap(file, dtype=info.dtype, mode="r", offset=offset, shape=info.shape)


def read_block(source: np.ndarray, index: Any) -> np.ndarray:
    """Copies ``source[index]`` out of a memory-mapped file (only those bytes are read).

    Args:
        source: A memory map (`memmap`), or any array.
        index: A NumPy index (``()`` for the whole array).

    Returns:
        A new in-memory array, in native byte order.
    """
    block = np.array(source[index])
    return block.astype(block.dtype.newbyteorder("="), copy=False)


def read_array(
    file: IO[bytes], offset: int, info: TensorInfo, sharding: jax.sharding.Sharding | None
) -> jax.Array:
    """Reads one tensor of a file into a `jax.Array`, whole or one device's slice at a time.

    Args:
        file: The file, open for binary reading.
        offset: Where the tensor's bytes start, from the start of the file.
        info: The tensor's entry of the header.
        sharding: Where the array goes; None puts it on the default device. With a sharding
            each device's callback reads only its own slice of the file.

    Returns:
        The array, in the file's dtype.
    """
    source = memmap(file, offset, info)
    if sharding is None:
        return jax.device_put(read_block(source, ()))
    return jax.make_array_from_callback(
        info.shape, sharding, lambda index: read_block(source, index)
    )


@dataclass(frozen=True)
class Relayout:
    """How a stored tensor becomes an array: an optional transpose, then a reshape.

    ``array = source.T.reshape(shape)`` (``transpose=True``, a 2-D source) or
    ``source.reshape(shape)``. The reshape may only split axes (``(N * D, H) -> (H, N, D)``
    after the transpose) or keep them, never merge, so that a slice of the array maps back to
    one rectangular block of the source: a slice of a split axis's outer part reads whole
    rows of the source (``n0 * D : n1 * D``), and only a slice of an inner part (a head's
    features split between devices, which is rare) reads more than it keeps.

    Args:
        transpose: Whether to transpose the (2-D) source first.
        shape: The array's shape.

    Example:
        >>> import numpy as np
        >>> from lamina.io.tensors import Relayout
        >>> q_proj = np.arange(24.0).reshape(6, 4)  # (heads * head_dim, hidden)
        >>> Relayout(True, (4, 3, 2)).apply(q_proj).shape  # (hidden, heads, head_dim)
        (4, 3, 2)
    """

    transpose: bool
    shape: Shape

    def groups(self, source_shape: Shape) -> list[tuple[int, ...]]:
        """Which axes of the array each axis of the (transposed) source splits into."""
        moved = tuple(reversed(source_shape)) if self.transpose else tuple(source_shape)
        groups: list[tuple[int, ...]] = []
        axis = 0
        for size in moved:
            group = [axis]
            product = self.shape[axis] if axis < len(self.shape) else -1
            axis += 1
            while product != size and axis < len(self.shape) and product < size:
                group.append(axis)
                product *= self.shape[axis]
                axis += 1
            if product != size:
                raise ValueError(f"cannot split {moved} into {self.shape}")
            groups.append(tuple(group))
        if axis != len(self.shape):
            raise ValueError(f"cannot split {moved} into {self.shape}")
        return groups

    def apply(self, source: np.ndarray) -> np.ndarray:
        """The whole array from the whole source (a view where NumPy can make one)."""
        moved = source.T if self.transpose else source
        return moved.reshape(self.shape)

    def read(self, source: np.ndarray, index: tuple[slice, ...]) -> np.ndarray:
        """``apply(source)[index]``, reading only the block of `source` that `index` needs.

        Args:
            source: The stored tensor (a memory map).
            index: One slice per axis of the array (steps of 1).

        Returns:
            A new in-memory array in native byte order.
        """
        groups = self.groups(source.shape)
        moved_index, inner_index, block_shape = [], [], []
        for group in groups:
            outer = group[0]
            start, stop, _ = index[outer].indices(self.shape[outer])
            inner = math.prod(self.shape[a] for a in group[1:])
            moved_index.append(slice(start * inner, stop * inner))
            block_shape.append(stop - start)
            inner_index.append(slice(None))
            for axis in group[1:]:
                block_shape.append(self.shape[axis])
                inner_index.append(index[axis])
        source_index = tuple(reversed(moved_index)) if self.transpose else tuple(moved_index)
        block = read_block(source, source_index)
        if self.transpose:
            block = block.T
        return block.reshape(block_shape)[tuple(inner_index)]


def _full(shape: Shape) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def read_stacked(
    sources: Sequence[np.ndarray],
    *,
    relayout: Relayout | None = None,
    dtype: Any = None,
    sharding: jax.sharding.Sharding | None = None,
    stack: bool = True,
) -> jax.Array:
    """Reads per-layer tensors into one array stacked on a new leading axis.

    Each source is laid out by `relayout` and cast to `dtype` on the host one layer at a
    time. Without a sharding the result is built in one host array of the final shape and
    dtype, then copied to the default device; that host array is freed once the copy is
    made, but until then it sits beside the device copy. On the CPU backend the device
    copy is host memory too, so loading a model variable by variable peaks at the model plus
    its largest variable (often the embedding or a stacked MLP kernel: about 1.1 to 1.4
    times the file). With a sharding each device's callback reads only its layers and,
    from each, the block of rows and columns its slice maps back to.

    Args:
        sources: The layers' tensors (memory maps, `memmap`), all of one shape.
        relayout: How each source becomes a layer's array; None keeps it as it is.
        dtype: The result's dtype; None keeps the sources' (they must then share one).
        sharding: Where the result goes (a sharding of the stacked shape); None: the default
            device.
        stack: False reads a single source with no leading axis (`sources` has one item).

    Returns:
        A `jax.Array` of shape ``(len(sources), *layer_shape)`` (or ``layer_shape``).

    Example:
        >>> import numpy as np
        >>> from lamina.io.tensors import Relayout, read_stacked
        >>> layers = [np.full((6, 4), i, np.float32) for i in range(3)]
        >>> out = read_stacked(layers, relayout=Relayout(True, (4, 3, 2)), dtype=np.float16)
        >>> out.shape, out.dtype.name, float(out[2, 0, 0, 0])
        ((3, 4, 3, 2), 'float16', 2.0)
    """
    if not sources:
        raise ValueError("read_stacked needs at least one source")
    if not stack and len(sources) != 1:
        raise ValueError(f"read_stacked(stack=False) takes one source, got {len(sources)}")
    layout = relayout if relayout is not None else Relayout(False, tuple(sources[0].shape))
    layout.groups(tuple(sources[0].shape))  # a bad relayout fails before any read
    dtypes = {np.dtype(s.dtype).newbyteorder("=") for s in sources}
    if dtype is None and len(dtypes) > 1:
        raise ValueError(f"read_stacked: the sources' dtypes differ ({sorted(map(str, dtypes))})")
    target = np.dtype(dtype) if dtype is not None else dtypes.pop()
    layer_shape = tuple(layout.shape)
    shape = (len(sources), *layer_shape) if stack else layer_shape

    def layer(i: int, index: tuple[slice, ...]) -> np.ndarray:
        return layout.read(sources[i], index).astype(target, copy=False)

    if sharding is None:
        out = np.empty(shape, target)
        if not stack:
            out[...] = layer(0, _full(layer_shape))
        else:
            for i in range(len(sources)):
                out[i] = layer(i, _full(layer_shape))
        return jax.device_put(out)

    # devices that hold the same block (replicated axes) share one read
    blocks: dict[tuple[tuple[int, int], ...], np.ndarray] = {}

    def callback(given: tuple[slice, ...] | None) -> np.ndarray:
        index = tuple(given or ()) + (slice(None),) * (len(shape) - len(given or ()))
        bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        if bounds in blocks:
            return blocks[bounds]
        if not stack:
            out = layer(0, index)
        else:
            (start, stop), inner = bounds[0], index[1:]
            out = np.empty([stop - start] + [b - a for a, b in bounds[1:]], target)
            for i in range(start, stop):
                out[i - start] = layer(i, inner)
        blocks[bounds] = out
        return out

    array = jax.make_array_from_callback(shape, sharding, callback)
    blocks.clear()
    return array
