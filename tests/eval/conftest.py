"""Import the scripts of ``eval/`` (a folder of scripts, not a package) by path."""
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EVAL_DIR = Path(__file__).resolve().parents[2] / "eval"


def load_script(name: str) -> ModuleType:
    """The module of ``eval/<name>.py``."""
    spec = importlib.util.spec_from_file_location(name, EVAL_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module
