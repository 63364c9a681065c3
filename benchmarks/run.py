"""lamina against raw JAX, Flax Linen, Flax NNX, Haiku and Equinox: every benchmark, one table.

Runs the parts back to back in one process (the scale part starts a fresh process per
contestant, so that caches and memory do not carry over), prints one table of ratios to raw
JAX (a column per peer, and raw JAX's own figure), and writes ``results.json`` (every raw
figure, the spread, the machine: CPU, load, jax and library versions, date) and PNG plots to
``--out`` (default: ``runs/benchmarks-<date>-<time>``). Parts:

- overhead.py: per-call time of eager and jitted apply and of a jitted SGD step (small MLP);
- train_steps.py: training-step time of an MLP and of the seed's CNN;
- char_transformer.py: the char transformer's training step in lamina and the four peers;
- depth.py: trace + compile time of a Python list of blocks and of a scan, per depth;
- scale.py: transform + first init, second init, peak memory of 1,000 and 10,000 layers;
- mnist_vs_linen.py: examples/mnist.py's seconds per epoch, lamina against Linen;
- llm.py: a Llama-shaped model: prefill and decode time of `lm.generate` against a
  hand-written JAX loop and transformers (PyTorch), trace + compile time at 4, 16 and 64
  layers, and an AdamW step against Flax NNX.

Each figure is the median of repeated runs after warm-up, contestants alternating round by
round, every result waited for (`jax.block_until_ready`). Run:

    python benchmarks/run.py --quick          # about five minutes on 2 CPU cores
    python benchmarks/run.py                  # the full run
    python benchmarks/run.py --only overhead --only depth
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import pathlib
import platform
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import jax
from _harness import COLUMNS, TITLES, Row

HERE = pathlib.Path(__file__).parent
PARTS = ("overhead", "train_steps", "char_transformer", "depth", "scale", "mnist_vs_linen", "llm")
PEERS = COLUMNS[1:]

# The targets: (row id prefix, description, check(row) -> (met, figure))


def _eager_target(row: Row):
    # Both timed as a pair (overhead.py): lamina's eager apply beside its kernels by hand.
    ratio = row.extra["lamina_beside_them_us"] / row.extra["lamina_kernels_by_hand_us"]
    return ratio <= 1.1, f"{ratio:.2f}x the same kernels called by hand"


def _jit_target(row: Row):
    ratio = row.values["lamina"] / row.values["jax"]
    return ratio <= 1.02, f"{ratio:.3f}x raw JAX"


def _best_peer_target(row: Row, noise: float = 0.05):
    peers = {c: v for c, v in row.values.items() if c in PEERS and c != "lamina"}
    if not peers:
        return None, "no peer"
    best = min(peers, key=peers.get)
    ratio = row.values["lamina"] / peers[best]
    return ratio <= 1.0 + noise, f"{ratio:.3f}x the best peer ({best})"


def _transformers_target(row: Row):
    # transformers has no column: its figure is in the row's extra (benchmarks/llm.py)
    if "transformers" not in row.extra:
        return None, "transformers not measured"
    ratio = row.values["lamina"] / row.extra["transformers"]
    return ratio < 1.0, f"{ratio:.3f}x transformers"


def _jax_loop_target(row: Row):
    ratio = row.values["lamina"] / row.values["jax"]
    return ratio <= 1.05, f"{ratio:.3f}x the hand-written JAX loop"


def _scale_target(row: Row):
    seconds = row.values["lamina"]
    return seconds < 2.0, f"{seconds:.2f} s"


TARGETS = [
    ("apply_eager", "eager apply <= 1.1x the same kernels called by hand", _eager_target),
    ("apply_jit", "jitted apply <= 1.02x raw JAX", _jit_target),
    ("step_overhead", "jitted step <= 1.0x the best peer (within 5% noise)", _best_peer_target),
    ("train_", "training step <= 1.0x the best peer (within 5% noise)", _best_peer_target),
    ("mnist_epoch", "epoch <= 1.0x Linen (within 5% noise)", _best_peer_target),
    ("llm_", "generation faster than transformers (PyTorch, its KV cache)", _transformers_target),
    ("llm_", "generation <= 1.05x the hand-written JAX loop", _jax_loop_target),
    ("scale_setup_10000", "transform + first init of 10,000 modules < 2 s", _scale_target),
]
# Compile time flat in depth: (row id prefix, description, the deepest row's limit as a multiple
# of the shallowest's), checked on lamina's column of the rows of one prefix (extra["depth"])
DEPTH_TARGETS = [
    ("compile_llm_", "LLM compile time flat in depth (deepest <= 1.5x shallowest)", 1.5),
]


def machine() -> dict:
    """Where and when the figures were taken."""
    cpu = platform.processor()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {"python": platform.python_version(), "jax": jax.__version__}
    for name, module in (
        ("jaxlib", "jaxlib"),
        ("flax", "flax"),
        ("haiku", "haiku"),
        ("equinox", "equinox"),
        ("optax", "optax"),
        ("lamina", "lamina"),
    ):
        try:
            versions[name] = getattr(importlib.import_module(module), "__version__", "?")
        except ImportError:
            versions[name] = None
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "versions": versions,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_average_start": os.getloadavg(),
    }


def _cell(row: Row, column: str, marks: dict[str, int]) -> str:
    if column in row.ratios():
        text = f"{row.ratios()[column]:.2f}"
    else:
        text = "-"
    note = row.notes.get(column)
    return text + (f" [{marks[note]}]" if note else "")


def _spread(row: Row) -> str:
    """The widest (p90 - p10) / median among the row's contestants, in percent."""
    widths = [
        (high - low) / row.values[c] for c, (low, high) in row.spread.items() if row.values.get(c)
    ]
    return f"{100 * max(widths):.0f}%" if widths else ""


