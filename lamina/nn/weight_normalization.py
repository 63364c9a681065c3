"""Wrappers that normalise a layer's weights before it runs: `SpectralNorm`, `WeightNorm`.

Each is numerically Flax Linen's wrapper of the same name. ``SpectralNorm(layer)`` and
``WeightNorm(layer)`` hold the layer (any lamina module: a `Dense`, a `Conv`, a block of
them) and call it with some of its parameters replaced by normalised versions of themselves,
computed on every call (`lamina.nn._substitution`, Linen's ``nn.map_variables``): the layer
itself is unchanged, and the gradients reach its own parameters through the normalisation.

Variable paths (lamina declares every variable when the model is built and allows no ``/``
in a key, so Linen's flat names ``"Dense_0/kernel/u"`` become nested ones):

- the layer's variables stay under ``layer``: ``params/<wrapper>/layer/kernel``;
- `SpectralNorm`'s power-iteration state is ``<collection>/<wrapper>/u/<path>`` (shape
  ``(1, out)``) and ``<collection>/<wrapper>/sigma/<path>`` (shape ``()``), ``<path>`` being
  the parameter's path inside the layer (``kernel``, ``layers/0/kernel``...), ``<collection>``
  ``batch_stats`` by default: Linen's ``"Dense_0/kernel/u"`` is ``u/kernel`` here;
- `WeightNorm`'s scales are ``params/<wrapper>/scale/<path>``: Linen's
  ``"Dense_0/kernel/scale"`` is ``scale/kernel`` here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import initializers
from .._core.checks import format_path
from .._core.graph import walk
from .._core.module import Module
from .._core.types import Dtype, Initializer
from .._core.variables import BatchStat, Parameter, State
from . import _checks, _dtypes
from ._substitution import substituted
from .normalization import axes_setting, promote, show_axes

ParameterPath = tuple[str, ...]


def _l2_normalize(x: jax.Array, axes: tuple[int, ...] | None, epsilon: float) -> jax.Array:
    """``x * rsqrt(sum(x * x) + epsilon)`` over `axes` (None: all), as Linen writes it."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=axes, keepdims=True) + epsilon)


