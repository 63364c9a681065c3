"""Seeing a model: the module tree as foldable HTML in notebooks, rendered by treescope.

Importing this file registers how modules and declarations render (`RENDERERS`, which
`Module._repr_html_`, `Module.__treescope_repr__` and `State.__treescope_repr__` call), so a
model shown in Jupyter is a tree that folds: every module with its settings and variables,
each variable with its path, stored shape (a `Stack`'s axes included), dtypes, collection,
kind and logical axes, and, when variables are given, its array (values on demand) and where
the array lives (``.sharding``). treescope is optional (``pip install 'lamina[notebook]'``)
and imported only when something is rendered; without it a model shows its plain ``repr``.
"""

from __future__ import annotations

import contextvars
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from ._core.checks import format_path
from ._core.errors import VariablesError
from ._core.graph import Plan, VariableEntry, children, deep_recursion, walk
from ._core.layout import present_variables
from ._core.module import Module
from ._core.variables import RENDERERS, State

INSTALL_HINT = "pip install 'lamina[notebook]' (or pip install treescope)"


@dataclass
class _Render:
    """What one rendering knows about the model it shows (one `Plan`, the arrays)."""

    problem: str | None = None  # why the model could not be planned
    entries: dict[int, VariableEntry] = field(default_factory=dict)
    arrays: dict[int, Any] = field(default_factory=dict)
    module_paths: dict[int, tuple] = field(default_factory=dict)
    sizes: dict[int, str] = field(default_factory=dict)  # per module: what it holds
    shown: set[int] = field(default_factory=set)  # modules and declarations already shown


_ACTIVE: contextvars.ContextVar[_Render | None] = contextvars.ContextVar(
    "lamina_display", default=None
)


def _plan_render(model: Module, variables: Any, where: str) -> _Render:
    """A `_Render` for `model` (and its `variables`, checked against the model's plan).

    A module of a snapshot that `lm.transform` planned (``self`` inside a call, or the
    snapshot a `to_callable` sees) is shown as that plan has it: its paths from the whole
    model's root and its stored shapes (a `Stack`'s axes included).
    """
    plan = _bound_plan(model)
    if plan is None:
        try:
            plan = Plan(model)
        except (TypeError, ValueError) as error:
            if variables is not None:
                raise
            message = str(error).split(". ")[0]
            return _Render(problem=f"cannot plan this model: {message}")
    render = _Render()
    render.module_paths = {id(m): vars(m).get("_lamina_path", p) for p, m in plan.modules}
    render.entries = {id(entry.state): entry for entry in plan.variables}
    render.sizes = _module_sizes(plan)
    if variables is not None:
        if isinstance(variables, tuple):
            raise VariablesError(
                f"{where}: variables= takes one variables dict, got a tuple of "
                f"{len(variables)} (as lm.split returns them): pass one group, or all of "
                f"them merged back, lm.merge(*groups)."
            )
        for entry, array in present_variables(plan, variables, where):
            render.arrays[id(entry.state)] = array
    return render


def _bound_plan(module: Module) -> Plan | None:
    """The plan `module` belongs to if `lm.transform` planned it (`Plan.bind`), else None."""
    if vars(module).get("_lamina_path") is None:
        return None
    for _, node, _ in walk(module):
        if isinstance(node, State) and _bound_entry(node) is not None:
            plan: Plan = node._lamina_plan
            return plan if id(module) in plan.module_paths() else None
    return None


def _bound_entry(state: State) -> VariableEntry | None:
    """The entry of a declaration that a `transform`'s plan holds (its path, stored shape)."""
    plan, slot = state._lamina_plan, state._lamina_slot
    if not isinstance(plan, Plan) or slot is None or slot >= len(plan.variables):
        return None
    entry = plan.variables[slot]
    return entry if entry.state is state else None  # a copy keeps stale marks


