"""The router's view of a prompt: split and hashed exactly as the workers' engines do, without
loading any weights."""
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from hypic import DEFAULT_SEPARATOR, default_model_path
from hypic.cache.modes import Mode, mode_policy
from hypic.cache.plan import RequestPlan, plan_request
from hypic.cache.segments import PromptParts, split_prompt
from hypic.cache.store import SegmentEntry
from hypic.config import ModelConfig
from hypic.errors import InvalidRequest
from hypic.loader import model_fingerprint, read_config
from hypic.tokenizer import TextTokenizer

from .plan import SegmentJob
from .transfer import entry_check


@dataclass
class Splitter:
    """Tokenizer, fingerprint and seams of the model the workers serve."""

    tokenizer: TextTokenizer
    fingerprint: str
    seam_width: int
    conv_kernel: int
    max_positions: int
    separator: str = DEFAULT_SEPARATOR
    config: ModelConfig | None = None

    @classmethod
    def for_model(cls, model: str, seam_width: int = 8, separator: str = DEFAULT_SEPARATOR) -> "Splitter":
        path = default_model_path() if model == "default" else Path(model)
        config = read_config(path)
        return cls(TextTokenizer.from_dir(path), model_fingerprint(path), seam_width, config.linear_conv_kernel_dim,
                   config.max_position_embeddings, separator, config)

    def parse(self, prompt: str, namespace: str = "") -> PromptParts:
        """``prompt`` split and tokenized as an engine does, in cache ``namespace``."""
        if not isinstance(prompt, str):
            raise InvalidRequest(f"the prompt must be a string, got {type(prompt).__name__}")
        parts = split_prompt(prompt, self.tokenizer.encode, self.separator)
        if len(parts.token_ids) > self.max_positions:
            raise InvalidRequest(f"the prompt has {len(parts.token_ids)} tokens, over the model's limit of "
                                 f"{self.max_positions}")
        return replace(parts, namespace=namespace) if namespace else parts

    def entry_check(self, mode: Mode) -> Callable[[SegmentEntry], None]:
        """The check a received entry of ``mode``'s role must pass for this model."""
        if self.config is None:
            raise ValueError("this splitter was made without the model's config")
        return entry_check(self.fingerprint, mode_policy(mode, self.seam_width, self.conv_kernel).role, self.config)

    def plan(self, parts: PromptParts, mode: Mode) -> RequestPlan:
        """The request's plan, as an engine of this model makes it (``hypic.cache.plan.plan_request``)."""
        policy = mode_policy(mode, self.seam_width, self.conv_kernel).scoped(parts.namespace)
        return plan_request(parts, policy, self.fingerprint)

    def combine_tokens(self, parts: PromptParts, mode: Mode) -> int:
        """The tokens a combine pass of ``mode`` recomputes once every document is cached: the prompt
        less the interiors it splices."""
        plan = self.plan(parts, mode)
        return len(parts.token_ids) - sum(plan.interior_tokens(i) for i in plan.spliced)

    def jobs(self, parts: PromptParts, mode: Mode) -> list[SegmentJob]:
        """The documents ``mode`` splices from the public pool, keyed as the engines key them."""
        plan = self.plan(parts, mode)
        return [SegmentJob(key, ids, plan.policy.namespace) for _, key, ids in plan.documents()]
