"""`sow` and `perturb`: values a module records into collections the caller asks for.

Flax Linen's ``sow``/``perturb`` semantics over a pure `apply`. A collection the model does not
declare, passed to `apply` among the variables (``{**variables, "intermediates": {}}``), is a
*request* (`recording.split_requests`): `sow` and `perturb` record into it, and `apply` returns
it in the new variables. Without the request they do nothing (the traced program is the same as
without the call).

A record's key is the recording module's path plus its name. The recording module is the
innermost one whose method is running, found on the Python stack by the methods' code objects
(`module.running_module`: no fixed stack depth, and calling a module costs nothing extra); a
method is any function among the attributes of the module's classes, including one assigned to
a class after it was created. The collection is returned as a nested dict like the variables
(``{"intermediates": {"layer1": {"h": (array,)}}}``). Entries given in a requested collection
are inputs: `sow` reduces into them, `perturb` adds them; every given entry must be used, so a
misspelt collection name is an error, not ignored data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from .._core.checks import format_path
from .._core.errors import VariablesError
from .._core.frame import require_frame
from .._core.module import Module, running_module
from .._core.recording import MISSING, RecordKey


def _append(records: tuple, value: Any) -> tuple:
    return (*records, value)


def _empty() -> tuple:
    return ()


def _record_key(where: str, plan: Any, name: str) -> RecordKey:
    """The key of record `name` made by the calling module: its path, then the name."""
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"{where}: a record's name is a non-empty str without '/', got {name!r}.")
    return (*_calling_module(where, plan, name)._lamina_path, name)  # type: ignore[misc]


def _calling_module(where: str, plan: Any, name: str) -> Module:
    """The module whose method is running: the innermost on the stack, of `plan`'s modules.

    A method is a function among the attributes of the module's class (or of a class it
    inherits from), known by its code object: those of the class body are registered when the
    class is created (`module.METHOD_CODES`); a frame whose first parameter holds a module of
    the plan and whose code is not registered is looked up in that module's classes as they
    are now (`module.method_of`), so a method assigned to the class later counts too. The
    module is what its first parameter holds. Other functions on the way (a closure, a
    lambda, a helper given a module, JAX's own frames under a transform) are passed over,
    so a closure that a parent hands to a child records under the child, wherever it was
    defined.
    """
    module = running_module(plan.module_paths())
    if module is not None:
        return module
    raise RuntimeError(
        f"{where}({name!r}) ran while no method of a module of the model being applied was "
        f"running (a function given to lm.transform's to_callable, or a method attached to "
        f"one module object rather than to its class?): a record belongs to the module "
        f"whose method calls it. Call {where} inside a method of a Module subclass."
    )


def sow(
    name: str,
    value: Any,
    *,
    collection: str = "intermediates",
    reduce_fn: Callable[[Any, Any], Any] = _append,
    init_fn: Callable[[], Any] = _empty,
) -> bool:
    """Records `value` under the calling module's path, if the caller asked for `collection`.

    Call it inside a module's method. The caller asks by passing the collection, empty, among
    the variables: ``apply({**variables, "intermediates": {}}, rngs, x)`` returns the records
    in ``new_variables["intermediates"]``. Without that, `sow` records nothing and adds nothing
    to the traced program. The record is ``reduce_fn(previous, value)``, where `previous` is
    what was recorded under the same name before in this call (or given in the collection),
    else ``init_fn()``: by default a tuple that grows by one value per call, so a module called
    twice records two values. Inside `lm.vmap` and `lm.scan` (and so `lm.Stack`) the records
    come out with the transform's axis in front.

    The record belongs to the innermost module whose method is running when `sow` runs (a
    method: a function among the attributes of a Module subclass, or of a class it inherits
    from, `__call__` or any other, whether defined in the class body or assigned to the
    class later). A function that is not a method records under the module whose method
    called it: a closure that a parent defines and hands to a child
    records under the child, whatever names the closure uses.

    Args:
        name: The record's name under the module's path.
        value: What to record (any pytree).
        collection: The collection to record into.
        reduce_fn: ``(previous, value) -> record``.
        init_fn: ``() -> the first previous``.

    Returns:
        Whether it recorded (the collection was requested).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Mlp(lm.Module):
        ...     def __init__(self):
        ...         self.hidden, self.out = lm.Dense(3, 4), lm.Dense(4, 2)
        ...     def __call__(self, x):
        ...         h = lm.relu(self.hidden(x))
        ...         lm.sow("h", h)
        ...         return self.out(h)
        >>> init, apply = lm.transform(Mlp())
        >>> variables = init(jax.random.key(0))
        >>> _, new = apply({**variables, "intermediates": {}}, None, jnp.ones((2, 3)))
        >>> [h.shape for h in new["intermediates"]["h"]]
        [(2, 4)]
        >>> "intermediates" in apply(variables, None, jnp.ones((2, 3)))[1]
        False
    """
    frame = require_frame("lm.sow")
    records = frame.records
    if records is None or not records.wants(collection):
        return False
    key = _record_key("lm.sow", frame.plan, name)
    previous = records.read(collection, key)
    previous = init_fn() if previous is MISSING else previous
    records.write(collection, key, reduce_fn(previous, value))
    return True


def perturb(name: str, x: Any, *, collection: str = "perturbations") -> Any:
    """Returns `x` plus a perturbation of its shape, when the caller asked for `collection`.

    The gradient of a loss with respect to the perturbation is its gradient with respect to
    the intermediate `x`. Pass ``{"perturbations": {}}`` among the variables to create zeros
    (returned in the new variables); pass them back and differentiate with respect to that
    collection. Without the collection, `x` is returned as it is. (`probe` does it all.)
    The perturbation belongs to the module whose method is running, by `sow`'s rule (the
    innermost; a closure called inside a child's method perturbs under the child).

    Args:
        name: The perturbation's name under the calling module's path.
        x: The intermediate value (an array).
        collection: The collection holding the perturbations.

    Returns:
        ``x + perturbation``, or `x`.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Model(lm.Module):
        ...     def __init__(self):
        ...         self.dense = lm.Dense(3, 2)
        ...     def __call__(self, x):
        ...         return jnp.sum(lm.perturb("h", self.dense(x)) ** 2)
        >>> init, apply = lm.transform(Model())
        >>> variables = init(jax.random.key(0))
        >>> x = jnp.ones((1, 3))
        >>> _, new = apply({**variables, "perturbations": {}}, None, x)
        >>> zeros = new["perturbations"]
        >>> def loss(p):
        ...     return apply({**variables, "perturbations": p}, None, x)[0]
        >>> dh = jax.grad(loss)(zeros)["h"]  # the model's own path is the root
        >>> dense = variables["params"]["dense"]
        >>> h = x @ dense["kernel"] + dense["bias"][None]
        >>> bool(jnp.allclose(dh, 2 * h))
        True
    """
    frame = require_frame("lm.perturb")
    records = frame.records
    if records is None or not records.wants(collection):
        return x
    key = _record_key("lm.perturb", frame.plan, name)
    x = jnp.asarray(x)
    noise = records.read(collection, key)
    if noise is MISSING:
        noise = jnp.zeros_like(x)
    elif jnp.shape(noise) != x.shape:
        raise VariablesError(
            f"the perturbation {format_path(key, collection)} has shape {jnp.shape(noise)}, "
            f"but the value it perturbs has shape {x.shape}. Create the perturbations with "
            f"the same inputs' shapes (apply with {{{collection!r}: {{}}}})."
        )
    records.write(collection, key, noise)
    return x + jnp.asarray(noise, x.dtype)
