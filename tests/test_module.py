import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm


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
