"""Random streams: what a call's ``rngs`` argument may be, and `next_rng_key`."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .errors import RngError
from .frame import current_frame

_DEFAULT = "<default>"  # the stream name of the default key; never a user's name


@jax.tree_util.register_pytree_node_class
class PRNGKeys:
    """A default key and named keys, for ``apply(variables, rngs, ...)`` and ``init(rngs)``.

    `next_rng_key(name)` takes the named stream when it exists and the default one otherwise.
    `PRNGKeys` is a pytree, so it passes through `jax.jit` and `jax.vmap`.

    Args:
        default: The key used when no name is given or the name is absent.
        **named: Keys of named streams (``dropout=...``).

    Example:
        >>> import jax, lamina as lm
        >>> rngs = lm.PRNGKeys(jax.random.key(0), dropout=jax.random.key(1))
        >>> sorted(rngs.named)
        ['dropout']
    """

    def __init__(self, default: Any = None, /, **named: Any):
        self.default = default
        self.named = dict(named)

    def tree_flatten(self) -> tuple[tuple, tuple]:
        names = tuple(self.named)
        return (self.default, *(self.named[n] for n in names)), names

    @classmethod
    def tree_unflatten(cls, names: tuple, children: tuple) -> PRNGKeys:
        keys = cls.__new__(cls)
        keys.default = children[0]
        keys.named = dict(zip(names, children[1:], strict=True))
        return keys

    def __repr__(self) -> str:
        named = "".join(f", {n}=..." for n in self.named)
        return f"PRNGKeys({'...' if self.default is not None else 'None'}{named})"


def check_rngs(where: str, rngs: Any) -> None:
    """Raises `TypeError` unless `rngs` is None, a key, a dict of keys or `PRNGKeys`."""
    if rngs is None or isinstance(rngs, (PRNGKeys, dict)) or is_key(rngs):
        return
    hint = ""
    if isinstance(rngs, (int, np.integer)):
        hint = f" To use a seed, pass jax.random.key({rngs})."
    elif getattr(rngs, "dtype", None) is not None:
        hint = (
            f" Got {_describe(rngs)}; a key is jax.random.key(seed) (shape ()) or "
            f"jax.random.PRNGKey(seed) (uint32, shape {_raw_key_shape()}). For several keys "
            f"(one per example), map apply over them with jax.vmap."
        )
    raise TypeError(
        f"{where}: rngs must be None, a PRNG key, a dict {{name: key}} or "
        f"lm.PRNGKeys(default, name=key), got {type(rngs).__name__}.{hint}"
    )


def is_key(x: Any) -> bool:
    """Whether `x` is one key: a typed key of shape (), or a raw ``uint32`` key.

    A raw key has the default implementation's shape (``jax.random.PRNGKey(0)``: ``(2,)``).
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return x.shape == ()
    return dtype == np.uint32 and tuple(x.shape) == _raw_key_shape()


_RAW_KEY_SHAPE: list[tuple[int, ...]] = []


def _raw_key_shape() -> tuple[int, ...]:
    if not _RAW_KEY_SHAPE:
        _RAW_KEY_SHAPE.append(tuple(jax.eval_shape(jax.random.PRNGKey, 0).shape))
    return _RAW_KEY_SHAPE[0]


