"""`checkpoint` (`remat`): `jax.checkpoint` over functions that take modules.

The function runs once in a nested frame under `jax.checkpoint`: nothing is mapped, all the
argument modules' state passes through, and records (`lm.sow`) go in and come out as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .bind import Binding, array_leaves, bind, shapes_inside, store
from .body import Body
from .lifted import Lifted, decorator_or


class _Checkpoint(Lifted):
    kind = "checkpoint"
    iterates = False

    def __init__(
        self,
        fn: Callable[..., Any],
        prevent_cse: bool,
        policy: Callable[..., bool] | None,
        static_argnums: int | tuple[int, ...],
    ):
        super().__init__(fn)
        self.prevent_cse, self.policy = prevent_cse, policy
        self.static = (static_argnums,) if isinstance(static_argnums, int) else static_argnums

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = "lm.checkpoint"
        static = {i % len(args) for i in self.static} if args else set()
        dynamic = tuple(a for i, a in enumerate(args) if i not in static)
        binding = bind(name, dynamic, None, allow_carry=False)

        def call(*dynamic_args: Any) -> Any:
            it = iter(dynamic_args)
            full = [args[i] if i in static else next(it) for i in range(len(args))]
            return self.fn(*full, **kwargs)

        out, new = _run_plain(binding, call, self._transform)
        store(binding, new)
        return out

    def _transform(self, run: Callable[..., Any]) -> Callable[..., Any]:
        return jax.checkpoint(run, prevent_cse=self.prevent_cse, policy=self.policy)


def _run_plain(
    binding: Binding,
    fn: Callable[..., Any],
    transform: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> tuple[Any, dict[int, Any]]:
    """Runs `fn` under a transform that maps nothing (checkpoint): all state passes through."""
    arrays, _ = array_leaves(binding)
    body = Body(binding, fn, {}, records="plain")
    shapes = shapes_inside(binding, {})
    mutable = binding.mutable_slots()

    def run(arrays: list, slot_values: dict, keys: dict) -> Any:
        out, new = body.run(arrays, slot_values, keys, shapes)
        return out, {s: new[s] for s in mutable}, body.records_out()

    values = binding.frame.values
    out, new, records = transform(run)(
        arrays, {s: values[s] for s in binding.slots}, binding.forked
    )
    body.absorb_records(records)
    return body.restore(out), new


def checkpoint(
    fn: Callable[..., Any] | None = None,
    *,
    prevent_cse: bool = True,
    policy: Callable[..., bool] | None = None,
    static_argnums: int | tuple[int, ...] = (),
) -> Any:
    """`jax.checkpoint` (rematerialisation) for functions that take modules.

    Args:
        fn: The function. Without it, returns a decorator.
        prevent_cse: As `jax.checkpoint`.
        policy: Which intermediates to save, e.g. ``jax.checkpoint_policies.dots_saveable``.
        static_argnums: Positional arguments that are Python values, not arrays.

    Returns:
        The lifted function; call it inside a model's method.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Block(lm.Module):
        ...     def __init__(self):
        ...         self.dense = lm.Dense(2, 2)
        ...     def __call__(self, x):
        ...         return lm.checkpoint(lambda d, x: lm.relu(d(x)))(self.dense, x)
        >>> init, apply = lm.transform(Block())
        >>> apply(init(jax.random.key(0)), None, jnp.ones(2))[0].shape
        (2,)
    """
    return decorator_or(fn, lambda f: _Checkpoint(f, prevent_cse, policy, static_argnums))


remat = checkpoint