def _rendered(obj: Any, variables: Any, where: str, fn: Callable[[], str]) -> str:
    """``fn()`` while `obj` renders: with the model's plan, in a thread with a big stack."""
    if variables is not None and not isinstance(obj, Module):
        raise TypeError(
            f"{where}: variables= goes with a model (an lm.Module), got "
            f"{type(obj).__name__}; to see a variables dict alone, pass it as the object."
        )

    def work() -> str:
        with deep_recursion():
            render = _plan_render(obj, variables, where) if isinstance(obj, Module) else None
            token = _ACTIVE.set(render)
            try:
                return fn()
            finally:
                _ACTIVE.reset(token)

    return _on_a_big_stack(work)


# treescope recurses through C frames for every level of the tree, so a model some 1,000
# modules deep overflows a thread's usual 8 MB stack: a crash of the process, which no
# recursion limit turns into an exception. Renders run in a thread with a big stack instead
# (virtual memory: only the pages a render touches are ever used).
_BIG_STACK = 512 << 20
_STACK_SIZE_LOCK = threading.Lock()
_WORKER = threading.local()

_T = TypeVar("_T")


def _on_a_big_stack(fn: Callable[[], _T]) -> _T:
    """``fn()``, run in a thread with a 512 MB stack (in this context); its error re-raised."""
    if getattr(_WORKER, "active", False):
        return fn()
    context = contextvars.copy_context()
    outcome: list[tuple[bool, Any]] = []

    def work() -> None:
        _WORKER.active = True
        try:
            outcome.append((True, context.run(fn)))
        except BaseException as error:  # re-raised in the caller's thread
            outcome.append((False, error))

    with _STACK_SIZE_LOCK:  # the size applies to the threads started next: set it, restore
        previous = threading.stack_size(_BIG_STACK)
        try:
            thread = threading.Thread(target=work, name="lamina-render", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    done, value = outcome[0]
    if done:
        return value
    raise value


def _treescope(where: str) -> Any:
    try:
        import treescope
    except ImportError:
        raise ImportError(
            f"{where} renders with treescope, which is not installed: {INSTALL_HINT}."
        ) from None
    return treescope


def render_html(model: Any, variables: Any = None, *, compressed: bool = False) -> str:
    """The HTML that shows `model` as a foldable tree (treescope), as a notebook shows it.

    Every module shows its settings (and its `lm.with_policy` policy) and, in a comment, the
    sizes of the variables it holds; every variable is folded to one line (kind, path,
    stored shape, dtype, logical axes) and unfolds to its collection, stored dtype,
    initializer and, when `variables` are given, its array (the values on demand) and the
    array's ``.sharding``; an array whose dtype is not the one the declaration stores is
    flagged (``mismatch='given bfloat16, declared float32'``). A model tied in two places
    (weight tying) is shown in full where the model's plan first meets it. The page is
    self-contained HTML with its script (no network needed); `lm.display` and a notebook cell
    that ends with the model show it compressed.

    Args:
        model: An `lm.Module`, or any object treescope renders (a variables dict, a list of
            models, a bare declaration).
        variables: The model's variables, shown beside each declaration; only with a
            module. All of them or some (``{"params": params}``, or one group of
            `lm.split`); the tuple `lm.split` returns is refused: pass one group, or
            ``lm.merge(*groups)``.
        compressed: Whether the tree travels deflated (the browser inflates it: a large
            model's page is some 40 times smaller); False keeps the text searchable.

    Returns:
        The HTML.

    Raises:
        ImportError: treescope is not installed (``pip install 'lamina[notebook]'``).
        TypeError: `variables` given with an object that is not a module.
        VariablesError: `variables` is not one variables dict, or holds a path the model
            lacks, or a wrong shape.

    Example:
        >>> import jax, lamina as lm
        >>> model = lm.Dense(2, 3, kernel_sharding=("embed", "mlp"))
        >>> html = lm.render_html(model, lm.transform(model).init(jax.random.key(0)))
        >>> "params/kernel" in html and "mlp" in html
        True
    """
    treescope = _treescope("lm.render_html")
    html = functools.partial(treescope.render_to_html, model, compressed=compressed)
    return _rendered(model, variables, "lm.render_html", html)


def render_text(model: Any, variables: Any = None) -> str:
    """The tree `render_html` shows, as text: the modules unfolded, each variable on a line.

    What `lm.display` prints outside a notebook. Without treescope: ``repr(model)`` (and a
    line saying how to see `variables`).

    Args:
        model: An `lm.Module`, or any object treescope renders.
        variables: The model's variables, or some of them (see `render_html`).

    Returns:
        The text.

    Example:
        >>> import lamina as lm
        >>> from lamina.rendering import render_text
        >>> print(render_text(lm.Dense(2, 3)).splitlines()[-2])
          bias=Parameter(path='params/bias', shape=(3,), dtype=float32),
    """
    try:
        treescope = _treescope("lm.display")
    except ImportError:
        if variables is None:
            return repr(model)
        return f"{model!r}\n(the variables are shown with treescope: {INSTALL_HINT})"
    # A model unfolds entirely (its variables stay one line each); other objects (a
    # variables dict) as treescope lays them out, so arrays show their summaries.
    height = None if isinstance(model, Module) else 20

    def text() -> str:
        with treescope.using_expansion_strategy(max_height=height):
            return str(treescope.render_to_text(model))

    return _rendered(model, variables, "lm.display", text)


def display(*objects: Any, variables: Any = None) -> None:
    """Shows models, variables dicts or summaries: foldable HTML in a notebook, text elsewhere.

    In Jupyter (IPython with a frontend) each object is shown as `render_html` renders it
    (with its ``repr`` as the plain-text alternative); an object with its own HTML (an
    `lm.summary`) as that HTML. Elsewhere (a script, a terminal) each is printed: treescope's
    text of the same tree, or ``repr`` when treescope is not installed. A model shown in a
    notebook cell on its own line renders the same way (``Module._repr_html_``).

    Args:
        *objects: What to show, in order.
        variables: Variables shown with every model among `objects` (see `render_html`).

    Raises:
        TypeError: `variables` given, but no object is a model.
        VariablesError: `variables` do not fit a model.

    Example:
        >>> import lamina as lm
        >>> lm.display(lm.Dense(2, 3))  # doctest: +ELLIPSIS
        Dense(...
    """
    if variables is not None and not any(isinstance(obj, Module) for obj in objects):
        raise TypeError(
            "lm.display: variables= goes with a model, but none of the objects is an lm.Module "
            "(to see a variables dict, pass it as the object: lm.display(variables))."
        )
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)  # never imported
    shell = None if get_ipython is None else get_ipython()
    for obj in objects:
        given = variables if isinstance(obj, Module) else None
        # an object with its own HTML (a summary's table) shows that, or its own text
        own = not isinstance(obj, (Module, State)) and callable(getattr(obj, "_repr_html_", None))
        if shell is None:
            print(obj if own else render_text(obj, given))
            continue
        from IPython import display as ipython_display

        if own:
            ipython_display.display(obj)
            continue
        try:
            html = render_html(obj, given, compressed=True)
        except ImportError:
            print(repr(obj))
            continue
        plain = _on_a_big_stack(functools.partial(_plain, obj))  # repr: cheap beside html
        bundle = {"text/html": html, "text/plain": plain}
        ipython_display.display(bundle, raw=True)


