import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm


class Draw(lm.Module):
    """Returns the raw key data of the draws it is told to make."""

    def __call__(self, requests):
        keys = []
        for name, num, strict in requests:
            key = lm.next_rng_key(name, num, strict)
            keys.append(jax.random.key_data(key).reshape(-1, 2))
        return keys


def run(rngs, requests):
    init, apply = lm.transform(Draw())
    return [np.asarray(k) for k in apply(init(), rngs, requests)[0]]


def as_set(keys):
    return {tuple(row) for k in keys for row in k}


def test_keys_never_repeat_including_num(getkey):
    keys = run(
        getkey(),
        [(None, None, False), (None, 3, False), (None, None, False), (None, (2, 2), False)],
    )
    assert [k.shape[0] for k in keys] == [1, 3, 1, 4]
    assert len(as_set(keys)) == 9


def test_named_streams_and_fallback():
    rngs = lm.PRNGKeys(jax.random.key(42), dropout=jax.random.key(0), noise=jax.random.key(1))
    keys = run(rngs, [("noise", None, False), (None, None, False), ("foo", None, False)])
    assert len(as_set(keys)) == 3
    # 'foo' falls back to the default stream: the second draw from it
    default_only = run(lm.PRNGKeys(jax.random.key(42)), [(None, None, False), (None, None, False)])
    np.testing.assert_array_equal(keys[2], default_only[1])
    # the named stream depends only on its own key
    noise_only = run({"noise": jax.random.key(1)}, [("noise", None, False)])
    np.testing.assert_array_equal(keys[0], noise_only[0])


def test_same_rng_same_keys():
    a = run(jax.random.key(7), [("dropout", None, False), (None, 2, False)])
    b = run(jax.random.key(7), [("dropout", None, False), (None, 2, False)])
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_strict_requires_the_name():
    with pytest.raises(lm.RngError, match=r"next_rng_key\('noise', strict=True\).*no 'noise'"):
        run(jax.random.key(0), [("noise", None, True)])


def test_missing_key_errors_name_the_stream():
    with pytest.raises(lm.RngError, match=r"next_rng_key\('dropout'\) found no key.*rngs=None"):
        run(None, [("dropout", None, False)])
    with pytest.raises(
        lm.RngError,
        match=r"next_rng_key\(\) found no key.*only the streams "
        r"'dropout'",
    ):
        run({"dropout": jax.random.key(0)}, [(None, None, False)])


def test_outside_call_is_an_error():
    with pytest.raises(RuntimeError, match="outside init/apply"):
        lm.next_rng_key()


@pytest.mark.parametrize(
    ("rngs", "match"),
    [
        (0, r"got int\. To use a seed, pass jax.random.key\(0\)"),
        ("key", "got str"),
        ({"dropout": 3}, "'dropout' stream is int"),
        ({1: jax.random.key(0)}, "stream names must be strings"),
        (
            lm.PRNGKeys(jnp.ones(2)),
            r"default stream is an array of dtype float32 and shape \(2,\), not a PRNG key",
        ),
    ],
)
def test_bad_rngs(rngs, match):
    with pytest.raises(TypeError, match=match):
        run(rngs, [(None, None, False)])


def test_next_rng_key_in_init_via_initializer():
    seen = []

    def noisy_init(key, shape, dtype):
        extra = lm.next_rng_key("extra")
        seen.append(extra)
        return jax.random.normal(key, shape, dtype) + jax.random.normal(extra, shape, dtype)

    class M(lm.Module):
        def __init__(self):
            self.w = lm.Parameter((3,), noisy_init)

    init, _ = lm.transform(M())
    a = init(lm.PRNGKeys(jax.random.key(0), extra=jax.random.key(1)))
    b = init(lm.PRNGKeys(jax.random.key(0), extra=jax.random.key(2)))
    assert len(seen) == 2
    assert not np.allclose(a["params"]["w"], b["params"]["w"])


def test_prngkeys_is_a_pytree_through_jit():
    rngs = lm.PRNGKeys(jax.random.key(0), dropout=jax.random.key(1))
    init, apply = lm.transform(Draw())
    requests = (("dropout", None, False), (None, None, False))
    eager = apply({}, rngs, requests)[0]
    jitted = jax.jit(apply, static_argnums=2)({}, rngs, requests)[0]
    for x, y in zip(eager, jitted, strict=True):
        np.testing.assert_array_equal(x, y)
    assert "dropout" in repr(rngs)


def test_vmap_over_rngs(getkey):
    class Noise(lm.Module):
        def __call__(self, x):
            return x + jax.random.normal(lm.next_rng_key(), x.shape)

    init, apply = lm.transform(Noise())
    keys = jax.random.split(getkey(), 4)
    outs, _ = jax.vmap(apply, in_axes=(None, 0, None))({}, keys, jnp.zeros(3))
    assert outs.shape == (4, 3)
    assert len({tuple(np.asarray(o).round(5)) for o in outs}) == 4
