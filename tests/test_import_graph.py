"""The packages import one way: serving -> pallas_kernels -> dsv41 (dsv41 imports neither, pallas_kernels does not
import serving), and no module imports itself back through a cycle. Every import counts, inside functions too."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("dsv41", "pallas_kernels", "serving")
# which packages each may import (besides itself)
ALLOWED = {"dsv41": set(), "pallas_kernels": {"dsv41"}, "serving": {"dsv41", "pallas_kernels"}}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package modules `name` imports (an `from a import b` names a.b where that is a module, else a)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            if t.split(".")[0] in PACKAGES:
                while t and t not in known:  # a name inside a module -> that module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    out.add(t)
    return out


GRAPH = {n: _imports(n, p, set(_modules())) for n, p in _modules().items()}


def test_the_graph_sees_the_packages():
    assert {"dsv41.model", "pallas_kernels.mhc", "serving.engine.engine"} <= set(GRAPH)
    assert "dsv41.nn" in GRAPH["pallas_kernels.mhc"]


@pytest.mark.parametrize("pkg", PACKAGES)
def test_packages_import_one_way(pkg):
    bad = sorted(f"{m} imports {t}" for m, ts in GRAPH.items() if m.split(".")[0] == pkg for t in ts
                 if t.split(".")[0] not in ALLOWED[pkg] | {pkg})
    assert not bad, f"{pkg} may import only {sorted(ALLOWED[pkg])}: " + "; ".join(bad)


def test_no_import_cycles():
    """Tarjan's strongly connected components over the module graph: any component of 2+ modules (or a module
    importing itself) is a cycle."""
    index, low, on, stack, cycles = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"