def _plain(obj: Any) -> str:
    with deep_recursion():  # a deep model's repr recurses once per level
        return repr(obj)


def _module_html(module: Module) -> str | None:
    """`Module._repr_html_`: the foldable tree, or None without treescope (Jupyter: repr)."""
    try:
        return render_html(module, compressed=True)
    except ImportError:
        return None


# --- treescope renderings (`__treescope_repr__` of modules and declarations) -------------


_REGISTERED: list[bool] = []


def _parts() -> Any:
    """The module `treescope.rendering_parts` (treescope is imported: it is rendering).

    The first time, it tells treescope that modules and declarations may be shared (tied):
    treescope would mark each one it meets twice "Repeated python obj at 0x...", while
    lamina says itself where a tied module or variable is shown.
    """
    from treescope import rendering_parts, type_registries

    if not _REGISTERED:
        type_registries.IMMUTABLE_TYPES_REGISTRY.update({Module: True, State: True})
        _REGISTERED.append(True)
    return rendering_parts


def _render_module(module: Module, path: str | None, subtree_renderer: Any) -> Any:
    render = _ACTIVE.get()
    if render is None:  # treescope renders the model itself (treescope.display(model))
        token = _ACTIVE.set(_plan_render(module, None, "treescope"))
        try:
            return _render_module(module, path, subtree_renderer)
        finally:
            _ACTIVE.reset(token)
    parts = _parts()
    from treescope import formatting_util

    if id(module) in render.shown:
        return _seen_again(module, render, path)
    root = not render.shown
    render.shown.add(id(module))
    attributes: dict[str, Any] = {}
    policy = vars(module).get("_lamina_policy")  # set by lm.with_policy
    if policy is not None:
        attributes["policy"] = _raw(repr(policy))
    for key, value in vars(module).items():
        if _shows(key, value):
            attributes[key] = _shown(value, render, set())
    children = _attribute_lines(attributes, path, subtree_renderer)
    notes = []
    if render.problem is not None and root:
        notes.append(render.problem)
    sizes = render.sizes.get(id(module), "")
    if sizes:
        notes.append(sizes)
    return parts.build_foldable_tree_node_from_children(
        prefix=parts.siblings(parts.maybe_qualified_type_name(type(module)), "("),
        children=children,
        suffix=")",
        path=path,
        background_color=formatting_util.color_from_string(type(module).__qualname__),
        first_line_annotation=(
            parts.comment_color(parts.text("  # " + "; ".join(notes))) if notes else None
        ),
    )


