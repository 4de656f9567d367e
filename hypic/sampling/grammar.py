"""Structured output: regex, JSON schema and EBNF constraints compiled by xgrammar (runs on CPU).

A ``GrammarCompiler`` belongs to one tokenizer and model vocabulary and caches what it compiled;
each generated sequence walks its grammar with a ``GrammarState``, which says which tokens may
come next.
"""
import json
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidRequest
from .params import SamplingParams
from ..tokenizer import TextTokenizer

# xgrammar's errors start with a time and the C++ file and line that raised them: "[13:22:47] /project/cpp/x.cc:83: "
XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@dataclass(frozen=True)
class Constraint:
    """One request's grammar: ``kind`` is regex, json_schema or ebnf."""

    kind: str
    source: str

    @classmethod
    def of(cls, params: SamplingParams) -> "Constraint | None":
        for kind in ("regex", "json_schema", "ebnf"):
            source = getattr(params, kind)
            if source is not None:
                return cls(kind, source)
        return None


class GrammarState:
    """Where one sequence is in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import xgrammar

        self._xgr, self._matcher = xgrammar, matcher
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self._vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """Bool mask [vocab] of the tokens the grammar accepts next."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        scores = torch.zeros(1, self._vocab_size)
        self._xgr.apply_token_bitmask_inplace(scores, self._bitmask)
        return scores[0] == 0

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"the grammar rejected token {token} that its own mask allowed")

    @property
    def finished(self) -> bool:
        return bool(self._matcher.is_terminated())


class GrammarCompiler:
    """Compiles constraints against one tokenizer; xgrammar is imported on first use."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self._compiler: Any = None
        self._compiled: dict[Constraint, Any] = {}

    def _xgrammar(self) -> Any:
        if self._compiler is None:
            try:
                import xgrammar
                from transformers import PreTrainedTokenizerFast
            except ImportError as err:
                raise InvalidRequest(f"structured output needs the xgrammar package ({err})") from err
            fast = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.tokenizer)
            info = xgrammar.TokenizerInfo.from_huggingface(fast, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar (cached); an invalid constraint raises ``InvalidRequest``."""
        if constraint not in self._compiled:
            compiler = self._xgrammar()
            try:
                if constraint.kind == "regex":
                    compiled = compiler.compile_regex(constraint.source)
                elif constraint.kind == "json_schema":
                    compiled = compiler.compile_json_schema(_schema_text(constraint.source), any_whitespace=False)
                else:
                    compiled = compiler.compile_grammar(constraint.source)
            except (RuntimeError, ValueError) as err:
                raise InvalidRequest(f"invalid {constraint.kind}: {_reason(err)}", param=constraint.kind) from err
            self._compiled[constraint] = compiled
        return self._compiled[constraint]

    def start(self, constraint: Constraint) -> GrammarState:
        """A fresh walk of ``constraint`` for one sequence."""
        import xgrammar

        return GrammarState(xgrammar.GrammarMatcher(self.compile(constraint)), self.vocab_size)


def _reason(err: Exception) -> str:
    """What xgrammar found wrong, without where in its C++ sources it noticed."""
    return XGRAMMAR_LOCATION.sub("", str(err)).strip()


def _schema_text(source: str) -> str:
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as err:
        raise InvalidRequest(f"json_schema is not valid JSON: {err}", param="json_schema") from err
    if not isinstance(schema, dict):
        raise InvalidRequest("json_schema must be a JSON object", param="json_schema")
    return json.dumps(schema)
