"""Mixed-precision policies: `Policy` (param, compute, output dtypes) and `with_policy`.

`with_policy` edits a deep copy of a model, as haiku's ``mixed_precision.set_policy`` would
per module class, but chosen by any module filter. Each matched module is *marked* with the
policy (``_lamina_policy``); then the whole copy is worked out again from its marks, top
down: a module's effective policy is its own mark, else its nearest marked ancestor's (the
innermost mark wins; a module matched again takes the newer mark). A module under policy
``P``

- computes in ``P.compute_dtype``: its ``dtype`` setting (where it has one, and it is None
  or floating) becomes it, and its parameters are read in it;
- stores its floating variables in ``P.param_dtype``: its ``param_dtype`` setting and every
  floating parameter it holds, read in the compute dtype (running statistics are kept as a
  layer built with those dtypes keeps them: in the compute dtype, at least float32;
  decoding caches are stored and read in the compute dtype; integer and boolean state is
  left alone);
- and, where it is matched itself, casts its floating inputs to the compute dtype and its
  floating outputs to ``P.output_dtype`` at its ``__call__`` (a `Boundary`, installed on the
  snapshot `lm.transform` runs). A layer whose own code already casts every floating input
  to its ``dtype`` (its class says so with ``_lamina_casts_inputs = True``) gets no input
  casts, and no boundary at all when the output dtype is the compute dtype: nothing runs on
  its calls that would not run without a policy.

State a module carries from call to call (an RNN cell's carry) is made in the dtype the
cell's calls exchange it in, and a `Stack`'s block returns its carry in the dtype it took
it, so that a scan's carry keeps one dtype. A module its parent reads instead of calling (a
`MultiHeadAttention`'s projections) follows its parent: a policy of its own is refused.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.casting import Boundary
from .._core.checks import as_dtype, check_cast, format_path
from .._core.graph import Plan, children, deep_recursion
from .._core.module import Module
from .._core.types import Path
from .._core.variables import Assigned, Cache, State
from ..selection.filters import (
    module_predicate,
)
from ..selection.surgery import no_module_matched


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Policy:
    """The dtypes a module stores its variables in, computes in and returns.

    As jmp's and haiku's policies: parameters are kept in `param_dtype` (what the optimizer
    updates and checkpoints hold), cast to `compute_dtype` where they are used, and the
    module's floating inputs are cast to `compute_dtype`, its floating outputs to
    `output_dtype`. Apply one to a model with `lm.with_policy`.

    Args:
        param_dtype: Storage dtype of the variables: a floating dtype or its name
            (``"float32"``).
        compute_dtype: The dtype the module computes in (``"bfloat16"``, ``"float16"``...).
        output_dtype: The dtype of the module's floating outputs; None (the default): the
            compute dtype.

    Raises:
        TypeError: A dtype that names none, or one that is not a real floating dtype
            (integers, booleans and complex numbers cannot carry a model's activations), or
            float64 while JAX's 64-bit mode is off.

    Example:
        >>> import lamina as lm
        >>> lm.Policy("float32", "bfloat16")
        Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=bfloat16)
        >>> lm.Policy("float32", "bfloat16", "float32").output_dtype
        dtype('float32')
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype

    def __init__(self, param_dtype: Any, compute_dtype: Any, output_dtype: Any = None):
        param = _floating("param_dtype", param_dtype)
        compute = _floating("compute_dtype", compute_dtype)
        output = compute if output_dtype is None else _floating("output_dtype", output_dtype)
        object.__setattr__(self, "param_dtype", param)
        object.__setattr__(self, "compute_dtype", compute)
        object.__setattr__(self, "output_dtype", output)

    def __repr__(self) -> str:
        return (
            f"Policy(param_dtype={self.param_dtype.name}, compute_dtype="
            f"{self.compute_dtype.name}, output_dtype={self.output_dtype.name})"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Policy:
        return self  # immutable: copies of a model share it


def _floating(name: str, value: Any) -> np.dtype:
    if value is None:
        raise TypeError(
            f"lm.Policy: {name} must be a floating dtype such as 'float32', 'bfloat16' or "
            f"'float16', got None: a policy names its storage and compute dtypes (only "
            f"output_dtype may be left out, and then is the compute dtype)."
        )
    if _names_float64(value) and not jax.config.read("jax_enable_x64"):
        raise TypeError(
            f"lm.Policy: {name} is float64, but JAX runs without 64-bit types, so every "
            f"float64 value would silently be float32. Enable them first, at the start of "
            f"the program: jax.config.update('jax_enable_x64', True)."
        )
    dtype = as_dtype("lm.Policy", name, value)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"lm.Policy: {name} must be a real floating dtype such as 'float32', 'bfloat16' "
            f"or 'float16', got {dtype}: a policy casts a model's floating values (weights "
            f"and activations); integer, boolean and complex values are left to the layers."
        )
    return np.dtype(dtype)