def _render_state(state: State, path: str | None, subtree_renderer: Any) -> Any:
    parts = _parts()
    render = _ACTIVE.get()
    entry = None if render is None else render.entries.get(id(state))
    if entry is None:  # alone (or met outside the rendered model): its plan's, if bound
        entry = _bound_entry(state)
    if render is not None:
        if id(state) in render.shown:
            return _seen_again(state, render, path)
        render.shown.add(id(state))
    shape, axes = (
        (state.shape, state.sharding) if entry is None else (entry.shape, entry.logical_axes)
    )
    axes = axes or (None,) * len(shape)
    dtype = np.dtype(state.dtype).name
    stored = np.dtype(state.param_dtype).name
    summary: dict[str, Any] = {}
    if entry is not None:  # a declaration alone has no path: only a model gives it one
        summary["path"] = entry.name
    summary["shape"] = shape
    summary["dtype"] = _raw(dtype)
    if stored != dtype:
        summary["param_dtype"] = _raw(stored)
    if any(a is not None for a in axes):
        summary["logical_axes"] = axes
    details: dict[str, Any] = {"collection": state.collection}
    if "logical_axes" not in summary:
        details["logical_axes"] = axes
    if entry is not None and entry.axes:
        details["declared_shape"] = state.shape
    details["mutable"] = state.mutable
    if state.tags:
        details["tags"] = state.tags
    details["init"] = _raw(_function_name(state.init) or repr(state.init))
    if render is not None and id(state) in render.arrays:
        array = render.arrays[id(state)]
        summary["value"] = array  # a summary folded; its values unfold on a click
        given = getattr(array, "dtype", None)
        if given is not None and given != state.param_dtype:  # may be a PRNG key's dtype
            given = getattr(given, "name", given)
            summary["mismatch"] = _raw(f"'given {given}, declared {stored}'", error=True)
        sharding = getattr(array, "sharding", None)
        if sharding is not None:
            details["sharding"] = _raw(repr(sharding))
    size = int(np.prod(shape, dtype=np.int64))
    note = f"  # {size:,} × {stored} ({_bytes(size * np.dtype(stored).itemsize)})"
    children = _attribute_lines(summary, None, subtree_renderer, expanded_only=details)
    return parts.build_foldable_tree_node_from_children(
        prefix=parts.siblings(parts.maybe_qualified_type_name(type(state)), "("),
        children=children,
        suffix=")",
        path=path,
        first_line_annotation=parts.comment_color(parts.text(note)),
        expand_state=parts.ExpandState.COLLAPSED,
    )


