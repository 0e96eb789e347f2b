"""The house rules of the source tree, kept by a test: modules import each other one way (no
circle, counting imports inside functions too), packages import only the layers below them
(`LAYERS`, as each package's docstring says), no module imports another's private (`_name`)
names, and no module grows past 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

from tests.conftest import ROOT

PACKAGES = ("piper", "planner", "cost_models", "search_spaces", "runtime")
MAX_LINES = 500
LAYERS = ("piper", "search_spaces", "runtime.train", "runtime.lowering", "runtime.execute",
          "runtime.cluster", "runtime", "cost_models", "planner.search", "planner.machine",
          "planner.report", "planner.commands", "planner")
"""Bottom to top: a module imports its own layer and those below it, never one above."""


def layer(module: str) -> int:
    """The index in `LAYERS` of the longest prefix of `module`."""
    return max((i for i, p in enumerate(LAYERS) if module == p or module.startswith(f"{p}.")),
               key=lambda i: len(LAYERS[i]))


def modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in (root / pkg).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports(path: Path, name: str, known: set[str]) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import in `path`, at any depth."""
    out = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [a.name for a in node.names]
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
            out.append((base, [n for n in names if f"{base}.{n}" not in known]))
            out += [(s, []) for s in subs]
    return [(m, ns) for m, ns in out if m in known]


def violations(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES
               ) -> tuple[list[list[str]], list[str], list[str], list[str]]:
    """(import circles, imports of a layer above, private imports, long modules) of the
    tree at `root`."""
    mods = modules(root, packages)
    graph = nx.DiGraph()
    upward, private, long = [], [], []
    for name, path in mods.items():
        graph.add_node(name)
        for target, names in imports(path, name, set(mods)):
            if target != name and not name.startswith(f"{target}."):
                graph.add_edge(name, target)  # a package's __init__ is its children's parent
                if layer(target) > layer(name):
                    upward.append(f"{name} imports {target}")
            private += [f"{name} imports {n} from {target}" for n in names
                        if n.startswith("_") and not n.startswith("__") and target != name]
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long.append(f"{name}: {lines} lines")
    circles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    return circles, upward, private, long


def test_no_import_circles_no_upward_or_private_imports_no_long_modules():
    circles, upward, private, long = violations()
    assert not circles, f"import circles: {circles}"
    assert not upward, upward
    assert not private, private
    assert not long, long


def test_every_package_says_what_lives_there():
    """Each package's `__init__` has a docstring (what lives there, what it may import)."""
    for name, path in modules().items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text()))
            assert doc and len(doc.splitlines()) <= 4, f"{name}: {doc!r}"


def test_the_rules_catch_what_they_forbid(tmp_path):
    """A circle, an import of a layer above, a private import and a long module in a
    throwaway tree are all found."""
    for pkg in ("piper", "planner"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "piper" / "a.py").write_text("from planner.b import _hidden\n")
    (tmp_path / "planner" / "b.py").write_text("def f():\n    import piper.a\n" +
                                                "x = 1\n" * MAX_LINES)
    circles, upward, private, long = violations(tmp_path, ("piper", "planner"))
    assert circles == [["piper.a", "planner.b"]]
    assert upward == ["piper.a imports planner.b"]
    assert private == ["piper.a imports _hidden from planner.b"]
    assert long == [f"planner.b: {MAX_LINES + 2} lines"]
