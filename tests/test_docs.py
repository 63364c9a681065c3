"""Every ```python block of README.md and docs/*.md runs, as a reader would run it.

The blocks of one file run in order in one namespace (a later block may use an earlier one's
names), in a fresh Python process with JAX's default configuration (a reader's, not this
suite's strict one; only XLA's backend optimisations are off, to compile faster), in an
empty temporary folder. A block that is deliberately not runnable
says so on the line before it, and why:

    <!-- not-run: the reason -->
    ```python
    ...
    ```

There should be almost none: `test_few_blocks_are_not_run` counts them.
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
from typing import NamedTuple

import pytest

ROOT = pathlib.Path(__file__).parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_NOT_RUN = 2  # in all the files together
TIMEOUT_SECONDS = 300  # per file

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
NOT_RUN = re.compile(r"^\s*<!--\s*not-run:(?P<reason>.*?)-->\s*$")

# Runs the blocks sent on stdin; a failing block's traceback names the file and its line.
RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for path, line, source in json.load(sys.stdin):
    exec(compile("\\n" * (line - 1) + source, path, "exec"), namespace)
"""


class Block(NamedTuple):
    line: int  # of the block's first line of code, 1-based
    source: str
    not_run: str | None  # the reason, for a block marked <!-- not-run: ... -->


def code_blocks(text: str) -> list[Block]:
    """The ```python blocks of a Markdown text, in order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info, start = match["fence"], match["info"].lower(), i + 1
        end = start
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if info in ("python", "py"):
            previous = next((line for line in reversed(lines[:i]) if line.strip()), "")
            marker = NOT_RUN.match(previous)
            source = textwrap.dedent("\n".join(lines[start:end])) + "\n"
            blocks.append(Block(start + 1, source, marker["reason"].strip() if marker else None))
        i = end + 1
    return blocks


def run_blocks(path: pathlib.Path, blocks: list[Block], cwd: pathlib.Path):
    name = str(path.relative_to(ROOT))
    payload = json.dumps([(name, b.line, b.source) for b in blocks if b.not_run is None])
    # XLA's backend optimisations off (as pytest.mark.fast_compile, tests/conftest.py): LLVM's
    # passes are most of a compile, and the blocks compile many small programs; the blocks
    # run the same operations (the float rounding may differ in the last bits).
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)}
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    return subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=payload,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=TIMEOUT_SECONDS,
    )


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run(path, tmp_path):
    blocks = code_blocks(path.read_text())
    if not any(b.not_run is None for b in blocks):
        return  # nothing to run (architecture.md, for one, has only diagrams)
    result = run_blocks(path, blocks, tmp_path)
    assert result.returncode == 0, (
        f"a ```python block of {path.relative_to(ROOT)} failed (the traceback's line numbers "
        f"are the file's):\n{result.stderr[-6000:]}"
    )


def test_few_blocks_are_not_run():
    not_run = {
        f"{path.relative_to(ROOT)}:{block.line}": block.not_run
        for path in DOC_FILES
        for block in code_blocks(path.read_text())
        if block.not_run is not None
    }
    assert all(not_run.values()), f"a not-run marker without a reason: {not_run}"
    assert len(not_run) <= MAX_NOT_RUN, f"too many blocks that do not run: {not_run}"


def test_the_readme_has_blocks_to_run():
    # a guard against a parser that finds nothing (the tests above would pass vacuously)
    blocks = code_blocks((ROOT / "README.md").read_text())
    assert len([b for b in blocks if b.not_run is None]) >= 2


def test_code_blocks_parser():
    text = textwrap.dedent(
        """\
        # Title

        ```bash
        echo not python
        ```

        ```python
        x = 1
        ```

        <!-- not-run: needs a GPU -->

        ```python
        raise SystemExit
        ```

        - a list item:

          ```python
          y = x + 1
          ```
        """
    )
    blocks = code_blocks(text)
    assert blocks == [
        Block(8, "x = 1\n", None),
        Block(14, "raise SystemExit\n", "needs a GPU"),
        Block(20, "y = x + 1\n", None),
    ]


def test_a_failing_block_names_the_file_and_line(tmp_path):
    path = ROOT / "README.md"
    blocks = [Block(3, "a = 1\n", None), Block(10, "b = a\nc = undefined\n", None)]
    result = run_blocks(path, blocks, tmp_path)
    assert result.returncode != 0
    assert 'File "README.md", line 11' in result.stderr and "NameError" in result.stderr
