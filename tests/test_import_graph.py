"""The import graph of the repo's packages: imports run downward and nothing imports in a circle.

Every module under the packages below is parsed (ast), with the imports inside functions and methods too: an
import that only runs when a function is called is still a dependency, and a cycle held apart by a function-level
import is still a cycle. `from a.b import c` is an edge to the module a.b.c when it is one, else to a.b (the
package's __init__); `import a.b` to a.b. Imports of anything outside these packages are ignored.

Layers (docs/ARCHITECTURE.md): pallas_kernels < dsv41_jax < checkpoints < serving < bench; training/ sits beside bench
(it may import dsv41_jax, checkpoints and pallas_kernels; only bench and the tests import it); tools/ may use the
library and bench's result writer; nothing imports tools/ or tests/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("pallas_kernels", "dsv41_jax", "checkpoints", "serving")  # in layer order
PACKAGES = (*LIBRARY, "training", "bench", "tools")
FIRST_PARTY = {*PACKAGES, "tests"}
MAY_IMPORT = {pkg: set(LIBRARY[:i + 1]) for i, pkg in enumerate(LIBRARY)} | {
    "training": {"pallas_kernels", "dsv41_jax", "checkpoints", "training"},
    "bench": {*LIBRARY, "training", "bench"},
    "tools": {*LIBRARY, "bench", "tools"},
}


def module_files() -> dict[str, Path]:
    """module name -> file, for every .py file of the packages."""
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = p.relative_to(ROOT).with_suffix("").parts
            if any(part.startswith(".") or part == "__pycache__" for part in parts):
                continue
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports_of(name: str, path: Path, modules, source: str | None = None) -> list[tuple[str, int]]:
    """(imported first-party module, line) of every import statement in the file, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                hit = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules),
                           alias.name)
                out.append((hit, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in modules else base, node.lineno))
    return [(m, line) for m, line in out if m.split(".")[0] in FIRST_PARTY]


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, int]]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_the_graph_is_the_whole_repo(graph):
    assert {m.split(".")[0] for m in graph} >= {*LIBRARY, "bench", "tools"}
    assert any(dst == "dsv41_jax.config" for dst, _ in graph["serving.engine.engine"])
    # function-level imports are edges too (serving.run imports the engine inside build())
    assert any(dst == "serving.engine.engine" for dst, _ in graph["serving.run"])
    # relative imports resolve (tools/official_parity/official imports its siblings by plain name: not ours)
    assert imports_of("x.y", ROOT / "x" / "y.py", {"serving.engine.config"}, "from ..serving.engine import config") \
        == [("serving.engine.config", 1)]


def test_imports_run_downward(graph):
    bad = [f"{src} (line {line}) imports {dst}" for src, edges in graph.items() for dst, line in edges
           if dst.split(".")[0] not in MAY_IMPORT[src.split(".")[0]]]
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def _cycles(graph) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w, _ in graph.get(v, ()):
            if w not in graph:
                continue
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
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def test_no_import_cycles(graph):
    cycles = _cycles(graph)
    lines = []
    for comp in cycles:
        members = set(comp)
        edges = sorted({f"  {src}:{line} -> {dst}" for src in comp for dst, line in graph[src] if dst in members})
        lines.append(" <-> ".join(comp) + "\n" + "\n".join(edges))
    assert not cycles, "import cycles:\n" + "\n".join(lines)


def test_the_cycle_finder_finds_a_function_level_cycle():
    fake = {"a": [("b", 1)], "b": [("c", 2)], "c": [("a", 3)], "d": [("a", 4)]}
    assert _cycles(fake) == [["a", "b", "c"]]
    assert _cycles({"a": [("b", 1)], "b": []}) == []
