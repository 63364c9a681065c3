"""Renders a small model as a notebook shows it, in headless chromium: a screenshot and its text.

Usage::

    python tools/render_model.py [--out-dir docs/images]

The model (a block of LayerNorm and two Dense layers, stacked 4 times, then a Dense head) is
rendered with its variables by `lm.render_html` (compressed: the HTML a notebook cell gets).
The page is opened in Debian's headless chromium (driven over the DevTools pipe by
`tools/check_site.py`'s `Browser`), the modules treescope folds are unfolded, and one
variable (the stacked kernel ``blocks.block.up.kernel``); the screenshot is as wide as the
longest line, so that none runs off it. The script writes

- ``model-in-a-notebook.png``: a screenshot of the page,
- ``model-in-a-notebook.txt``: the text the page shows (``innerText`` of treescope's tree).

docs/seeing-models.md shows the screenshot; tests/test_display.py runs this script into a
temporary folder and compares the text with the committed one, so the picture in the docs stays
what lamina renders. It fails (exit status 1) on a JavaScript exception, an empty rendering, a
node it cannot unfold, a line wider than the widest screenshot allowed or a blank screenshot;
without chromium it says so and exits with 2.

The model is built in a child process (``--html FILE``): the parent, which forks chromium,
never imports JAX (JAX warns on a fork after its threads start). The child runs JAX on the CPU
so that the arrays' summaries and shardings read the same on every machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAME = "model-in-a-notebook"
# treescope's paths of the nodes the screenshot unfolds: the modules it folds (a folded module
# is one long line), and one variable
UNFOLD = (".blocks.block.norm", ".blocks.block.down", ".blocks.block.up.kernel")
WIDTH = (800, 2000)  # the screenshot is as wide as its longest line, within these bounds

_spec = importlib.util.spec_from_file_location("check_site", ROOT / "tools" / "check_site.py")
assert _spec is not None and _spec.loader is not None
check_site = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_site)


def model_html() -> str:
    """The model's HTML as `lm.render_html` gives it, with its variables (imports JAX)."""
    import jax

    import lamina as lm

    class Block(lm.Module):
        def __init__(self, size: int, hidden: int):
            super().__init__()
            self.norm = lm.LayerNorm(size, scale_sharding=("embed",))
            self.up = lm.Dense(size, hidden, kernel_sharding=("embed", "mlp"))
            self.down = lm.Dense(hidden, size, kernel_sharding=("mlp", "embed"))

        def __call__(self, x: jax.Array) -> jax.Array:
            return x + self.down(lm.gelu(self.up(self.norm(x))))

    class Model(lm.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = lm.Stack(Block(16, 64), 4, depth_sharding="layers")
            self.head = lm.Dense(16, 10)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.head(self.blocks(x))

    model = Model()
    variables = lm.transform(model).init(jax.random.key(0))
    return lm.render_html(model, variables, compressed=True)  # as a notebook gets it


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>a lamina model in a notebook</title>
<style>body {{ margin: 16px; background: white; }}</style></head>
<body>{body}</body></html>
"""

# treescope draws its tree in the shadow DOM of a <treescope-container>.
TREE = "document.querySelector('treescope-container')?.shadowRoot?.querySelector('.treescope_root')"
UNFOLD_JS = """(() => {
  const root = document.querySelector('treescope-container').shadowRoot;
  const button = root.querySelector('[data-copy="%s"]');
  if (!button) return -1;
  let node = button.closest('.foldable_node'), clicked = 0;
  const folded = [];
  for (; node; node = node.parentElement && node.parentElement.closest('.foldable_node')) {
    const toggle = node.querySelector(':scope > label > .foldable_node_toggle');
    if (toggle && !toggle.checked) folded.push(node.querySelector(':scope > label'));
  }
  for (const label of folded.reverse()) { label.click(); clicked++; }
  return clicked;
})()"""


def render(out_dir: pathlib.Path, executable: str) -> list[str]:
    """Writes the screenshot and the text into `out_dir`; returns the problems found."""
    problems = []
    with tempfile.TemporaryDirectory() as work:
        page = pathlib.Path(work) / "model.html"
        html_file = pathlib.Path(work) / "fragment.html"
        child = subprocess.run(
            [sys.executable, __file__, "--html", str(html_file)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            check=False,
        )
        if child.returncode != 0:
            return [f"rendering the model failed:\n{child.stderr[-3000:]}"]
        page.write_text(PAGE.format(body=html_file.read_text("utf-8")), "utf-8")
        browser = check_site.Browser(executable, str(pathlib.Path(work) / "profile"))
        try:
            browser.open(page.as_uri())
            if not browser.wait_for(f"{TREE} && {TREE}.innerText.length > 0"):
                problems.append("treescope rendered nothing (no .treescope_root in its container)")
                return problems
            for node in UNFOLD:
                clicked = browser.evaluate(UNFOLD_JS % node)
                if clicked is None or clicked < 1:
                    problems.append(f"could not unfold {node} (found: {clicked})")
            time.sleep(0.2)  # let the layout settle before the screenshot
            text = str(browser.evaluate(f"{TREE}.innerText"))
            needed = int(browser.evaluate("document.documentElement.scrollWidth") or 0) + 16
            if needed > WIDTH[1]:
                problems.append(f"the longest line needs {needed} px, over {WIDTH[1]}")
            width = min(max(needed, WIDTH[0]), WIDTH[1])
            height = int(browser.evaluate("document.documentElement.scrollHeight") or 600)
            png = browser.screenshot(width, min(max(height + 16, 300), 4000))
            overflow = browser.evaluate("document.documentElement.scrollWidth > innerWidth")
            if overflow:
                problems.append(f"a line runs off the {width} px screenshot")
            if browser.exceptions:
                problems.append(f"JavaScript exceptions: {browser.exceptions}")
        finally:
            browser.close()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{NAME}.txt").write_text(text.rstrip() + "\n", "utf-8")
    (out_dir / f"{NAME}.png").write_bytes(png)
    problems.extend(check_site.check_screenshot(out_dir / f"{NAME}.png"))
    return problems


def main(argv: list[str] | None = None) -> int:
    """Renders the model; prints each problem, then one summary line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=pathlib.Path, default=ROOT / "docs" / "images")
    parser.add_argument("--html", type=pathlib.Path, help=argparse.SUPPRESS)  # the child's job
    args = parser.parse_args(argv)
    if args.html is not None:
        args.html.write_text(model_html(), "utf-8")
        return 0
    executable = check_site.find_chromium()
    if executable is None:
        print("render_model: SKIPPED: no chromium found (apt-get install chromium, or $CHROMIUM)")
        return 2
    started = time.monotonic()
    problems = render(args.out_dir.resolve(), executable)
    for problem in problems:
        print(f"render_model: {problem}")
    if problems:
        return 1
    seconds = time.monotonic() - started
    print(f"render_model: OK, wrote {NAME}.png and {NAME}.txt in {args.out_dir} ({seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