class _Part:
    """A value shown as lamina builds it: ``build(path)`` gives treescope's rendering part."""

    def __init__(self, build: Callable[[str | None], Any]):
        self.build = build

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        return self.build(path)


def _raw(text: str, error: bool = False) -> _Part:
    """A value shown as its text, unquoted (a dtype's name, an initializer, a function)."""

    def build(path: str | None) -> Any:
        parts = _parts()
        shown = parts.error_color(parts.text(text)) if error else text
        return parts.build_one_line_tree_node(shown, path=path)

    return _Part(build)


def _attribute_lines(
    attributes: dict[str, Any],
    path: str | None,
    subtree_renderer: Any,
    expanded_only: dict[str, Any] | None = None,
) -> list[Any]:
    """``name=value`` lines, as treescope's constructor format writes them.

    `expanded_only` are further lines shown only when the node is unfolded.
    """
    parts = _parts()
    lines = []
    items = list(attributes.items())
    for i, (name, value) in enumerate(items):
        comma = (
            parts.siblings(",", parts.fold_condition(collapsed=parts.text(" ")))
            if i < len(items) - 1
            else parts.fold_condition(expanded=parts.text(","))
        )
        child = subtree_renderer(value, path=None if path is None else f"{path}.{name}")
        lines.append(
            parts.build_full_line_with_annotations(
                parts.siblings_with_annotations(f"{name}=", child), comma
            )
        )
    for name, value in (expanded_only or {}).items():
        child = subtree_renderer(value, path=None)
        line = parts.build_full_line_with_annotations(
            parts.siblings_with_annotations(f"{name}=", child), ","
        )
        lines.append(parts.fold_condition(expanded=line))
    return lines


def _seen_again(obj: Module | State, render: _Render, path: str | None) -> Any:
    """A module or declaration met again (tied): one line naming where it is shown."""
    parts = _parts()
    if isinstance(obj, Module):
        first, collection = render.module_paths.get(id(obj)), None
    else:
        entry = render.entries.get(id(obj)) or _bound_entry(obj)
        first, collection = (None if entry is None else entry.path), obj.collection
    where = "" if first is None else f": shown at {format_path(first, collection)}"
    name = parts.maybe_qualified_type_name(type(obj))
    return parts.build_one_line_tree_node(
        parts.siblings(name, "(...)", parts.comment_color(parts.text(f"  # tied{where}"))),
        path=path,
    )


def _shown(value: Any, render: _Render, open_containers: set[int]) -> Any:
    """A module's attribute as shown, also inside its lists, tuples and dicts.

    A dtype or a function (an activation) by its name, a `functools.partial` as
    ``partial(name, args)``; a module or declaration already shown (a tie, or an enclosing
    module: a cycle) as one line saying where; a container that holds itself as ``[...]``.
    """
    if isinstance(value, (Module, State)):
        seen = id(value) in render.shown
        return _Part(functools.partial(_seen_again, value, render)) if seen else value
    if isinstance(value, np.dtype):
        return _raw(value.name)
    name = _function_name(value)
    if name is not None:
        return _raw(name)
    if not isinstance(value, (list, tuple, dict)):
        return value
    if id(value) in open_containers:
        return _raw("{...}" if isinstance(value, dict) else "[...]")
    open_containers.add(id(value))
    keys = list(value) if isinstance(value, dict) else range(len(value))
    items = [_shown(value[key], render, open_containers) for key in keys]
    open_containers.discard(id(value))
    if all(item is value[key] for key, item in zip(keys, items, strict=True)):
        return value
    if isinstance(value, (dict, list)):
        return dict(zip(keys, items, strict=True)) if isinstance(value, dict) else items
    return type(value)(*items) if hasattr(value, "_fields") else tuple(items)


def _function_name(value: Any) -> str | None:
    """A function's name; a `functools.partial` as ``partial(name, args)``; else None."""
    if isinstance(value, functools.partial):
        shown = [value.func, *value.args]
        arguments = [_function_name(x) or repr(x) for x in shown]
        arguments += [f"{k}={_function_name(v) or repr(v)}" for k, v in value.keywords.items()]
        return f"partial({', '.join(arguments)})"
    name = getattr(value, "__qualname__", None)
    function = callable(value) and not isinstance(value, type)
    return name if function and isinstance(name, str) else None


