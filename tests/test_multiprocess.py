"""Two processes on this machine, one JAX distributed runtime: the same numbers as one process.

Each process (tests/multiprocess_worker.py) has 4 CPU devices; together they form a global
mesh of 8 on which a data-parallel AdamW step runs, the batch split between the processes.
Their loss, gradients and new weights must equal the same step run here on one device. Every
wait has a timeout, and the processes are killed if anything goes wrong, so a hang fails the
test instead of blocking the suite.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from . import multiprocess_worker

ROOT = pathlib.Path(__file__).parents[1]
WORKER = ROOT / "tests" / "multiprocess_worker.py"
TIMEOUT_SECONDS = 180
# XLA's backend optimisations off here (tests/conftest.py) and in the workers alike
pytestmark = pytest.mark.fast_compile


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(count: int, folder: pathlib.Path) -> list[dict]:
    """Runs `count` workers; returns their JSON lines. Kills them all when one fails."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    logs = [(folder / f"{i}.out", folder / f"{i}.err") for i in range(count)]
    processes = []
    try:
        for i, (out, err) in enumerate(logs):
            with out.open("w") as stdout, err.open("w") as stderr:
                processes.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), str(i), str(count), str(port)],
                        stdout=stdout,
                        stderr=stderr,
                        env=env,
                        cwd=ROOT,
                    )
                )
        deadline = time.monotonic() + TIMEOUT_SECONDS
        while None in (codes := [p.poll() for p in processes]):
            if any(code not in (None, 0) for code in codes) or time.monotonic() > deadline:
                break  # the others would wait for the failed one until their own timeouts
            time.sleep(0.1)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)
    results = []
    for i, (process, (out, err)) in enumerate(zip(processes, logs, strict=True)):
        stdout, stderr = out.read_text(), err.read_text()
        assert process.returncode == 0, (
            f"process {i} of {count} ended with {process.returncode} (killed after "
            f"{TIMEOUT_SECONDS} s or when another failed):\n{stdout[-2000:]}{stderr[-6000:]}"
        )
        lines = stdout.strip().splitlines()
        assert lines, f"process {i} of {count} printed nothing:\n{stderr[-6000:]}"
        results.append(json.loads(lines[-1]))
    return results


def test_two_processes_match_one(tmp_path):
    results = run_processes(2, tmp_path)
    expected = multiprocess_worker.step_on_one_device()
    assert [r["process"] for r in results] == [0, 1]
    for result in results:
        assert result["processes"] == 2 and result["devices"] == 8
        np.testing.assert_allclose(result["loss"], expected["loss"], rtol=1e-6)
        for part in ("grads", "params"):
            assert result[part].keys() == expected[part].keys()
            for name, sums in result[part].items():
                np.testing.assert_allclose(
                    sums, expected[part][name], rtol=1e-5, atol=1e-6, err_msg=f"{part} {name}"
                )
    # the gradients are not trivially zero: the comparison can fail
    assert any(abs(s[1]) > 1e-4 for s in expected["grads"].values())
