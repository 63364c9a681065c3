"""Seeing a model: treescope's rendering (HTML and text), lm.display, and the screenshot tool.

treescope is in the dev extra; the tests that need it skip (and say so) without it. The
browser test runs `tools/render_model.py` into a temporary folder and compares the text the
page shows with the committed docs/images/model-in-a-notebook.txt; without chromium it skips,
as tests/test_site.py does.
"""

import base64
import copy
import functools
import pathlib
import pickle
import re
import subprocess
import sys
import textwrap
import threading
import types
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from lamina import rendering
from lamina._core.graph import Plan
from lamina.rendering import render_text

treescope = pytest.importorskip("treescope", reason="treescope renders models (dev extra)")

ROOT = pathlib.Path(__file__).parents[1]


class Block(lm.Module):
    def __init__(self):
        self.norm = lm.LayerNorm(4, scale_sharding=("embed",))
        self.dense = lm.Dense(4, 4, kernel_sharding=("embed", "mlp"), param_dtype=jnp.bfloat16)
        self.stats = lm.BatchStat((4,), lm.initializers.zeros())

    def __call__(self, x):
        self.stats.value = x.mean(0)
        return self.dense(self.norm(x))


class Model(lm.Module):
    def __init__(self):
        self.embed = lm.Dense(3, 4)
        self.blocks = lm.Stack(Block(), 3, depth_sharding="layers")
        self.head = lm.Dense(4, 2, kernel_sharding=("embed", "vocab"))

    def __call__(self, x):
        return self.head(self.blocks(self.embed(x)))


@pytest.fixture(scope="module")
def model_and_variables():
    model = Model()
    return model, lm.transform(model).init(jax.random.key(0))


def _expected(model):
    """(path, stored shape, dtype, param_dtype, logical axis names) per variable, by hand."""
    plan = Plan(model)  # the plan is what the rendering must agree with
    return [
        (e.name, e.shape, e.state.dtype, e.state.param_dtype, e.logical_axes)
        for e in plan.variables
    ]


def test_the_html_holds_every_path_dtype_and_logical_axis(model_and_variables):
    model, _ = model_and_variables
    html = lm.render_html(model)
    expected = _expected(model)
    assert len(expected) == 9  # embed 2, block 5 (norm 2, dense 2, stats 1), head 2
    for name, _, dtype, stored, axes in expected:
        assert name in html, name
        assert np.dtype(dtype).name in html and np.dtype(stored).name in html
        for axis in axes:
            if axis is not None:
                assert f"&#x27;{axis}&#x27;" in html, (name, axis)
    # the stacked variables are shown in their stored shape, the declared one beside it
    assert "params/blocks/block/dense/kernel" in html
    assert "param_dtype=" in html and "bfloat16" in html
    assert html.count("<treescope-container") == 1  # one tree, no second copy in an iframe
    assert "<iframe" not in html


def test_the_text_holds_every_path_shape_dtype_and_axis(model_and_variables):
    model, _ = model_and_variables
    for text in (treescope.render_to_text(model), render_text(model)):
        for name, shape, dtype, stored, axes in _expected(model):
            line = next(line for line in text.splitlines() if f"path='{name}'" in line)
            assert f"shape={shape}" in line, line
            assert f"dtype={np.dtype(dtype).name}" in line
            if stored != dtype:
                assert f"param_dtype={np.dtype(stored).name}" in line
            if any(a is not None for a in axes):
                assert f"logical_axes={axes}" in line, line
    text = render_text(model)
    assert "kernel=Parameter(path='params/blocks/block/dense/kernel', shape=(3, 4, 4)" in text
    assert "stats=BatchStat(path='batch_stats/blocks/block/stats', shape=(3, 4)" in text
    assert "logical_axes=('layers', 'embed', 'mlp')" in text