def _shows(key: str, value: Any) -> bool:
    """Whether a module's attribute is shown: public ones, and private ones holding parts."""
    if key.startswith("_lamina_"):
        return False
    return not key.startswith("_") or _holds_parts(value)


def _holds_parts(value: Any) -> bool:
    return isinstance(value, (Module, State)) or next(_parts_held(value), None) is not None


def _module_sizes(plan: Plan) -> dict[int, str]:
    """``params: 1,234 (4.8 KB)`` per collection, for every module: the variables it reaches.

    One pass over the model, children before parents: a module reaches its own variables
    and its children's (a child held by one module only hands its set over: a tree costs no
    copies), a tied variable counts once, a module in a cycle is walked alone (`slots_of`).
    """
    slot_of = {id(entry.state): i for i, entry in enumerate(plan.variables)}
    names = list(dict.fromkeys(entry.collection for entry in plan.declared))
    column = np.array([names.index(e.collection) for e in plan.variables], np.int64)
    sizes = np.array(
        [(np.prod(e.shape), np.dtype(e.state.param_dtype).itemsize) for e in plan.variables],
        np.int64,
    ).reshape(-1, 2)
    sizes[:, 1] *= sizes[:, 0]  # bytes
    direct: dict[int, tuple[list[int], list[Module]]] = {}
    held: dict[int, int] = {}  # how many times modules hold each module
    pending = [plan.root]
    while pending:
        module = pending.pop()
        if id(module) not in direct:
            own: tuple[list[int], list[Module]] = ([], [])
            direct[id(module)] = own
            for node in _parts_held(module):
                if isinstance(node, Module):
                    own[1].append(node)
                    held[id(node)] = held.get(id(node), 0) + 1
                    pending.append(node)
                elif id(node) in slot_of:
                    own[0].append(slot_of[id(node)])
    found: dict[int, set[int] | None] = {}  # None: handed over to the one module holding it
    inexact: set[int] = set()  # in a cycle
    described: dict[int, str] = {}  # "" while open
    stack: list[tuple[Module, bool]] = [(plan.root, False)]
    while stack:
        module, expanded = stack.pop()
        key = id(module)
        if key in found or (key in described and not expanded):
            continue
        slots, modules = direct[key]
        if not expanded:
            described[key] = ""
            stack += [(module, True)] + [(m, False) for m in modules if id(m) not in described]
            continue
        reached = set(slots)
        for child in modules:
            theirs = found.get(id(child))
            if id(child) not in found or id(child) in inexact:  # not found: an ancestor
                inexact.add(key)
            if theirs is not None and held[id(child)] == 1:  # ours alone: taken, not copied
                found[id(child)] = None
                reached, theirs = (
                    (theirs, reached) if len(theirs) > len(reached) else (reached, theirs)
                )
            if theirs is not None:
                reached |= theirs
        found[key] = reached
        index = np.fromiter(plan.slots_of(module) if key in inexact else reached, np.int64)
        total = np.zeros((len(names), 2), np.int64)
        np.add.at(total, column[index], sizes[index])
        described[key] = ", ".join(
            f"{c}: {int(n):,} ({_bytes(int(b))})"
            for c, (n, b) in zip(names, total, strict=True)
            if n
        )
    return described


def _parts_held(node: Any) -> Iterator[Any]:
    """The modules and declarations a module (or container) holds, also in its containers."""
    pending, open_containers = [child for _, child in children(node)], set()
    while pending:
        node = pending.pop()
        if isinstance(node, (Module, State)):
            yield node
        elif isinstance(node, (list, tuple, dict)) and id(node) not in open_containers:
            open_containers.add(id(node))
            pending.extend(child for _, child in children(node))


def _bytes(n: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


RENDERERS["module"] = _render_module
RENDERERS["state"] = _render_state
RENDERERS["html"] = _module_html
