"""A prompt split, tokenized and planned: what an engine does to a request before any compute, and
what a router does without loading weights. Each request is parsed and planned once, where it
arrives; its ``RequestPlan`` is what everything after that (the loop, the peers) goes by."""
from dataclasses import dataclass, replace
from pathlib import Path

from .cache.modes import Mode, ModePolicy, mode_policy
from .cache.plan import RequestPlan, plan_request
from .cache.segments import DEFAULT_SEPARATOR, PromptParts, split_prompt
from .loading.default_model import default_model_path
from .errors import InvalidRequest, as_written
from .loading.loader import model_fingerprint, read_config
from .tokenizer import TextTokenizer


@dataclass(frozen=True)
class Planner:
    """The tokenizer, fingerprint and seams of one model, and the limits a prompt must fit."""

    tokenizer: TextTokenizer
    fingerprint: str
    seam_width: int
    conv_kernel: int
    max_positions: int
    vocab_size: int
    separator: str = DEFAULT_SEPARATOR

    @classmethod
    def for_model(cls, model: str | Path, seam_width: int = 8, separator: str = DEFAULT_SEPARATOR) -> "Planner":
        """The planner of a checkpoint directory (``"default"``: the shipped model), weights unread."""
        path = default_model_path() if str(model) == "default" else Path(model)
        config = read_config(path)
        return cls(TextTokenizer.from_dir(path), model_fingerprint(path), seam_width, config.linear_conv_kernel_dim,
                   config.max_position_embeddings, config.vocab_size, separator)

    def policy(self, mode: Mode | str, namespace: str = "") -> ModePolicy:
        """What ``mode`` reuses and how, inside cache ``namespace`` ("": the shared one)."""
        return mode_policy(mode, self.seam_width, self.conv_kernel).scoped(namespace)

    def parse(self, prompt: str | list[int], namespace: str = "") -> PromptParts:
        """Split and tokenize a prompt, checking it fits the model's positions. A list of token ids
        is taken as it is (no segments: every token is Q, though a prefix-cache hit still applies)."""
        parts = self._ids(prompt) if isinstance(prompt, list) else split_prompt(prompt, self.tokenizer.encode,
                                                                               self.separator)
        if len(parts.token_ids) > self.max_positions:
            raise InvalidRequest(f"the prompt has {len(parts.token_ids)} tokens, over the model's limit of "
                                 f"{self.max_positions}")
        return replace(parts, namespace=namespace) if namespace else parts

    def _ids(self, ids: list[int]) -> PromptParts:
        if not ids:
            raise InvalidRequest("input_ids is empty")
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size),
                   None)
        if bad is not None:
            raise InvalidRequest(f"input_ids must be integers in [0, {self.vocab_size}), got {as_written(bad)}")
        return PromptParts((), (), tuple(ids))

    def plan(self, parts: PromptParts, mode: Mode | str = Mode.HYPIC, logits_from: int | None = None) -> RequestPlan:
        """What a prefill of ``parts`` under ``mode`` reuses (see ``RequestPlan``). Pure: any thread."""
        return plan_request(parts, self.policy(mode, parts.namespace), self.fingerprint, logits_from)

    def documents(self, documents: list[str], namespace: str = "") -> PromptParts:
        """Documents to cache, each tokenized on its own, as the segments of one prompt with nothing
        before or after them. No request sends that prompt, so the context does not bound its length
        (it bounds each document's: ``Engine.check_documents``)."""
        parts = PromptParts((), tuple(tuple(self.tokenizer.encode(document)) for document in documents), ())
        return replace(parts, namespace=namespace) if namespace else parts
