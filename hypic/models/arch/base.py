"""What an architecture module declares (``hypic.models.arch``)."""
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...config import ModelConfig
from ...loading.tensor_sources import Source

Parse = Callable[[dict[str, Any], dict[str, Any]], ModelConfig]  # (text config, whole config.json) -> ours


@dataclass(frozen=True)
class Architecture:
    """One architecture: its ``model_types`` (and the multimodal types that ``wraps`` one in a
    ``text_config``), how its ``config.json`` becomes a ``ModelConfig`` (``parse``; the linear family
    it names chooses the token mixer), where its checkpoint names differ from ours (``rename``: a
    tensor's name, before layers are grouped; ``sources``: a last rewrite of the parameters' sources,
    where one checkpoint tensor fills several parameters (Ring-linear's fused attention projections);
    ``fused_experts``: gpt-oss's interleaved expert tensors), and a tiny random config (``tiny``: fields of its ``transformers`` config
    class, ``reference``: that class and its causal-LM class, under ``transformers``) whose
    zero-initialised sinks and biases may want noise (``noisy_biases``) and whose initial decays are
    kept as they are where they already remember long (``keeps_decay``: Bailing's bounded gate); ``study``: the fields of a
    random model of this architecture at a hidden size and layer count, its per-head linear state
    as the Qwen3.5 study model's (64 x 64), for ``hypic eval scaling`` (over ``tiny``'s other fields:
    ``checkpoints.write_random_checkpoint`` writes both, for the tests and the study alike)."""

    model_types: tuple[str, ...]
    parse: Parse
    tiny: dict[str, Any] = field(default_factory=dict)
    reference: tuple[str, str] | None = None
    wraps: tuple[str, ...] = ()
    rename: Callable[[ModelConfig, str], str] | None = None
    sources: Callable[[ModelConfig, dict[str, Source]], dict[str, Source]] | None = None
    fused_experts: bool = False
    noisy_biases: bool = False
    keeps_decay: bool = False
    study: Callable[[int, int], dict[str, Any]] | None = None


def every_fourth_full(layers: int) -> list[str]:
    """Layer kinds with a full-attention layer every fourth, as Qwen3.5's."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