def test_each_module_counts_the_variables_it_holds(model_and_variables):
    model, variables = model_and_variables
    leaves = jax.tree.leaves(variables["params"])
    assert sum(x.size for x in leaves) == 110
    assert sum(x.size * x.dtype.itemsize for x in leaves) == 320  # the Dense in bfloat16
    lines = render_text(model).splitlines()
    assert lines[0] == "Model(  # params: 110 (320 B), batch_stats: 12 (48 B)"
    stack = next(line for line in lines if "blocks=Stack(" in line)
    # 3 copies of norm (8 float32) and dense (20 bfloat16): the stacked sizes
    assert stack.endswith("# params: 84 (216 B), batch_stats: 12 (48 B)")


def test_variables_show_their_arrays_and_shardings():
    model = lm.Dense(2, 3)
    model.kernel.value = jnp.full((2, 3), 1.25)
    variables = lm.transform(model).init(jax.random.key(0))
    html = lm.render_html(model, variables)
    assert "Array([[1.25, 1.25, 1.25]" in html  # the values, shown when the array is opened
    text = render_text(model, variables)
    kernel = next(line for line in text.splitlines() if "kernel=" in line)
    assert "value=<jax.Array float32(2, 3) ≈1.2" in kernel  # folded: a summary
    assert "sharding=" not in kernel  # the sharding is in the unfolded view only
    assert repr(variables["params"]["kernel"].sharding) in html
    # only the params: the other collections show their declarations without arrays
    model = Model()
    variables = lm.transform(model).init(jax.random.key(0))
    text = render_text(model, {"params": variables["params"]})
    stats = next(line for line in text.splitlines() if "stats=BatchStat(" in line)
    assert "value=" not in stats
    assert text.count("value=<jax.Array") == 8  # every parameter


def test_variables_that_do_not_fit_are_an_error():
    model = lm.Dense(2, 3)
    with pytest.raises(lm.VariablesError, match="params/nothing"):
        lm.render_html(model, {"params": {"nothing": jnp.zeros(3)}})
    with pytest.raises(lm.VariablesError, match=r"params/kernel"):
        lm.render_html(model, {"params": {"kernel": jnp.zeros((3, 3))}})
    with pytest.raises(TypeError, match="variables= goes with a model"):
        lm.render_html({"params": {}}, {"params": {}})
    with pytest.raises(TypeError, match=r"none of the objects is an lm\.Module"):
        lm.display({"params": {}}, variables={"params": {}})


def test_a_variables_dict_and_other_objects_render(capsys):
    model = lm.Dense(2, 3)
    variables = lm.transform(model).init(jax.random.key(0))
    html = lm.render_html(variables)
    assert "&#x27;kernel&#x27;" in html and "float32(2, 3)" in html
    lm.display(variables, [model, model.kernel])
    out = capsys.readouterr().out
    assert "'kernel': # jax.Array float32(2, 3) ≈" in out  # small: treescope unfolds it
    assert "kernel=Parameter(path='params/kernel', shape=(2, 3), dtype=float32)" in out
    # alone (in a list, not a model): no path; and no treescope note on the shared object
    assert "\n  Parameter(shape=(2, 3), dtype=float32),\n]" in out
    assert "0x" not in out and "Repeated" not in out


def test_a_summary_shows_its_own_table(capsys):
    model = lm.Dense(2, 3)
    summary = lm.summary(model)
    lm.display(summary)
    assert capsys.readouterr().out == f"{summary}\n"


def test_a_bare_declaration_renders_though_it_has_no_value():
    # a State is a pytree whose flattening reads its value: treescope's pytree handler
    # would raise UnboundVariableError
    with pytest.raises(lm.UnboundVariableError):
        jax.tree.leaves(lm.Parameter((2,), lm.initializers.zeros()))
    state = lm.State("counters", (2, 5), lm.initializers.zeros(), jnp.float32, jnp.bfloat16)
    text = treescope.render_to_text(state)
    assert text == "State(shape=(2, 5), dtype=float32, param_dtype=bfloat16)"
    assert "State(" in lm.render_html(state)
    frozen = lm.FrozenParam((3,), lm.initializers.zeros(), sharding=("embed",))
    assert render_text([frozen]).splitlines()[1] == (
        "  FrozenParam(shape=(3,), dtype=float32, logical_axes=('embed',)),"
    )


