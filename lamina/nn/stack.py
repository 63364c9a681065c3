"""`Stack`: n copies of a block with stacked variables, run in sequence by a lifted scan."""

from __future__ import annotations

from typing import Any

from .._core.graph import walk
from .._core.lift import Carry, checkpoint, scan, split_rngs
from .._core.module import Module
from .._core.variables import State
from . import _checks


class Stack(Module):
    """``n`` copies of `block`, with their variables stacked on a leading axis of size ``n``.

    The plan holds one block: each of its variables is stored with shape ``(n, *declared)``
    and initialised with one key per copy, so the copies differ. Calling the stack runs the
    copies in sequence with `scan` (``x = block(x, *args, **kwargs)`` for each copy), so the
    traced program, and the compile time, do not grow with ``n``. Every random stream is
    split per copy, so each layer draws its own dropout masks.

    ``stack.block`` is the template: its variables carry the leading axis. For an ensemble
    instead of a sequence, map over it: ``lm.vmap(lambda m, x: m(x), in_axes=(0, None))(
    stack.block, x)``.

    Args:
        block: A module that maps ``x -> x`` (same shape and dtype), such as a residual
            block. It becomes the stack's own: do not use it elsewhere.
        n: The number of copies.
        remat: Rematerialise each block in the backward pass (`checkpoint`), trading
            compute for memory.
        unroll: Copies run per loop iteration (`jax.lax.scan`'s ``unroll``; True for all).
            On CPUs a few unrolled layers can run faster than the loop (XLA fuses across
            them) at the cost of a program that grows with ``unroll``.
        depth_sharding: The logical axis name of the stacked leading axis, which
            `lm.shardings` maps to a mesh axis by its rules; None (the default): the depth is
            not sharded, and each device holds its part of every copy, as the block's own
            names say.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> stack = lm.Stack(lm.Dense(4, 4), 3)
        >>> init, apply = lm.transform(stack)
        >>> variables = init(jax.random.key(0))
        >>> variables["params"]["block"]["kernel"].shape
        (3, 4, 4)
        >>> apply(variables, None, jnp.ones((2, 4)))[0].shape
        (2, 4)

        The leading axis comes first in the logical names `lm.shardings` reads:

        >>> block = lm.Dense(4, 4, kernel_sharding=("embed", "mlp"))
        >>> stack = lm.Stack(block, 3, depth_sharding="layers")
        >>> mesh = jax.sharding.AbstractMesh((4,), ("model",))
        >>> lm.shardings(stack, mesh, {"mlp": "model"})["params"]["block"]["kernel"].spec
        P(None, None, 'model')
    """

    n = _checks.Setting()
    remat = _checks.Setting()
    unroll = _checks.Setting()
    depth_sharding = _checks.Setting()

    def __init__(
        self,
        block: Module,
        n: int,
        *,
        remat: bool = False,
        unroll: int | bool = 1,
        depth_sharding: str | None = None,
    ):
        super().__init__()
        where = type(self).__name__
        if not isinstance(block, Module):
            raise TypeError(
                f"{where}: block must be an lm.Module (a layer or your block), got "
                f"{type(block).__name__}."
            )
        self.n = _checks.positive_int(where, "n", n)
        self.remat = _checks.flag(where, "remat", remat)
        if isinstance(unroll, bool):
            self.unroll = unroll
        else:
            self.unroll = _checks.positive_int(where, "unroll", unroll)
        if depth_sharding is not None and not isinstance(depth_sharding, str):
            raise TypeError(
                f"{where}: depth_sharding must be None or one logical axis name (a str) for "
                f"the stacked leading axis, got {depth_sharding!r}."
            )
        self.depth_sharding = depth_sharding
        for _, node in walk(block):
            if isinstance(node, State):
                names = getattr(node, "_lamina_axis_names", (None,) * len(node._lamina_axes))
                node._lamina_axes = (self.n, *node._lamina_axes)
                # the logical names of the leading axes, read by the plan (Plan.variables)
                setattr(node, "_lamina_axis_names", (depth_sharding, *names))  # noqa: B010
        self.block = block

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """Runs the copies in sequence: ``x = block_i(x, *args, **kwargs)`` for i < n."""

        def step(block: Any, x: Any) -> Any:
            return block(x, *args, **kwargs)

        run = checkpoint(step) if self.remat else step
        with split_rngs(splits=self.n):
            lifted = scan(
                run, in_axes=(0, Carry), out_axes=Carry, length=self.n, unroll=self.unroll
            )
            return lifted(self.block, x)
