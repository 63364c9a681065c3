"""FLOPs per module call from XLA's cost analysis: what `lm.summary` shows with example inputs.

`call_costs` traces the model once abstractly to list its module calls and their arguments
(`records.capture.calls`), then lowers each call alone, ``jax.jit(lm.transform(module).apply)``
on the shapes that call received, and reads XLA's count (``Lowered.cost_analysis()``). A
call's *own* FLOPs are its count less those of the calls inside it; a module's total adds its
children's totals back. XLA counts the body of a loop once, so where a parent runs a child in a
loop (a `Stack`'s block, an `RNN`'s cell), the caller's `repeats` says how many times it runs
and how many copies of its body XLA counted; the counts are corrected by those two numbers.
For the backward pass the body is lowered as the loop runs it (under `jax.checkpoint` when the
loop rematerialises, summing its parameters' gradients when the loop shares them), so that the
correction does not depend on ``unroll``. Of the branches of an `lm.cond`/`lm.switch`, XLA
counts the costliest, and so does the parent's total.
Nothing runs on a device and nothing is compiled: lowering traces each module once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ._core.checks import format_path
from ._core.graph import Plan
from ._core.module import Module
from ._core.transform import transform
from ._core.variables import Parameter
from .records.capture import Call, CallFailed, calls


class Loop(NamedTuple):
    """How a parent runs a child in a loop (what a `Repeats` function returns).

    Attributes:
        runs: How many times one call of the parent runs the child.
        bodies: How many copies of the loop's body XLA counts in the parent's program (the
            ``unroll``ed copies, and the remainder's).
        remat: The loop rematerialises its body (`jax.checkpoint`, no policy): the body's
            backward pass, and those of the calls inside it, are counted with their forward
            pass run again, as the loop runs them.
        shared: The body's parameters are the same at every iteration (an `RNN`'s cell), so
            the loop sums their gradients: each iteration's backward pass counts that sum.
    """

    runs: int
    bodies: int
    remat: bool = False
    shared: bool = False


Repeats = Callable[[Call, Call], "Loop | None"]
"""``repeats(parent, child) -> Loop | None``: how the parent runs the child in a loop, or None
for a child that runs once per parent call."""

_LOOPS = ("lm.scan", "lm.fori_loop", "lm.while_loop")
_BRANCHES = ("lm.cond", "lm.switch")


class CallCost(NamedTuple):
    """The FLOPs of one module call (`records.capture.Call`), as one model call runs it.

    Attributes:
        call: The call.
        runs: How many times it runs in one call of the model (a Stack's block: its depth).
        flops: Its forward FLOPs per run, those of the calls inside it included; None when
            XLA gives no count.
        grad_flops: The FLOPs of its forward and backward pass per run (the gradient with
            respect to its float parameters and float inputs), or None when not asked.
        note: Why the count may be off (a loop XLA counts once, a branch that may not run),
            or "".
    """

    call: Call
    runs: int
    flops: int | None
    grad_flops: int | None
    note: str


def call_costs(
    model: Module,
    args: tuple,
    kwargs: dict[str, Any],
    *,
    backward: bool = False,
    repeats: Repeats | None = None,
    where: str = "lm.summary",
) -> list[CallCost]:
    """The FLOPs of every module call of one call of `model` on the example inputs.

    Each call is lowered alone, as its parent runs it: under `jax.checkpoint` inside a loop
    that rematerialises, with its parameters' gradients summed inside a loop that shares
    them. A parent's count holds what XLA counts of its children there (a loop's body once,
    the costliest branch of an `lm.cond`/`lm.switch`); its total replaces that by its
    children's totals (times their runs; for branches, the costliest branch's).

    Args:
        model: The model.
        args: Its example positional inputs (arrays, `jax.ShapeDtypeStruct`, or any other
            value, which is passed as it is).
        kwargs: Its example keyword inputs.
        backward: Also count each call's forward and backward pass.
        repeats: Which children run in a loop (see `Repeats`); default: none.
        where: The function named in messages.

    Returns:
        One `CallCost` per call, in the order the calls start (the model's own first).

    Raises:
        Exception: The model's error on these inputs (its type kept), naming the module
            whose call failed; the same when JAX cannot lower the model's own forward or
            backward pass (its reason kept); ValueError when `backward` finds nothing to
            differentiate.

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> from lamina.flops import call_costs
        >>> [c.flops for c in call_costs(lm.Dense(4, 2), (jnp.ones((3, 4)),), {})]
        [54]
    """
    init, apply = transform(model)
    key = jax.random.key(0)
    variables = jax.eval_shape(init, key)
    try:
        recorded = calls(apply)(variables, key, *args, **kwargs)
    except CallFailed as failed:
        raise _failure(where, model, failed) from failed.error
    plan = Plan(model)
    lowering = _Lowering({path: module for path, module in plan.modules}, key)
    lowering.transformed[()] = (apply, variables, plan)  # the model's own, already made
    loops = _links(recorded, repeats or (lambda parent, child: None))
    remat, shared = _contexts(recorded, loops)
    forward = [lowering.flops(c) for c in recorded]
    _root_lowers(where, model, lowering, "forward pass")
    grads: list[int | None] | None = None
    if backward:
        grads = [
            lowering.grad_flops(c, x, remat=r, shared=s)
            for c, x, r, s in zip(recorded, forward, remat, shared, strict=True)
        ]
        _root_lowers(where, model, lowering, "backward pass")
        if recorded and recorded[0].path in lowering.no_gradient:
            raise ValueError(
                f"{where}(..., backward=True): {type(model).__name__} has no floating-point "
                f"parameters to differentiate (lm.Parameter; frozen ones are not) and none of "
                f"its example inputs is a floating-point array, so there is no gradient to "
                f"count. Give float inputs, or leave backward=False."
            )
    counted, runs, notes = _loops(recorded, loops, remat if backward else None)
    totals = _totals(recorded, forward, counted)
    grad_totals = None if grads is None else _totals(recorded, grads, counted)
    return [
        CallCost(
            call,
            runs[i],
            totals[i],
            None if grad_totals is None else grad_totals[i],
            lowering.notes.get(call.path, "") or notes[i],
        )
        for i, call in enumerate(recorded)
    ]


def _links(recorded: list[Call], repeats: Repeats) -> list[Loop | None]:
    """Per call: the loop its parent runs it in, or None."""
    return [
        None if call.parent is None else repeats(recorded[call.parent], call) for call in recorded
    ]


def _contexts(recorded: list[Call], loops: list[Loop | None]) -> tuple[list[bool], list[bool]]:
    """Per call: whether a loop around it rematerialises, and whether it shares parameters.

    Both hold for the calls inside a loop's body too; a loop whose body has parameters of
    its own at each iteration (a `Stack`'s block) stops the sharing: its stacked parameters'
    gradients are summed outside it.
    """
    remat: list[bool] = []
    shared: list[bool] = []
    for call, loop in zip(recorded, loops, strict=True):
        above = call.parent
        inherited = (False, False) if above is None else (remat[above], shared[above])
        if loop is None:
            remat.append(inherited[0])
            shared.append(inherited[1])
        else:
            remat.append(inherited[0] or loop.remat)
            shared.append(loop.shared)
    return remat, shared


def _root_lowers(where: str, model: Module, lowering: _Lowering, what: str) -> None:
    """Raises when the model's own pass could not be lowered: there is no total to show."""
    error = lowering.errors.pop((), None)
    if error is None:
        return
    said = str(error).strip().split("\n")[0].rstrip() or type(error).__name__
    said += "" if said.endswith((".", "!", "?")) else "."
    message = (
        f"{where}: JAX cannot lower the {what} of {type(model).__name__} on the example "
        f"inputs, so its FLOPs cannot be counted. JAX said: {said}"
        + (" Count the forward pass alone (backward=False)." if what == "backward pass" else "")
    )
    try:
        raised = type(error)(message)
    except Exception:  # an exception class that takes other arguments
        raised = ValueError(message)
    raise raised from error


def _failure(where: str, model: Module, failed: CallFailed) -> BaseException:
    """The model's error on the example inputs, naming the module whose call failed."""
    error = failed.error
    if failed.path is None:
        at = f"calling {type(model).__name__} with the example inputs"
    else:
        at = f"the call of {type(failed.module).__name__} at {format_path(failed.path)}"
    said = str(error).rstrip() or type(error).__name__
    said += "" if said.endswith((".", "!", "?")) else "."
    message = (
        f"{where}: the example inputs failed in {at}: {said} Check the example inputs "
        f"against what that module expects (their shapes, dtypes and number)."
    )
    try:
        return type(error)(message)
    except Exception:  # an exception class that takes other arguments
        return ValueError(message)


class _Lowering:
    """Lowers module calls one at a time (each module transformed once) and reads XLA's count."""

    def __init__(self, modules: dict[tuple, Module], key: Any):
        self.modules = modules
        self.key = key
        self.transformed: dict[tuple, tuple[Any, Any, Plan]] = {}
        self.cache: dict[Any, Any] = {}
        self.notes: dict[tuple, str] = {}  # by path: why a module's calls are not counted
        self.errors: dict[tuple, Exception] = {}  # by path: why it could not be lowered
        self.no_gradient: set[tuple] = set()  # paths of calls with nothing to differentiate

    def _model(self, path: tuple) -> tuple[Any, Any, Plan]:
        found = self.transformed.get(path)
        if found is None:
            module = self.modules[path]
            plan = Plan(module)
            # The variables' shapes from the plan, no initializer run: a value assigned to a
            # Stack's block holds every copy (its stacked axis), which the block alone
            # would refuse, and counting needs shapes only.
            shapes = [jax.ShapeDtypeStruct(e.shape, e.state.param_dtype) for e in plan.variables]
            found = (transform(module).apply, plan.treedef.unflatten(shapes), plan)
            self.transformed[path] = found
        return found

    def _cached(self, kind: tuple, call: Call, compute: Callable[[], Any]) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((call.args, call.kwargs))
        signature = tuple(
            (leaf.shape, str(leaf.dtype), leaf.weak_type) if _is_shape(leaf) else leaf
            for leaf in leaves
        )
        key = (kind, call.path, treedef, signature)
        try:
            hash(key)
        except TypeError:  # an unhashable argument: counted for this call only
            return self._counted(call, compute)
        if key not in self.cache:
            self.cache[key] = self._counted(call, compute)
        return self.cache[key]

    def _counted(self, call: Call, compute: Callable[[], Any]) -> Any:
        try:
            return compute()
        except Exception as error:  # lowered alone, the call fails: its parent holds it
            self.errors[call.path] = error
            self.notes[call.path] = f"not counted alone ({_reason(error)}): in its parent's"
            return None

    def flops(self, call: Call) -> int | None:
        """XLA's count of the call's forward pass (outputs and updated state); None if none."""
        return self._cached(("forward",), call, lambda: self._forward(call))

    def _forward(self, call: Call) -> int | None:
        apply, variables, _ = self._model(call.path)
        arrays, rebuild = _split(call)

        def run(variables: Any, arrays: list) -> Any:
            a, k = rebuild(arrays)
            return apply(variables, self.key, *a, **k)

        return _count(jax.jit(run).lower(variables, arrays))

    def grad_flops(
        self, call: Call, forward: int | None, *, remat: bool = False, shared: bool = False
    ) -> int | None:
        """XLA's count of the call's forward and backward pass.

        A call with nothing to differentiate (no float parameter, no float input) counts its
        forward pass (`forward`), and its path goes into `no_gradient`.

        Args:
            call: The call.
            forward: Its forward count.
            remat: Lower it under `jax.checkpoint`, as a loop that rematerialises runs it.
            shared: Add its parameters' gradients to a running sum, as a loop that runs it
                with the same parameters at every iteration does.
        """
        kind = ("backward", remat, shared)
        return self._cached(kind, call, lambda: self._backward(call, forward, remat, shared))

    def _backward(self, call: Call, forward: int | None, remat: bool, shared: bool) -> int | None:
        apply, variables, plan = self._model(call.path)
        arrays, rebuild = _split(call)
        leaves, treedef = jax.tree_util.tree_flatten(variables)
        chosen = [
            i
            for i, (entry, leaf) in enumerate(zip(plan.variables, leaves, strict=True))
            if isinstance(entry.state, Parameter) and _is_float(leaf)
        ]
        floats = [i for i, a in enumerate(arrays) if _is_float(a)]
        if not chosen and not floats:
            self.no_gradient.add(call.path)
            return forward

        def run(leaves: list, arrays: list) -> Any:
            a, k = rebuild(arrays)
            return apply(jax.tree_util.tree_unflatten(treedef, leaves), self.key, *a, **k)

        outputs = jax.tree_util.tree_leaves(jax.eval_shape(run, leaves, arrays)[0])
        differentiable = [i for i, out in enumerate(outputs) if _is_float(out)]
        if not differentiable:
            return forward  # nothing flows back: the forward pass is all
        # As a Stack with remat=True runs its block (lm.checkpoint's defaults).
        counted = jax.checkpoint(run) if remat else run

        def step(leaves: list, arrays: list, cotangents: list, sums: list) -> Any:
            def differentiated(params: list, inputs: list) -> Any:
                all_leaves, all_arrays = list(leaves), list(arrays)
                for i, p in zip(chosen, params, strict=True):
                    all_leaves[i] = p
                for i, x in zip(floats, inputs, strict=True):
                    all_arrays[i] = x
                out, new = counted(all_leaves, all_arrays)
                out_leaves = jax.tree_util.tree_leaves(out)
                rest = [o for i, o in enumerate(out_leaves) if i not in differentiable]
                return [out_leaves[i] for i in differentiable], (rest, new)

            primals = ([leaves[i] for i in chosen], [arrays[i] for i in floats])
            out, pullback, aux = jax.vjp(differentiated, *primals, has_aux=True)
            param_grads, input_grads = pullback(cotangents)
            if shared:  # the loop sums the gradients of the parameters it shares
                param_grads = [s + g for s, g in zip(sums, param_grads, strict=True)]
            return out, aux, param_grads, input_grads

        cotangents = [outputs[i] for i in differentiable]
        sums = [leaves[i] for i in chosen] if shared else []
        return _count(jax.jit(step).lower(leaves, arrays, cotangents, sums))


def _reason(error: Exception) -> str:
    """The error's type and the start of its message, for a note."""
    said = str(error).strip().split("\n")[0]
    said = said if len(said) <= 80 else said[:77].rstrip() + "..."
    return f"{type(error).__name__}: {said}" if said else type(error).__name__


def _split(call: Call) -> tuple[list, Callable[[list], tuple[tuple, dict]]]:
    """The call's array arguments (as shapes), and how to put them back among the rest."""
    leaves, treedef = jax.tree_util.tree_flatten((call.args, call.kwargs))
    is_array = [_is_shape(leaf) for leaf in leaves]
    arrays = [leaf for leaf, a in zip(leaves, is_array, strict=True) if a]

    def rebuild(given: list) -> tuple[tuple, dict]:
        it = iter(given)
        merged = [next(it) if a else leaf for leaf, a in zip(leaves, is_array, strict=True)]
        return jax.tree_util.tree_unflatten(treedef, merged)

    return arrays, rebuild


def _is_shape(leaf: Any) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct)


def _is_float(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))  # keys: False