def _names_float64(value: Any) -> bool:
    try:
        return np.dtype(value) == np.float64
    except TypeError:
        return False


def with_policy(model: Module, policy: Policy, *, where: Any = ...) -> Module:
    """A copy of `model` in which the modules `where` matches follow `policy`.

    Each matched module, and every module below it that is not matched by a policy of its
    own (the innermost mark wins; matched again, a module takes the newer mark), computes
    in ``policy.compute_dtype`` and stores its floating variables in
    ``policy.param_dtype``; each matched module also casts its floating
    inputs to the compute dtype and its floating outputs to ``policy.output_dtype`` (only in
    ``__call__``: other methods, such as `Embed.attend`, compute in the module's dtype
    without the casts). Modules that no policy covers, and `model` itself, are unchanged.

    Call it several times to compose policies, e.g. bfloat16 everywhere but the norms in
    float32::

        model = lm.with_policy(model, lm.Policy("float32", "bfloat16"), where=lm.Stack)
        model = lm.with_policy(
            model, lm.Policy("float32", "float32", "bfloat16"), where=lm.LayerNorm
        )

    Apply policies after `lm.replace` or wrapping layers in `lm.LoRA`: modules added later
    are not covered. ``where=...`` matches the model itself too, so its output is cast to
    the output dtype (logits in bfloat16): to keep the model's output in float32, match the
    blocks instead, or mark the model with a float32 output afterwards.

    Args:
        model: The model (an `lm.Module`); it is not changed.
        policy: The `lm.Policy`.
        where: A module filter: a Module class (``lm.LayerNorm``), ``lm.PathContains`` on
            a module's path, ``...`` for every module, a function ``(path, module) -> bool``,
            or a tuple or ``lm.Any``/``lm.All``/``lm.Not`` of these. A module reached by
            two paths is matched by its first one.

    Returns:
        The copy.

    Raises:
        TypeError: `model` is not a Module, `policy` not an `lm.Policy`, `where` selects
            variables rather than modules, or a covered variable is complex.
        ValueError: `where` matches no module (the message lists the model's modules), a
            module or variable shared between places under two different policies, a
            policy of its own on a module its parent reads instead of calling, or an
            assigned value that does not fit the new storage dtype.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> model = lm.Sequential(lm.Dense(4, 8), lm.relu, lm.Dense(8, 2))
        >>> half = lm.with_policy(model, lm.Policy("float32", "bfloat16"), where=lm.Dense)
        >>> init, apply = lm.transform(half)
        >>> variables = init(jax.random.key(0))
        >>> variables["params"]["layers_0"]["kernel"].dtype  # stored in float32
        dtype('float32')
        >>> apply(variables, None, jnp.ones((3, 4)))[0].dtype  # computed in bfloat16
        dtype(bfloat16)
    """
    if not isinstance(model, Module):
        raise TypeError(
            f"lm.with_policy takes an lm.Module, got {type(model).__name__}: "
            f"lm.with_policy(model, lm.Policy('float32', 'bfloat16'), where=...)."
        )
    if not isinstance(policy, Policy):
        raise TypeError(
            f"lm.with_policy: policy must be an lm.Policy, got {type(policy).__name__} "
            f"{policy!r:.60}. Build one with lm.Policy(param_dtype, compute_dtype, "
            f"output_dtype) (a jmp.Policy p converts as lm.Policy(p.param_dtype, "
            f"p.compute_dtype, p.output_dtype))."
        )
    try:
        predicate = module_predicate(where, "lm.with_policy")
    except TypeError as error:
        raise TypeError(_name_hint(str(error), model, where)) from None
    with deep_recursion():
        result = copy.deepcopy(model)
    plan = Plan(result)
    matched = [module for path, module in plan.modules if predicate(path, module)]
    if not matched:
        raise ValueError(no_module_matched("lm.with_policy", plan, where, predicate))
    ids = {id(module) for module in matched}
    for module in matched:
        vars(module)["_lamina_policy"] = policy
        # The parts a module reads rather than calls (the attention's projections) are part
        # of its computation: they follow its policy, whatever they were marked with before.
        for _, child in children(module):
            if isinstance(child, Module) and _read_only(child) and id(child) not in ids:
                vars(child).pop("_lamina_policy", None)
    _work_out(plan)
    return result