def table(rows: list[Row]) -> tuple[str, dict[str, int]]:
    """The table as Markdown (readable as plain text too), and the footnotes' numbers."""
    marks: dict[str, int] = {}
    for row in rows:
        for note in row.notes.values():
            marks.setdefault(note, len(marks) + 1)
    header = ["row", "raw JAX", *(TITLES[c] for c in PEERS), "spread"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * 7) + "|"]
    for row in rows:
        if row.base not in row.values:
            base = "-"
        elif row.base == "jax":
            base = f"{row.values['jax']:.4g} {row.unit}"
        else:
            base = f"- (ratios to {TITLES[row.base]}: {row.values[row.base]:.4g} {row.unit})"
        if "jax" in row.notes:
            base += f" [{marks[row.notes['jax']]}]"
        cells = [row.label, base, *(_cell(row, c, marks) for c in PEERS), _spread(row)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"[{number}] {note}  " for note, number in marks.items()]
    return "\n".join(lines), marks


def targets(rows: list[Row]) -> list[dict]:
    """Each of the issue's targets, met or not, with the figure."""
    found = []
    for prefix, what, check in TARGETS:
        for row in rows:
            if row.id.startswith(prefix) and "lamina" in row.values:
                met, figure = check(row)
                found.append({"row": row.id, "target": what, "met": met, "figure": figure})
    for prefix, what, limit in DEPTH_TARGETS:
        chosen = sorted(
            (r for r in rows if r.id.startswith(prefix) and "lamina" in r.values),
            key=lambda r: r.extra["depth"],
        )
        if len(chosen) < 2:
            continue
        shallow, deep = chosen[0], chosen[-1]
        ratio = deep.values["lamina"] / shallow.values["lamina"]
        figure = (
            f"{ratio:.3g}x: {deep.values['lamina']:.3g} s at {deep.extra['depth']} layers, "
            f"{shallow.values['lamina']:.3g} s at {shallow.extra['depth']}"
        )
        found.append({"row": deep.id, "target": what, "met": ratio <= limit, "figure": figure})
    return found


