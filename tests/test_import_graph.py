"""The house drawn from its imports: no module of sage/, analysis/, sweeps/, launchers/ or benchmarks/ takes
part in an import circle, none imports an entry point, neither analysis/ nor sage.data reaches into the
testbed, and nothing installed imports benchmarks/.
Static (ast): every import counts, at the top of a module or deferred inside a function, since a deferred
import only hides a circle until the call."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("sage", "analysis", "sweeps", "launchers", "benchmarks")
# The console scripts' modules (pyproject's [project.scripts]) and the benchmark runner: what a user starts.
ENTRY_POINTS = {"sage.train.main", "sage.eval.main", "benchmarks.bench"}
# (layer, what it must not import): analysis reads MLflow frames, never models; data is what any model reads.
# What both need of the testbed's world is sage.data.arith (sage.testbed.task re-exports it).
# Nothing installed imports benchmarks/, which only a clone has.
FORBIDDEN = [("analysis", "sage.testbed"), ("sage.data", "sage.testbed")] + [
    (installed, "benchmarks") for installed in ("sage", "analysis", "sweeps", "launchers")
]


def module_files() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def library_part(tree: ast.Module) -> ast.Module:
    """The module without its ``if __name__ == "__main__":`` block: what runs only when the file is the
    program (``python -m <module>``) is an entry point, not an import of the module by others."""
    main = [
        n
        for n in tree.body
        if isinstance(n, ast.If)
        and isinstance(n.test, ast.Compare)
        and isinstance(n.test.left, ast.Name)
        and n.test.left.id == "__name__"
    ]
    return ast.Module(body=[n for n in tree.body if n not in main], type_ignores=[])


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (``from a.b import c`` counts as a.b.c when c is a module)."""
    files = module_files()

    def project_module(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets = set()
        for node in ast.walk(library_part(ast.parse(path.read_text(encoding="utf-8")))):
            if isinstance(node, ast.Import):
                targets |= {project_module(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    targets.add(project_module(f"{base}.{alias.name}") or project_module(base))
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_graph_is_read_from_the_imports():
    """The drawing itself: known edges are found, top-level and deferred, absolute and relative."""
    graph = import_graph()
    assert "sage.config" in graph["sage.train.main"]  # top level
    assert "sage.train.sft" in graph["sage.train.main"]  # deferred inside a function
    assert "analysis.report" in graph["sage.grid"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle():
    assert circles(import_graph()) == []


def test_no_module_imports_an_entry_point():
    # a package's `python -m` shim (__main__) is the entry point itself
    offenders = {
        module: sorted(targets & ENTRY_POINTS)
        for module, targets in import_graph().items()
        if targets & ENTRY_POINTS and not module.endswith("__main__")
    }
    assert offenders == {}


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_analysis_and_data_do_not_import_the_testbed_nor_installed_code_the_benchmarks():
    graph = import_graph()
    assert "sage.data.arith" in graph["analysis.moved"] and "sage.data.arith" in graph["sage.data.datasets"]
    offenders = {
        (module, below): sorted(t for t in targets if within(t, below))
        for module, targets in graph.items()
        for layer, below in FORBIDDEN
        if within(module, layer) and any(within(t, below) for t in targets)
    }
    assert offenders == {}
