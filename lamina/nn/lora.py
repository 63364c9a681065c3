"""Low-rank adaptation (LoRA): `LoRA` wraps a `Dense`, a `Conv` or an attention projection.

``LoRA(base, rank)`` computes ``base(x) + scale * (x @ lora_a @ lora_b)``: the base layer's
weights stay as they are and two small `LoRAParam` matrices learn a low-rank update; `merge_lora`
folds it back in. Train the
adapters alone by filtering on their type (``lm.grad(loss, model, lm.DiffState(0,
lm.LoRAParam))``, ``lm.split(model, variables, lm.LoRAParam, ...)``); for inference,
`merge_lora` folds ``scale * lora_a @ lora_b`` into the base kernels and returns a plain model.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import initializers
from .._core.checks import format_list, format_path
from .._core.errors import VariablesError
from .._core.graph import Plan, substitute, walk
from .._core.layout import nest, present_variables
from .._core.module import Module
from .._core.types import Dtype, Initializer, Path, PrecisionLike, Variables
from .._core.variables import Parameter
from . import _checks, _dtypes
from ._projections import Projection, dense_general
from .conv import Conv, conv
from .linear import Dense, dense


class LoRAParam(Parameter):
    """A parameter of a LoRA adapter (collection ``"params"``).

    A distinct type, so that filters can pick the adapters out of a model's parameters:
    ``lm.DiffState(0, lm.LoRAParam)``, ``lm.split(model, variables, lm.LoRAParam, ...)``,
    ``lm.mask(model, variables, lm.LoRAParam)``.

    Example:
        >>> import jax, lamina as lm
        >>> model = lm.Sequential(lm.LoRA(lm.Dense(4, 3), rank=2), lm.Dense(3, 1))
        >>> variables = lm.transform(model).init(jax.random.key(0))
        >>> adapters, frozen = lm.split(model, variables, lm.LoRAParam, ...)
        >>> sorted(adapters["params"]["layers_0"])
        ['lora_a', 'lora_b']
    """


@functools.partial(jax.jit, static_argnames=("scale", "dtype", "precision"))
def lora_dense(
    y: jax.Array,
    x: jax.Array,
    lora_a: jax.Array,
    lora_b: jax.Array,
    scale: float,
    dtype: Dtype,
    precision: PrecisionLike = None,
) -> jax.Array:
    """``y + scale * (x @ lora_a @ lora_b)``, the products in `dtype`, the sum in `y`'s dtype.

    `y` is the base layer's output; the products are two calls of the `dense` kernel.
    """
    hidden = dense(x, lora_a, None, dtype, precision)
    update = scale * dense(hidden, lora_b, None, dtype, precision)
    return y + update.astype(y.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "dtype"))
def lora_heads(
    y: jax.Array,
    x: jax.Array,
    lora_a: jax.Array,
    lora_b: jax.Array,
    scale: float,
    dtype: Dtype,
) -> jax.Array:
    """``y + scale * (x @ lora_a) @ lora_b`` for an attention projection's ``(in, heads, D)``.

    `lora_b` is ``(rank, heads, head_dim)``: the update has the heads' shape of `y`.
    """
    hidden = dense(x, lora_a, None, dtype)
    update = scale * dense_general(hidden, lora_b, None, 1, dtype)
    return y + update.astype(y.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "dtype",
        "strides",
        "padding",
        "dilation",
        "input_dilation",
        "precision",
    ),
)
def lora_conv(
    y: jax.Array,
    x: jax.Array,
    lora_a: jax.Array,
    lora_b: jax.Array,
    scale: float,
    dtype: Dtype,
    strides: tuple[int, ...],
    padding: Any,
    dilation: tuple[int, ...],
    input_dilation: tuple[int, ...] | None = None,
    precision: PrecisionLike = None,
) -> jax.Array:
    """``y + scale * conv(x, lora_a) @ lora_b``, the products in `dtype`, the sum in `y`'s dtype.

    A convolution into ``rank`` channels with the base's window, strides, padding and
    dilations (the `conv` kernel), then a 1x1 projection to the outputs (the `dense` kernel).
    """
    hidden = conv(
        x, lora_a, None, None, dtype, strides, padding, dilation, input_dilation, 1, precision
    )
    update = scale * dense(hidden, lora_b, None, dtype, precision)
    return y + update.astype(y.dtype)


@functools.partial(jax.jit, static_argnames=("scale",))
def merge_kernel(
    kernel: jax.Array, lora_a: jax.Array, lora_b: jax.Array, scale: float
) -> jax.Array:
    """``kernel + scale * lora_a @ lora_b``, contracting `lora_a`'s last (rank) axis.

    Computed in float32 at least (float64 if any input is) at the highest precision, and
    returned in `kernel`'s dtype: for a `Conv`, `lora_a` is ``(*window, in, rank)`` and the
    result has the kernel's shape ``(*window, in, out)``.
    """
    wide = max(
        (kernel.dtype, lora_a.dtype, lora_b.dtype, jnp.dtype(jnp.float32)),
        key=lambda d: jnp.dtype(d).itemsize,
    )
    update = lax.dot_general(
        lora_a.astype(wide),
        lora_b.astype(wide),
        (((lora_a.ndim - 1,), (0,)), ((), ())),
        precision=lax.Precision.HIGHEST,
    )
    return (kernel.astype(wide) + scale * update).astype(kernel.dtype)


class LoRA(Module):
    """Low-rank adaptation of a `Dense` or `Conv` layer: ``base(x) + scale * x @ lora_a @ lora_b``.

    It also adapts the ``query``, ``key`` and ``value`` projections of a
    `MultiHeadAttention` (``mha.query = lm.LoRA(mha.query, 8)``, or by filter with
    `lm.replace`): their kernels are ``(in, heads, head_dim)``, so ``lora_b`` is ``(rank,
    heads, head_dim)``, and `merge_lora` folds the update back into the kernel.

    The base layer's variables keep their names under ``base`` (``params/.../base/kernel``);
    the adapters are two `LoRAParam`s, ``lora_a`` and ``lora_b``, and ``scale = alpha / rank``.
    With the default ``b_init=zeros()`` the adapter starts as a no-op: the outputs equal the base
    layer's exactly. Call it as the base: ``lora(x)``.

    For a `Conv` (``groups=1`` and no mask only), ``lora_a`` is a convolution kernel with the
    base's window, strides, padding and dilations into `rank` channels, of shape
    ``kernel_size + (in_size, rank)``, and ``lora_b`` a 1x1 projection ``(rank, out_size)``;
    their product, contracted over the rank axis, has the base kernel's shape.

    Sharding: the adapters take their logical axis names from the base's kernel
    (``kernel_sharding``), so that they split as the base does: ``lora_a`` the kernel's
    names for its input axes (and window) with an unnamed rank axis, ``lora_b`` an unnamed
    rank axis and the kernel's output name. With a kernel ``("embed", "mlp")``, ``lora_a`` is
    ``("embed", None)`` and ``lora_b`` ``(None, "mlp")``; `lm.shardings` maps them by the same
    rules. To lay them out otherwise, set ``lora.lora_a.sharding`` before planning.

    The rank may be at most the rank the base's weight can have as a matrix:
    ``min(in_size, out_size)`` for a `Dense`, ``min(prod(kernel_size) * in_size, out_size)``
    for a `Conv` (its kernel seen as a ``(prod(kernel_size) * in_size, out_size)`` matrix). A
    larger rank would only add parameters: ``lora_a @ lora_b`` could not have a higher rank.

    Args:
        base: The layer to adapt: a `Dense`, a `Conv` with ``groups=1`` and no mask, or an
            attention's query, key or value projection. It is
            held, not copied (``model.layer = lm.LoRA(model.layer, 8)`` adapts a layer in place).
        rank: The rank of the update: an int from 1 to ``min(in_size, out_size)`` (a `Dense`)
            or ``min(prod(kernel_size) * in_size, out_size)`` (a `Conv`).
        alpha: The update's scale is ``alpha / rank`` (default: `rank`, so a scale of 1);
            a positive number.
        a_init: Initializer of ``lora_a`` (He uniform: fan-in ``in_size``, times the window
            for a `Conv`).
        b_init: Initializer of ``lora_b`` (zeros: the adapter starts as a no-op).
        dtype: Compute dtype of the adapter. Left out (or None), the base's `dtype` setting:
            its fixed compute dtype, or, when the base was built with ``dtype=None``,
            inferred per call from the input and the adapters (Linen's ``promote_dtype``).
            The update is cast to the base's output dtype and added there, so the output has
            the base's dtype.
        param_dtype: Storage dtype of the adapters (default: the base's storage dtype).

    Everything after `rank` is keyword-only; `base`, `rank` and the other settings are
    read-only once the LoRA is built.

    Raises:
        TypeError: `base` is not a `Dense` or `Conv`.
        ValueError: `rank` out of range, a non-positive `alpha`, or a `Conv` with groups != 1
            or a mask (a `rank` or `alpha` of the wrong type raises a `TypeError` that is also a
            `ValueError`).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> layer = lm.LoRA(lm.Dense(16, 8), rank=2)
        >>> init, apply = lm.transform(layer)
        >>> variables = init(jax.random.key(0))
        >>> jax.tree.map(jnp.shape, variables)  # doctest: +NORMALIZE_WHITESPACE
        {'params': {'base': {'bias': (8,), 'kernel': (16, 8)},
                    'lora_a': (16, 2), 'lora_b': (2, 8)}}
        >>> x = jnp.ones((4, 16))
        >>> base_apply = lm.transform(layer.base).apply
        >>> y, _ = apply(variables, None, x)
        >>> bool((y == base_apply({"params": variables["params"]["base"]}, None, x)[0]).all())
        True
    """

    # lm.with_policy: this __call__ casts every floating input to `dtype` (the base layer
    # its own), and returns the base's dtype, so a policy adds no casts to it.
    _lamina_casts_inputs = True

    base = _checks.Setting()
    rank = _checks.Setting()
    alpha = _checks.Setting()
    scale = _checks.Setting()
    dtype = _checks.Setting()
    param_dtype = _checks.Setting()

    def __init__(
        self,
        base: Dense | Conv | Projection,
        rank: int,
        *,
        alpha: float | None = None,
        a_init: Initializer = initializers.he_uniform(),
        b_init: Initializer = initializers.zeros(),
        dtype: Dtype = None,
        param_dtype: Dtype = None,
    ):
        super().__init__()
        where = _check_base(type(self).__name__, base, rank)
        rank = _checked_rank(where, base, rank)
        alpha = _checked_alpha(where, rank if alpha is None else alpha)
        self.base = base
        self.rank = rank
        self.alpha = float(alpha)
        self.scale = self.alpha / rank
        # Left out (None), the adapter takes the base's settings: its `dtype` (so None, which
        # infers the compute dtype per call, when the base infers it) and its storage dtype.
        base_dtype = getattr(base, "dtype", None)  # an attention projection infers it
        self.dtype = base_dtype if dtype is None else _dtypes.layer_dtype(where, dtype)
        self.param_dtype = (
            getattr(base, "param_dtype", base.kernel.param_dtype)
            if param_dtype is None
            else _dtypes.storage_dtype(where, param_dtype, self.dtype)
        )
        self._declare_adapter(where, a_init, b_init)

    def _declare_adapter(self, where: str, a_init: Initializer, b_init: Initializer) -> None:
        """Declares ``lora_a`` and ``lora_b``, sharded as the base's kernel's in and out axes."""
        base, rank = self.base, self.rank
        window = base.kernel_size if isinstance(base, Conv) else ()
        in_size, out_shape = _in_out(base)
        a_init = _checks.initializer(where, "a_init", a_init)
        b_init = _checks.initializer(where, "b_init", b_init)
        names = base.kernel.sharding  # (*window, in, *out) or None
        n_in = len(window) + 1
        a_names = None if names is None else (*names[:n_in], None)
        b_names = None if names is None else (None, *names[n_in:])
        self.lora_a = LoRAParam(
            (*window, in_size, rank), a_init, self.dtype, self.param_dtype, sharding=a_names
        )
        self.lora_b = LoRAParam(
            (rank, *out_shape), b_init, self.dtype, self.param_dtype, sharding=b_names
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the base layer to `x` and adds the low-rank update."""
        base = self.base
        y = base(x)
        lora_a, lora_b = self.lora_a.value, self.lora_b.value
        dtype = _dtypes.compute_dtype(self, self.dtype, x, lora_a, lora_b)
        if isinstance(base, Conv):
            return lora_conv(
                y,
                x,
                lora_a,
                lora_b,
                self.scale,
                dtype,
                base.strides,
                base.padding,
                base.dilation,
                base.input_dilation,
                base.precision,
            )
        if isinstance(base, Projection):
            return lora_heads(y, x, lora_a, lora_b, self.scale, dtype)
        return lora_dense(y, x, lora_a, lora_b, self.scale, dtype, base.precision)


def merge_lora(model: Module, variables: Variables) -> tuple[Module, Variables]:
    """Folds every `LoRA` adapter of `model` into its base layer, for inference.

    Returns a copy of `model` in which each `LoRA` module is replaced by (a copy of) its base
    layer, everywhere it is referenced (a LoRA module used twice becomes one base layer used
    twice), and the variables of that copy: each base kernel becomes ``kernel + scale *
    lora_a @ lora_b`` (computed in float32 at least, stored in the kernel's dtype), the
    adapters are dropped, and every other variable, of any collection, is carried over. Paths
    lose the ``base`` level: ``params/layer/base/kernel`` becomes ``params/layer/kernel``.
    `model` and `variables` are left untouched; a model without LoRA modules comes back as a
    plain copy.

    Args:
        model: A model holding `LoRA` modules.
        variables: Its variables: all of them, or a subset that holds, for every LoRA, its base
            kernel and both adapters (``{"params": variables["params"]}`` is enough).

    Returns:
        ``(merged_model, merged_variables)``; ``transform(merged_model).apply`` with
        `merged_variables` computes what the LoRA model computes.

    Raises:
        TypeError: `model` is not a `Module`.
        VariablesError: `variables` do not fit `model`, or lack a kernel or adapter to merge.
        ValueError: A LoRA's base kernel is also used outside that LoRA (by the model
            directly, or by another LoRA), so folding the update into it would change that
            other use too.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Net(lm.Module):
        ...     def __init__(self):
        ...         self.hidden = lm.LoRA(lm.Dense(4, 8), rank=2)
        ...         self.out = lm.Dense(8, 1)
        ...     def __call__(self, x):
        ...         return self.out(lm.relu(self.hidden(x)))
        >>> model = Net()
        >>> variables = lm.transform(model).init(jax.random.key(0))
        >>> merged, merged_variables = lm.merge_lora(model, variables)
        >>> type(merged.hidden).__name__, sorted(merged_variables["params"]["hidden"])
        ('Dense', ['bias', 'kernel'])
        >>> x = jnp.ones((2, 4))
        >>> y, _ = lm.transform(model).apply(variables, None, x)
        >>> y_merged, _ = lm.transform(merged).apply(merged_variables, None, x)
        >>> bool(jnp.allclose(y, y_merged))
        True
    """
    if not isinstance(model, Module):
        raise TypeError(f"merge_lora takes an lm.Module, got {type(model).__name__}.")
    merged = copy.deepcopy(model)
    before = Plan(merged)
    old_keys = {id(entry.state): entry.key for entry in before.variables}
    present = dict(
        (entry.key, leaf) for entry, leaf in present_variables(before, variables, "merge_lora")
    )
    loras = [(path, module) for path, module in before.modules if isinstance(module, LoRA)]
    missing = [
        "/".join(old_keys[id(state)])
        for _, lora in loras
        for state in (lora.base.kernel, lora.lora_a, lora.lora_b)
        if old_keys[id(state)] not in present
    ]
    if missing:
        raise VariablesError(
            f"merge_lora needs every LoRA's base kernel and adapters, but variables lack "
            f"({len(missing)}): {format_list(missing)}. Pass all the model's variables, or at "
            f"least {{'params': variables['params']}}."
        )
    for _, lora in loras:
        _carry_policy(lora)
    merged = _replace_loras(merged, loras)
    folds = {id(lora.base.kernel): lora for _, lora in loras}
    items = []
    for entry in Plan(merged).variables:
        old_key = old_keys[id(entry.state)]
        if old_key not in present:
            continue
        value = present[old_key]
        if id(entry.state) in folds:
            lora = folds[id(entry.state)]
            lora_a = present[old_keys[id(lora.lora_a)]]
            lora_b = present[old_keys[id(lora.lora_b)]]
            merge = functools.partial(merge_kernel, scale=lora.scale)
            for _ in entry.axes:  # inside a Stack: one merge per copy
                merge = jax.vmap(merge)
            value = merge(value, lora_a, lora_b)
        items.append((entry.key, value))
    return merged, nest(items)


def _carry_policy(lora: LoRA) -> None:
    """Gives `lora`'s base the mixed-precision marks of `lora` (see `lm.with_policy`).

    The merged layer then computes and returns in the dtypes the LoRA did.
    The base keeps a policy mark of its own (the innermost wins); the casts around its call
    become the LoRA's: its inputs as the LoRA cast them, else as the base did, its outputs as
    the LoRA returned them, else as the base did.
    """
    outer, inner = vars(lora), vars(lora.base)
    if "_lamina_policy" in outer:
        inner.setdefault("_lamina_policy", outer["_lamina_policy"])
    around, within = outer.get("_lamina_boundary"), inner.get("_lamina_boundary")
    if around is None:
        return
    if within is None:
        inner["_lamina_boundary"] = around
        return
    inner["_lamina_boundary"] = dataclasses.replace(
        around,
        input_dtype=within.input_dtype if within.input_dtype is not None else around.input_dtype,
        output_dtype=around.output_dtype
        if around.output_dtype is not None
        else within.output_dtype,
    )


def _replace_loras(root: Module, loras: list[tuple[Path, LoRA]]) -> Module:
    """Replaces, in place, every LoRA module under `root` by its base; returns the new root.

    Raises unless each base kernel is used by its own LoRA alone: folding an adapter into a
    kernel that is also used elsewhere would change that other use too.
    """
    if not loras:
        return root
    if isinstance(root, LoRA):
        return root.base  # the whole model is one LoRA: nothing else can use its base
    owners: dict[int, Path] = {}  # the kernel that each LoRA's merge rewrites
    for path, lora in loras:
        kernel = id(lora.base.kernel)
        if kernel in owners:
            raise ValueError(
                f"merge_lora: the LoRA modules at {format_path(owners[kernel])} and "
                f"{format_path(path)} share their base kernel, but their adapters differ, so no "
                f"single merged kernel computes both. Give each LoRA its own base layer, or "
                f"share the whole LoRA module."
            )
        owners[kernel] = path
    # Cut the LoRA modules out (placeholders): what the model still reaches of their bases is
    # used elsewhere. Then put the bases where the placeholders are.
    placeholders = {id(lora): Module() for _, lora in loras}
    substitute(root, placeholders)
    for path, node, _ in walk(root):
        if id(node) in owners:
            raise ValueError(
                f"merge_lora: the base kernel of the LoRA at {format_path(owners[id(node)])} is "
                f"also used outside that LoRA, at {format_path(path)}; folding the adapter into "
                f"it would change that use too. Give the LoRA its own copy of the layer "
                f"(copy.deepcopy), or merge by hand."
            )
    substitute(root, {id(placeholders[id(lora)]): lora.base for _, lora in loras})
    return root


def _check_base(cls: str, base: Any, rank: Any) -> str:
    """Checks that `base` is a layer LoRA adapts; returns how messages name the adapter."""
    if not isinstance(base, (Dense, Conv, Projection)):
        hint = ""
        if isinstance(base, LoRA):
            hint = " It is already a LoRA; give the rank you want to one LoRA instead."
        raise TypeError(
            f"LoRA adapts a Dense, a Conv (groups=1) or an attention's query, key or value "
            f"projection, got {type(base).__name__}.{hint}"
        )
    where = f"{cls}({base._describe()}, rank={rank!r})"
    if isinstance(base, Projection) and base.n_in != 1:
        raise ValueError(
            f"{where}: this attention projection contracts {base.n_in} axes (the output "
            f"projection's (heads, head_dim)); LoRA adapts the query, key and value "
            f"projections, which contract the features alone. Adapt those."
        )
    if isinstance(base, Conv) and base.groups != 1:
        raise ValueError(
            f"{where}: the base Conv has groups={base.groups}; LoRA supports groups=1 only "
            f"(a grouped kernel has no single low-rank update)."
        )
    if isinstance(base, Conv) and base.mask is not None:
        raise ValueError(
            f"{where}: the base Conv has a mask; LoRA adapts unmasked Convs only: its "
            f"update, conv(x, lora_a) @ lora_b, is not masked, so it would undo what the "
            f"mask keeps out (e.g. causality). Adapt an unmasked Conv."
        )
    return where


def _in_out(base: Dense | Conv | Projection) -> tuple[int, tuple[int, ...]]:
    """The base's input features and output shape (``(out,)``, or ``(heads, head_dim)``)."""
    if isinstance(base, Projection):
        return base.in_shape[0], base.out_shape
    return base.in_size, (base.out_size,)


def _checked_rank(where: str, base: Dense | Conv | Projection, rank: Any) -> int:
    """`rank`, a positive int no larger than the largest rank of the base's weight."""
    rank = _checks.positive_int(where, "rank", rank)
    in_size, out_shape = _in_out(base)
    out_size = math.prod(out_shape)
    if isinstance(base, Conv):
        fan_in = math.prod(base.kernel_size) * in_size
        bound = f"min(prod(kernel_size) * in_size, out_size) = min({fan_in}, {out_size})"
    else:
        fan_in = in_size
        bound = f"min(in_size, out_size) = min({fan_in}, {out_size})"
    max_rank = min(fan_in, out_size)
    if rank > max_rank:
        raise ValueError(
            f"{where}: rank must be at most {bound} = {max_rank}, the largest rank the "
            f"base's weight can have; a larger rank only adds parameters. Use rank <= "
            f"{max_rank}."
        )
    return rank


def _checked_alpha(where: str, alpha: Any) -> Any:
    """`alpha`, a positive finite number (the update is scaled by ``alpha / rank``)."""
    if not _checks.is_real(alpha) or not (alpha > 0 and math.isfinite(alpha)):
        error = ValueError if _checks.is_real(alpha) else _checks.SettingTypeError
        raise error(
            f"{where}: alpha must be a positive number (the update is scaled by "
            f"alpha / rank), got {alpha!r}."
        )
    return alpha
