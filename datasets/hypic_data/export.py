"""Export a trained checkpoint as a model directory to ship (weights cast to a smaller dtype).

The package ships the default model in ``hypic/assets/default_model`` under a 25 MB budget:
a 9.6 M-parameter model is 38 MB in float32 and 19 MB in bfloat16. Our runtime and
transformers both load the bf16 weights and compute in whatever dtype they are asked for.

Command line: ``python -m hypic_data.export --src runs/tiny --dst hypic/assets/default_model``.
"""
from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_model(src: Path, dst: Path, dtype: str = "bfloat16") -> Path:
    """Copy ``src``'s checkpoint to ``dst`` with floating weights cast to ``dtype``.

    ``config.json`` records the dtype; ``training_config.json`` (the training run's
    settings) becomes ``training.json``. Returns ``dst``.
    """
    from safetensors.torch import load_file, save_file

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    weights = load_file(str(src / "model.safetensors"))
    dst.mkdir(parents=True, exist_ok=True)
    cast = {name: t.to(DTYPES[dtype]) if t.is_floating_point() else t
            for name, t in weights.items()}
    save_file(cast, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    (dst / "config.json").write_text(json.dumps({**config, "dtype": dtype}, indent=2) + "\n",
                                     encoding="utf-8")
    for name in COPIED_FILES:
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
    if (src / "training_config.json").exists():
        shutil.copyfile(src / "training_config.json", dst / "training.json")
    return dst


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m hypic_data.export",
        description="Copy a trained checkpoint (config, weights, tokenizer, training settings) "
                    "to a model directory, casting the weights (e.g. to ship the default model).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--src", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--dst", type=Path, required=True, help="directory to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = parser.parse_args(argv)
    out = export_model(args.src, args.dst, args.dtype)
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(f"exported {args.src} to {out} ({args.dtype}, {size:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
