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


def test_timer_reports_the_mean_seconds_between_updates(monkeypatch):
    clock = iter([10.0, 10.5, 11.5, 20.0, 20.25])
    monkeypatch.setattr(lm.utils.time, "perf_counter", lambda: next(clock))
    meter = lm.utils.AverageMeter(with_timer=True, timer_key="step_time")  # created at 10.0
    meter.update({"loss": 1.0}, n=1)  # 0.5 s
    meter.update({"loss": 4.0}, n=3)  # 1.0 s: the time is not weighted by n
    assert meter.compute() == {"loss": 3.25, "step_time": 0.75}
    meter.reset()  # 20.0
    meter.update({"loss": 2.0})  # 0.25 s
    assert meter.compute() == {"loss": 2.0, "step_time": 0.25}


def test_prefix_names_every_metric_and_the_timer():
    meter = lm.utils.AverageMeter(with_timer=True)
    meter.update({"loss": 1.0, "accuracy": 0.5}, n=2, prefix="train/")
    meter.update({"loss": 4.0, "accuracy": 1.0}, prefix="train/")
    result = meter.compute()
    assert list(result) == ["train/loss", "train/accuracy", "train/time"]
    assert result["train/loss"] == 2.0 and result["train/accuracy"] == 2 / 3
    assert 0.0 <= result["train/time"] < 60.0
    with pytest.raises(ValueError, match=r"got metrics \('loss', 'accuracy'\), but earlier"):
        meter.update({"loss": 1.0, "accuracy": 1.0})  # the prefix is part of the names
    plain = lm.utils.AverageMeter()
    plain.update({"loss": 3.0}, prefix="val_")
    assert plain.compute() == {"val_loss": 3.0}


def test_a_meter_may_time_steps_without_metrics(monkeypatch):
    clock = iter([0.0, 0.5, 2.0, 3.0])
    monkeypatch.setattr(lm.utils.time, "perf_counter", lambda: next(clock))
    meter = lm.utils.AverageMeter(with_timer=True)  # created at 0.0
    meter.update({}, prefix="train/")  # 0.5 s
    meter.update({}, prefix="train/")  # 1.5 s
    assert meter.compute() == {"train/time": 1.0}
    with pytest.raises(
        ValueError, match=r"metrics \('train/loss',\), but earlier updates had \(\)"
    ):
        meter.update({"loss": 1.0}, prefix="train/")
    plain = lm.utils.AverageMeter()
    plain.update({})
    assert plain.compute() == {}


def test_timer_and_prefix_errors():
    with pytest.raises(TypeError, match="with_timer must be a bool, got 'yes'"):
        lm.utils.AverageMeter(with_timer="yes")
    with pytest.raises(TypeError, match="timer_key must be a non-empty str"):
        lm.utils.AverageMeter(with_timer=True, timer_key="")
    meter = lm.utils.AverageMeter(with_timer=True)
    with pytest.raises(ValueError, match=r"the metric 'time' has the timer's name"):
        meter.update({"time": 1.0})
    with pytest.raises(ValueError, match=r"with_timer=True names the metrics.*Pass \{'loss'"):
        meter.update(1.0)
    with pytest.raises(ValueError, match=r"prefix='a/' names the metrics"):
        lm.utils.AverageMeter().update(1.0, prefix="a/")
    with pytest.raises(TypeError, match="prefix must be a str, got 3"):
        meter.update({"loss": 1.0}, prefix=3)
