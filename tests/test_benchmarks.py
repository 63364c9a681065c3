"""benchmarks/run.py runs end to end at tiny sizes and writes a well-formed results.json.

The figures of a smoke run mean nothing (a few calls, tiny models, a busy machine): these
tests check the structure of what run.py writes and that every ratio is a positive number,
never a timing. `run.py` runs in a subprocess: the peers' code is not written for this
suite's strict dtype and rank promotion.
"""

import importlib
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
RUN = ROOT / "benchmarks" / "run.py"
COLUMNS = ["jax", "lamina", "linen", "nnx", "haiku", "equinox"]
FAST_PARTS = ["overhead", "scale", "mnist_vs_linen"]
# About 50 seconds more on 2 cores (XLA compiles a step for each of six libraries)
HEAVY_PARTS = ["train_steps", "char_transformer", "depth"]


def smoke(tmp_path, parts) -> dict:
    command = [sys.executable, str(RUN), "--smoke", "--out", str(tmp_path), "--only", *parts]
    # XLA's backend optimisations off (as the marker fast_compile, tests/conftest.py): a smoke
    # run's figures mean nothing and its time is compiling; the checks are on its structure
    env = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| row | raw JAX | lamina | linen | nnx | haiku | equinox | spread |" in done.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    return results


def check_rows(results: dict, expected_ids: set[str]) -> None:
    assert results["mode"] == "smoke"
    assert results["columns"] == COLUMNS
    machine = results["machine"]
    assert machine["versions"]["jax"] and machine["cpu"] and machine["date"]
    assert len(machine["load_average_start"]) == 3
    ids = {row["id"] for row in results["rows"]}
    assert expected_ids <= ids, expected_ids - ids
    for row in results["rows"]:
        assert row["base"] in row["values"], row["id"]
        assert row["ratios"][row["base"]] == 1.0
        for column, value in row["values"].items():
            assert column in COLUMNS, (row["id"], column)
            assert isinstance(value, float) and math.isfinite(value) and value > 0, row["id"]
            ratio = row["ratios"][column]
            assert math.isfinite(ratio) and ratio > 0, (row["id"], column, ratio)
        for column in COLUMNS:  # a contestant without a figure has a footnote
            assert column in row["values"] or column in row["notes"], (row["id"], column)
        for column, (low, high) in row["spread"].items():
            assert low <= row["values"][column] <= high, (row["id"], column)


