import functools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from lamina._core.graph import Plan
from tests.layer_table import IDS, LAYERS, cast_inputs


def zeros():
    return lm.initializers.zeros()


class Leaf(lm.Module):
    def __init__(self, n=2):
        super().__init__()
        self.w = lm.Parameter((n,), lm.initializers.ones())

    def __call__(self, x):
        return x * self.w


class Containers(lm.Module):
    def __init__(self):
        super().__init__()
        self.items = [Leaf(), (Leaf(3), {"inner": Leaf(4)})]
        self.table = {"a": Leaf(5), "b": [lm.Parameter((6,), zeros())]}


def test_containers_layout(getkey):
    variables = lm.transform(Containers()).init(getkey())
    shapes = jax.tree.map(jnp.shape, variables)
    assert shapes == {
        "params": {
            "items": {"0": {"w": (2,)}, "1": {"0": {"w": (3,)}, "1": {"inner": {"w": (4,)}}}},
            "table": {"a": {"w": (5,)}, "b": {"0": (6,)}},
        }
    }


def test_subclass_without_super_init_works(getkey):
    class NoSuper(lm.Module):
        def __init__(self):
            self.layer = Leaf()

        def __call__(self, x):
            return self.layer(x)

    init, apply = lm.transform(NoSuper())
    out, _ = apply(init(getkey()), None, jnp.ones(2))
    np.testing.assert_allclose(out, [1.0, 1.0])


def test_modules_are_frozen_during_call(getkey):
    class Sets(lm.Module):
        def __init__(self):
            self.layer = Leaf()

        def __call__(self, x):
            self.cache = x
            return x

    init, apply = lm.transform(Sets())
    with pytest.raises(lm.FrozenModuleError, match=r"'cache' of Sets at <root>.*lm.State"):
        apply(init(getkey()), None, jnp.ones(2))


def test_submodule_frozen_and_delete(getkey):
    class Dels(lm.Module):
        def __init__(self):
            self.layer = Leaf()

        def __call__(self):
            self.layer.w = None

    init, apply = lm.transform(Dels())
    with pytest.raises(lm.FrozenModuleError, match="of Leaf at layer"):
        apply(init(getkey()))

    class Deleter(lm.Module):
        def __init__(self):
            self.layer = Leaf()

        def __call__(self):
            del self.layer

    init, apply = lm.transform(Deleter())
    with pytest.raises(lm.FrozenModuleError, match="cannot delete attribute 'layer'"):
        apply(init(getkey()))


def test_original_module_stays_mutable_after_transform():
    model = Containers()
    lm.transform(model)
    model.extra = Leaf()  # no error: only the snapshot is frozen, and only during calls
    assert isinstance(model.extra, Leaf)


def test_repr_shows_tree():
    text = repr(Containers())
    assert text.startswith("Containers(")
    assert "Parameter(shape=(6,)" in text and "'inner': Leaf(" in text


def test_repr_of_shared_module():
    class Tied(lm.Module):
        def __init__(self):
            self.a = Leaf()
            self.b = self.a

    assert "b=Leaf(...)" in repr(Tied())


def test_a_read_only_setting_holding_a_numpy_array_survives_transform():
    """The snapshot freezes NumPy arrays read-only, even behind a layer's read-only setting."""
    from lamina.nn import _checks

    class Offset(lm.Module):
        offset = _checks.Setting()

        def __init__(self):
            super().__init__()
            self.offset = np.arange(3.0, dtype=np.float32)
            self.scale = lm.Parameter((3,), lm.initializers.ones())

        def __call__(self, x):
            return x * self.scale.value + self.offset

    model = Offset()
    init, apply = lm.transform(model)
    y, _ = apply(init(jax.random.key(0)), None, jnp.ones(3))
    np.testing.assert_array_equal(y, [1.0, 2.0, 3.0])
    assert model.offset.flags.writeable  # the user's own array is untouched


@pytest.mark.parametrize(
    "value",
    [
        lm.Dense(2, 2),
        lm.Parameter((2,), lm.initializers.zeros()),
        [lm.Dense(2, 2)],
        {"a": (lm.Dense(2, 2),)},
    ],
)
def test_the_reserved_prefix_cannot_hold_parts_of_the_model(value):
    holder = lm.Module()
    with pytest.raises(
        AttributeError,
        match=r"cannot set attribute '_lamina_encoder' of Module: the prefix '_lamina_' is "
        r"reserved .* would silently not be part of the model. Rename the attribute \(e.g. "
        r"'encoder'\)",
    ):
        holder._lamina_encoder = value
    holder._lamina_note = 3  # other values are the user's business
    assert holder._lamina_note == 3


def test_sequential_layers_refuse_item_assignment_and_say_how_to_replace(getkey):
    seq = lm.Sequential(lm.Dense(2, 2), lm.relu, lm.Dense(2, 2))
    with pytest.raises(
        TypeError,
        match=r"Sequential.layers is read-only: .* To replace a layer, assign its attribute "
        r"\(seq.layers_2 = new_layer\); to add or remove layers, build a new Sequential",
    ):
        seq.layers[2] = lm.Dense(2, 3)
    with pytest.raises(TypeError, match=r"Sequential\(\*seq.layers\[:2\], \*seq.layers\[3:\]\)"):
        del seq.layers[-1]
    seq.layers_2 = lm.Dense(2, 3)  # the way the message gives
    assert seq.layers[2].out_size == 3 and isinstance(seq.layers, tuple)
    init, apply = lm.transform(seq)
    assert apply(init(getkey()), None, jnp.ones((1, 2)))[0].shape == (1, 3)


