"""The package's layers: no import circle, and no backend imports another, nor does anything
below the backends (the registry, the plan, the stages, the index loss, the Triton utilities)
import a backend. Imports are read from the sources (function-local ones and the registry's
`"module:function"` paths included), so nothing is imported to check."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "torch_msa"
BACKENDS = ("torch_msa.triton", "torch_msa.sm90", "torch_msa.sm100")
IMPORT_PATH = re.compile(r"torch_msa(\.\w+)+:\w+")  # a registry path, "package.module:function"
BELOW_BACKENDS = ("torch_msa.backends", "torch_msa.plan", "torch_msa.stages", "torch_msa.index_loss",
                  "torch_msa.triton_utils", "torch_msa.cute_dsl", "torch_msa.query_windows")


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and IMPORT_PATH.fullmatch(node.value):
            targets = [node.value.partition(":")[0]]
        found.update(target for target in targets if target in modules and target != name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _within(name: str, packages: tuple[str, ...]) -> str | None:
    return next((package for package in packages if name == package or name.startswith(package + ".")), None)


def test_the_import_graph_is_read():
    graph = _graph()
    assert "torch_msa.plan.schedule" in graph["torch_msa.reference"]
    assert {"torch_msa.stages.delta", "torch_msa.sm90.common"} <= graph["torch_msa.sm90.backward_host"]
    assert "torch_msa.plan.kernels" in graph["torch_msa.stages.deterministic"]


def test_no_import_circle():
    graph = _graph()
    done, path = set(), []

    def visit(name):
        if name in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        path.append(name)
        for imported in sorted(graph[name]):
            visit(imported)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_no_backend_imports_another_and_nothing_below_imports_one():
    wrong = []
    for name, imported in _graph().items():
        own = _within(name, BACKENDS)
        for target in imported:
            backend = _within(target, BACKENDS)
            if backend and backend != own and (own or _within(name, BELOW_BACKENDS)):
                wrong.append(f"{name} -> {target}")
    assert not wrong, wrong
