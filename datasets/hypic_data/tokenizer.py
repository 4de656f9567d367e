"""Byte-level BPE tokenizer trained on the synthetic QA corpus.

The tokenizer adds no special tokens on encode (the engine encodes each prompt part on its
own and concatenates the ids); ``<|endoftext|>`` (id 0) ends every training text and
``<|pad|>`` (id 1) pads batches. Byte-level BPE round-trips any text exactly.

Command line: ``python -m hypic_data.tokenizer --data datasets/synthetic_qa --out PATH``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from hypic_data.synthetic_qa import EOS_TOKEN, PAD_TOKEN, prompt_parts, read_jsonl

TOKENIZER_FILE = "tokenizer.json"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)  # ids 0 and 1, in this order


@dataclass(frozen=True)
class TokenizerConfig:
    """Training parameters of the tokenizer."""

    vocab_size: int = 4096
    min_frequency: int = 2


def corpus_texts(examples: Iterable[dict]) -> Iterator[str]:
    """Training texts: each example's prompt and answer, without the eos string.

    The eos string is left out because BPE training would otherwise learn merges over
    its characters; it is a special token and never split.
    """
    for example in examples:
        yield "".join(prompt_parts(example)) + " " + example["answer"]


def new_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE tokenizer that adds no special tokens on encode."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # ByteLevel post-processing only fixes offsets; it adds no tokens.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def train_tokenizer(texts: Iterable[str], config: TokenizerConfig = TokenizerConfig()) -> Tokenizer:
    """Train a tokenizer on ``texts`` (same texts in the same order -> same tokenizer)."""
    tokenizer = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def tokenizer_path(out: str | Path) -> Path:
    """``out`` itself when it names a .json file, else ``out/tokenizer.json``."""
    out = Path(out)
    return out if out.suffix == ".json" else out / TOKENIZER_FILE


def save_tokenizer(tokenizer: Tokenizer, out: str | Path) -> Path:
    """Save as ``tokenizer.json`` (see ``tokenizer_path``); returns the file written."""
    path = tokenizer_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path), pretty=True)
    return path


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer from a ``tokenizer.json`` file or a directory holding one."""
    path = Path(path)
    return Tokenizer.from_file(str(path / TOKENIZER_FILE if path.is_dir() else path))


def special_token_ids(tokenizer: Tokenizer) -> tuple[int, int]:
    """(eos id, pad id) of a tokenizer built by this module."""
    eos, pad = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(PAD_TOKEN)
    if eos is None or pad is None:
        raise ValueError(f"tokenizer lacks {EOS_TOKEN} or {PAD_TOKEN}")
    return eos, pad


def encode_parts(tokenizer: Tokenizer, parts: Sequence[str]) -> list[int]:
    """Concatenated ids of ``parts`` each encoded on its own, as the engine does."""
    ids: list[int] = []
    for part in parts:
        if part:  # empty parts are dropped, as in the engine
            ids.extend(tokenizer.encode(part, add_special_tokens=False).ids)
    return ids


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        prog="python -m hypic_data.tokenizer",
        description="Train the byte-level BPE tokenizer of the synthetic QA model on a "
                    "generated dataset and save it as tokenizer.json (deterministic).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("datasets/synthetic_qa"),
                        help="dataset directory written by hypic_data.synthetic_qa")
    parser.add_argument("--out", type=Path, required=True,
                        help="output directory (gets tokenizer.json) or a .json file path")
    parser.add_argument("--vocab-size", type=int, default=TokenizerConfig.vocab_size,
                        help="vocabulary size including the 2 special tokens and 256 bytes")
    parser.add_argument("--splits", nargs="+", default=["train"],
                        help="dataset splits to train on (keep test out of it)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the command line."""
    args = _parse_args(argv)
    examples = [ex for split in args.splits for ex in read_jsonl(args.data / f"{split}.jsonl")]
    tokenizer = train_tokenizer(corpus_texts(examples), TokenizerConfig(args.vocab_size))
    path = save_tokenizer(tokenizer, args.out)
    print(f"trained on {len(examples)} examples; vocab {tokenizer.get_vocab_size()}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
