"""Checks the built documentation site: links, search, and every page in a headless chromium.

Usage (after ``mkdocs build --strict``, which writes ``site/``)::

    python tools/check_site.py site [--screenshot home.png]

Without a browser, over the built HTML:

- every ``href`` and ``src`` to a local file names a file that exists, and every ``#anchor``
  names an ``id`` (or ``name``) on its page;
- every page has main content, and the search index holds ``StateAxes``.

In Debian's ``chromium`` (headless, driven over the DevTools protocol on a pipe, so nothing but
the standard library is needed), with the site served on a local port:

- every page renders: its main content is non-empty, it is not mkdocs' 404 page, and it throws
  no JavaScript exception;
- the search box, given ``?q=StateAxes``, lists a result for it;
- a screenshot of the home page is not blank (many distinct colours).

Where no chromium is installed the browser checks are skipped, and the script says so on its
last line (``SKIPPED``); any failure is listed, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import functools
import html.parser
import http.server
import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

SEARCH_TERM = "StateAxes"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",  # chromium refuses to run as root without it (CI runs as root)
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--remote-debugging-pipe",
]
PAGE_TIMEOUT_S = 15.0
EXTERNAL_SCHEMES = ("http", "https", "mailto", "data", "javascript", "tel")


class _Page(html.parser.HTMLParser):
    """The ids and the local links of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.article_text: list[str] = []
        self._article_depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        for key in ("id", "name"):
            if values.get(key) and (key == "id" or tag == "a"):
                self.ids.add(str(values[key]))
        for key in ("href", "src"):
            if values.get(key) is not None and tag in ("a", "link", "img", "script", "source"):
                self.links.append(str(values[key]))
        if tag == "article" or self._article_depth:
            self._article_depth += tag not in _VOID_TAGS

    def handle_endtag(self, tag: str) -> None:
        if self._article_depth and tag not in _VOID_TAGS:
            self._article_depth -= 1

    def handle_data(self, data: str) -> None:
        if self._article_depth:
            self.article_text.append(data)


_VOID_TAGS = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source"}


