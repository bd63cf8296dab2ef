"""No import cycles between the top-level parts of `beamrl/` (folders and top-level modules).

Static: every `import` statement of every file counts, at module level, inside functions and under
`if TYPE_CHECKING:` alike, so a cycle cannot hide in a lazy import."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "beamrl"


def _part(module: str) -> str | None:
    """The top-level part of `beamrl.<part>...`, or None for a module outside beamrl."""
    names = module.split(".")
    return names[1] if names[0] == "beamrl" and len(names) > 1 else None


def _imported_modules(node: ast.AST, file_module: list[str], is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolve against this file's package
            package = file_module if is_package else file_module[:-1]
            base = package[: len(package) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        return [module] + [f"{module}.{a.name}" for a in node.names]
    return []


def part_graph(root: Path = ROOT) -> dict[str, dict[str, list[str]]]:
    """{part: {imported part: ["file:line", ...]}} over every import in `root`."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        module = list(rel.parts)
        is_package = module[-1] == "__init__"
        if is_package:
            module = module[:-1]
        if len(module) < 2:
            continue  # beamrl/__init__.py
        src = module[1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for dst in {_part(m) for m in _imported_modules(node, module, is_package)} - {None, src}:
                graph.setdefault(src, {}).setdefault(dst, []).append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return graph


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Strongly connected components with more than one part (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_between_top_level_parts():
    graph = part_graph()
    found = cycles(graph)
    lines = []
    for component in found:
        for a in component:
            for b in component:
                if b in graph.get(a, {}):
                    lines.append(f"  {a} -> {b}: {', '.join(graph[a][b][:4])}")
    assert not found, "import cycles between parts of beamrl/:\n" + "\n".join(lines)


def test_the_cycle_finder_sees_lazy_and_type_checking_imports(tmp_path):
    """The checker itself: a function-level import and a TYPE_CHECKING import that close a cycle are found."""
    pkg = tmp_path / "beamrl"
    for part in ("a", "b", "c"):
        (pkg / part).mkdir(parents=True)
        (pkg / part / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from beamrl.b import y\n")
    (pkg / "b" / "y.py").write_text("def f():\n    from beamrl.a.x import g\n")
    (pkg / "c" / "z.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import x\n")
    (pkg / "a" / "w.py").write_text("from beamrl.c import z\n")
    graph = part_graph(pkg)
    assert graph["b"]["a"] == ["beamrl/b/y.py:2"]
    assert cycles(graph) == [["a", "b", "c"]]