def test_tied_modules_and_variables_are_shown_once():
    class Tied(lm.Module):
        def __init__(self):
            self.encoder = lm.Dense(3, 3)
            self.decoder = self.encoder
            self.other = lm.Dense(3, 3)
            self.other.bias = self.encoder.bias

    text = render_text(Tied())
    assert text.count("path='params/encoder/kernel'") == 1
    assert "decoder=Dense(...)  # tied: shown at encoder" in text
    assert "bias=Parameter(...)  # tied: shown at params/encoder/bias" in text
    assert "path='params/other/bias'" not in text
    # the root counts each tied variable once: encoder 12 + other's kernel 9
    assert text.splitlines()[0].startswith("Tied(  # params: 21 (84 B)")
    # treescope's own notes on objects met twice ("Repeated python obj at 0x...") are not
    # shown: lamina says where the tied object is
    assert "0x" not in text and "Repeated" not in text
    html = lm.render_html(Tied())
    assert "tied: shown at encoder" in html
    assert "0x" not in treescope.render_to_text([Tied(), Tied().encoder])


def test_cycles_and_ties_inside_containers_say_where_they_are_shown():
    class Child(lm.Module):
        def __init__(self, parent):
            self.parent = parent  # a reference back up: a cycle
            self.dense = lm.Dense(2, 2)

    class Parent(lm.Module):
        def __init__(self):
            self.child = Child(self)
            self.shared = lm.Dense(2, 2)
            self.heads = {"a": self.shared, "all": [self.child, self.shared]}
            self.loop = [self.shared]
            self.loop.append(self.loop)  # a list that holds itself

    text = render_text(Parent())
    assert "parent=Parent(...)  # tied: shown at <root>" in text
    assert "'a': Dense(...)  # tied: shown at shared" in text
    assert "Child(...)  # tied: shown at child" in text
    assert "[...]" in text  # the list inside itself, as Python's repr writes it
    assert "0x" not in text and "cyclic" not in text
    # every module counts what it reaches, each variable once: Parent 6 + 6, Child 12
    assert text.splitlines()[0] == "Parent(  # params: 12 (48 B)"
    assert "child=Child(  # params: 12 (48 B)" in text


def test_a_transformed_snapshot_renders_as_its_plan_has_it():
    model = Model()
    snapshots = []
    lm.transform(model, lambda m: snapshots.append(m) or m.__call__)
    (snapshot,) = snapshots
    assert render_text(snapshot) == render_text(model)
    # a part of it shows the paths from the model's root and the stored (stacked) shapes,
    # as the variables hold them (the snapshot is bound to its plan)
    kernel = snapshot.blocks.block.dense.kernel
    assert treescope.render_to_text(kernel) == (
        "Parameter(path='params/blocks/block/dense/kernel', shape=(3, 4, 4), dtype=float32, "
        "param_dtype=bfloat16, logical_axes=('layers', 'embed', 'mlp'))"
    )
    block = render_text(snapshot.blocks.block)
    assert block.splitlines()[0] == "Block(  # params: 84 (216 B), batch_stats: 12 (48 B)"
    assert "kernel=Parameter(path='params/blocks/block/dense/kernel', shape=(3, 4, 4)" in block
    head = render_text(snapshot.head)
    assert "kernel=Parameter(path='params/head/kernel', shape=(4, 2)" in head
    # a copy of a bound declaration is no part of the plan: no path, its declared shape
    assert treescope.render_to_text(copy.copy(kernel)).startswith(
        "Parameter(shape=(4, 4), dtype=float32"
    )
    # the user's own model, never bound: a declaration alone has no path
    assert treescope.render_to_text(model.blocks.block.dense.kernel).startswith(
        "Parameter(shape=(4, 4)"
    )