def _name_hint(message: str, model: Module, where: Any) -> str:
    """`message`, with the module filter meant when `where` is a string naming a module."""
    if isinstance(where, str):
        for path, _ in Plan(model).modules:
            if where in (str(key) for key in path):
                return (
                    f"{message} A module of {type(model).__name__} is named {where!r} (at "
                    f"{format_path(path)}): to match it, pass lm.PathContains({where!r})."
                )
    return message


# --- working out the copy from its marks ----------------------------------------------------


class _Reach:
    """How the walk of all paths reached one module or declaration."""

    __slots__ = ("node", "path", "policies")

    def __init__(self, node: Any, path: Path):
        self.node = node
        self.path = path  # the first path
        self.policies: dict[Policy | None, Path] = {}  # each effective policy, first path


def _reach(root: Module) -> dict[int, _Reach]:
    """Every module and declaration with the effective policies of every path to it.

    A module's own mark is its effective policy; otherwise each path brings its nearest
    marked ancestor's (None: no policy). A node is expanded once per policy it is reached
    with, so a shared one is looked at from every place that covers it.
    """
    found: dict[int, _Reach] = {}
    expanded: set[tuple[int, int]] = set()
    stack: list[tuple[Path, Any, Policy | None]] = [((), root, None)]
    while stack:
        path, node, inherited = stack.pop()
        if isinstance(node, (Module, State)):
            reach = found.get(id(node))
            if reach is None:
                reach = found[id(node)] = _Reach(node, path)
            if isinstance(node, Module):
                inherited = vars(node).get("_lamina_policy", inherited)
            reach.policies.setdefault(inherited, path)
            if isinstance(node, State):
                continue
        elif not isinstance(node, (list, tuple, dict)):
            continue
        key = (id(node), id(inherited))
        if key in expanded:
            continue
        expanded.add(key)
        items = list(children(node))
        stack.extend(((*path, k), child, inherited) for k, child in reversed(items))
    return found


def _effective(reach: _Reach) -> Policy | None:
    """The one policy a node follows: its own mark, or the one policy over all its paths."""
    node = reach.node
    if isinstance(node, Module) and "_lamina_policy" in vars(node):
        return vars(node)["_lamina_policy"]
    policies = [p for p in reach.policies if p is not None]
    if len(policies) > 1:
        places = "; ".join(f"{format_path(reach.policies[p])} under {p!r}" for p in policies)
        raise ValueError(
            f"lm.with_policy: the {type(node).__name__} at {format_path(reach.path)} is one "
            f"object reached in places that follow different policies ({places}), and it "
            f"can hold only one set of dtypes. Give each place its own copy "
            f"(copy.deepcopy), or match this {type(node).__name__} itself to choose its policy."
        )
    return policies[0] if policies else None


def _work_out(plan: Plan) -> None:
    """Rewrites the covered modules and declarations of `plan.root` from the marks."""
    with deep_recursion():
        found = _reach(plan.root)
    effective = {key: _effective(reach) for key, reach in found.items()}
    paths = {id(entry.state): entry.name for entry in plan.declared}
    _check_read_parts(plan, effective)
    for key, reach in found.items():
        policy = effective[key]
        if policy is None:
            continue
        if isinstance(reach.node, State):
            _rewrite_declaration(reach.node, policy, paths.get(key, format_path(reach.path)))
        else:
            own = vars(reach.node)
            for name, dtype in (
                ("dtype", policy.compute_dtype),
                ("param_dtype", policy.param_dtype),
            ):
                if name in own and _is_precision(own[name]):
                    own[name] = dtype  # past a layer's read-only `Setting`, as copying.freeze
    boundaries = {id(module): _boundary(module, effective) for _, module in plan.modules}
    carries: dict[int, Any] = {}
    for _, module in reversed(plan.modules):  # a nested Stack's carry before its parent's
        _carry_through(module, effective, boundaries, carries)
    for _, module in plan.modules:
        own = vars(module)
        boundary = boundaries[id(module)]
        if boundary is None:
            own.pop("_lamina_boundary", None)
        else:
            own["_lamina_boundary"] = boundary
        policy = effective[id(module)]
        if policy is None or not getattr(type(module), "_lamina_carry_methods", ()):
            own.pop("_lamina_carry_dtype", None)
        else:
            # The carry goes in and out of the module's calls: in the output dtype where a
            # boundary casts them, else in the compute dtype the module returns.
            carry = boundary.output_dtype if boundary is not None else None
            own["_lamina_carry_dtype"] = carry if carry is not None else policy.compute_dtype


