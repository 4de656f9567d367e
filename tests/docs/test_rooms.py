"""Which parts of the code may import which: read from the sources' imports (``ast``), at module
level and inside functions and methods alike (an import on demand is a dependency all the same),
what imports what.

- the serving package never imports the training and data toolkit (``hypic_data``);
- the router imports nothing from the server (``hypic.server``), not even through the modules it
  imports (checked in a fresh interpreter);
- the scheduler (``hypic.scheduler``), which the server and the workers both host, imports neither;
- the caches (``hypic.cache``) import nothing above them: no engine, assembler, model, server,
  and no kernels (they hold and compose tensors; the models run the kernels);
- the scheduler runs the model only through the model runner (no forward pass of its own), and
  a prefill reaches the pools only through their one interface (``HybridCache``);
- nothing outside the pools reads a pool's ``entries``, and nothing outside the caches reaches the
  pools behind their one interface (``engine.cache.<method>``): ``HybridCache``'s pools are its own,
  and an ``Engine`` holds none of its own;
- no import cycles.
"""
import ast
import subprocess
import sys
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


def _run(body: list[ast.stmt]) -> list[ast.stmt]:
    """Every statement that may run, at import or on a call: the module's own and those nested in
    its blocks, functions and classes (but not under ``if TYPE_CHECKING``, never run)."""
    found = []
    for node in body:
        found.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found += _run(node.orelse)
            continue
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, field, ()):
                found += _run(child.body) if isinstance(child, (ast.ExceptHandler, ast.match_case)) else _run([child])
    return found


def _imports(name: str, path: Path) -> set[str]:
    """The modules ``name`` imports, at module level or inside a function (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in _run(ast.parse(path.read_text()).body):
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


def test_the_router_imports_nothing_from_the_server() -> None:
    graph = _graph()
    assert [(m, t) for m, targets in graph.items() if m.startswith("hypic.router") for t in targets
            if t.startswith("hypic.server")] == []


def test_importing_the_router_loads_no_server_module() -> None:
    """Through any chain of imports: a Ray worker never loads the HTTP layer."""
    code = "import sys, hypic.router; print(sorted(m for m in sys.modules if m.startswith('hypic.server')))"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert found.stdout.strip() == "[]"


def test_the_scheduler_imports_neither_the_server_nor_the_router() -> None:
    graph = _graph()
    assert [(m, t) for m, targets in graph.items() if m.startswith("hypic.scheduler") for t in targets
            if t.startswith(("hypic.server", "hypic.router"))] == []


def test_nothing_outside_the_pools_reads_their_entries() -> None:
    """``store.entries`` is the public pool's own: others ask it (``keys``, ``held``, ``peek``)."""
    readers = [name for name, path in _modules().items() if name.startswith("hypic")
               and not name.startswith("hypic.cache") and "store.entries" in path.read_text()]
    assert readers == []


def test_callers_reach_the_pools_only_through_their_interface() -> None:
    found = [(name, ast.unparse(node)) for name, path in _modules().items()
             if name.startswith("hypic") and not name.startswith("hypic.cache")
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)
             and node.attr in ("public", "private", "resume_points")
             and isinstance(node.value, ast.Attribute) and node.value.attr == "cache"]
    assert found == []


def test_an_engine_holds_no_pool_of_its_own() -> None:
    """Its pools are its ``cache``'s: no second handle on them for callers to bypass it with."""
    from hypic import Engine
    from hypic.cache.prefix_cache import PrefixCache
    from hypic.cache.resume_points import ResumePoints
    from hypic.cache.store import SegmentStore
    from hypic.cache.tiers.resume import ResumeStore

    pools = (SegmentStore, PrefixCache, ResumePoints, ResumeStore)
    engine = Engine.from_pretrained("default")
    assert [name for name, value in vars(engine).items() if isinstance(value, pools)] == []
    assert any(isinstance(value, pools) for value in vars(engine.cache).values())


def test_the_caches_import_nothing_above_them() -> None:
    above = ("hypic.engine", "hypic.assembler", "hypic.models", "hypic.server", "hypic.decode", "hypic.router",
             "hypic.kernels")
    graph = _graph()
    assert [(m, t) for m, targets in graph.items() if m.startswith("hypic.cache") for t in targets
            if t.startswith(above)] == []


def test_the_scheduler_runs_the_model_only_through_the_runner() -> None:
    passes = ("hypic.decode", "hypic.models", "hypic.segment_prefill", "hypic.assembler.combine", "hypic.kernels")
    graph = _graph() | {m: _imports(m, path) for m, path in _modules().items() if m.startswith("hypic.scheduler")}
    assert [(m, t) for m, targets in graph.items() if m.startswith("hypic.scheduler") for t in targets
            if t.startswith(passes)] == []


def test_a_prefill_reaches_the_pools_through_their_interface() -> None:
    pools = ("hypic.cache.store.SegmentStore", "hypic.cache.prefix_cache", "hypic.cache.resume_points",
             "hypic.cache.tiers")
    found = {t for m in ("hypic.prefill", "hypic.model_runner") for t in _imports(m, _modules()[m])}
    assert sorted(t for t in found if t.startswith(pools)) == []


def test_no_import_cycles() -> None:
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