def test_self_inside_a_call_renders_as_the_plan_has_it():
    seen = {}

    class Inner(lm.Module):
        def __init__(self):
            self.dense = lm.Dense(2, 2)

        def __call__(self, x):
            seen["inner"] = render_text(self)  # inside the Stack's scan, under jit
            return self.dense(x)

    class Outer(lm.Module):
        def __init__(self):
            self.blocks = lm.Stack(Inner(), 3, depth_sharding="layers")
            self.head = lm.Dense(2, 1)

        def __call__(self, x):
            seen["outer"] = lm.render_html(self)
            seen["head"] = treescope.render_to_text(self.head.kernel)
            return self.head(self.blocks(x))

    model = Outer()
    init, apply = lm.transform(model)
    jax.jit(apply)(init(jax.random.key(0)), None, jnp.ones((1, 2)))
    assert seen["inner"].splitlines()[0] == "Inner(  # params: 18 (72 B)"
    assert (
        "kernel=Parameter(path='params/blocks/block/dense/kernel', shape=(3, 2, 2), "
        "dtype=float32, logical_axes=('layers', None, None))"
    ) in seen["inner"]
    assert "params/blocks/block/dense/kernel" in seen["outer"]
    assert seen["head"].startswith("Parameter(path='params/head/kernel', shape=(2, 1)")


def test_containers_lora_and_a_model_that_cannot_be_planned():
    class Holder(lm.Module):
        def __init__(self):
            self.layers = [lm.LoRA(lm.Dense(2, 2), rank=1)]
            self.heads = {"a": lm.Dense(2, 1)}

    text = render_text(Holder())
    assert "layers_1=relu," in render_text(lm.Sequential(lm.Dense(2, 2), lm.relu))
    assert "lora_a=LoRAParam(path='params/layers/0/lora_a', shape=(2, 1)" in text
    assert "kernel=Parameter(path='params/layers/0/base/kernel'" in text
    assert "path='params/heads/a/bias'" in text

    class Clash(lm.Module):
        def __init__(self):
            self.heads = {1: lm.Dense(2, 1), "1": lm.Dense(2, 1)}

    text = render_text(Clash())  # shown with a note, never a traceback
    assert text.splitlines()[0].startswith("Clash(  # cannot plan this model: two variables")
    assert "shape=(2, 1), dtype=float32" in text
    with pytest.raises(ValueError, match="two variables need the same place"):
        lm.render_html(Clash(), {"params": {}})


def test_functions_show_by_name_also_inside_containers():
    class Mixed(lm.Module):
        def __init__(self):
            self.layers = [lm.Dense(2, 2), lm.relu, jnp.tanh]
            self.pair = (functools.partial(jax.nn.gelu, approximate=False), lm.sigmoid)
            self.by_name = {"act": lm.relu, "dtype": np.dtype("bfloat16")}
            self.activation = lm.relu

    text = render_text(Mixed())
    assert "    relu,\n    tanh,\n  ]," in text
    assert "pair=(partial(gelu, approximate=False), sigmoid)," in text
    assert "by_name={'act': relu, 'dtype': bfloat16}," in text
    assert "activation=relu," in text
    assert "0x" not in text and "PjitFunction" not in text


def test_a_policy_shows_on_the_modules_that_carry_it():
    model = lm.Sequential(lm.Dense(2, 3), lm.LayerNorm(3))
    policy = lm.Policy("float32", "bfloat16", "float32")
    text = render_text(lm.with_policy(model, policy, where=lm.Dense))
    dense = text.split("layers_0=Dense(")[1].split("layers_1=")[0]
    assert dense.splitlines()[1].strip() == (
        "policy=Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=float32),"
    )
    assert "dtype=bfloat16," in dense
    assert text.count("policy=") == 1  # the LayerNorm (and the root) carry none
    assert "policy=" not in render_text(model)


