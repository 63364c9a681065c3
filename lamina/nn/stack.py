"""`Stack`: n copies of a block with stacked variables, run in sequence by a lifted scan."""

from __future__ import annotations

from typing import Any

from .._core.module import Module
from ..lift import Carry, checkpoint, scan
from . import _checks


class Stack(Module):
    """``n`` copies of `block`, with their variables stacked on a leading axis of size ``n``.

    The plan holds one block: each of its variables is stored with shape ``(n, *declared)``
    and initialised with one key per copy, so the copies differ. Calling the stack runs the
    copies in sequence with `scan` (``x = block(x, *args, **kwargs)`` for each copy), so the
    traced program, and the compile time, do not grow with ``n``. Every random stream is
    split per copy, so each layer draws its own dropout masks.

    ``stack.block`` is the template and is not changed: the leading axis is the plan's
    (`VariableEntry.axes`), added to every variable reached through ``block`` (and only
    there: the attributes a subclass adds keep their declared shapes), so
    ``lm.transform(stack.block)`` plans one copy with the declared shapes. Inside the model
    the block's variables hold every copy, so the block runs only on one copy at a time:
    through the stack, or, for an ensemble instead of a sequence, mapped over the axis:
    ``lm.vmap(lambda m, x: m(x), in_axes=(0, None))(stack.block, x)``. Calling
    ``stack.block`` (or reading its variables) directly is an error; the variables dict
    holds all copies. Stacks nest (the outer axis first).

    Args:
        block: A module that maps ``x -> x`` (same shape and dtype), such as a residual
            block. It belongs to this stack: using the same object outside it, or in
            another Stack, is an error when the model is planned (stack a
            ``copy.deepcopy(block)`` instead); to share weights, share the whole stack.
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
        self.block = block  # not changed: the plan's walk adds the axis (_lamina_stacked_axis)

    def _lamina_stacked_axis(self) -> tuple[int, str | None, tuple[str, ...]]:
        """The axis the plan stores in front of every variable of the block.

        Returns:
            ``(n, its logical name, the attributes it stacks)``: only ``block``, so the
            attributes a subclass adds (a final norm, a gain) keep their declared shapes.
        """
        return self.n, self.depth_sharding, ("block",)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """Runs the copies in sequence: ``x = block_i(x, *args, **kwargs)`` for i < n."""

        def step(block: Any, x: Any) -> Any:
            return block(x, *args, **kwargs)

        run = checkpoint(step) if self.remat else step
        lifted = scan(
            run,
            in_axes=(0, Carry),
            out_axes=Carry,
            length=self.n,
            unroll=self.unroll,
            split_rngs=True,  # every stream, one key per copy
        )
        return lifted(self.block, x)
