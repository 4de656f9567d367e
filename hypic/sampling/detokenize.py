"""Incremental detokenization: the text of a growing list of token ids in O(1) work per token.

Decoding a few tokens before the new ones and comparing gives the new text even where a token
does not decode on its own (byte-level pieces of one character); a trailing U+FFFD means the
character is not complete yet, so that text waits for the next token.
"""
from ..tokenizer import TextTokenizer

CONTEXT_TOKENS = 6  # tokens decoded before the new ones, so merges across the boundary are seen


class IncrementalDetokenizer:
    """Appends decoded text as token ids arrive; ``text`` holds only complete characters."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # start of the context decoded with the new tokens
        self._read_offset = 0  # tokens whose text is already in ``text``

    def add(self, token: int) -> str:
        """Add one token; returns the text it completed (may be empty)."""
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self._prefix_offset : self._read_offset])
        after = self.tokenizer.decode(self.ids[self._prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self.text += delta
        self._prefix_offset = max(0, len(self.ids) - CONTEXT_TOKENS)
        self._read_offset = len(self.ids)
        return delta