def _count(lowered: Any) -> int | None:
    """XLA's FLOP count of a lowered program (compiled only where lowering gives none).

    A program without arithmetic has no "flops" entry: 0. None where XLA gives no analysis.
    """
    cost = lowered.cost_analysis()
    if cost is None:
        cost = lowered.compile().cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
        cost = cost[0] if cost else None
    if cost is None:
        return None
    return max(0, round(float(cost.get("flops", 0.0))))


def _loops(
    recorded: list[Call], loops: list[Loop | None], remat: list[bool] | None
) -> tuple[list[tuple[int, int]], list[int], list[str]]:
    """Per call: (runs per parent run, copies XLA counted), runs per model call, and notes.

    `remat` (given when backward passes are counted) marks the calls inside a loop that
    rematerialises: a loop there gets a note (see `_NESTED`) unless it is fully unrolled.
    """
    counted: list[tuple[int, int]] = []
    runs: list[int] = []
    notes: list[str] = []
    for call, loop in zip(recorded, loops, strict=True):
        if call.parent is None:
            counted.append((1, 1))
            runs.append(1)
            notes.append("")
            continue
        counted.append((1, 1) if loop is None else (loop.runs, loop.bodies))
        runs.append(runs[call.parent] * counted[-1][0])
        said = [] if loop is not None else [_note(lift.name) for lift in call.lifts]
        notes.append("; ".join(dict.fromkeys(n for n in said if n)))
    for call, loop in zip(recorded, loops, strict=True):
        parent = call.parent
        if loop is None or parent is None or remat is None or not remat[parent]:
            continue
        if loop.bodies != loop.runs and _NESTED not in notes[parent]:
            notes[parent] = "; ".join(n for n in (notes[parent], _NESTED) if n)
    return counted, runs, notes