def _rewrite_declaration(state: State, policy: Policy, name: str) -> None:
    """`state`'s dtypes under `policy` (see the module's rules); its assigned value checked."""
    stored = np.dtype(state.param_dtype)
    if stored.kind == "c" or np.dtype(state.dtype).kind == "c":
        raise TypeError(
            f"lm.with_policy: {name} is a complex {type(state).__name__} ({stored}), but a "
            f"policy's dtypes are real: it would lose its imaginary part. A policy covers "
            f"everything below the modules it matches, so match neither the module that holds "
            f"it nor any module above it (not the model itself, which `...` and lm.Not(...) "
            f"match too): match the other modules, e.g. where=lm.Dense or "
            f"where=lm.PathContains('encoder')."
        )
    if not jnp.issubdtype(stored, jnp.floating):
        return  # counters, indices, masks: not a precision question
    if isinstance(state, Cache):
        dtype = param = policy.compute_dtype  # what the attention writes and reads
    elif state.collection == "params":
        dtype, param = policy.compute_dtype, policy.param_dtype
    else:
        # Statistics (running means and variances...): what a layer built with the policy's
        # dtypes declares (BatchNorm's `statistics_dtype`): the compute dtype, at least
        # float32, whatever the parameters' storage. Averages kept in bfloat16 stall, and
        # in float16 overflow.
        with jax.numpy_dtype_promotion("standard"):
            dtype = param = np.dtype(jnp.promote_types(policy.compute_dtype, jnp.float32))
    if isinstance(state.init, Assigned) and param != stored:
        value = state.init.array

        def what() -> str:
            return (
                f"lm.with_policy cannot store the value assigned to {name} as {param} "
                f"(param_dtype of {policy!r})"
            )

        check_cast(
            value if hasattr(value, "dtype") else np.asarray(value), param, what, by_value=True
        )
    state.dtype, state.param_dtype = dtype, param


def _casts_inputs(module: Module) -> bool:
    """Whether the ``__call__`` `module` runs declares that it casts its inputs itself.

    The marker counts on the class that defines the ``__call__`` in use, so a subclass with a
    ``__call__`` of its own gets the casts.
    """
    for klass in type(module).__mro__:
        if "__call__" in vars(klass):
            return vars(klass).get("_lamina_casts_inputs", False) is True
    return False


def _boundary(module: Module, effective: dict[int, Policy | None]) -> Boundary | None:
    """The casts a matched `module`'s call needs by its own policy, or None."""
    policy = vars(module).get("_lamina_policy")
    if policy is None or not _called(module):
        return None  # holds variables that its parent reads
    if _casts_inputs(module) and _uniform(module, policy, effective):
        if policy.output_dtype == policy.compute_dtype:
            return None
        return Boundary(None, policy.output_dtype)
    return Boundary(policy.compute_dtype, policy.output_dtype)