class Layers(lm.Module):
    """Layers of the layer table, in one model."""

    def __init__(self, names):
        self.layers = {
            case.name: case.make(jnp.float32, None) for case in LAYERS if case.name in names
        }

    def __call__(self, name, *args, **kwargs):
        return self.layers[name](*args, **kwargs)


def declarations(model):
    return [(e.name, e.state) for e in Plan(model).variables]


def test_every_layer_of_the_table_pickles_with_equal_declarations():
    model = Layers(IDS)
    copy = pickle.loads(pickle.dumps(model))
    assert copy is not model and list(copy.layers) == IDS
    pairs = list(zip(declarations(model), declarations(copy), strict=True))
    assert pairs
    for (name, state), (copied_name, copied) in pairs:
        assert copied_name == name and copied is not state
        assert (copied.shape, copied.dtype, copied.param_dtype) == (
            state.shape,
            state.dtype,
            state.param_dtype,
        )
        assert copied.init == state.init, name  # by value: init groups (and caches) them alike


def test_an_unpickled_model_initialises_and_computes_alike():
    # one layer per kind of initializer (variance scaling, orthogonal, normal, ones/zeros,
    # the spectral norm's and LoRA's), and activations held as function objects
    names = ["dense", "embed", "lstm_cell", "lora_dense", "spectral_norm_dense", "batch_norm_eval"]
    model = Layers(names)
    copy = pickle.loads(pickle.dumps(model))
    key = jax.random.key(0)
    variables = lm.transform(copy).init(key)
    expected = lm.transform(model).init(key)
    assert jax.tree.structure(variables) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    case = LAYERS[IDS.index("lstm_cell")]
    inputs = cast_inputs(case.inputs(np.random.default_rng(0), np.float32), jnp.float32)
    outputs = [lm.transform(m).apply(variables, None, case.name, *inputs)[0] for m in (model, copy)]
    jax.tree.map(np.testing.assert_array_equal, outputs[0], outputs[1])


def test_pickle_keeps_functions_and_initializers_as_they_were():
    seq = lm.Sequential(
        lm.Dense(2, 2, kernel_init=lm.initializers.variance_scaling(0.5, "fan_avg", "uniform")),
        jax.nn.gelu,
        functools.partial(jax.nn.softmax, axis=-1),
        lm.relu,
        jnp.tanh,
    )
    copy = pickle.loads(pickle.dumps(seq))
    assert copy.layers[1] is jax.nn.gelu and copy.layers[3] is lm.relu
    assert copy.layers[4] is jnp.tanh and copy.layers[2].func is jax.nn.softmax
    assert copy.layers[0].kernel.init == seq.layers[0].kernel.init  # still equal by value
    assert repr(copy.layers[0].kernel.init) == repr(seq.layers[0].kernel.init)
    key = jax.random.key(1)
    np.testing.assert_array_equal(
        copy.layers[0].kernel.init(key, (3, 4)), seq.layers[0].kernel.init(key, (3, 4))
    )


def _local_activation():
    def act(x):
        return x

    return act


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: lm.Sequential(
                lm.Dense(2, 2),
                lm.Dense(2, 2, kernel_init=lambda k, s, d=jnp.float32: jnp.ones(s, d)),
            ),
            r"^cannot pickle Sequential\.layers_1\.kernel\.init: it is a lambda .* Use an "
            r"initializer of lm\.initializers",
        ),
        (
            lambda: lm.Sequential(lm.Dense(2, 2), _local_activation()),
            r"^cannot pickle Sequential\.layers_1: it is a function defined in a function "
            r"\('_local_activation\.<locals>\.act' in module tests\.test_module\).*"
            r"Define it at the top level of a module",
        ),
        (
            lambda: lm.Sequential(lm.Dense(2, 2), functools.partial(lambda x, a: x * a, a=2)),
            r"^cannot pickle Sequential\.layers_1\.func: it is a lambda",
        ),
        (
            lambda: lm.MultiHeadAttention(2, 4, kernel_init=lambda k, s, d: jnp.zeros(s, d)),
            r"^cannot pickle MultiHeadAttention\.query\.kernel\.init\.init: it is a lambda",
        ),
    ],
    ids=["lambda-initializer", "local-activation", "partial-of-lambda", "wrapped-initializer"],
)
def test_pickling_an_unnamed_function_names_its_path_and_the_fix(make, match):
    model = make()
    with pytest.raises(pickle.PicklingError, match=match):
        pickle.dumps(model)
    # a submodule pickled on its own (after the failure) is checked too, named from itself
    sub = getattr(model, "layers_1", None) or model.query
    if isinstance(sub, lm.Module):
        with pytest.raises(pickle.PicklingError, match=rf"^cannot pickle {type(sub).__name__}\."):
            pickle.dumps(sub)


def test_copy_copy_of_a_model_shares_its_attributes():
    act = _local_activation()
    seq = lm.Sequential(lm.Dense(2, 2), act, lm.relu)
    copy = __import__("copy").copy(seq)
    assert copy is not seq and copy.layers_0 is seq.layers_0
    assert copy.layers_1 is act and copy.layers_2 is lm.relu  # no stand-ins for pickling