def test_arrays_in_another_dtype_than_declared_are_flagged():
    model = lm.Sequential(lm.Dense(2, 3), lm.Dense(3, 1, param_dtype=jnp.bfloat16))
    variables = lm.transform(model).init(jax.random.key(0))
    assert "mismatch" not in render_text(model, variables)
    params = variables["params"]
    params["layers_0"]["kernel"] = params["layers_0"]["kernel"].astype(jnp.bfloat16)
    params["layers_1"]["kernel"] = params["layers_1"]["kernel"].astype(jnp.float32)
    text = render_text(model, variables)
    line = next(line for line in text.splitlines() if "params/layers_0/kernel" in line)
    assert line.endswith("mismatch='given bfloat16, declared float32'),")
    line = next(line for line in text.splitlines() if "params/layers_1/kernel" in line)
    assert line.endswith("mismatch='given float32, declared bfloat16'),")
    assert text.count("mismatch=") == 2  # the biases are as declared
    assert "given bfloat16, declared float32" in lm.render_html(model, variables)


def test_the_groups_of_split_are_passed_one_at_a_time_or_merged():
    model = lm.Sequential(lm.Dense(2, 3), lm.BatchNorm(3))
    variables = lm.transform(model).init(jax.random.key(0))
    groups = lm.split(model, variables, lm.Parameter, ...)
    with pytest.raises(lm.VariablesError, match=r"got a tuple of 2.*lm\.merge\(\*groups\)"):
        lm.render_html(model, groups)
    with pytest.raises(lm.VariablesError, match=r"lm\.display: .*one group"):
        lm.display(model, variables=groups)
    assert render_text(model, groups[0]).count("value=") == 4  # the parameters only
    assert render_text(model, lm.merge(*groups)) == render_text(model, variables)


def _sizes_by_walking(plan):
    """Every module's sizes from `Plan.slots_of` (a walk of the module), by hand."""
    order = list(dict.fromkeys(entry.collection for entry in plan.declared))
    result = {}
    for _, module in plan.modules:
        counts = {}
        for slot in plan.slots_of(module):
            entry = plan.variables[slot]
            size = int(np.prod(entry.shape))
            n, b = counts.get(entry.collection, (0, 0))
            counts[entry.collection] = (n + size, b + size * entry.state.param_dtype.itemsize)
        result[id(module)] = ", ".join(
            f"{c}: {counts[c][0]:,} ({rendering._bytes(counts[c][1])})"
            for c in order
            if c in counts
        )
    return result


_WALK = Plan.slots_of


def _counting(calls):
    """`Plan.slots_of` that notes each module it walks in `calls`."""

    def slots_of(plan, module):
        calls.append(module)
        return _WALK(plan, module)

    return slots_of


def test_module_sizes_come_from_one_pass_and_match_each_modules_reach(monkeypatch):
    # A walk per module (Plan.slots_of) made rendering quadratic: 10,000 variables took
    # many seconds. The sizes now come from one pass; they must equal the walks' counts.
    class Tied(lm.Module):
        def __init__(self):
            self.shared = lm.Dense(2, 3)
            self.body = lm.Sequential(self.shared, lm.Dense(3, 2))
            self.heads = {"a": lm.Dense(2, 2), "b": [self.shared, self.body]}
            self.bias = self.heads["a"].bias  # a tied variable
            self.stack = lm.Stack(lm.Dense(2, 2), 3)

    class Child(lm.Module):
        def __init__(self, parent):
            self.parent = parent
            self.dense = lm.Dense(2, 2)

    class Cyclic(lm.Module):
        def __init__(self):
            self.child = Child(self)
            self.norm = lm.LayerNorm(2)

    wide = lm.Sequential(*[lm.Dense(2, 2) for _ in range(300)])
    deep = lm.Dense(2, 2)
    for _ in range(300):
        deep = lm.Sequential(deep, lm.LayerNorm(2))
    for model in (Model(), Tied(), wide, deep, Cyclic()):
        plan = Plan(model)
        expected = _sizes_by_walking(plan)
        calls = []
        monkeypatch.setattr(Plan, "slots_of", _counting(calls))
        sizes = rendering._module_sizes(plan)
        monkeypatch.undo()
        assert sizes == expected
        # no module is walked on its own, but those in a cycle
        cycle = {id(model), id(model.child)} if isinstance(model, Cyclic) else set()
        assert {id(m) for m in calls} == cycle


