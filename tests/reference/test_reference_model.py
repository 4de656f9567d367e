"""The reference forward equals ``transformers``' models, so it can stand as the oracle of HYPIC's
semantics: every position's logits of a full forward, and greedy decoding run by the reference
one token at a time (its state carried between runs). The 150-token prompt is many windows of the
sliding-window hybrids (window 8), so their masks, sinks and per-kind RoPE are all exercised."""
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hypic.loading.checkpoints import reference_classes
from hypic_testing.tiny_models import REFERENCE_MODEL_TYPES, TINY_VARIANTS
from hypic_reference.model import ReferenceModel

TOLERANCE = 1e-4
SLIDING_WINDOW_TYPES = ("gpt_oss", "mimo_v2_flash")  # run by hypic_reference too (not yet in REFERENCE_MODEL_TYPES)
CHECKED_TYPES = frozenset(REFERENCE_MODEL_TYPES) | frozenset(SLIDING_WINDOW_TYPES)


def _transformers_model(path: Path) -> torch.nn.Module:
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    return reference_classes(model_type)[1].from_pretrained(path).eval()


def _prompt(seed: int, length: int = 150) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("long_memory", [False, True])
@pytest.mark.parametrize("name", sorted(n for n, (t, _) in TINY_VARIANTS.items() if t in CHECKED_TYPES))
def test_reference_forward_equals_transformers(checkpoint_factory: Callable[..., Path], name: str,
                                               long_memory: bool) -> None:
    """All positions' logits, with the prompt fed in three runs of different lengths."""
    path = checkpoint_factory(name, long_memory=long_memory)
    ids = _prompt(int(long_memory))
    with torch.no_grad():
        expected = _transformers_model(path)(torch.tensor([ids])).logits[0].float()
    model = ReferenceModel(path)
    state = model.empty_state()
    ours = torch.cat([model.run(state, ids[lo:hi])[0] for lo, hi in ((0, 61), (61, 62), (62, len(ids)))])
    assert (ours - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("name", ["qwen3_5_text-ratio2", "qwen3_next-moe", "qwen3_5-wrapper", "gpt_oss-clamped",
                                  "mimo_v2_flash"])
def test_reference_greedy_decode_equals_transformers(checkpoint_factory: Callable[..., Path], name: str) -> None:
    path = checkpoint_factory(name, long_memory=True)
    oracle, model = _transformers_model(path), ReferenceModel(path)
    ids, state = _prompt(7), model.empty_state()
    logits = model.run(state, ids)[0][-1]
    for _ in range(24):
        with torch.no_grad():
            expected = oracle(torch.tensor([ids])).logits[0, -1].float()
        assert (logits - expected).abs().max().item() <= TOLERANCE
        assert int(logits.argmax()) == int(expected.argmax())
        ids.append(int(expected.argmax()))
        logits = model.run(state, [ids[-1]])[0][-1]