@functools.partial(jax.jit, static_argnames=("n_steps", "epsilon", "dtype"))
def spectral_normalize(
    value: jax.Array, u: jax.Array, *, n_steps: int, epsilon: float, dtype: Dtype
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`value` divided by its largest singular value, estimated by power iteration.

    `value` is seen as the matrix ``(-1, value.shape[-1])``. Starting from `u` (shape
    ``(1, value.shape[-1])``), `n_steps` steps of power iteration estimate the singular vectors;
    they are not differentiated (``stop_gradient``), as in Linen, and ``sigma = v @ W @ u.T``.
    Computed in the promotion of the dtypes of `value` and `u`, as Linen's arithmetic is.

    Returns:
        ``(value / sigma in dtype, new u, sigma)``; a zero sigma divides by 1.
    """
    common = promote(value.dtype, u.dtype)
    matrix = jnp.reshape(value.astype(common), (-1, value.shape[-1]))

    def step(_: Any, vectors: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        v0 = _l2_normalize(vectors[0] @ matrix.T, None, epsilon)
        return _l2_normalize(v0 @ matrix, None, epsilon), v0

    # a loop, not unrolled: the program's size does not grow with n_steps
    start = (u.astype(common), jnp.zeros((1, matrix.shape[0]), common))
    u0, v0 = lax.fori_loop(0, n_steps, step, start)
    u0, v0 = lax.stop_gradient(u0), lax.stop_gradient(v0)
    sigma = (v0 @ matrix @ u0.T)[0, 0]
    matrix = matrix / jnp.where(sigma != 0, sigma, 1)
    return jnp.reshape(matrix, value.shape).astype(dtype), u0, sigma


@functools.partial(jax.jit, static_argnames=("feature_axes", "epsilon", "dtype"))
def weight_normalize(
    value: jax.Array,
    scale: jax.Array | None,
    *,
    feature_axes: tuple[int, ...] | None,
    epsilon: float,
    dtype: Dtype,
) -> jax.Array:
    """`value` with unit L2 norm over every axis but `feature_axes`, times `scale`.

    `feature_axes` are non-negative and increasing (None: the norm over every axis, one
    scalar scale); `scale` has their shape. As Linen: the norm in `value`'s dtype, the product
    in the promotion of both dtypes, the result cast to `dtype`.
    """
    features = () if feature_axes is None else feature_axes
    reduction = tuple(a for a in range(value.ndim) if a not in features)
    normalized = _l2_normalize(value, reduction, epsilon)
    if scale is not None:
        common = promote(normalized.dtype, scale.dtype)
        shape = tuple(value.shape[a] if a in features else 1 for a in range(value.ndim))
        normalized = normalized.astype(common) * jnp.reshape(scale, shape).astype(common)
    return normalized.astype(dtype)


class _WeightWrapper(Module):
    """A wrapper that calls `layer` with some of its parameters replaced by functions of them.

    Subclasses choose the parameters in ``__init__`` (``self._paths``, paths inside the layer)
    and call `_call_layer` with the function that computes each replacement.
    """

    dtype = _checks.Setting()
    param_dtype = _checks.Setting()
    layer: Any  # the wrapped module, called with the wrapper's arguments

    def __init__(self, layer: Module, dtype: Dtype, param_dtype: Dtype):
        super().__init__()
        where = type(self).__name__
        if not isinstance(layer, Module) or not callable(layer):
            raise TypeError(
                f"{where} wraps a layer (a callable lm.Module such as lm.Dense(4, 3)), got "
                f"{type(layer).__name__} {layer!r:.60}."
            )
        self.layer = layer
        self.dtype = _dtypes.layer_dtype(where, dtype)
        self.param_dtype = _dtypes.storage_dtype(where, param_dtype, self.dtype)
        self._paths: tuple[ParameterPath, ...] = ()

    def _describe(self) -> str:
        return f"{type(self).__name__}({self._layer_name()})"

    def _layer_name(self) -> str:
        describe = getattr(self.layer, "_describe", None)
        return describe() if callable(describe) else type(self.layer).__name__

    def _where(self) -> str:
        path = self._lamina_path
        return f"{self._describe()} at {format_path(path) if path else 'the root'}"

    def _call_layer(
        self,
        replacement: Callable[[ParameterPath, jax.Array], jax.Array],
        args: tuple,
        kwargs: dict,
    ) -> Any:
        """Calls the layer with each chosen parameter read as ``replacement(path, value)``."""
        found = dict(parameters(self.layer))
        replacements: dict[State, Any] = {}
        for path in self._paths:
            state = found.get(path)
            if state is None:
                raise ValueError(
                    f"{self._where()}: the layer has no parameter at {'/'.join(path)} any more; "
                    f"it was changed after it was wrapped. Wrap the new layer instead."
                )
            # The layer reads the parameter in its compute dtype whatever the wrapper's
            # `dtype`, as Linen's layer casts the normalised kernel it is given: the cast is
            # the wrapper's explicit choice (a bfloat16 `Dense` computes with a bfloat16
            # kernel), so the substitution's widening-only rule does not refuse it.
            replacements[state] = replacement(path, state.value).astype(state.dtype)
        with substituted(replacements, where=self._where()):
            return self.layer(*args, **kwargs)


def parameters(layer: Module) -> list[tuple[ParameterPath, State]]:
    """The parameters (immutable ``params`` variables) under `layer`, with their paths in it."""
    return [
        (tuple(str(k) for k in path), node)
        for path, node, _ in walk(layer)
        if isinstance(node, State) and node.collection == "params" and not node.mutable
    ]


def _nest(items: Sequence[tuple[ParameterPath, Any]]) -> dict[str, Any]:
    """``{path: x}`` as nested dicts: ``(("a", "kernel"), x)`` becomes ``{"a": {"kernel": x}}``."""
    tree: dict[str, Any] = {}
    for path, item in items:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = item
    return tree


def _get(tree: dict[str, Any], path: ParameterPath) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _shown(found: Sequence[tuple[ParameterPath, State]]) -> str:
    return ", ".join(f"{'/'.join(p)} {s.shape}" for p, s in found) or "none"


class SpectralNorm(_WeightWrapper):
    """Spectral normalisation of a layer's weights, as Flax Linen's ``SpectralNorm``.

    ``SpectralNorm(layer)`` calls `layer` with each parameter of two or more dimensions divided
    by its largest singular value (its spectral norm), estimated by `n_steps` steps of power
    iteration from a stored vector ``u``; higher-order kernels (a `Conv`'s) are seen as the
    matrix ``(-1, out)``. Called as ``sn(*args, update_stats=..., **kwargs)``, with the
    layer's own arguments: with ``update_stats=True`` (training) the new ``u`` and the
    estimate ``sigma`` are stored, so that the estimate improves over the calls.

    Variables: the layer's under ``layer`` (``params/<sn>/layer/kernel``); ``u`` of shape
    ``(1, out)`` and ``sigma`` of shape ``()`` per normalised parameter, in collection
    `collection_name`, at ``u/<path>`` and ``sigma/<path>`` with ``<path>`` the parameter's
    path in the layer (Linen's ``"Dense_0/kernel/u"`` is ``u/kernel``). Parameters of fewer
    than two dimensions (biases) are used as they are. ``u`` starts standard normal, ``sigma``
    at 1.

    `update_stats` must be a Python bool (static under `jax.jit`): it decides what is written.

    Args:
        layer: The layer to wrap (any lamina module); it is held, not copied.
        n_steps: Steps of power iteration per call (0: the parameters are used as they are).
        epsilon: Added under the square roots of the L2 normalisations.
        error_on_non_matrix: Refuse parameters of more than two dimensions instead of
            flattening them.
        collection_name: The collection of ``u`` and ``sigma``.
        dtype: The dtype of the normalised parameters; None: the promotion of the
            parameter's and ``u``'s dtypes.
        param_dtype: Storage dtype of ``u`` and ``sigma`` (default: `dtype`, float32 when
            `dtype` is None).

    Everything after `layer` is keyword-only.

    Raises:
        ValueError: A layer without a parameter of two or more dimensions (with
            ``n_steps >= 1``); with `error_on_non_matrix`, a parameter of more than two.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.SpectralNorm(lm.Dense(3, 2)))
        >>> variables = init(jax.random.key(0))
        >>> jax.tree.map(jnp.shape, variables["batch_stats"])
        {'sigma': {'kernel': ()}, 'u': {'kernel': (1, 2)}}
        >>> y, new = apply(variables, None, jnp.ones((4, 3)), update_stats=True)
        >>> y.shape
        (4, 2)
    """

    n_steps = _checks.Setting()
    epsilon = _checks.Setting()
    error_on_non_matrix = _checks.Setting()
    collection_name = _checks.Setting()

    def __init__(
        self,
        layer: Module,
        *,
        n_steps: int = 1,
        epsilon: float = 1e-12,
        error_on_non_matrix: bool = False,
        collection_name: str = "batch_stats",
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
    ):
        super().__init__(layer, dtype, param_dtype)
        where = type(self).__name__
        self.n_steps = _checks.non_negative_int(
            where, "n_steps", n_steps, " (steps of power iteration per call)"
        )
        meaning = " (it is added under the square roots of the L2 normalisations)"
        self.epsilon = _checks.non_negative(where, "epsilon", epsilon, meaning=meaning)
        self.error_on_non_matrix = _checks.flag(where, "error_on_non_matrix", error_on_non_matrix)
        if not isinstance(collection_name, str) or not collection_name or "/" in collection_name:
            raise TypeError(
                f"{where}: collection_name must be a non-empty string without '/', such as "
                f"'batch_stats', got {collection_name!r}."
            )
        self.collection_name = collection_name
        found = parameters(layer)
        targets = [(p, s) for p, s in found if len(s.shape) >= 2] if self.n_steps else []
        if self.n_steps and not targets:
            raise ValueError(
                f"{where}: the layer {self._layer_name()} has no parameter of two or more "
                f"dimensions to normalise (its parameters: {_shown(found)}). Wrap a layer "
                f"with a kernel, such as lm.Dense or lm.Conv."
            )
        for path, state in targets:
            if self.error_on_non_matrix and len(state.shape) > 2:
                raise ValueError(
                    f"{where}: the layer's parameter {'/'.join(path)} has shape {state.shape}, "
                    f"{len(state.shape)} dimensions, and error_on_non_matrix=True: spectral "
                    f"normalisation is defined on matrices. Pass error_on_non_matrix=False to "
                    f"see it as the matrix (-1, {state.shape[-1]}), as Linen does."
                )
        stat = (
            BatchStat
            if collection_name == "batch_stats"
            else functools.partial(State, collection_name, mutable=True)
        )
        stored = self.param_dtype
        self.u = _nest(
            [(p, stat((1, s.shape[-1]), initializers.normal(1.0), stored)) for p, s in targets]
        )
        self.sigma = _nest([(p, stat((), initializers.ones(), stored)) for p, _ in targets])
        self._paths = tuple(p for p, _ in targets)

    def __call__(self, *args: Any, update_stats: bool, **kwargs: Any) -> Any:
        """Calls the layer on `args` and `kwargs` with its weights spectrally normalised."""
        _checks.static_flags(type(self).__name__, update_stats=update_stats)
        normalized = functools.partial(self._normalized, update_stats=update_stats)
        return self._call_layer(normalized, args, kwargs)

    def _normalized(self, path: ParameterPath, value: jax.Array, update_stats: bool) -> jax.Array:
        u, sigma = _get(self.u, path), _get(self.sigma, path)
        u_value = u.value
        dtype = _dtypes.compute_dtype(self, self.dtype, value, u_value)
        normalized, new_u, new_sigma = spectral_normalize(
            value, u_value, n_steps=self.n_steps, epsilon=self.epsilon, dtype=dtype
        )
        if update_stats:
            # Stored in param_dtype, as Linen's: rounding the new estimates is the layer's
            # choice, so the cast is explicit (a narrowing write would be an error).
            u.value = new_u.astype(u.param_dtype)
            sigma.value = new_sigma.astype(sigma.param_dtype)
        return normalized


class WeightNorm(_WeightWrapper):
    """Weight normalisation of a layer's weights, as Flax Linen's ``WeightNorm``.

    ``WeightNorm(layer)`` calls `layer` with each chosen parameter ``w`` replaced by
    ``scale * w / ||w||``: the L2 norm over every axis but `feature_axes` (by default the
    last: one norm per output feature of a `Dense` or `Conv` kernel), times a learned
    ``scale`` per feature. The parameters chosen are those whose path in the layer, written
    ``a/b/kernel``, contains one of the strings of `variable_filter` (by default ``kernel``);
    Linen matches the same strings against the layer's name and path. Called as the layer:
    ``wn(*args, **kwargs)``.

    Variables: the layer's under ``layer`` (``params/<wn>/layer/kernel``); the scales at
    ``params/<wn>/scale/<path>``, with the shape of the parameter's feature axes (Linen's
    ``"Dense_0/kernel/scale"`` is ``scale/kernel``).

    Args:
        layer: The layer to wrap (any lamina module); it is held, not copied.
        epsilon: Added to the squared norm before the square root.
        use_scale: Whether to multiply by a learned ``scale``.
        scale_init: Initializer of the scales.
        feature_axes: The axes that keep their own norm and scale (an int or a tuple, of
            every chosen parameter); None: one norm over the whole parameter, a scalar scale.
        variable_filter: Strings; a parameter is normalised when its path contains one (None
            or empty: every parameter).
        dtype: The dtype of the normalised parameters; None: the promotion of the
            parameter's and the scale's dtypes.
        param_dtype: Storage dtype of the scales (default: `dtype`, float32 when `dtype` is
            None).

    Everything after `layer` is keyword-only.

    Raises:
        ValueError: No parameter of the layer matches `variable_filter`; a feature axis
            that a chosen parameter does not have.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.WeightNorm(lm.Dense(3, 2, use_bias=False)))
        >>> variables = init(jax.random.key(0))
        >>> jax.tree.map(jnp.shape, variables["params"])
        {'layer': {'kernel': (3, 2)}, 'scale': {'kernel': (2,)}}
        >>> y, _ = apply(variables, None, jnp.eye(3))  # the normalised kernel: unit columns
        >>> (y**2).sum(axis=0).round(3)
        Array([1., 1.], dtype=float32)
    """

    epsilon = _checks.Setting()
    use_scale = _checks.Setting()
    feature_axes = _checks.Setting()
    variable_filter = _checks.Setting()

    def __init__(
        self,
        layer: Module,
        *,
        epsilon: float = 1e-12,
        use_scale: bool = True,
        scale_init: Initializer = initializers.ones(),
        feature_axes: int | Sequence[int] | None = -1,
        variable_filter: Sequence[str] | None = ("kernel",),
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
    ):
        super().__init__(layer, dtype, param_dtype)
        where = type(self).__name__
        meaning = " (it is added to the squared norm before the square root)"
        self.epsilon = _checks.non_negative(where, "epsilon", epsilon, meaning=meaning)
        self.use_scale = _checks.flag(where, "use_scale", use_scale)
        scale_init = _checks.initializer(where, "scale_init", scale_init)
        self.feature_axes = (
            None if feature_axes is None else axes_setting(where, "feature_axes", feature_axes)
        )
        self.variable_filter = _filter_setting(where, variable_filter)
        found = parameters(layer)
        targets = [(p, s) for p, s in found if self._chosen(p)]
        if not targets:
            raise ValueError(
                f"{where}: no parameter of the layer {self._layer_name()} matches "
                f"variable_filter={self.variable_filter!r} (its parameters: {_shown(found)}). "
                f"Give strings that occur in the paths of the parameters to normalise, or "
                f"variable_filter=None for all of them."
            )
        scales = []
        for path, state in targets:
            shape = tuple(state.shape[a] for a in self._feature_axes_of(path, state.shape) or ())
            scales.append((path, Parameter(shape, scale_init, self.dtype, self.param_dtype)))
        self.scale = _nest(scales) if self.use_scale else None
        self._paths = tuple(p for p, _ in targets)

    def _chosen(self, path: ParameterPath) -> bool:
        text = "/".join(path)
        return not self.variable_filter or any(f in text for f in self.variable_filter)

    def _feature_axes_of(
        self, path: ParameterPath, shape: tuple[int, ...]
    ) -> tuple[int, ...] | None:
        if self.feature_axes is None:
            return None
        ndim = len(shape)
        if not all(-ndim <= a < ndim for a in self.feature_axes):
            raise ValueError(
                f"{type(self).__name__}: feature_axes={show_axes(self.feature_axes)} is out of "
                f"range for the layer's parameter {'/'.join(path)} of shape {shape}. Give "
                f"axes every chosen parameter has (variable_filter chooses them), or None."
            )
        axes = sorted({a % ndim for a in self.feature_axes})
        if len(axes) != len(self.feature_axes):
            raise ValueError(
                f"{type(self).__name__}: feature_axes={show_axes(self.feature_axes)} names the "
                f"same axis twice for the parameter {'/'.join(path)} of shape {shape}."
            )
        return tuple(axes)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the layer on `args` and `kwargs` with its chosen weights normalised."""
        return self._call_layer(self._normalized, args, kwargs)

    def _normalized(self, path: ParameterPath, value: jax.Array) -> jax.Array:
        scale = _get(self.scale, path).value if self.scale is not None else None
        dtype = _dtypes.compute_dtype(self, self.dtype, value, scale)
        features = self._feature_axes_of(path, tuple(value.shape))
        return weight_normalize(
            value, scale, feature_axes=features, epsilon=self.epsilon, dtype=dtype
        )


def _filter_setting(where: str, value: Any) -> tuple[str, ...]:
    """`variable_filter` as a tuple of strings (empty: every parameter)."""
    if value is None:
        return ()
    if isinstance(value, str) or not all(isinstance(v, str) for v in _iterable(value)):
        raise TypeError(
            f"{where}: variable_filter must be a collection of strings such as ('kernel',), "
            f"or None, got {value!r}."
        )
    return tuple(sorted(set(value)))


def _iterable(value: Any) -> Sequence[Any]:
    try:
        return list(value)
    except TypeError:
        return [None]
