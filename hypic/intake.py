"""What an engine does with a request before any weight is touched: the prompt parsed and planned
once, the mode's policy, the request's samples and the documents to warm up checked against the
model, the memory a request's state takes. ``hypic.Engine`` is one with the weights; the ingress of a
replicated service (``hypic.cluster.front.FrontEngine``) one without, so both refuse and plan a
request alike."""
from typing import Any

import torch

from . import sizing
from .cache.modes import Mode, ModePolicy
from .cache.plan import RequestPlan
from .cache.segments import PromptParts, Seams
from .errors import InvalidRequest, as_written
from .parallel.group import common_seed
from .planner import Planner
from .sampling.grammar import Constraint, GrammarCompiler
from .sampling.params import SamplingParams
from .sampling.sequence import Sequence, SequenceLimits
from .tokenizer import TextTokenizer


class RequestIntake:
    """The weightless part of an engine. Whoever inherits it sets ``model`` (its ``config`` and
    ``dtype``; the weights are not read here), ``tokenizer``, ``planner``, ``pic_separator``,
    ``eos_token_ids`` and ``grammars``."""

    model: Any
    tokenizer: TextTokenizer
    planner: Planner
    pic_separator: str
    eos_token_ids: set[int]
    grammars: GrammarCompiler

    def policy(self, mode: Mode | str, namespace: str = "") -> ModePolicy:
        """What ``mode`` reuses and how, for this engine's seam width and model, inside cache
        ``namespace`` ("": the shared one)."""
        return self.planner.policy(mode, namespace)

    @property
    def seams(self) -> Seams:
        """HYPIC's cut of a PIC segment: max(w, k - 1) head tokens, w tail tokens recomputed."""
        seams = self.policy("hypic").seams
        assert seams is not None
        return seams

    def parse(self, prompt: str | list[int], namespace: str = "") -> PromptParts:
        """Split and tokenize a prompt, checking it fits the model's positions. A list of token ids
        is taken as it is (no segments: every token is Q, though a prefix-cache hit still applies).
        ``namespace``: the cache namespace the request lives in ("": shared). Pure: safe on any thread."""
        return self.planner.parse(prompt, namespace)

    def plan(self, parts: PromptParts, mode: Mode | str = Mode.HYPIC, logits_from: int | None = None) -> RequestPlan:
        """What a prefill of ``parts`` under ``mode`` reuses, worked out once (see ``RequestPlan``):
        the segments it splices (none from ``logits_from`` on), their public-pool keys, its layout
        marks and its private-pool key. Pure: safe on any thread."""
        return self.planner.plan(parts, mode, logits_from)

    def sequences(self, params: SamplingParams, prompt_ids: list[int], logprobs: int | None = None,
                  seed: int | None = None) -> list[Sequence]:
        """The ``params.n`` continuations of a prompt, checked against this model (prompt + max_new_tokens
        within its positions, token ids in its vocabulary, the grammar compiles). ``logprobs``: None,
        or record each token's logprob and its top-k alternatives. With a seed, sample i draws from ``seed + i``.
        ``seed``: the seed of an unseeded request (a tensor-parallel server's rank 0 draws one and hands it
        to the other ranks); None: torch's generator, or under tensor parallelism one rank 0 draws now."""
        params.check_context(len(prompt_ids), self.model.config.max_position_embeddings)
        vocab = self.model.config.vocab_size
        bad = [t for t, _ in params.logit_bias if t >= vocab] + [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        constraint = Constraint.of(params)
        if constraint is not None:
            self.grammars.compile(constraint)  # a bad grammar fails here, before any work
        limits = SequenceLimits(frozenset(self.eos_token_ids), self.model.config.max_position_embeddings, logprobs)
        tp = self.model.config.tensor_parallel
        if params.seed is not None:
            seed = params.seed
        elif seed is None and tp.enabled:
            seed = common_seed(tp)  # the ranks sample alike
        return [Sequence(params, list(prompt_ids), self.tokenizer, limits,
                         torch.Generator().manual_seed(seed + i) if seed is not None else None,
                         self.grammars.start(constraint) if constraint is not None else None,
                         seed=seed + i if seed is not None else None)
                for i in range(params.n)]

    def check_documents(self, documents: list[str]) -> list[tuple[int, ...]]:
        """Documents to warm up, checked before any compute is spent on them, and their token ids:
        strings, none empty, none holding the PIC separator (a request would split such a document in
        two, so its entry could never be hit), none longer than the model's context (no prompt could
        hold it, so its entry could never be used)."""
        if not isinstance(documents, list) or not all(isinstance(d, str) for d in documents):
            raise InvalidRequest("documents must be a list of strings")
        for index, document in enumerate(documents):
            if not document:
                raise InvalidRequest(f"document {index} is empty")
            if self.pic_separator in document:
                raise InvalidRequest(f"document {index} contains the PIC separator {as_written(self.pic_separator)}: "
                                     "a request would split it into two segments; warm up each part as its own document")
        encoded = [tuple(self.tokenizer.encode(d)) for d in documents]
        for index, ids in enumerate(encoded):
            self._check_document_tokens(index, len(ids))
        return encoded

    def _check_document_tokens(self, index: int, tokens: int) -> None:
        context = self.model.config.max_position_embeddings
        if not tokens:
            raise InvalidRequest(f"document {index} is empty")
        if tokens > context:
            raise InvalidRequest(f"document {index} has {tokens} tokens, over the model's context of {context} tokens: "
                                 "no prompt could hold it; split it into documents of at most that many tokens "
                                 "(a prompt holding one must still fit the context with its other parts and answer)")

    def state_bytes(self, tokens: int, samples: int = 1, shared_tokens: int = 0) -> int:
        """Memory a request's state takes (``sizing.state_bytes``: the server's admission budget)."""
        return sizing.state_bytes(self.model.config, self.model.dtype, tokens, samples, shared_tokens)
