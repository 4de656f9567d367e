"""What a user gets from ``pip install`` of a built wheel, not from an editable checkout: the wheel
holds every module of the source tree, each imports from the wheel alone, and the ``hypic`` command
starts. Oracle: the source tree itself (every ``.py`` file under the shipped folders)."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = {"hypic": ROOT / "hypic", "hypic_data": ROOT / "datasets" / "hypic_data"}


def _source_modules() -> set[str]:
    """Every module of the shipped folders by its import name, read from the tree."""
    found = set()
    for package, folder in SHIPPED.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def _wheel_modules(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(".py") and ".dist-info/" not in n]
    return {n[: -len("/__init__.py")].replace("/", ".") if n.endswith("/__init__.py")
            else n[:-3].replace("/", ".") for n in names}


def test_every_source_folder_is_a_package() -> None:
    """Discovery skips a folder without ``__init__.py``: its modules would be missing from a wheel."""
    folders = {p.parent for f in SHIPPED.values() for p in f.rglob("*.py")}
    assert sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists()) == []


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The project built as a wheel from a copy of the tree, then installed into a folder of its own."""
    work = tmp_path_factory.mktemp("wheel")
    tree = work / "src"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info",
                                                               "__pycache__", ".pytest_cache", "runs", ".whl"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(work / "dist"), str(tree)],
                   check=True, cwd=work)
    wheel = next((work / "dist").glob("hypic-*.whl"))
    site = work / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", str(site), str(wheel)],
                   check=True, cwd=work)
    return wheel, site


def test_the_wheel_holds_every_module_of_the_tree(installed_wheel: tuple[Path, Path]) -> None:
    wheel, _ = installed_wheel
    assert sorted(_source_modules() - _wheel_modules(wheel)) == []


def _run_from(site: Path, *args: str) -> subprocess.CompletedProcess:
    """A command run outside the checkout with the installed wheel first on the path."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(args, cwd=site.parent, env=env, capture_output=True, text=True, timeout=300)


IMPORT_ALL = """
import importlib, sys
sys.modules.setdefault("fla", None)  # FLA's kernels need a GPU; every module has a PyTorch path
site, names = sys.argv[1], sys.argv[2:]
wrong = []
for name in names:
    module = importlib.import_module(name)
    if not module.__file__.startswith(site):
        wrong.append((name, module.__file__))
print("imported", len(names))
assert not wrong, wrong
"""


def test_every_module_of_the_wheel_imports_from_it(installed_wheel: tuple[Path, Path]) -> None:
    wheel, site = installed_wheel
    names = sorted(_wheel_modules(wheel))
    done = _run_from(site, sys.executable, "-c", IMPORT_ALL, str(site), *names)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"imported {len(names)}" in done.stdout


def test_the_hypic_command_of_the_wheel_starts(installed_wheel: tuple[Path, Path]) -> None:
    _, site = installed_wheel
    done = _run_from(site, sys.executable, str(site / "bin" / "hypic"), "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "serve" in done.stdout
