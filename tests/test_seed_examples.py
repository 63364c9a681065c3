"""Every code sample of the Metoryx article runs with `import lamina as mx`, as the text says.

The article is the seed `../shared/seeds/004_a6172f56ed72f6a5.txt`.

Some samples are fragments of a longer story (they use `inputs` without defining it, or
say ``loss = ...``); the context each one needs is set up here, around the verbatim code.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import lamina as lm
from tests.seed_004_samples import SAMPLES

pytestmark = pytest.mark.fast_compile  # tests/conftest.py

CODE = dict(SAMPLES)
SEED = pathlib.Path(__file__).parents[2] / "shared" / "seeds" / "004_a6172f56ed72f6a5.txt"


def run(name, namespace=None, replace=()):
    code = CODE[name].replace("import metoryx as mx", "import lamina as mx")
    for old, new in replace:
        assert old in code
        code = code.replace(old, new)
    if namespace is None:  # the article's imports, from its first sample
        namespace = {"jax": jax, "jnp": jnp, "jr": jr, "mx": lm}
    exec(compile(code, f"<seed 004: {name}>", "exec"), namespace)
    return namespace


def shapes(tree):
    return jax.tree.map(jnp.shape, tree)


def words(text):
    return re.sub(r"\s+", " ", text).strip()


@pytest.mark.skipif(not SEED.exists(), reason="the seed documents are not beside this checkout")
def test_samples_are_verbatim():
    seed = words(SEED.read_text(encoding="utf-8"))
    for name, code in SAMPLES:
        assert words(code) in seed, name


def test_usage_init_apply():
    ns = run("usage")
    assert shapes(ns["variables"]) == {
        "params": {
            "layer1": {"bias": (256,), "kernel": (784, 256)},
            "layer2": {"bias": (10,), "kernel": (256, 10)},
        }
    }
    assert ns["outputs"].shape == (1, 10)
    assert shapes(ns["new_variables"]) == shapes(ns["variables"])
    run("init", ns)
    run("apply", ns)
    assert ns["outputs"].shape == (1, 10)


def test_gradient_pattern():
    ns = run("usage")
    ns.update(inputs=jnp.ones((4, 784)), targets=jnp.zeros((4, 10)))
    run("grad", ns, replace=[("loss = ...", "loss = jnp.mean((outputs - targets) ** 2)")])
    assert shapes(ns["grads"]) == shapes(ns["params"])
    assert set(ns["new_state"]) == {"params"}  # apply returns every collection
    assert float(jnp.abs(ns["grads"]["layer2"]["kernel"]).sum()) > 0


def test_definition_list_and_surgery():
    ns = run("definition")
    run("list", ns)
    mlp_list = ns["MlpList"](784, [128, 64, 32], 10)
    variables = lm.transform(mlp_list).init(jr.PRNGKey(0))
    assert sorted(variables["params"]["layers"]) == ["0", "1", "2", "3"]
    assert variables["params"]["layers"]["3"]["kernel"].shape == (32, 10)
    out, _ = lm.transform(mlp_list).apply(variables, None, jnp.ones((2, 784)))
    assert out.shape == (2, 10)

    run("replace_layer", ns)
    init, _ = lm.transform(ns["model"])
    assert init(jr.PRNGKey(0))["params"]["layer2"]["kernel"].shape == (256, 20)

    run("assign_value", ns)
    init, _ = lm.transform(ns["model"])
    assert float(jnp.abs(init(jr.PRNGKey(0))["params"]["layer1"]["kernel"]).sum()) == 0.0


def test_assign_value_wrong_shape_fails_at_once():
    ns = run("definition")
    with pytest.raises(ValueError, match=r"\(784, 255\).*\(784, 256\)"):
        run("assign_value", ns, replace=[("jnp.zeros((784, 256))", "jnp.zeros((784, 255))")])


def test_transfer_learning():
    ns = run("definition")
    run("transfer", ns)
    variables = lm.transform(ns["model"]).init(jr.PRNGKey(0))
    np.testing.assert_array_equal(variables["params"]["layer1"]["kernel"], 1.0)
    np.testing.assert_array_equal(variables["params"]["layer1"]["bias"], 1.0)
    assert variables["params"]["layer2"]["kernel"].shape == (256, 2)
    assert not np.allclose(variables["params"]["layer2"]["kernel"], 1.0)


def test_transform_and_to_callable():
    ns = run("definition")
    run("transform", ns)
    assert ns["apply"](ns["init"](jr.PRNGKey(0)), None, jnp.ones((1, 784)))[0].shape == (1, 10)

    class WithForward(ns["Mlp"]):
        def forward(self, x):
            return mx_relu(self.layer1(x))

    mx_relu = lm.relu
    ns["model"] = WithForward(784, 256, 10)
    run("to_callable", ns)
    out, _ = ns["apply"](ns["init"](jr.PRNGKey(0)), None, jnp.ones((1, 784)))
    assert out.shape == (1, 256)


def test_parameter_and_state_declarations():
    ns = run("my_layer")
    variables = lm.transform(ns["MyLayer"](3, 4)).init(jr.PRNGKey(0))
    assert shapes(variables) == {"params": {"param": (3, 4)}, "some_states": {"state": (4,)}}
    run("parameter_value", ns)
    np.testing.assert_array_equal(ns["p"].init(None, (10, 10), jnp.float32), 1.0)


def test_state_update():
    ns = run("my_layer")
    run("state_update", ns)
    init, apply = lm.transform(ns["MyLayer"](3, 3))
    variables = init(jr.PRNGKey(0))
    x = jnp.ones((2, 3))
    with jax.numpy_rank_promotion("allow"):  # the seed's own code broadcasts (2, 3) + (3,)
        out, new = apply(variables, None, x)
        out2, new2 = apply(new, None, x)
    np.testing.assert_allclose(new["some_states"]["state"], [2.0, 2.0, 2.0])
    np.testing.assert_allclose(new2["some_states"]["state"], [4.0, 4.0, 4.0])
    np.testing.assert_allclose(out2, np.full((2, 3), 5.0))


def test_randomness_samples():
    ns = run("add_noise")
    noisy = ns["outputs"]
    assert noisy.shape == (10, 10) and float(jnp.std(noisy)) > 0.5
    # "if the model uses no randomness, pass None": a model without randomness
    ns_det = run("definition")
    model = ns_det["Mlp"](10, 32, 10)
    ns["init"], ns["apply"] = lm.transform(model)
    ns["variables"] = ns["init"](jr.PRNGKey(0))
    run("no_rng", ns)
    assert ns["outputs"].shape == (10, 10)
    # the named-stream AddNoise takes its key from the dict, and from PRNGKeys
    run("named_noise", ns)
    ns["init"], ns["apply"] = lm.transform(ns["AddNoise"]())
    ns["variables"] = ns["init"](jr.PRNGKey(0))
    run("rng_dict", ns)
    from_dict = ns["outputs"]
    run("prng_keys", ns)
    np.testing.assert_allclose(ns["outputs"], from_dict)  # same 'noise' key, same noise


def test_next_rng_key_names():
    code = CODE["next_rng_key_names"].strip().splitlines()

    class Draws(lm.Module):
        def __call__(self):
            return [jax.random.key_data(eval(line.split("#")[0], {"mx": lm})) for line in code]

    rngs = lm.PRNGKeys(jr.PRNGKey(42), dropout=jr.PRNGKey(0), noise=jr.PRNGKey(1))
    init, apply = lm.transform(Draws())
    noise, default, foo = apply(init(), rngs)[0]
    np.testing.assert_array_equal(noise, jax.random.fold_in(jr.PRNGKey(1), 0))
    np.testing.assert_array_equal(default, jax.random.fold_in(jr.PRNGKey(42), 0))
    np.testing.assert_array_equal(foo, jax.random.fold_in(jr.PRNGKey(42), 1))
