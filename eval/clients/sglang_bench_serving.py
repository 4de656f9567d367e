"""SGLang's own ``bench_serving`` client, run with this environment's torch and transformers.

sglang's package imports torchvision (for images, which a text benchmark never sends) and registers
model configs that transformers 5.x already has; a torchvision built for another torch breaks the
import. So torchvision is stood in for by empty modules and those registrations are let through;
nothing the benchmark sends or measures is touched. Install the client beside the project, not into
it (sglang's own dependencies would replace torch):

    pip install --no-deps --target ~/sglang-client sglang==0.5.16 orjson pybase64 msgspec \
        partial_json_parser sentencepiece compressed_tensors loguru gguf zmq IPython datasets
    PYTHONPATH=~/sglang-client python eval/clients/sglang_bench_serving.py --backend sglang --port 30000 ...
"""
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

import transformers.utils
import transformers.utils.import_utils as import_utils


class _Anything:
    """Whatever a stood-in module is asked for: callable, subclassable, never used by a text run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> "_Anything":
        return _Anything()

    def __getattr__(self, name: str) -> "_Anything":
        return _Anything()

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


def _attribute(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Anything()


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty packages for ``torchvision`` and everything under it."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__file__ = "/nonexistent/torchvision_stand_in.py"
        module.__getattr__ = _attribute  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def main() -> int:
    import_utils.is_torchvision_available = lambda: False
    transformers.utils.is_torchvision_available = lambda: False
    sys.meta_path.insert(0, _StandIns())
    from transformers.models.auto import configuration_auto
    register = configuration_auto.AutoConfig.register
    configuration_auto.AutoConfig.register = staticmethod(  # type: ignore[method-assign]
        lambda model_type, config, exist_ok=False: register(model_type, config, exist_ok=True))
    from sglang.bench_serving import cli_main
    return cli_main() or 0


if __name__ == "__main__":
    sys.exit(main())
