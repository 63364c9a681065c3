"""examples/char_transformer.py: cached decoding against recomputation, and a run end to end."""

import importlib
import os
import platform
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm

from .test_examples import EXAMPLES, check_saved, run_example

TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\nFirst Citizen:\nYou are all resolved rather to die than to "
    "famish?\n\n"
) * 40


FAST_COMPILE = {"xla_backend_optimization_level": 0}  # for programs that run once
# the example's own processes, as the marker does in this one (tests/conftest.py)
FAST_ENV = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
pytestmark = pytest.mark.fast_compile


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))  # it imports _common
    return importlib.import_module("char_transformer")


def tiny_args(example, *extra):
    return example.parse_args(
        ["--layers", "2", "--heads", "2", "--width", "16", "--block-size", "8", *extra]
    )


def tiny_model(example):
    args = tiny_args(example)
    chars = "".join(sorted(set(TEXT)))
    data = example.Text("tiny", chars, np.zeros(0, np.int32), np.zeros(0, np.int32))
    init = lm.transform(example.build_model(args, len(chars))).init
    params = jax.jit(init, compiler_options=FAST_COMPILE)(jax.random.key(0))["params"]
    # Untrained weights (std 0.02) predict the same character everywhere; large random
    # weights make greedy decoding depend on the whole context, so a wrong cache shows.
    noise = np.random.default_rng(2)
    params = jax.tree.map(
        lambda x: np.asarray(x) + noise.normal(size=x.shape).astype(x.dtype), params
    )
    return args, data, params


def test_cached_decoding_writes_what_full_recomputation_writes(example):
    args, data, params = tiny_model(example)
    key = jax.random.key(2)
    # 30 characters, context 8: the window moves on to its last 4 characters 6 times, and
    # the cached decoding reads a prompt of 4 characters into its cache first
    cached = example.sample(args, data, params, key, 30, 0.0, prompt="Spea")
    recomputed = example.sample(args, data, params, key, 30, 0.0, prompt="Spea", use_cache=False)
    assert len(cached) == 30 and len(set(cached)) >= 3
    assert cached == recomputed
    assert example.sample(args, data, params, key, 0, 0.0) == ""
    for use_cache in (True, False):
        with pytest.raises(ValueError, match="the prompt is empty"):
            example.sample(args, data, params, key, 5, 0.0, prompt="", use_cache=use_cache)


def test_sampling_draws_what_full_recomputation_draws_with_the_same_key(example):
    # both draw the i-th character with categorical(fold_in(key, i), logits / temperature)
    args, data, params = tiny_model(example)
    key, other = jax.random.key(3), jax.random.key(4)
    cached = example.sample(args, data, params, key, 30, 1.0, prompt="\n")
    recomputed = example.sample(args, data, params, key, 30, 1.0, prompt="\n", use_cache=False)
    assert len(cached) == 30 and set(cached) <= set(data.chars)
    assert cached == recomputed
    assert example.sample(args, data, params, key, 30, 1.0, prompt="\n") == cached
    assert example.sample(args, data, params, other, 30, 1.0, prompt="\n") != cached