def test_smoke_run_fast_parts(tmp_path):
    results = smoke(tmp_path, FAST_PARTS)
    check_rows(
        results,
        {
            "apply_eager",
            "apply_jit",
            "step_overhead",
            "scale_setup_10",
            "scale_second_init_10",
            "scale_tracemalloc_peak_mib_10",
            "mnist_epoch",
        },
    )
    eager = next(row for row in results["rows"] if row["id"] == "apply_eager")
    assert eager["extra"]["lamina_kernels_by_hand_us"] > 0
    assert {target["row"] for target in results["targets"]} >= {"apply_eager", "apply_jit"}
    assert all(isinstance(target["met"], bool) for target in results["targets"])
    for name in ("ratios.png", "scale.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.full
def test_smoke_run_heavy_parts(tmp_path):
    results = smoke(tmp_path, HEAVY_PARTS)
    check_rows(
        results,
        {"train_mlp", "train_cnn", "train_char_transformer", "compile_list_2", "compile_scan_2"},
    )
    assert (tmp_path / "depth.png").is_file()


def test_only_rejects_unknown_parts(tmp_path):
    command = [sys.executable, str(RUN), "--smoke", "--out", str(tmp_path), "--only", "nope"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2
    assert "invalid choice: 'nope'" in done.stderr


def test_the_example_compiles_to_linens_program():
    """The claim behind the epoch row: with dropout on, lamina's and Linen's compiled steps
    differ only in the ops that derive each library's dropout key."""
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import mnist_vs_linen as m; "
        "c = m.compiled_ops((8, 8, 1), 10, 4); a, b = c['lamina'], c['Flax Linen']; "
        "print(json.dumps([sorted(k for k in set(a) | set(b) if a[k] != b[k]), "
        "a['convolution'], a['dot']]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    differing, convolutions, dots = json.loads(done.stdout.splitlines()[-1])
    assert differing == ["add", "constant"]
    assert (convolutions, dots) == (5, 6)


@pytest.mark.slow
def test_smoke_run_llm(tmp_path):
    """The Llama-shaped model's rows (benchmarks/llm.py; smoke: batch 2 alone): generation
    against the hand-written JAX loop (and transformers, in extra, when installed), compile
    time per depth and its flatness target, AdamW against NNX; every contestant wrote the same
    first tokens and the same loss (checked by the part itself before timing)."""
    results = smoke(tmp_path, ["llm"])
    check_rows(
        results,
        {
            "llm_prefill_b2",
            "llm_decode_b2",
            "compile_llm_1",
            "compile_llm_2",
            "train_llm",
        },
    )
    rows = {row["id"]: row for row in results["rows"]}
    assert set(rows["llm_decode_b2"]["values"]) == {"jax", "lamina"}
    assert set(rows["train_llm"]["values"]) == {"jax", "lamina", "nnx"}
    assert rows["compile_llm_2"]["extra"] == {"depth": 2, "kind": "llm forward"}
    targets = {(t["row"], t["target"]) for t in results["targets"]}
    assert ("llm_decode_b2", "generation <= 1.05x the hand-written JAX loop") in targets
    flat = "LLM compile time flat in depth (deepest <= 1.5x shallowest)"
    assert ("compile_llm_2", flat) in targets
    assert any(t["row"] == "train_llm" for t in results["targets"])
    try:
        import transformers  # noqa: F401
    except ImportError:
        return
    decode = rows["llm_decode_b2"]["extra"]
    assert decode["transformers"] > 0 and decode["lamina_over_transformers"] > 0
    assert decode["tokens_per_second"]["transformers"] > 0
    assert set(decode["token_agreement_with_raw_jax"]) == {"lamina", "transformers"}
    assert (tmp_path / "depth.png").is_file()


def script(*args: str) -> str:
    """Runs a script of benchmarks/ with XLA's optimisations off (as `smoke`: structure only)."""
    done = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_char_transformer_profile_and_the_operations_against_torch(tmp_path):
    """The scripts that take the char transformer's step apart run and report every part: the
    profile's tables (tiny model) sum the thunks they found, the operation race has a row
    per operation with a positive ratio. Their figures are not checked."""
    profile = tmp_path / "profile.json"
    tiny = ["--layers", "1", "--heads", "2", "--width", "16", "--block-size", "8", "--batch-size"]
    options = ["--steps", "2", "--top", "3", "--json", str(profile), "--show", "LayerNorm"]
    out = script("benchmarks/char_transformer_profile.py", *options, *tiny, "4")
    table = json.loads(profile.read_text())
    assert table["step_ms"] > 0 and table["thunks_ms"] > 0
    assert math.isclose(sum(table["layer"].values()), table["thunks_ms"], rel_tol=1e-6)
    assert math.isclose(sum(table["phase"].values()), table["thunks_ms"], rel_tol=1e-6)
    assert {"LayerNorm", "MLP: the two Dense layers"} <= set(table["layer"])
    assert {"forward", "backward"} <= set(table["phase"])
    assert "thunks of rows containing 'LayerNorm'" in out
    lines = script("benchmarks/ops_vs_torch.py", "--rounds", "1", "--calls", "2").splitlines()
    rows = lines[lines.index(next(x for x in lines if x.startswith("operation"))) + 1 : -1]
    assert len(rows) == 8 and lines[-1].startswith("load average after"), lines
    for row in rows:  # name, JAX us, torch us, JAX/torch[, GFLOP/s]
        numbers = [float(x) for x in row.split() if x.replace(".", "", 1).isdigit()][-4:]
        jax_us, torch_us, ratio = numbers[:3] if len(numbers) == 4 else numbers[-3:]
        assert jax_us > 0 and torch_us > 0  # the ratio is printed to two decimals:
        assert math.isclose(ratio, jax_us / torch_us, rel_tol=0.05, abs_tol=0.006), row


def test_the_race_reads_nanogpts_training_time(tmp_path, monkeypatch):
    """benchmarks/char_transformer_wall.py reads each contestant's training milliseconds per
    iteration from what it prints: here nanoGPT's (a two-iteration run; the example's is read
    in tests/test_char_transformer.py), its loop less its evaluations; it refuses an output
    without one, and its medians and ratios are those of the rounds."""
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 200, encoding="utf-8")
    out = script("benchmarks/nanogpt_torch.py", f"--data={text}", "--iters=2")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    wall = importlib.import_module("char_transformer_wall")
    line = re.search(r"([\d.]+) ms per iteration \(evaluation included\), ([\d.]+) ms per", out)
    assert line, out
    assert 0 < wall.training_ms_per_iteration(out) == float(line[2]) < float(line[1])
    with pytest.raises(SystemExit, match="no training time in the output"):
        wall.training_ms_per_iteration("val loss: 1.2345\n")
    rounds = {"a": [(10.0, 5.0, 1.9), (30.0, 7.0, 1.9), (20.0, 9.0, 1.9)], "b": [(8.0, 6.0, 1.8)]}
    assert wall.medians(rounds) == {"a": (20.0, 1.0, 7.0, 1.0), "b": (8.0, 0.4, 6.0, 6.0 / 7.0)}