def test_rendering_changes_nothing_and_pickles_the_same(model_and_variables):
    model = Model()
    before = (repr(model), pickle.dumps(model), dict(vars(model.blocks.block)))
    lm.render_html(model)
    render_text(model)
    model._repr_html_()
    assert (repr(model), pickle.dumps(model), dict(vars(model.blocks.block))) == before
    copy = pickle.loads(pickle.dumps(model))
    assert render_text(copy) == render_text(model)


def _inflated(html):
    """The text of a compressed treescope page (its deflated, base64 blobs)."""
    blobs = re.findall(
        r'<script type="application/octet-stream" ?>([A-Za-z0-9+/=]+)</script>', html
    )
    assert blobs, "no compressed blob"
    return "".join(zlib.decompress(base64.b64decode(blob)).decode() for blob in blobs)


def test_repr_html_is_the_rendering_and_treescope_shows_the_model_once():
    model = lm.Dense(2, 3)
    html = model._repr_html_()  # compressed, as notebooks store it
    assert "<treescope-container" in html and "params/kernel" not in html
    assert "params/kernel" in _inflated(html)
    big = lm.Sequential(*[lm.Dense(8, 8) for _ in range(50)])
    assert len(big._repr_html_()) * 10 < len(lm.render_html(big))
    # a property on the class, so treescope does not add the HTML again under the tree
    assert not callable(vars(lm.Module)["_repr_html_"])
    assert "<iframe" not in treescope.render_to_html(model, compressed=False)
    assert "(not shown in text mode)" not in treescope.render_to_text(model)


def test_display_in_a_notebook_sends_html_and_text(monkeypatch):
    shown = []
    fake = types.ModuleType("IPython")
    fake.get_ipython = lambda: object()
    fake.display = types.SimpleNamespace(display=lambda obj, raw=False: shown.append((obj, raw)))
    monkeypatch.setitem(sys.modules, "IPython", fake)

    class WithHtml:
        def _repr_html_(self):
            return "<table></table>"

    model = lm.Dense(2, 3)
    table = WithHtml()
    lm.display(model, table, variables=lm.transform(model).init(jax.random.key(0)))
    (bundle, raw), (own, _) = shown
    assert raw and set(bundle) == {"text/html", "text/plain"}
    assert "params/kernel" in _inflated(bundle["text/html"])
    assert "Array(" in _inflated(bundle["text/html"])
    assert bundle["text/plain"] == repr(model)  # cheap beside the tree
    assert own is table  # an object with its own HTML (a summary) shows that


DEEP = textwrap.dedent(
    """
    import contextlib, io, sys, threading, types
    import lamina as lm
    model = lm.Dense(2, 2)
    for _ in range(1000):
        model = lm.Sequential(model)
    inner = "params/" + "layers_0/" * 1000 + "kernel"
    assert inner in lm.render_html(model)
    assert "<treescope-container" in model._repr_html_()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        lm.display(model)
    assert inner in out.getvalue()
    shown = []  # in a notebook: the tree, and the repr as its text
    fake = types.ModuleType("IPython")
    fake.get_ipython = lambda: object()
    fake.display = types.SimpleNamespace(display=lambda obj, raw: shown.append(obj))
    sys.modules["IPython"] = fake
    lm.display(model)
    assert shown[0]["text/plain"].count("Sequential(") == 1000
    assert threading.stack_size() == 0  # the big stack was for the render's thread only
    print("rendered")
    """
)


