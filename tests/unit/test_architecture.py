"""The shape of the code base, checked: no import cycles between modules (function-level imports
count too), and no file over 600 lines or function over 80 lines outside the listed exceptions.

The layer contract itself (which package may import which) is ``[tool.importlinter]`` in
``pyproject.toml``, checked by ``lint-imports`` in ``make test``; this file covers what a layers
contract cannot see: cycles inside one layer and size.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("deltaloop", "bench", "flows", "tasks", "infra", "evals")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80

# Exceptions, each with its reason. Paths are relative to the repository root.
LONG_FILES = {
    # Shipped into each sandbox as ONE source string (``python3 -c "exec(sys.argv[1])" SOURCE``) and
    # run on the sandbox's own stdlib-only python: it cannot import sibling modules.
    "infra/sandbox/runner.py": "one source string executed inside the sandbox",
}
LONG_FUNCTIONS: dict[str, str] = {}
KERNEL_FILES = ("infra/weightsync/numba_kernels.py",)  # numba kernels: one loop nest per function, by design


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles() -> None:
    grimp = pytest.importorskip("grimp")  # installed with import-linter (the test extra)
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    cycles = _strongly_connected(edges)
    assert not cycles, "import cycles (each line one strongly connected set of modules):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_files_and_functions_are_small() -> None:
    problems = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        n = len(text.splitlines())
        if n > MAX_FILE_LINES and rel not in LONG_FILES and rel not in KERNEL_FILES:
            problems.append(f"{rel}: {n} lines")
        if rel in KERNEL_FILES:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES and f"{rel}::{node.name}" not in LONG_FUNCTIONS:
                    problems.append(f"{rel}::{node.name}: {length} lines")
    assert not problems, "over the size limits:\n" + "\n".join(problems)


def test_cycle_finder_finds_a_cycle() -> None:
    """The checker above is only as good as its cycle finder."""
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _strongly_connected({"a": {"b"}, "b": set()}) == []
