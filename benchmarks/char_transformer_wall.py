"""Wall time of a whole run: the char transformer example against nanoGPT in PyTorch.

The issue's race: nanoGPT's Shakespeare settings (4 layers, 4 heads, width 128, context 64,
batch 12, 2,000 iterations, no dropout, lr 1e-3), start-up to exit, on the same machine.
Each round runs `benchmarks/nanogpt_torch.py` and ``examples/char_transformer.py --quiet
--sample-chars 0`` (nanoGPT's ``train.py`` writes no sample; ``--sample`` keeps the
example's 500 characters) one after the other, in alternating order, each as its own process
timed from start to exit; the table gives every round's seconds, each run's training
milliseconds per iteration (its loop less its evaluations, from what it prints: nanoGPT
evaluates 20 batches of each split one at a time, the example 20 validation batches in one
call, so their evaluations are not the same work; the example's figure keeps its first call's
wait for the compiled program) and validation losses, and the ratios of the medians, with the
versions (torch's and its thread count as nanoGPT's script prints them, jax's), the CPU
model and the load average. The machine's speed drifts (other tenants, thermal limits): only
figures taken in the same run compare; so does the CPU (the ratios differ between an Intel
Xeon with AVX-512 and an AMD EPYC with AVX2: docs/performance.md has both).

The example keeps XLA's compiled programs between runs (its ``--compile-cache``, JAX's
persistent compilation cache, in ``~/.cache/lamina/xla``), as a user re-running it gets them: the
first lamina run on a machine compiles (4.5 to 6 s of CPU), the later ones read the programs
back, and each row says how many it read. ``--cold`` makes every lamina run compile.

    python benchmarks/char_transformer_wall.py                    # 2 rounds, 5 to 9 minutes
    python benchmarks/char_transformer_wall.py --rounds 3 --torch-python /path/to/python

PyTorch is not a lamina dependency: `--torch-python` names an interpreter that has it
(default: this one); ``pip install torch==2.15.0`` (PyPI's Linux wheel is the CUDA build, which
runs on the CPU; ``--index-url https://download.pytorch.org/whl/cpu`` gives the CPU-only wheel).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def run(command: list[str]) -> tuple[float, float, float, str]:
    """Runs `command`; returns (seconds, its training milliseconds per iteration, the last
    ``val loss: X`` it printed, its output).

    Python may keep the bytecode of what it imports (``__pycache__``), as it does on a
    user's machine: a ``PYTHONDONTWRITEBYTECODE`` in this environment is not passed on (it
    would have the example compile lamina's 120-odd modules from source at every run).
    """
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    start = time.perf_counter()
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, check=False, env=environment
    )
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    losses = re.findall(r"val loss: (\d+\.\d+)", done.stdout)
    return seconds, training_ms_per_iteration(done.stdout), float(losses[-1]), done.stdout


def training_ms_per_iteration(output: str) -> float:
    """A run's training loop less its evaluations, in milliseconds per iteration, from what
    it prints: nanoGPT's ``X ms per training iteration``, or the example's ``N iterations in
    S s: ...`` and ``E s evaluating`` (its first call's wait for the compiled program stays
    in)."""
    torch_line = re.search(r"^torch .*?([\d.]+) ms per training iteration", output, re.MULTILINE)
    if torch_line:
        return float(torch_line[1])
    example = re.search(r"^(\d+) iterations in ([\d.]+) s: .*?([\d.]+) s evaluating", output, re.M)
    if example is None:
        raise SystemExit(f"no training time in the output:\n{output[-2000:]}")
    return 1000 * (float(example[2]) - float(example[3])) / int(example[1])


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else `platform.processor()`."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def version(package: str) -> str:
    """`package`'s installed version in this Python, or "not installed"."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="(default: %(default)s)")
    parser.add_argument("--iters", type=int, default=2000, help="(default: %(default)s)")
    parser.add_argument(
        "--torch-python", default=sys.executable, help="a Python with PyTorch (default: this one)"
    )
    parser.add_argument(
        "--sample", action="store_true", help="let the example write its sample at the end"
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="every lamina run compiles (--compile-cache ''): no programs kept between runs",
    )
    args = parser.parse_args()
    if not Path(args.data).is_file():
        raise SystemExit(f"no text at {args.data} (--data)")
    commands = {
        "nanoGPT (PyTorch)": [
            args.torch_python,
            "benchmarks/nanogpt_torch.py",
            f"--data={args.data}",
            f"--iters={args.iters}",
        ],
        "lamina example": [
            sys.executable,
            "examples/char_transformer.py",
            f"--data={args.data}",
            f"--iters={args.iters}",
            "--quiet",
            "--out=/tmp/char_transformer_wall",
            *([] if args.sample else ["--sample-chars=0"]),
            *(["--compile-cache="] if args.cold else []),
        ],
    }
    names = list(commands)
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}
    versions = {names[0]: "torch ?", names[1]: f"jax {version('jax')}"}
    print(
        f"{os.cpu_count()} CPUs: {cpu_model()}; jax {version('jax')} (lamina's Python); "
        f"load average {load_average()} at the start"
    )
    print(
        f"{'round':>5}  {'contestant':<20} {'seconds':>8} {'ms/iter':>8} {'val loss':>9}  "
        f"{'load average':<18}  versions"
    )
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else reversed(names):
            seconds, ms_per_iter, loss, output = run(commands[name])
            results[name].append((seconds, ms_per_iter, loss))
            torch_line = re.search(r"^(torch \S+, \d+ threads)", output, re.MULTILINE)
            if torch_line:
                versions[name] = torch_line.group(1)
            compiled = ""
            if name != names[0]:  # the example says how many programs it read back
                cache = re.search(r"compiled programs: (\d+) of (\d+) read from", output)
                compiled = f", {cache[1]} of {cache[2]} programs from XLA's cache" if cache else ""
            print(
                f"{round_ + 1:>5}  {name:<20} {seconds:8.1f} {ms_per_iter:8.2f} {loss:9.4f}  "
                f"{load_average():<18}  "
                f"{versions[name]}{compiled}",
                flush=True,
            )
    print(
        f"\nmedians: wall time (start-up to exit) and training ms per iteration, and against "
        f"nanoGPT ({cpu_model()}, load average {load_average()} at the end):"
    )
    for name, (seconds, wall_ratio, ms_per_iter, step_ratio) in medians(results).items():
        print(
            f"  {name:<20} {seconds:7.1f} s   {wall_ratio:5.2f}x   {ms_per_iter:6.2f} ms/iter "
            f"  {step_ratio:5.2f}x   {versions[name]}"
        )


def medians(results: dict[str, list[tuple[float, float, float]]]) -> dict[str, tuple]:
    """Each contestant's median seconds and training ms per iteration over its rounds (rows of
    ``(seconds, ms per iteration, val loss)``), and both as ratios to the first contestant's:
    ``{name: (seconds, seconds ratio, ms, ms ratio)}``."""
    table = {
        name: (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
        for name, rows in results.items()
    }
    wall, step = next(iter(table.values()))
    return {name: (s, s / wall, ms, ms / step) for name, (s, ms) in table.items()}


if __name__ == "__main__":
    main()