@pytest.mark.slow
def test_example_end_to_end(monkeypatch, capsys, tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    out_dir = tmp_path / "run"
    argv = [
        *("--data", str(path), "--layers", "2", "--heads", "2", "--width", "32"),
        *("--block-size", "16", "--batch-size", "8", "--iters", "60", "--eval-interval", "20"),
        *("--eval-batches", "2", "--sample-chars", "40", "--quiet", "--out", str(out_dir)),
    ]
    results = run_example("char_transformer.py", argv, monkeypatch)
    out = capsys.readouterr().out
    lines = out.rstrip("\n").split("\n")
    assert re.fullmatch(r"val loss: \d+\.\d{4}", lines[-1])
    assert lines[-1] == f"val loss: {results['val_loss']:.4f}"
    assert f"data: {path.resolve()}" in out
    assert f"{len(TEXT):,} characters, {len(set(TEXT))} distinct" in out
    assert [row["step"] for row in results["history"]] == [0, 20, 40, 60]
    history = results["history"]
    assert history[-1]["val_loss"] < history[0]["val_loss"] - 0.5  # it learns
    assert len(results["sample"]) == 40 and set(results["sample"]) <= set(TEXT)
    saved = check_saved(results, out_dir, out)
    assert saved["val_loss"] == results["val_loss"] and saved["args"]["layers"] == 2
    assert len(saved["train_loss_per_iter"]) == 60
    # the race (benchmarks/char_transformer_wall.py) reads the training time from this output:
    # the loop less the evaluations, each printed to 0.1 s
    monkeypatch.syspath_prepend(str(EXAMPLES.parent / "benchmarks"))
    training_ms = importlib.import_module("char_transformer_wall").training_ms_per_iteration(out)
    seconds = results["seconds"]
    expected = 1000 * (seconds["loop"] - seconds["evaluation_with_compilation"]) / 60
    assert training_ms == pytest.approx(expected, abs=0.11 * 1000 / 60)


def test_example_defaults_to_python_source(example, capsys):
    name, text = example.stdlib_text()
    assert name == example.stdlib_text()[0]  # the same files every time
    assert "standard library" in name and 1_000_000 <= len(text) < 3_000_000
    args = example.parse_args([])
    assert (args.layers, args.heads, args.width, args.block_size) == (4, 4, 128, 64)
    assert (args.batch_size, args.iters, args.lr, args.dropout) == (12, 2000, 1e-3, 0.0)
    assert args.tie
    data = example.load_text(args)
    assert f"data: {name} (no --data given)" in capsys.readouterr().out
    assert len(data.train) == int(0.9 * len(text))
    assert data.decode(data.val) == text[len(data.train) :]


def test_example_bad_arguments(monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match=r"error: no text file at .*missing\.txt \(--data\)"):
        run_example("char_transformer.py", ["--data", str(tmp_path / "missing.txt")], monkeypatch)
    short = tmp_path / "short.txt"
    short.write_text("too short", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"error: short\.txt: 9 characters leave 1"):
        run_example("char_transformer.py", ["--data", str(short)], monkeypatch)
    with pytest.raises(SystemExit):
        run_example("char_transformer.py", ["--width", "30", "--heads", "4"], monkeypatch)


@pytest.mark.slow
def test_splitting_the_batch_across_cpu_cores_gives_the_numbers_of_one_device(tmp_path):
    """The example makes each CPU core a JAX device (a setting read when JAX starts, so each
    run is its own process) and splits every batch across them: same losses as one device.
    Five steps per call (the divisor of --iters, --eval-interval and --log-interval) give
    the losses of one step per call (--log-interval 1), and that run reads the setup and
    the evaluation back from --compile-cache (compiled by the run before it)."""
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    common = [
        *("--data", str(path), "--layers", "1", "--heads", "2", "--width", "16"),
        *("--block-size", "8", "--batch-size", "4", "--iters", "10", "--eval-interval", "5"),
        *("--eval-batches", "2", "--sample-chars", "0", "--quiet", "--log-interval", "5"),
        *("--compile-cache", str(tmp_path / "xla")),
    ]
    script = str(EXAMPLES / "char_transformer.py")
    runs, cached, per_call = {}, {}, {}
    settings = {
        "1 device": ["--devices", "1"],
        "2 devices, 1 step a call": ["--devices", "2", "--log-interval", "1"],
        "2 devices": ["--devices", "2"],
    }
    for name, options in settings.items():
        done = subprocess.run(
            [sys.executable, script, *common, *options, "--out", str(tmp_path / name)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, **FAST_ENV},
        )
        count = int(options[1])
        assert f"devices: {count} CPU, {4 // count} windows of the batch each" in done.stdout
        runs[name] = [float(x) for x in re.findall(r"val loss (\d+\.\d+)", done.stdout)]
        (cached[name],) = re.findall(r"compiled programs: (\d+ of \d+) read", done.stdout)
        (per_call[name],) = re.findall(r"\((\d+) steps? a call", done.stdout)
    assert len(runs["1 device"]) == 3
    np.testing.assert_allclose(runs["2 devices"], runs["1 device"], rtol=1e-4)
    assert runs["2 devices, 1 step a call"] == runs["2 devices"]
    assert per_call == {name: "1" if "1 step" in name else "5" for name in settings}
    # The third run shares the setup and the evaluation with the second, not the step.
    assert list(cached.values()) == ["0 of 3", "0 of 3", "2 of 3"], cached
    too_many = subprocess.run(
        [sys.executable, script, *common, "--devices", "3"],
        capture_output=True,
        text=True,
        env={**os.environ, **FAST_ENV},
    )
    assert too_many.returncode != 0
    assert "--devices 3 does not divide --batch-size 4" in too_many.stderr


def test_training_keeps_a_bounded_number_of_steps_queued(example):
    """JAX dispatches steps ahead of the devices; with several CPU devices XLA:CPU deadlocks
    in the all-reduce when more than about 32 steps are queued (jaxlib 0.10), so `fit`
    waits for the step `IN_FLIGHT` back, whatever --log-interval says."""
    slow = jax.jit(lambda x: jax.lax.fori_loop(0, 200, lambda _, y: jnp.tanh(y @ y), x))
    x = jnp.eye(96) * 0.5
    queued = []

    def train_step(params, opt_state, inputs, targets, key, step):
        queued.append(sum(not loss.is_ready() for loss in returned))
        loss = slow(x)[0, 0]
        returned.append(loss)
        return params, opt_state, loss

    class Batches:
        def next(self, count=None):
            return None, None

    returned = []
    args = tiny_args(example, "--iters", "60", "--eval-interval", "1000", "--log-interval", "1000")
    args.quiet = True
    example.fit(args, (None, None), train_step, lambda *a: 0.0, Batches(), (), None)
    assert len(queued) == 60
    assert max(queued) <= example.IN_FLIGHT
    assert max(queued) >= example.IN_FLIGHT // 2  # the host does run ahead


def _dot_dtypes(jaxpr) -> list[str]:
    """The operand dtypes of every dot_general in a jaxpr, sub-jaxprs included."""
    found = []
    for equation in jaxpr.eqns:
        if equation.primitive.name == "dot_general":
            found.append(str(equation.invars[0].aval.dtype))
        for value in equation.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(inner, "jaxpr"):
                    found += _dot_dtypes(getattr(inner.jaxpr, "jaxpr", inner.jaxpr))
    return found


def test_bfloat16_precision_computes_the_blocks_in_bfloat16_from_float32_parameters(example):
    chars = 11
    ids = np.zeros((2, 8), np.int32)
    full, half = (
        example.build_model(tiny_args(example, "--precision", p), chars)
        for p in ("float32", "bfloat16")
    )
    init, apply = lm.transform(half)
    variables = jax.jit(init, compiler_options=FAST_COMPILE)(jax.random.key(0))
    assert {str(x.dtype) for x in jax.tree.leaves(variables)} == {"float32"}  # stored
    logits, _ = apply(variables, None, ids)
    assert logits.dtype == np.float32  # the final norm and the tied head stay float32
    dots = _dot_dtypes(jax.make_jaxpr(lambda v: apply(v, None, ids))(variables).jaxpr)
    # the Stack's scan body (one block: q, k, v, scores, weighted values, out, mlp in, mlp
    # out) in bfloat16; the head in float32
    assert sorted(dots) == ["bfloat16"] * 8 + ["float32"], dots
    # the same parameters, a float32 model: the logits agree to bfloat16's precision
    reference, _ = lm.transform(full).apply(variables, None, ids)
    np.testing.assert_allclose(logits, reference, atol=2e-2)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="glibc's malloc settings: Linux with glibc only",
)
def test_freed_memory_stays_with_the_thread_that_frees_it(example):
    """A thread (own arena, as XLA's workers have) allocating, writing and freeing a 16 MiB
    buffer 20 times takes the buffer's page faults once (glibc's defaults take them at least
    twice: an ``mmap`` first, then a fresh heap; in the example, every step). The settings
    stay for the rest of the process, as they do in the example's."""
    import ctypes
    import resource
    import threading

    assert example.keep_freed_memory()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size, faults = 16 << 20, []

    def churn():  # this thread's faults only, not other threads' (XLA's, tqdm's)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(20):
            buffer = libc.malloc(size)
            ctypes.memset(buffer, 1, size)
            libc.free(buffer)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    thread = threading.Thread(target=churn)
    thread.start()
    thread.join()
    pages = size // resource.getpagesize()
    assert faults[0] < 1.5 * pages, f"{faults[0]} page faults for 20 uses of {pages} pages"
