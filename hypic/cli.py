"""``hypic`` command line: generate with position-independent caching from the shell."""
import argparse
import os
import sys
from pathlib import Path

from . import DEFAULT_SEPARATOR, Engine, HypicError
from .engine import MODES

RANDOM_MODEL_SEED = 0


def random_model_path() -> Path:
    """A deterministic random Qwen3.5-architecture model, written once to the user's cache.
    It produces meaningless text: it exists so that HYPIC runs before a trained model is shipped."""
    from .checkpoints import write_random_checkpoint

    path = Path(os.environ.get("HYPIC_CACHE", Path.home() / ".cache" / "hypic")) / f"random-qwen3_5-seed{RANDOM_MODEL_SEED}"
    if not (path / "tokenizer.json").is_file():
        write_random_checkpoint(path, "qwen3_5_text", RANDOM_MODEL_SEED, hidden_size=128, num_hidden_layers=8)
    return path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hypic", description="Position-independent caching for hybrid-attention LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="prefill a prompt (separators mark reusable segments) and decode",
                              description="Generate from PROMPT. Parts between separators are PIC segments: "
                                          f"'system {DEFAULT_SEPARATOR} doc1 {DEFAULT_SEPARATOR} doc2 {DEFAULT_SEPARATOR} question'.")
    gen.add_argument("prompt", nargs="+", help="one or more prompts, run in order on one engine (later ones reuse the cache)")
    gen.add_argument("--model", help="local HF checkpoint directory (default: a small random Qwen3.5-architecture model)")
    gen.add_argument("--mode", choices=MODES, default="hypic", help="reuse strategy (default: hypic)")
    gen.add_argument("--seam-width", type=int, default=8, help="tokens recomputed at each segment end (default: 8)")
    gen.add_argument("--pic-separator", default=DEFAULT_SEPARATOR, help=f"segment separator (default: {DEFAULT_SEPARATOR})")
    gen.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate (default: 16)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    gen.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weight dtype")
    return parser


def _generate(args: argparse.Namespace) -> None:
    model = args.model or random_model_path()
    engine = Engine.from_pretrained(model, device=args.device, dtype=args.dtype, seam_width=args.seam_width,
                                    pic_separator=args.pic_separator)
    for prompt in args.prompt:
        result = engine.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, mode=args.mode)
        print(f"{result.text!r}\n  mode={result.mode} prompt_tokens={result.prompt_tokens} cached={result.cached_tokens} "
              f"recomputed={result.recomputed_tokens} segments hit/missed={result.segments_hit}/{result.segments_missed} "
              f"ttft={result.ttft_s * 1000:.1f} ms finish={result.finish_reason}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _generate(args)
    except HypicError as err:
        print(f"hypic: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
