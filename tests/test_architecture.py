"""The package's shape: imports run one way (engine -> graphs -> steps), no import cycle (imports
inside functions and under TYPE_CHECKING count), the graph layer meets the engine only through its
documented interface, and no class grows past about 250 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_graph"
MAX_CLASS_LINES = 250
# What a higher layer may import of a lower one (besides the public package root).
ALLOWED_DOWNWARD = {
    "fsdp_graph.graphs": {"fsdp_graph.fsdp.capture_interface", "fsdp_graph.fsdp.introspect"},
    "fsdp_graph.steps": {"fsdp_graph.fsdp.capture_interface", "fsdp_graph.fsdp.clip_grad"},
    "fsdp_graph.checkpoint": {"fsdp_graph.fsdp.agreement"},
    "fsdp_graph.hf": {"fsdp_graph.fsdp.fully_shard"},
}
LAYERS = ("fsdp_graph.fsdp", "fsdp_graph.graphs", "fsdp_graph.steps", "fsdp_graph.checkpoint", "fsdp_graph.hf")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every package module ``name`` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    # A package's __init__ is not an edge by itself: ``from .unit import X`` depends on ``unit``.
    return {name: {t for t in _imports(name, path, known) if modules[t].name != "__init__.py" or t == "fsdp_graph"}
            for name, path in modules.items()}


def _layer(module: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        if module == layer or module.startswith(layer + "."):
            return i
    return None


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_imports_run_one_way_through_the_documented_interface():
    problems = []
    for module, targets in _graph().items():
        layer = _layer(module)
        if layer is None:
            if module != "fsdp_graph":
                problems.append(f"{module} lies outside the layers")
            continue
        for target in targets:
            if target == "fsdp_graph":
                problems.append(f"{module} imports the package root (import from the module instead)")
                continue
            target_layer = _layer(target)
            if target_layer > layer:
                problems.append(f"{module} imports {target}, a higher layer")
            elif target_layer < layer and target.startswith("fsdp_graph.fsdp"):
                allowed = ALLOWED_DOWNWARD[LAYERS[layer]]
                if target not in allowed:
                    problems.append(f"{module} imports {target}; the engine's interface is {sorted(allowed)}")
    assert not problems, "\n".join(problems)


def test_no_class_is_longer_than_about_250_lines():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long.append(f"{path.relative_to(PACKAGE)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


def test_the_import_scan_sees_imports_inside_functions_and_type_checking(tmp_path):
    """A check that cannot fail proves nothing: the scan must see the imports these rules forbid."""
    fake = tmp_path / "fake.py"
    fake.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .root import RootContext\n"
        "def f():\n    from ..graphs.module_graphs import graph_modules\n    import fsdp_graph.steps.make_step\n"
    )
    found = _imports("fsdp_graph.fsdp.fake", fake, set(_modules()))
    assert found == {"fsdp_graph.fsdp.root", "fsdp_graph.graphs.module_graphs", "fsdp_graph.steps.make_step"}
