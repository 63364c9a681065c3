"""benchmarks/run.py runs end to end at tiny sizes and writes a well-formed results.json.

The figures of a smoke run mean nothing (a few calls, tiny models, a busy machine): these
tests check the structure of what run.py writes and that every ratio is a positive number,
never a timing. `run.py` runs in a subprocess: the peers' code is not written for this
suite's strict dtype and rank promotion.
"""

import json
import math
import pathlib
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
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
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