@functools.cache
def _parse(path: pathlib.Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def html_pages(site: pathlib.Path) -> list[pathlib.Path]:
    """The site's pages (every ``.html`` file but mkdocs' ``404.html``)."""
    return sorted(p for p in site.rglob("*.html") if p.name != "404.html")


def check_links(site: pathlib.Path) -> list[str]:
    """Every broken local link of the site, as ``'page: href (why)'``."""
    problems = []
    for page in sorted(site.rglob("*.html")):
        for link in _parse(page).links:
            parts = urllib.parse.urlsplit(link)
            if parts.scheme in EXTERNAL_SCHEMES or link.startswith("//") or not link:
                continue
            if parts.path.startswith("/"):  # 404.html's links: from the site's root
                target = (site / urllib.parse.unquote(parts.path).lstrip("/")).resolve()
            elif parts.path:
                target = (page.parent / urllib.parse.unquote(parts.path)).resolve()
                if target.is_dir():
                    target = target / "index.html"
            else:
                target = page
            name = f"{page.relative_to(site)}: {link}"
            if not target.is_relative_to(site.resolve()):
                problems.append(f"{name} (outside the site)")
            elif not target.is_file():
                problems.append(f"{name} (no file {target.relative_to(site.resolve())})")
            elif parts.fragment and target.suffix == ".html":
                anchor = urllib.parse.unquote(parts.fragment)
                if anchor not in _parse(target).ids:
                    problems.append(f"{name} (no id {anchor!r} in {target.name})")
    return problems


def check_pages(site: pathlib.Path) -> list[str]:
    """Each page without main content, and a search index without ``StateAxes``."""
    problems = []
    pages = html_pages(site)
    if not pages:
        problems.append(f"{site}: no HTML pages (was `mkdocs build` run?)")
    for page in pages:
        text = " ".join("".join(_parse(page).article_text).split())
        if len(text) < 40:
            problems.append(f"{page.relative_to(site)}: no main content ({text!r})")
    index = site / "search" / "search_index.json"
    if not index.is_file():
        problems.append(f"{index.relative_to(site)}: missing (the search plugin is off?)")
    else:
        docs = json.loads(index.read_text(encoding="utf-8"))["docs"]
        if not any(SEARCH_TERM in d["title"] + d["text"] for d in docs):
            problems.append(f"{index.relative_to(site)}: no entry mentions {SEARCH_TERM}")
    return problems


def find_chromium() -> str | None:
    """The chromium to use: ``$CHROMIUM``, else Debian's ``chromium`` on the PATH."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    return None


@contextlib.contextmanager
def serve(site: pathlib.Path) -> Iterator[str]:
    """Serves `site` on a free local port; yields its base URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = _JoiningServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _JoiningServer(http.server.ThreadingHTTPServer):
    """A local server whose closing waits for every request's thread.

    So no connection's socket outlives the server unclosed (a ResourceWarning raised in
    whatever code the garbage collector runs next: a flaky failure in the test suite).
    """

    daemon_threads = False
    block_on_close = True


class Browser:
    """A headless chromium driven over the DevTools protocol on a pipe (fds 3 and 4).

    Putting the pipe on fds 3 and 4 takes a ``preexec_fn``, so the child is forked: run this
    in a process without threads of its own (JAX's warn on fork), as the CLI and the test do.
    """

    def __init__(self, executable: str, profile: str) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def child_fds() -> None:  # chromium reads commands on fd 3 and writes on fd 4
            read, write = (
                fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser_r, from_browser_w)
            )
            os.dup2(read, 3, inheritable=True)
            os.dup2(write, 4, inheritable=True)

        self._process = subprocess.Popen(
            [executable, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=child_fds,
            pass_fds=(3, 4, to_browser_r, from_browser_w),
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.exceptions: list[str] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        self.call("Page.enable", session=True)
        self.call("Runtime.enable", session=True)

    def call(self, method: str, session: bool = False, **params: Any) -> dict[str, Any]:
        """Sends one command and returns its result (events on the way are recorded)."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + PAGE_TIMEOUT_S
        while True:
            reply = self._read(deadline, method)
            if reply.get("method") == "Runtime.exceptionThrown":
                details = reply["params"]["exceptionDetails"]
                description = details.get("exception", {}).get("description", details["text"])
                self.exceptions.append(description.splitlines()[0])
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"chromium: {method} failed: {reply['error']}")
                return dict(reply["result"])

    def _read(self, deadline: float, method: str) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline or self._process.poll() is not None:
                raise RuntimeError(f"chromium did not answer {method} (exited or timed out)")
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError(f"chromium closed its pipe during {method}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return dict(json.loads(message))

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page."""
        result = self.call("Runtime.evaluate", session=True, expression=expression)
        return result["result"].get("value")

    def open(self, url: str) -> None:
        """Navigates to `url` and waits for the document to load."""
        self.call("Page.navigate", session=True, url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def wait_for(self, expression: str, timeout: float = PAGE_TIMEOUT_S) -> bool:
        """Polls a JavaScript expression until it is true; False after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.evaluate(expression):
                return True
            time.sleep(0.05)
        return False

    def screenshot(self, width: int, height: int) -> bytes:
        """A PNG of the page at `width` x `height` CSS pixels."""
        self.call(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        return base64.b64decode(data)

    def close(self) -> None:
        """Ends the browser (the process this object started)."""
        with contextlib.suppress(Exception):
            self.call("Browser.close")
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)


MAIN_TEXT = "(document.querySelector('article.md-content__inner') || {innerText: ''}).innerText"


def check_in_browser(site: pathlib.Path, executable: str, screenshot: pathlib.Path) -> list[str]:
    """Renders every page, searches for ``StateAxes`` and screenshots the home page."""
    problems = []
    with tempfile.TemporaryDirectory() as profile, serve(site) as base:
        browser = Browser(executable, profile)
        try:
            for page in html_pages(site):
                name = str(page.relative_to(site))
                browser.exceptions.clear()
                browser.open(base + urllib.parse.quote(name))
                text = str(browser.evaluate(MAIN_TEXT) or "")
                title = str(browser.evaluate("document.title"))
                if len(text.strip()) < 40:
                    problems.append(f"{name}: renders no main content ({text.strip()!r})")
                if "404" in title or "Page not found" in text[:200]:
                    problems.append(f"{name}: renders mkdocs' 404 page ({title!r})")
                if browser.exceptions:
                    problems.append(f"{name}: JavaScript exceptions {browser.exceptions}")
            browser.open(f"{base}index.html?q={SEARCH_TERM}")
            items = "document.querySelectorAll('.md-search-result__item')"
            if not browser.wait_for(f"{items}.length > 0"):
                meta = browser.evaluate(
                    "(document.querySelector('.md-search-result__meta') || {}).innerText"
                )
                problems.append(f"search for {SEARCH_TERM}: no results ({meta!r})")
            else:
                found = browser.evaluate(f"Array.from({items}).map(e => e.innerText).join(' ')")
                if SEARCH_TERM not in str(found):
                    problems.append(f"search for {SEARCH_TERM}: results do not mention it")
            browser.open(f"{base}index.html")
            screenshot.write_bytes(browser.screenshot(1280, 900))
        finally:
            browser.close()
    problems.extend(check_screenshot(screenshot))
    return problems


def check_screenshot(path: pathlib.Path) -> list[str]:
    """A blank or near-blank PNG (few colours, or one colour almost everywhere)."""
    from PIL import Image  # matplotlib's dependency: in the examples' extras

    with Image.open(io.BytesIO(path.read_bytes())) as image:
        pixels = image.convert("RGB")
        colors = pixels.getcolors(maxcolors=1 << 24) or []
        total = pixels.width * pixels.height
    most = max((count for count, _ in colors), default=total)
    if len(colors) < 64 or most > 0.97 * total:
        return [f"{path}: looks blank ({len(colors)} colours, {most / total:.0%} one colour)"]
    return []


def main(argv: list[str] | None = None) -> int:
    """Runs every check; prints each problem, then one summary line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=pathlib.Path, help="the built site (mkdocs' site/)")
    parser.add_argument(
        "--screenshot",
        type=pathlib.Path,
        default=None,
        help="where to save the home page's screenshot (default: SITE/../site-home.png)",
    )
    args = parser.parse_args(argv)
    site = args.site.resolve()
    started = time.monotonic()
    problems = check_links(site) + check_pages(site)
    executable = find_chromium()
    skipped = None
    if executable is None:
        skipped = "no chromium found (Debian: apt-get install chromium; or set $CHROMIUM)"
    else:
        screenshot = args.screenshot or site.parent / "site-home.png"
        problems += check_in_browser(site, executable, screenshot.resolve())
    for problem in problems:
        print(f"check_site: {problem}")
    pages = len(html_pages(site))
    seconds = time.monotonic() - started
    if problems:
        print(f"check_site: FAILED, {len(problems)} problem(s) in {pages} pages ({seconds:.1f} s)")
        return 1
    if skipped:
        print(f"check_site: links and search index OK in {pages} pages; ", end="")
        print(f"browser checks SKIPPED: {skipped}")
    else:
        print(f"check_site: OK, {pages} pages render in chromium, search finds ", end="")
        print(f"{SEARCH_TERM} ({seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
