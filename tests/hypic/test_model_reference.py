"""Our runtime vs the ``transformers`` reference models on tiny random checkpoints."""
from pathlib import Path
from typing import Callable

import pytest
import torch

from hypic import Engine
from hypic.assembler import combine
from hypic.loading.checkpoints import reference_classes
from hypic_testing.tiny_models import TINY_VARIANTS
from hypic.models.arch import parse_config
from hypic.cache.segments import Run
from hypic.models.families import empty_state

PROMPT_LENGTH, GREEDY_TOKENS = 150, 32


def _reference(path: Path) -> torch.nn.Module:
    import json

    model_type = json.loads((path / "config.json").read_text())["model_type"]
    return reference_classes(model_type)[1].from_pretrained(path).eval()


def _prompt(seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", sorted(TINY_VARIANTS))
@pytest.mark.parametrize("seed", [0, 1])
def test_full_prefill_logits_match_transformers(checkpoint_factory: Callable[..., Path], name: str, seed: int) -> None:
    path = checkpoint_factory(name, seed)
    engine, reference = Engine.from_pretrained(path), _reference(path)
    ids = _prompt(seed)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1].float()
    empty = empty_state(engine.model.config, "cpu", torch.float32)
    ours = combine(engine.model, ids, [Run(0, len(ids))], empty).logits
    assert (ours - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["qwen3_5_text-ratio2", "qwen3_next-moe", "qwen3_5-wrapper", "minimax",
                                  "minimax-residual-scales", "granitemoehybrid", "granitemoehybrid-dense-nope",
                                  "kimi_linear", "kimi_linear-dense-q-lora", "nemotron_h", "nemotron_h-dense",
                                  "nemotron_h-latent-moe", "gpt_oss", "mimo_v2_flash",
                                  "bailing_hybrid", "bailing_hybrid-dense-softplus"])
def test_greedy_decode_matches_transformers(checkpoint_factory: Callable[..., Path], name: str) -> None:
    """32 greedy tokens identical, and each decode step's logits equal a full forward of the extended ids."""
    path = checkpoint_factory(name)
    engine, reference = Engine.from_pretrained(path), _reference(path)
    ids = _prompt(7)
    prefill = engine.prefill(engine.parse(bytes(ids).decode("latin-1")), "full")
    state, logits, produced = prefill.state, prefill.logits, []
    assert state.token_ids == engine.tokenizer.encode(bytes(ids).decode("latin-1"))
    for _ in range(GREEDY_TOKENS):
        with torch.no_grad():
            expected = reference(torch.tensor([state.token_ids])).logits[0, -1].float()
        assert (logits - expected).abs().max().item() <= 1e-4
        produced.append(int(expected.argmax()))
        assert int(logits.argmax()) == produced[-1]
        logits, state = engine.decode_step(state, produced[-1])
    assert len(produced) == GREEDY_TOKENS


def test_decode_after_prefill_equals_prefill_of_extended_sequence(tiny_checkpoint: Path) -> None:
    engine = Engine.from_pretrained(tiny_checkpoint)
    ids = _prompt(3)
    empty = lambda: empty_state(engine.model.config, "cpu", torch.float32)  # noqa: E731 - consumed by combine
    state = combine(engine.model, ids[:100], [Run(0, 100)], empty()).state
    for token in ids[100:110]:
        logits, state = engine.decode_step(state, token)
    extended = combine(engine.model, ids[:110], [Run(0, 110)], empty())
    assert (logits - extended.logits).abs().max().item() <= 1e-5
    for ours, full in zip(state.layers, extended.state.layers):
        for a, b in zip(ours.tensors(), full.tensors()):
            assert torch.allclose(a, b, atol=1e-5)


def test_bfloat16_weights_run_with_fp32_states(tiny_checkpoint: Path) -> None:
    engine = Engine.from_pretrained(tiny_checkpoint, dtype="bfloat16")
    prefill = engine.prefill(engine.parse("hello hybrid world"), "full")
    linear = prefill.state.layers[0]
    assert engine.model.dtype == torch.bfloat16 and linear.recurrent.dtype == torch.float32
    assert torch.isfinite(prefill.logits).all()


def test_wrapper_config_unwraps_to_text_model(checkpoint_factory: Callable[..., Path]) -> None:
    import json

    raw = json.loads((checkpoint_factory("qwen3_5-wrapper") / "config.json").read_text())
    config = parse_config(raw)
    assert raw["model_type"] == "qwen3_5" and config.model_type == "qwen3_5_text"
    assert config.rotary_dim == 4 and config.linear_value_ratio == 2