def _carry_through(
    module: Module,
    effective: dict[int, Policy | None],
    boundaries: dict[int, Boundary | None],
    carries: dict[int, Any],
) -> None:
    """Keeps a `Stack`'s carry in one dtype through its block (a scan demands it).

    The carry enters the stack in the dtype its block works in (a marked block's output
    dtype, else the compute dtype of the policy over it), and each block's output is cast to
    that dtype where it would not otherwise come out in it (a float32 norm closing a
    bfloat16 block). Where no dtype is known (an uncovered block with policies inside), the
    block's output is cast back to the dtype its carry came in.
    """
    stacked = getattr(type(module), "_lamina_stacked_axis", None)
    if stacked is None:
        return
    found = [vars(module).get(name) for name in stacked(module)[2]]
    blocks: list[Module] = [block for block in found if isinstance(block, Module)]
    involved = effective.get(id(module)) is not None or any(
        "_lamina_policy" in vars(node) for block in blocks for node in _modules_under(block)
    )
    if not blocks or not involved:
        return
    block = blocks[0]
    mark = vars(block).get("_lamina_policy")
    covering = effective.get(id(block))
    carry = (
        mark.output_dtype
        if mark is not None
        else covering.compute_dtype
        if covering is not None
        else _known_output(block, effective, boundaries, carries)
    )
    carries[id(module)] = carry
    own = boundaries[id(module)]
    if carry is not None:
        output = own.output_dtype if own is not None else None
        boundaries[id(module)] = Boundary(carry, output)
    for block in blocks:
        known = _known_output(block, effective, boundaries, carries)
        if carry is not None and known == carry:
            continue
        inner = boundaries[id(block)]
        boundaries[id(block)] = Boundary(
            inner.input_dtype if inner is not None else None,
            carry,
            output_like_input=carry is None,
        )


def _known_output(
    module: Module,
    effective: dict[int, Policy | None],
    boundaries: dict[int, Boundary | None],
    carries: dict[int, Any],
) -> Any:
    """The dtype `module`'s call returns, where the policies decide it; else None."""
    boundary = boundaries.get(id(module))
    if boundary is not None and boundary.output_dtype is not None:
        return boundary.output_dtype
    if carries.get(id(module)) is not None:
        return carries[id(module)]  # a Stack returns its carry
    policy = effective.get(id(module))
    if policy is not None and _casts_inputs(module) and _uniform(module, policy, effective):
        return policy.compute_dtype
    return None


def _modules_under(module: Module) -> list[Module]:
    """`module` and every module below it."""
    found: list[Module] = []
    pending: list[Any] = [module]
    seen: set[int] = set()
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, Module):
            found.append(node)
        if isinstance(node, (Module, list, tuple, dict)):
            pending.extend(child for _, child in children(node))
    return found


def _is_precision(value: Any) -> bool:
    """Whether a module's ``dtype``/``param_dtype`` setting is a precision a policy sets.

    It is one when None (inferred) or a real floating dtype; not an integer dtype a module
    makes indices in, say.
    """
    if value is None:
        return True
    try:
        return bool(jnp.issubdtype(np.dtype(value), jnp.floating))
    except TypeError:
        return False


def _called(module: Module) -> bool:
    """Whether `module`'s parent calls it (rather than reading its variables).

    A module that cannot be called is read; so is one whose class says
    ``_lamina_read_by_parent = True`` (a `MultiHeadAttention`'s projections: callable on
    their own, as a LoRA base calls them, but read by the attention).
    """
    return callable(module) and not getattr(type(module), "_lamina_read_by_parent", False)


def _read_only(module: Module) -> bool:
    """Whether `module` only holds variables for its parent to read.

    Neither it nor any module below it is called (a `MultiHeadAttention`'s projections).
    """
    return not any(_called(node) for node in _modules_under(module))


def _check_read_parts(plan: Plan, effective: dict[int, Policy | None]) -> None:
    """Refuses a policy of its own on a module its parent reads instead of calling."""
    by_path = {path: module for path, module in plan.modules}
    for path, module in plan.modules:
        policy = vars(module).get("_lamina_policy")
        if policy is None or not path or not _read_only(module):
            continue
        parent_path = next(path[:k] for k in range(len(path) - 1, -1, -1) if path[:k] in by_path)
        parent = by_path[parent_path]
        if effective.get(id(parent)) == policy:
            continue
        where = format_path(parent_path) if parent_path else "<root>"
        raise ValueError(
            f"lm.with_policy: the {type(module).__name__} at {format_path(path)} would follow "
            f"{policy!r}, but it is never called: its parent, the {type(parent).__name__} at "
            f"{where}, reads its variables in its own computation, in its own dtypes, so "
            f"this policy would be ignored. Match the {type(parent).__name__} instead (e.g. "
            f"where=lm.{type(parent).__name__} or a lm.PathContains of its path); its parts "
            f"follow it."
        )


def _uniform(module: Module, policy: Policy, effective: dict[int, Policy | None]) -> bool:
    """Whether every module below `module` follows `policy` too.

    Then what they return is computed in the compute dtype, and a layer that casts its own
    inputs needs nothing more.
    """
    return all(effective.get(id(m)) == policy for m in _modules_under(module) if m is not module)
