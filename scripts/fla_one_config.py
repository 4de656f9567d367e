"""Write one fixed Triton config per FLA kernel, so an exactness run compiles each kernel once.

FLA autotunes its kernels over 12-36 configs each; with IEEE fp32 dots every config compiles for
seconds, which is why one family's exactness run outlasts a device call. The configs change block
sizes and pipelining, not the arithmetic, so one config per kernel checks the same math.
FLA reads the files when run with ``FLA_CACHE_MODE=default FLA_CONFIG_DIR=<dir>``.

    python3 scripts/fla_one_config.py DIR fla.ops.gla fla.ops.simple_gla
"""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path


def autotuners(module_names: list[str]) -> dict[str, object]:
    """Every FLA autotuned kernel loaded by importing ``module_names``, by kernel name."""
    from fla.ops.utils.cache import CachedAutotuner
    for name in module_names:
        importlib.import_module(name)
    found = {}
    for module in [m for name, m in sys.modules.items() if name.startswith("fla.") and m is not None]:
        for value in vars(module).values():
            while value is not None and not isinstance(value, CachedAutotuner):
                value = getattr(value, "fn", None)  # under triton.heuristics, say
            if value is not None:
                found[value.kernel_name] = value
    return found


def first_config(tuner) -> dict:
    """The first of the kernel's own configs, in the form FLA's config files take."""
    config = tuner.configs[0]
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}


def main(out: str, module_names: list[str]) -> None:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    tuners = autotuners(module_names)
    for kernel, tuner in sorted(tuners.items()):
        (folder / f"{kernel}.json").write_text(json.dumps({"default_config": first_config(tuner)}))
    print(f"{len(tuners)} kernels, one config each, in {folder}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
