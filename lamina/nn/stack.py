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

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> stack = lm.Stack(lm.Dense(4, 4), 3)
        >>> init, apply = lm.transform(stack)
        >>> variables = init(jax.random.key(0))
        >>> variables["params"]["block"]["kernel"].shape
        (3, 4, 4)
        >>> apply(variables, None, jnp.ones((2, 4)))[0].shape
        (2, 4)
    """

    n = _checks.Setting()
    remat = _checks.Setting()
    unroll = _checks.Setting()

    def __init__(self, block: Module, n: int, *, remat: bool = False, unroll: int | bool = 1):
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
        for _, node in walk(block):
            if isinstance(node, State):
                node._lamina_axes = (self.n, *node._lamina_axes)
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