def test_a_model_a_thousand_modules_deep_renders():
    # treescope recurses through C frames per level: in the main thread's 8 MB stack such a
    # model crashed the process (a segfault, no exception), in every way of showing it. The
    # child's main stack is 4 MB, so the check does not hang on the margin a bigger one
    # leaves (it crashed there at 1,000 levels without the render's own thread).
    shell = 'ulimit -s 4096 2>/dev/null; exec "$0" -c "$1"'
    done = subprocess.run(
        ["sh", "-c", shell, sys.executable, DEEP],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stdout.strip() == "rendered"


def test_a_render_runs_in_a_thread_of_its_own_and_raises_its_errors_here():
    threads = []
    model = lm.Dense(2, 3)
    variables = lm.transform(model).init(jax.random.key(0))
    with pytest.raises(lm.VariablesError, match="params/nothing"):
        lm.render_html(model, {"params": {"nothing": jnp.zeros(3)}})
    original = rendering._render_state

    def spy(state, path, subtree_renderer):
        threads.append(threading.current_thread())
        return original(state, path, subtree_renderer)

    rendering.RENDERERS["state"] = spy
    try:
        render_text(model, variables)
    finally:
        rendering.RENDERERS["state"] = original
    assert len(threads) == 2 and threads[0] is not threading.main_thread()
    assert threading.stack_size() == 0


NO_TREESCOPE = textwrap.dedent(
    """
    import sys
    sys.modules["treescope"] = None  # as if not installed
    import lamina as lm
    model = lm.Sequential(lm.Dense(2, 3), lm.relu)
    assert model._repr_html_() is None
    print(repr(model))
    print("---")
    lm.display(model)
    print("---")
    lm.display(model, variables=lm.transform(model).init(__import__("jax").random.key(0)))
    try:
        lm.render_html(model)
    except ImportError as error:
        print("---", error)
    """
)

REPR = """Sequential(
  layers_0=Dense(
    in_size=2,
    out_size=3,
    use_bias=True,
    precision=None,
    kernel=Parameter(shape=(2, 3), dtype=float32, init=lecun_normal()),
    bias=Parameter(shape=(3,), dtype=float32, init=zeros()),
  ),
  num_layers=2,
)"""


def test_without_treescope_a_model_is_its_text():
    done = subprocess.run(
        [sys.executable, "-c", NO_TREESCOPE], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    shown, printed, with_variables, error = done.stdout.split("---")
    assert shown == REPR + "\n"  # the repr of before display existed, byte for byte
    assert printed.strip() == REPR
    assert with_variables.strip() == (
        REPR + "\n(the variables are shown with treescope: pip install 'lamina[notebook]' "
        "(or pip install treescope))"
    )
    assert "lm.render_html renders with treescope, which is not installed" in error
    assert "pip install 'lamina[notebook]'" in error


def test_importing_lamina_does_not_import_treescope():
    code = (
        "import sys, lamina as lm\n"
        "m = lm.Dense(2, 3); repr(m); pickle = __import__('pickle').dumps(m)\n"
        "assert 'treescope' not in sys.modules, 'imported'\n"
        "m._repr_html_()\n"
        "assert 'treescope' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_screenshot_in_the_docs_is_what_lamina_renders(tmp_path):
    # In a process of its own: it forks chromium, which JAX's threads in this one forbid.
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "render_model.py"), "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    if done.returncode == 2 and "SKIPPED" in done.stdout:
        pytest.skip("no chromium: install Debian's (apt-get install chromium) for this check")
    # the tool fails on a JavaScript exception, an empty page, a node it cannot open and a
    # blank screenshot
    assert done.returncode == 0, done.stdout + done.stderr
    name = "model-in-a-notebook"
    committed = (ROOT / "docs" / "images" / f"{name}.txt").read_text("utf-8")
    assert (tmp_path / f"{name}.txt").read_text("utf-8") == committed, (
        "the page renders differently from the committed text: run "
        "`python tools/render_model.py` and commit docs/images/"
    )
    assert "path='params/blocks/block/up/kernel'," in committed  # the unfolded variable
    assert "sharding=SingleDeviceSharding" in committed
    assert (tmp_path / f"{name}.png").stat().st_size > 20_000
