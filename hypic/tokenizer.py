"""Tokenizer of a checkpoint (``tokenizer.json``), encoding each prompt part without special tokens."""
from pathlib import Path

from tokenizers import Tokenizer

from .errors import CheckpointError

EOS_CANDIDATES = ("<|endoftext|>", "<|im_end|>", "</s>", "<eos>")


class TextTokenizer:
    """Thin wrapper: ``encode`` adds no special tokens, because parts are tokenized independently."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_dir(cls, path: str | Path) -> "TextTokenizer":
        file = Path(path) / "tokenizer.json"
        if not file.is_file():
            raise CheckpointError(f"{path} has no tokenizer.json")
        return cls(Tokenizer.from_file(str(file)))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids if text else []

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids of the usual end-of-text special tokens present in the vocabulary."""
        ids = (self.tokenizer.token_to_id(token) for token in EOS_CANDIDATES)
        return tuple(i for i in ids if i is not None)
