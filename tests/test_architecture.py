"""The package's layout is its architecture: which folder may import which, no cycles.

The rules are the table "What each folder may import" in docs/architecture.md; this file reads
them from there, so the design note and the code cannot drift apart. Every import counts,
including those inside functions; only imports under ``if TYPE_CHECKING:`` are left out (they
never run).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lamina"
DESIGN = ROOT / "docs" / "architecture.md"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    return skipped


def _private_attributes(path: pathlib.Path) -> list[tuple[str, str, int]]:
    """(module, private name, line) for each ``module._name`` read of an imported lamina file."""
    imported = {}
    for target, name, _ in _imports(path):
        if not name:  # `from . import x` or `import lamina.x as y`: a module bound to a name
            imported[target.rsplit(".", 1)[-1]] = target
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lamina") and alias.asname:
                    imported[alias.asname] = alias.name
    return [
        (imported[node.value.id], node.attr, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in imported
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    ]


def _imports(path: pathlib.Path) -> list[tuple[str, str, int]]:
    """(imported lamina module, imported name or "", line) for each import that runs."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skipped = _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "lamina" or target.startswith("lamina."):
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    as_module = ROOT / full.replace(".", "/")
                    if as_module.with_suffix(".py").exists() or as_module.is_dir():
                        found.append((full, "", node.lineno))
                    else:
                        found.append((target, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.startswith("lamina")]
    return found


FILES = sorted(PACKAGE.rglob("*.py"))
GRAPH = {_module_name(path): _imports(path) for path in FILES}
PRIVATE_READS = {_module_name(path): _private_attributes(path) for path in FILES}


def _folder(module: str) -> str:
    """The room a module belongs to: `lamina.nn.conv` -> "nn", `lamina.utils` -> "utils"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "lamina"


def _rules() -> dict[str, set[str]]:
    """The table of docs/architecture.md: folder -> the folders it may import."""
    text = DESIGN.read_text()
    section = text.split("## What each folder may import", 1)[1].split("\n## ", 1)[0]
    rules = {}
    for row in re.findall(r"^\| *`lamina/([\w.]+?)/?` *\|(.*)\|", section, flags=re.M):
        folder = row[0].removesuffix(".py")
        allowed = {
            a.removesuffix("/").removesuffix(".py") for a in re.findall(r"`([\w./]+)`", row[1])
        }
        rules[folder] = allowed
    return rules


RULES = _rules()


def test_the_design_note_names_every_folder():
    folders = {_folder(m) for m in GRAPH} - {"lamina"}
    assert folders <= set(RULES), f"add to docs/architecture.md's table: {folders - set(RULES)}"
    assert set(RULES) <= folders, f"folders gone, still in the table: {set(RULES) - folders}"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_follow_the_layers(module):
    folder = _folder(module)
    if folder == "lamina":
        return  # the public surface imports everything
    allowed = RULES[folder] | {folder}
    wrong = sorted(
        {
            f"line {line}: {target}"
            for target, _, line in GRAPH[module]
            if _folder(target) not in allowed
        }
    )
    assert not wrong, f"{module} ({folder}/) may import only {sorted(allowed)}: {wrong}"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_private_name_crosses_files(module):
    crossing = [
        f"line {line}: {name} from {target}"
        for target, name, line in GRAPH[module] + PRIVATE_READS[module]
        if name.startswith("_") and not name.startswith("__") and target != module
    ]
    assert not crossing, f"{module} uses private names of other files: {crossing}"


def _core_order() -> list[str]:
    """The core's files bottom to top, as the numbered list of `_core/__init__.py` gives them."""
    doc = (PACKAGE / "_core" / "__init__.py").read_text()
    return re.findall(r"^\d+\. (\w+):", doc, flags=re.M)


def test_the_core_order_names_every_core_file():
    files = {p.stem for p in (PACKAGE / "_core").glob("*.py")} - {"__init__"}
    assert sorted(_core_order()) == sorted(files)


@pytest.mark.parametrize("name", _core_order())
def test_core_files_import_only_earlier_ones(name):
    order = _core_order()
    later = set(order[order.index(name) :])
    wrong = sorted(
        {
            f"line {line}: {target}"
            for target, _, line in GRAPH[f"lamina._core.{name}"]
            if target.startswith("lamina._core.") and target.split(".")[2] in later
        }
    )
    assert not wrong, f"_core/{name}.py imports a file at or above it in _core/__init__.py: {wrong}"


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    edges = {m: {t for t, _, _ in GRAPH[m] if t in GRAPH and t != m} for m in GRAPH}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    # A package's __init__ re-exports its files, and its files import each other through the
    # file, never the package: an edge to the package itself would be a cycle too.
    assert _cycles() == []


def test_the_checker_sees_a_cycle_and_a_wrong_layer(tmp_path, monkeypatch):
    # The rules can fail: a core file importing a layer, and two files importing each other.
    GRAPH["lamina._core.fake_a"] = [("lamina.nn.linear", "", 1), ("lamina._core.fake_b", "", 2)]
    GRAPH["lamina._core.fake_b"] = [("lamina._core.fake_a", "", 1)]
    try:
        assert ["lamina._core.fake_a", "lamina._core.fake_b"] in _cycles()
        with pytest.raises(AssertionError, match="may import only"):
            test_imports_follow_the_layers("lamina._core.fake_a")
    finally:
        del GRAPH["lamina._core.fake_a"], GRAPH["lamina._core.fake_b"]
    # A private name read through an imported module counts as importing it.
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    (tmp_path / "lamina" / "nn").mkdir(parents=True)
    (tmp_path / "lamina" / "nn" / "_dtypes.py").write_text("")
    fake = tmp_path / "lamina" / "nn" / "fake.py"
    fake.write_text("from . import _dtypes\n\nx = _dtypes._promote\n")
    assert _private_attributes(fake) == [("lamina.nn._dtypes", "_promote", 3)]


def test_no_file_is_too_long():
    long = {
        str(p.relative_to(ROOT)): n for p in FILES if (n := len(p.read_text().splitlines())) > 700
    }
    assert not long, f"split these by concept (about 650 lines at most): {long}"
