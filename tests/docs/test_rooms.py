"""Which parts of the code may import which: read from the sources' module-level imports (``ast``;
imports inside functions are on-demand and not counted), what imports what.

- the serving package never imports the training and data toolkit (``hypic_data``);
- the router imports nothing from the HTTP server (``hypic.server.app``, ``gate``, ``tenancy``);
- the caches (``hypic.cache``) import nothing above them: no engine, assembler, model, server;
- no module-level import cycles.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"hypic": ROOT / "hypic", "hypic_data": ROOT / "datasets" / "hypic_data"}


def _modules() -> dict[str, Path]:
    """Every module of the installed packages by its import name."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            if package == "hypic" and path.relative_to(folder).parts[0] in ("assets",):
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements run at import: the module's own, and those inside its ``try`` and ``if`` blocks
    (but not ``if TYPE_CHECKING``, never run)."""
    found = []
    for node in body:
        found.append(node)
        if isinstance(node, ast.Try):
            found += _module_level(node.body + node.orelse + node.finalbody
                                   + [s for handler in node.handlers for s in handler.body])
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            found += _module_level(node.body + node.orelse)
    return found


def _imports(name: str, path: Path) -> set[str]:
    """The modules ``name`` imports at module level (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in _module_level(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    return targets


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {t for t in _imports(name, path) if t in modules} for name, path in modules.items()}


def _serving(name: str) -> bool:
    return name.startswith("hypic") and not name.startswith(("hypic.evaluation", "hypic_data"))


def test_serving_never_imports_the_training_toolkit() -> None:
    graph = _graph()
    assert [(m, t) for m, targets in graph.items() if _serving(m) for t in targets if t.startswith("hypic_data")] == []


def test_the_router_imports_nothing_from_the_http_server() -> None:
    http = ("hypic.server.app", "hypic.server.gate", "hypic.server.tenancy")
    graph = _graph()
    assert [(m, t) for m, targets in graph.items() if m.startswith("hypic.router") for t in targets
            if t.startswith(http)] == []


def test_the_caches_import_nothing_above_them() -> None:
    above = ("hypic.engine", "hypic.assembler", "hypic.models", "hypic.server", "hypic.decode", "hypic.router")
    graph = _graph()
    assert [(m, t) for m, targets in graph.items() if m.startswith("hypic.cache") for t in targets
            if t.startswith(above)] == []


def test_no_module_level_import_cycles() -> None:
    graph = _graph()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        for target in sorted(graph.get(name, ())):
            if target != name and not name.startswith(target + "."):  # a package's own __init__ is no cycle
                cycle = visit(target, [*path, name])
                if cycle:
                    return cycle
        done.add(name)
        return None

    cycles = [cycle for name in sorted(graph) if (cycle := visit(name, []))]
    assert cycles == []
