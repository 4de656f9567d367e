"""What the ingress of a replicated service knows of the model: its tokenizer, configuration and
planner, never its weights. It parses, checks and plans each request once, as the replicas' engines
would (``RequestIntake``, which ``Engine`` is too), and the plan travels to the replica that runs it."""
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..sampling.grammar import GrammarCompiler
from ..loading.loader import ModelConfig, model_fingerprint, read_config, read_quantization, resolve_dtype
from ..intake import RequestIntake
from ..planner import Planner
from ..sizing import default_snapshot_interval
from ..tokenizer import TextTokenizer


@dataclass(frozen=True)
class FrontModel:
    """The model as the ingress sees it: its configuration and dtype; it holds no weights."""

    config: ModelConfig
    dtype: torch.dtype

    def parameters(self) -> tuple[torch.Tensor, ...]:
        return ()

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return ()


class FrontEngine(RequestIntake):
    """An engine without weights: it parses, plans and checks requests, documents and state sizes
    exactly as the replicas' engines do, over a model that is only a configuration."""

    def __init__(self, path: Path, dtype: str, device: str, seam_width: int, separator: str,
                 snapshot_interval: int | None) -> None:
        config = read_config(path)
        self.model = FrontModel(config, resolve_dtype(dtype, path, device))
        self.tokenizer = TextTokenizer.from_dir(path)
        self.fingerprint, self.quantization = model_fingerprint(path), read_quantization(path)
        self.seam_width, self.pic_separator = seam_width, separator
        self.snapshot_interval = default_snapshot_interval(config) if snapshot_interval is None else snapshot_interval
        self.planner = Planner(self.tokenizer, self.fingerprint, seam_width, config.linear_conv_kernel_dim,
                               config.max_position_embeddings, config.vocab_size, separator)
        self.eos_token_ids = set(config.eos_token_ids) | set(self.tokenizer.eos_token_ids())
        self.grammars = GrammarCompiler(self.tokenizer, config.vocab_size, sorted(self.eos_token_ids))

    def describe(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "model_type": self.model.config.model_type}