class RngStreams:
    """The random streams of one call; normalised on the first draw, not before.

    Each stream hands out ``fold_in(key, n)`` for n = 0, 1, 2, ...: never the same key twice.
    """

    __slots__ = ("_counts", "_keys", "_raw")

    def __init__(self, rngs: Any):
        self._raw = rngs
        self._keys: dict[str, Any] | None = None
        self._counts: dict[str, int] = {}

    def keys(self) -> dict[str, Any]:
        """The streams by name; the default stream is under an internal name."""
        if self._keys is None:
            raw = self._raw
            if raw is None:
                keys = {}
            elif isinstance(raw, PRNGKeys):
                keys = dict(raw.named)
                if raw.default is not None:
                    keys[_DEFAULT] = raw.default
            elif isinstance(raw, dict):
                keys = dict(raw)
            else:
                keys = {_DEFAULT: raw}
            for name, key in keys.items():
                if not isinstance(name, str):
                    raise TypeError(f"rngs: stream names must be strings, got {name!r}.")
                if not is_key(key):
                    raise TypeError(
                        f"rngs: the {_label(name)} stream is {_describe(key)}, not a PRNG key; "
                        f"make keys with jax.random.key(seed)."
                    )
            self._keys = keys
        return self._keys

    def base(self, name: str | None, strict: bool = False) -> tuple[str, Any]:
        """Returns ``(stream, key)`` for `name`, falling back to the default stream."""
        keys = self.keys()
        stream = _DEFAULT if name is None else name
        if stream not in keys:
            if name is not None and strict:
                raise RngError(
                    f"next_rng_key({name!r}, strict=True): this call has no {name!r} stream "
                    f"({_available(keys)}). Pass one: apply(variables, {{{name!r}: key}}, ...) "
                    f"or lm.PRNGKeys(default_key, {name}=key)."
                )
            stream = _DEFAULT
        if stream not in keys:
            asked = "next_rng_key()" if name is None else f"next_rng_key({name!r})"
            raise RngError(
                f"{asked} found no key: this call has {_available(keys)}. Pass a key as the "
                f"second argument, apply(variables, jax.random.key(1), ...), "
                + (
                    f"or name the stream: {{{name!r}: key}}."
                    if name is not None
                    else "or lm.PRNGKeys(key, ...) so that unnamed draws have a default."
                )
            )
        return stream, keys[stream]

    def next(self, name: str | None, num: int | tuple[int, ...] | None, strict: bool) -> Any:
        """Draws a fresh key (or `num` keys) from the stream `name`."""
        stream, key = self.base(name, strict)
        key = self._draw(stream, key)
        return key if num is None else jax.random.split(key, num)

    def _draw(self, stream: str, key: Any) -> Any:
        count = self._counts.get(stream, 0)
        self._counts[stream] = count + 1
        return jax.random.fold_in(key, count)

    def fork(self) -> dict[str, Any]:
        """Draws one fresh key from every stream: the bases of per-iteration streams.

        A transform that lamina runs over user code (a scan over time steps) forks before
        the transform and gives iteration ``i`` the streams `for_iteration(forked, i)`, so
        that every iteration draws different keys, as `next_rng_key`'s guard asks of users.
        """
        return {stream: self._draw(stream, key) for stream, key in self.keys().items()}

    @staticmethod
    def for_iteration(forked: dict[str, Any], index: Any) -> RngStreams:
        """The streams of iteration `index` (a traced int is fine) of a forked call."""
        return RngStreams.from_keys(
            {s: jax.random.fold_in(key, index) for s, key in forked.items()}
        )

    @staticmethod
    def from_keys(keys: dict[str, Any]) -> RngStreams:
        """Streams over already checked keys, by internal stream name (as `fork` returns)."""
        streams = RngStreams(None)
        streams._keys = keys
        return streams


def _describe(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return type(x).__name__
    return f"an array of dtype {dtype} and shape {tuple(x.shape)}"


def _label(name: str) -> str:
    return "default" if name == _DEFAULT else repr(name)


def stream_label(stream: str) -> str:
    """A stream's user-facing name: its name, or ``"default"`` for the default stream."""
    return "default" if stream == _DEFAULT else stream


def _available(keys: dict[str, Any]) -> str:
    if not keys:
        return "no random keys (rngs=None)"
    return "only the streams " + ", ".join(_label(n) for n in keys)


def next_rng_key(
    name: str | None = None, num: int | tuple[int, ...] | None = None, strict: bool = False
) -> Any:
    """Returns a fresh PRNG key from the running call's random streams.

    Every call returns a key that no earlier call of this `init`/`apply` returned, `num`
    included. A name that the call was not given falls back to the default stream, unless
    `strict`.

    Args:
        name: The stream (``"dropout"``, ``"noise"``...); None for the default stream.
        num: If given, return ``jax.random.split(key, num)`` instead of one key.
        strict: Raise instead of falling back to the default stream.

    Returns:
        A key, or an array of `num` keys.

    Raises:
        RngError: No key is available for `name`, or none at all.
        RuntimeError: Called outside `init`/`apply`.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class AddNoise(lm.Module):
        ...     def __call__(self, x):
        ...         return x + jax.random.normal(lm.next_rng_key("noise"), x.shape)
        >>> init, apply = lm.transform(AddNoise())
        >>> y, _ = apply(init(jax.random.key(0)), {"noise": jax.random.key(1)}, jnp.zeros(3))
        >>> y.shape
        (3,)
    """
    frame = current_frame()
    if frame is None:
        raise RuntimeError(
            "next_rng_key() was called outside init/apply: random keys come from the rngs "
            "argument of a running call. Call it inside the model's methods."
        )
    frame.check_trace(
        lambda: f"next_rng_key({'' if name is None else repr(name)}) was called",
        "The transform traces its function once, so every iteration (every vmapped member, "
        "every scan step) would get the same key. Draw the keys before the transform and "
        "pass them in: `keys = lm.next_rng_key(name, num=n)`, then "
        "`jax.vmap(f)(keys, xs)` or `jax.lax.scan(f, carry, (keys, xs))`.",
    )
    return frame.rngs.next(name, num, strict)