_NESTED = (
    "a loop in a rematerialised loop: forward+backward misses part of the forward pass JAX "
    "redoes at each step (unroll=True on this loop counts it exactly)"
)


def _note(lift: str) -> str:
    """What a lifted transform that lamina does not count through does to a count."""
    if lift in _LOOPS:
        return f"in {lift}: XLA counts the loop's body once"
    if lift == "lm.vmap":
        return "in lm.vmap: one member (the batch is counted in its parent)"
    if lift in _BRANCHES:
        return f"a branch of {lift}: counted as if it runs; its parent counts the costliest"
    return ""


def _totals(
    recorded: list[Call], counts: list[int | None], counted: list[tuple[int, int]]
) -> list[int | None]:
    """Each call's FLOPs, the calls inside it included.

    Its own count less its children's as XLA counted them (never below 0), plus its
    children's totals times their runs. Of the branches of an `lm.cond`/`lm.switch`, XLA
    counts the costliest; so does the total.
    """
    children: list[list[int]] = [[] for _ in recorded]
    for i, call in enumerate(recorded):
        if call.parent is not None:
            children[call.parent].append(i)
    totals: list[int | None] = [None] * len(recorded)

    def within(kids: list[int], depth: int) -> tuple[int, int]:
        """(what XLA counts of `kids` in their parent, their totals), branch by branch."""
        seen = inner = 0
        runs: dict[int, dict[int, list[int]]] = {}
        for j in kids:
            branch = _branches(recorded[j])
            if len(branch) > depth:
                run, index = branch[depth]
                runs.setdefault(run, {}).setdefault(index, []).append(j)
            else:
                seen += counted[j][1] * (counts[j] or 0)
                inner += counted[j][0] * (totals[j] or 0)
        for branches in runs.values():
            each = [within(js, depth + 1) for js in branches.values()]
            seen += max(s for s, _ in each)
            inner += max(t for _, t in each)
        return seen, inner

    for i in reversed(range(len(recorded))):
        count = counts[i]
        if count is None:  # not counted alone (its parent's count holds it)
            continue
        kids = [j for j in children[i] if counts[j] is not None]  # others: in its own count
        seen, inner = within(kids, 0)
        totals[i] = max(0, count - seen) + inner
    return totals


def _branches(call: Call) -> list[tuple[int, int]]:
    """The (run, branch) of each `lm.cond`/`lm.switch` between the call and its parent's."""
    return [(lift.run, lift.branch) for lift in call.lifts if lift.name in _BRANCHES]
