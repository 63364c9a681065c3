"""What every example shares: finding the data, and saving what a run prints.

Not an example to run: import it. Each example loads its data with `load_data` (which says
what it found, and how to get the real Fashion-MNIST when it falls back to the digits) and
ends with `save_run`, which writes ``metrics.json`` and ``curves.png`` into the run's folder
(``--out``, by default ``runs/<example>-<date>-<time>``) and prints where.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import lamina as lm

INSTALL_HINT = (
    "For the real set: `sudo apt-get install dataset-fashion-mnist` on Debian or Ubuntu (it "
    f"installs the files under {lm.data.FASHION_MNIST_DIR}), or --data-dir DIR for any folder "
    "of MNIST-format IDX files (MNIST, Fashion-MNIST, KMNIST)."
)

# --- data -------------------------------------------------------------------------------


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        metavar="DIR",
        help="a folder of MNIST-format IDX files: train-images-idx3-ubyte, ... plain or .gz "
        f"(default: Fashion-MNIST from {lm.data.FASHION_MNIST_DIR} if installed, else "
        "scikit-learn's 8x8 digits)",
    )
    parser.add_argument(
        "--digits",
        action="store_true",
        help="use scikit-learn's 8x8 digits even if Fashion-MNIST is installed",
    )


def load_data(args) -> lm.data.ImageData:
    """The data the command line asks for; prints which data that is, and where it came from."""
    if args.digits:
        data = lm.data.load_digits()
        print("data: scikit-learn's 8x8 digits (--digits)")
    elif args.data_dir:
        data = lm.data.load_idx_folder(args.data_dir)
        print(f"data: the MNIST-format folder {Path(args.data_dir).resolve()}")
    elif lm.data.FASHION_MNIST_DIR.is_dir():
        data = lm.data.load_idx_folder(lm.data.FASHION_MNIST_DIR, "Fashion-MNIST")
        print(f"data: Fashion-MNIST, from {lm.data.FASHION_MNIST_DIR}")
    else:
        data = lm.data.load_digits()
        print(
            f"data: scikit-learn's 8x8 digits (1,797 images, bundled with scikit-learn), "
            f"because Fashion-MNIST is not installed at {lm.data.FASHION_MNIST_DIR}.\n"
            f"      {INSTALL_HINT}"
        )
    return data


# --- what a run leaves behind -----------------------------------------------------------


def add_output_argument(parser: argparse.ArgumentParser, example: str) -> None:
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="the folder for metrics.json and curves.png (default: "
        f"runs/{example}-<date>-<time>, under the current folder)",
    )


def run_folder(args, example: str) -> Path:
    """`--out`, or a new ``runs/<example>-<date>-<time>`` folder; created if missing."""
    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(100):  # two runs in the same second get -1, -2, ...
        folder = Path("runs") / (f"{example}-{stamp}" + (f"-{n}" if n else ""))
        try:
            folder.mkdir(parents=True)
            return folder
        except FileExistsError:
            continue
    raise FileExistsError(f"runs/{example}-{stamp}: 100 runs in one second? Pass --out.")


def save_run(folder: Path, results: dict, args, panels: dict, xlabel: str) -> dict[str, Path]:
    """Writes ``metrics.json`` (the results and the command line) and ``curves.png``.

    Args:
        folder: Where (from `run_folder`).
        results: What the example printed, as a dict of numbers, strings, lists and dicts.
        args: The parsed command line, saved beside the results.
        panels: ``{panel title: {line label: (xs, ys)}}``, one plot per panel, side by side.
        xlabel: The x axis of every panel ("epoch", "step").

    Returns:
        ``{"metrics": path, "curves": path}``.
    """
    paths = {"metrics": folder / "metrics.json", "curves": folder / "curves.png"}
    record = {"command": [Path(sys.argv[0]).name, *sys.argv[1:]], "args": vars(args)}
    with open(paths["metrics"], "w") as f:
        json.dump({**record, **results}, f, indent=2, default=_to_json)
        f.write("\n")
    plot_curves(paths["curves"], panels, xlabel, title=results.get("data"))
    print(f"saved the metrics to {paths['metrics']} and the curves to {paths['curves']}")
    return paths


def plot_curves(path: Path, panels: dict, xlabel: str, title: str | None = None) -> None:
    """One line plot per panel, side by side, saved as a PNG (matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (name, lines) in zip(axes[0], panels.items(), strict=True):
        for label, (xs, ys) in lines.items():
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=label)
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs and steps are whole
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _to_json(value):
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")
