import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm


def test_weighted_means_match_numpy():
    meter = lm.utils.AverageMeter()
    rng = np.random.default_rng(0)
    losses, sizes = rng.random(1200), rng.integers(1, 65, 1200)
    for loss, n in zip(losses, sizes, strict=True):  # crosses the fold threshold twice
        meter.update({"loss": jnp.float32(loss), "accuracy": 1.0 - loss}, n=int(n))
    result = meter.compute()
    assert list(result) == ["loss", "accuracy"]
    np.testing.assert_allclose(
        result["loss"], np.average(losses.astype(np.float32), weights=sizes), rtol=1e-6
    )
    np.testing.assert_allclose(result["accuracy"], np.average(1 - losses, weights=sizes))
    assert isinstance(result["loss"], float)


def test_scalar_metric_and_reset():
    meter = lm.utils.AverageMeter()
    meter.update(2.0)
    meter.update(4.0, n=3)
    assert meter.compute() == 3.5
    meter.reset()
    meter.update({"a": 1.0})
    assert meter.compute() == {"a": 1.0}


def test_errors():
    meter = lm.utils.AverageMeter()
    with pytest.raises(ValueError, match="no update since the last reset"):
        meter.compute()
    with pytest.raises(ValueError, match="n must be a positive int, got 0"):
        meter.update({"a": 1.0}, n=0)
    meter.update({"a": 1.0})
    with pytest.raises(
        ValueError,
        match=r"got metrics \('b',\), but earlier updates had "
        r"\('a',\)",
    ):
        meter.update({"b": 1.0})
    with pytest.raises(ValueError, match=r"'a' has shape \(2,\); metrics must be scalars"):
        meter.update({"a": jnp.ones(2)})
    assert meter.compute() == {"a": 1.0}  # the rejected updates left no trace