def plot(rows: list[Row], folder: pathlib.Path) -> list[pathlib.Path]:
    """ratios.png (every row, a bar per contestant), depth.png and scale.png."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt
    import numpy as np

    paths = []
    ratio_rows = [r for r in rows if not r.id.startswith(("compile_", "scale_"))]
    if ratio_rows:
        figure, ax = plt.subplots(figsize=(10, 0.6 * len(ratio_rows) + 1.5))
        height = 0.8 / len(PEERS)
        for i, column in enumerate(PEERS):
            ys = np.arange(len(ratio_rows)) + i * height
            xs = [r.ratios().get(column, np.nan) for r in ratio_rows]
            ax.barh(ys, xs, height, label=TITLES[column])
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_yticks(np.arange(len(ratio_rows)) + 0.4 - height / 2)
        ax.set_yticklabels([r.label.rsplit(",", 1)[0] for r in ratio_rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("time / raw JAX's (log scale; rows without raw JAX: / Linen's)")
        ax.legend(fontsize=8)
        figure.tight_layout()
        paths.append(folder / "ratios.png")
        figure.savefig(paths[-1], dpi=100)
        plt.close(figure)
    for prefix, name, xkey, xlabel in (
        ("compile_", "depth.png", "depth", "blocks"),
        ("scale_setup_", "scale.png", "n", "modules"),
    ):
        chosen = [r for r in rows if r.id.startswith(prefix)]
        if not chosen:
            continue
        kinds = sorted({r.extra.get("kind", "") for r in chosen})
        figure, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4), squeeze=False)
        for ax, kind in zip(axes[0], kinds, strict=True):
            mine = [r for r in chosen if r.extra.get("kind", "") == kind]
            for column in COLUMNS:
                points = [(r.extra[xkey], r.values[column]) for r in mine if column in r.values]
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, marker="o", label=TITLES[column])
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("seconds")
            ax.set_title(mine[0].label.split(",")[0] + (f" ({kind})" if kind else ""))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        figure.tight_layout()
        paths.append(folder / name)
        figure.savefig(paths[-1], dpi=100)
        plt.close(figure)
    return paths


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="about five minutes on 2 cores")
    group.add_argument(
        "--smoke", action="store_true", help="tiny sizes, a few calls: checks that it runs"
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="where results.json and the plots go (default: runs/benchmarks-<date>-<time>)",
    )
    parser.add_argument(
        "--only",
        metavar="PART",
        nargs="+",
        action="extend",
        choices=PARTS,
        help=f"run only these parts (default: all of {', '.join(PARTS)})",
    )
    args = parser.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    folder = pathlib.Path(args.out or f"runs/benchmarks-{stamp}")
    folder.mkdir(parents=True, exist_ok=True)

    info = machine()
    print(
        f"{mode} run; jax {jax.__version__} on {info['backend']} ({info['cpu']}, "
        f"{info['cpu_count']} CPUs); load average {info['load_average_start']}"
    )
    rows: list[Row] = []
    seconds = {}
    for part in args.only or PARTS:
        start = time.perf_counter()
        print(f"{part} ...", flush=True)
        sys.path.insert(0, str(HERE))  # before examples/ (which has a char_transformer.py)
        rows += importlib.import_module(part).collect(mode)
        seconds[part] = time.perf_counter() - start
        print(f"{part}: {seconds[part]:.0f} s", flush=True)
    info["load_average_end"] = os.getloadavg()
    with open(folder / "rows.json", "w") as f:  # the raw figures first, whatever follows
        json.dump([row.as_dict() for row in rows], f, indent=2)

    text, _ = table(rows)
    print(f"\nratios to raw JAX (lower is faster); {mode} run; spread: widest (p90 - p10)/median")
    print(text)
    met = targets(rows)
    if met:
        print("targets:")
        for target in met:
            state = "met" if target["met"] else "NOT met" if target["met"] is False else "n/a"
            print(f"  {state:7s} {target['target']}: {target['figure']} ({target['row']})")
    print(f"load average at the end: {info['load_average_end']}")
    results = {
        "mode": mode,
        "machine": info,
        "part_seconds": seconds,
        "columns": list(COLUMNS),
        "rows": [row.as_dict() for row in rows],
        "targets": met,
        "table": text,
    }
    with open(folder / "results.json", "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    paths = plot(rows, folder)
    print(f"saved {folder / 'results.json'} and {', '.join(p.name for p in paths)}")
    return results


if __name__ == "__main__":
    main()
