"""The documentation site: it builds with `mkdocs build --strict`, and its checks pass.

The build (about 5 s) is shared by the tests of this file. `tools/check_site.py` does the
checks: links and search index over the HTML, then every page, the search box and a screenshot
in Debian's headless chromium. Where no chromium is installed, the browser test is skipped and
says why; everything else still runs.
"""

import importlib.util
import inspect
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import yaml

import lamina
from tests.test_docs import DOC_FILES, code_blocks

ROOT = pathlib.Path(__file__).parents[1]
DOCS = ROOT / "docs"
DIRECTIVE = re.compile(r"^:::\s*(?P<name>[\w.]+)\s*$", re.MULTILINE)

_spec = importlib.util.spec_from_file_location("check_site", ROOT / "tools" / "check_site.py")
assert _spec is not None and _spec.loader is not None
check_site = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_site)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site") / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-6000:]}"
    return out


def nav_files(entries) -> list[str]:
    files = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        files += nav_files(value) if isinstance(value, list) else [value]
    return files


def test_the_nav_lists_every_page_once():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = nav_files(config["nav"])
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert sorted(listed) == pages, "mkdocs.yml's nav and docs/*.md differ"
    # every page's code blocks run in tests/test_docs.py (it reads docs/*.md, not subfolders)
    assert not list(DOCS.glob("*/**/*.md")), "pages in subfolders are not run by test_docs.py"
    assert {DOCS / name for name in listed} <= set(DOC_FILES)


def test_every_public_name_is_on_a_page():
    directives = {m["name"] for p in DOCS.glob("*.md") for m in DIRECTIVE.finditer(p.read_text())}
    documented_modules = {name for name in directives if inspect.ismodule(eval_name(name))}
    api = (DOCS / "api.md").read_text()
    missing = []
    for name in dir(lamina):
        obj = getattr(lamina, name)
        if name.startswith("_") or inspect.ismodule(obj):
            continue
        if not str(getattr(obj, "__module__", "")).startswith("lamina"):
            if f"`{name}`" not in api:  # jax.nn's activations: listed on the API page
                missing.append(name)
            continue
        if f"lamina.{name}" not in directives:
            missing.append(name)
    for module_name in ("initializers", "data"):
        module = getattr(lamina, module_name)
        if f"lamina.{module_name}" not in documented_modules:
            missing += [f"{module_name}.{n}" for n in getattr(module, "__all__", dir(module))]
    assert not missing, f"public names on no page of docs/ (add a `::: lamina.X` line): {missing}"


def eval_name(dotted: str):
    obj = lamina
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def test_directives_are_not_code():
    # mkdocstrings' `::: lamina.X` lines stay out of fenced blocks, so test_docs.py never runs them
    for path in DOCS.glob("*.md"):
        for block in code_blocks(path.read_text()):
            assert ":::" not in block.source, f"{path.name}:{block.line}"


def test_the_site_builds_and_its_links_resolve(site):
    assert check_site.check_links(site) == []
    assert check_site.check_pages(site) == []
    pages = {p.name for p in check_site.html_pages(site)}
    assert {"index.html", "api.html", "coming-from.html", "performance.html"} <= pages
    api = (site / "api.html").read_text()
    assert 'id="lamina.StateAxes"' in api and 'id="lamina.transform"' in api
    # the docstrings' doctests render as Python code, not as Markdown text
    assert api.count('<span class="gp">&gt;&gt;&gt; </span>') > 100


def test_the_site_in_chromium(site, tmp_path):
    executable = check_site.find_chromium()
    if executable is None:
        pytest.skip("no chromium: install Debian's (apt-get install chromium) to check the site")
    screenshot = tmp_path / "home.png"
    # In a process of its own: starting chromium on its DevTools pipe needs a fork with
    # preexec_fn, which in this JAX-initialised process triggers JAX's fork warning.
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "check_site.py"),
            str(site),
            "--screenshot",
            str(screenshot),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pages render in chromium, search finds StateAxes" in done.stdout
    assert screenshot.stat().st_size > 10_000


def test_the_link_checker_finds_broken_links(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "index.html").write_text(
        '<h1 id="top">x</h1><a href="sub/page.html#there">ok</a><a href="#top">ok</a>'
        '<a href="https://example.com/missing">external</a><a href="missing.html">broken</a>'
        '<img src="sub/nothing.png"><a href="sub/page.html#nowhere">bad anchor</a>'
    )
    (tmp_path / "sub" / "page.html").write_text(
        '<p id="there">x</p><a href="../index.html">up</a><a href="/index.html#top">root</a>'
        '<a href="../../outside.html">out</a>'
    )
    problems = check_site.check_links(tmp_path)
    assert problems == [
        "index.html: missing.html (no file missing.html)",
        "index.html: sub/nothing.png (no file sub/nothing.png)",
        "index.html: sub/page.html#nowhere (no id 'nowhere' in page.html)",
        "sub/page.html: ../../outside.html (outside the site)",
    ]


def test_pages_without_content_or_search_entry_are_reported(tmp_path):
    (tmp_path / "index.html").write_text("<article>   </article>")
    problems = check_site.check_pages(tmp_path)
    assert problems[0].startswith("index.html: no main content")
    assert "search_index.json: missing" in problems[1]


def test_a_blank_screenshot_is_reported(tmp_path):
    from PIL import Image

    blank = tmp_path / "blank.png"
    Image.new("RGB", (320, 200), "white").save(blank)
    assert "looks blank" in check_site.check_screenshot(blank)[0]
    noisy = tmp_path / "noisy.png"
    pixels = np.random.default_rng(0).integers(0, 256, (200, 320, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(noisy)
    assert check_site.check_screenshot(noisy) == []


def test_the_script_says_when_it_skips_the_browser(site, monkeypatch, capsys):
    monkeypatch.setattr(check_site, "find_chromium", lambda: None)
    assert check_site.main([str(site)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "browser checks SKIPPED: no chromium found" in last
