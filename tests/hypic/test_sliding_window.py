"""Sliding-window hybrids (gpt-oss, MiMo-V2-Flash; their logits and greedy decode equal transformers'
in test_model_reference.py): a request's sliding-window KV is a ring of W tokens however long the
context grows; the private pool resumes only where a sliding layer's last W tokens are kept whole;
a cached document keeps W tokens per sliding layer and its whole interior per full layer."""
import random
from pathlib import Path
from typing import Callable

import pytest
import torch

from hypic import DEFAULT_SEPARATOR as SEP, Engine
from hypic.config import ModelConfig
from hypic.models.arch import parse_config
from hypic.sizing import default_snapshot_interval
from hypic.state import AttentionLayerState, WindowLayerState

SWA_CHECKPOINTS = ("gpt_oss", "mimo_v2_flash")
MIMO_V2_FLASH = dict(  # the fields of XiaomiMiMo/MiMo-V2-Flash's config.json that size its KV
    model_type="mimo_v2_flash", vocab_size=152576, hidden_size=4096, intermediate_size=16384, moe_intermediate_size=2048,
    num_hidden_layers=48, num_attention_heads=64, num_key_value_heads=4, head_dim=192, v_head_dim=128,
    sliding_window_size=128, n_routed_experts=256, num_experts_per_tok=8,
)
FP32 = 4


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnop ,.") for _ in range(n))


def _token_bytes(config: ModelConfig, index: int) -> int:
    """K and V of one token in attention layer ``index`` (fp32)."""
    return config.kv_heads(index) * (config.head_dim + config.attention_value_dim) * FP32


@pytest.fixture(params=SWA_CHECKPOINTS)
def checkpoint(request: pytest.FixtureRequest, checkpoint_factory: Callable[..., Path]) -> Path:
    return checkpoint_factory(request.param)


def test_rings_hold_w_tokens_however_long_the_context(checkpoint: Path) -> None:
    """Prefill 150 tokens (18 windows), then decode 40: each sliding layer holds exactly the last W
    positions in W slots (its bytes never grow); each full layer holds every token; the admission
    budget's closed form equals the state's bytes."""
    engine = Engine.from_pretrained(checkpoint)
    config, rng = engine.model.config, random.Random(0)
    prefill = engine.prefill(engine.parse(_text(rng, 150)), "full")
    state, logits = prefill.state, prefill.logits
    assert engine.state_bytes(state.length) == state.nbytes
    window_bytes = sum(config.sliding_window.size * _token_bytes(config, i) for i in config.window_layers())
    windows = config.window_layers()
    assert windows and config.sliding_window is not None
    window = config.sliding_window.size
    for _ in range(40):
        for index, layer in enumerate(state.layers):
            if index in windows:
                assert isinstance(layer, WindowLayerState)
                assert layer.nbytes == window * _token_bytes(config, index)
                assert layer.held()[2].tolist() == list(range(state.length - window, state.length))
            else:
                assert isinstance(layer, AttentionLayerState) and layer.length == state.length
        assert state.window_nbytes == window_bytes
        logits, state = engine.decode_step(state, int(logits.argmax()))


def test_hypic_without_interiors_is_full(checkpoint: Path) -> None:
    """Every document shorter than 2w + 1: nothing is spliced and hypic is full recompute."""
    engine, rng = Engine.from_pretrained(checkpoint, seam_width=64), random.Random(1)
    prompt = SEP.join([_text(rng, 24), *(_text(rng, 100) for _ in range(3)), _text(rng, 20)])
    full = engine.prefill(engine.parse(prompt), "full")
    hypic = engine.prefill(engine.parse(prompt), "hypic")
    assert (hypic.logits - full.logits).abs().max().item() <= 1e-5
    assert engine.generate(prompt, max_new_tokens=8, mode="hypic").output_ids == \
           engine.generate(prompt, max_new_tokens=8, mode="full").output_ids


def test_an_entry_keeps_w_tokens_per_sliding_layer(checkpoint: Path) -> None:
    """A 90-token document (interior 74 tokens at w = 8): per full layer its 74 tokens' K and V, per
    sliding layer the last W of them, which are the keys a ring holds after prefilling the
    document alone up to the interior's end (rotated at the same local positions)."""
    engine, rng = Engine.from_pretrained(checkpoint, seam_width=8), random.Random(2)
    document = _text(rng, 90)
    engine.warmup([document])
    (entry,) = engine.cache.public.entries.values()
    config = engine.model.config
    window = config.sliding_window.size
    assert (entry.local_start, entry.length) == (8, 74)
    expected = sum((74 if config.window(i) is None else window) * _token_bytes(config, i) for i in config.attention_layers())
    assert entry.nbytes == engine.cache.public.nbytes == expected
    alone = engine.prefill(engine.parse(document[:82]), "full").state  # the document's first 8 + 74 tokens
    for index in config.window_layers():
        keys, values, positions = alone.layers[index].held()
        assert positions.tolist() == list(range(82 - window, 82))
        assert torch.allclose(entry.layers[index].keys, keys, atol=1e-5)
        assert torch.allclose(entry.layers[index].values, values, atol=1e-5)


def test_reuse_recomputes_only_leading_seams_and_query(checkpoint: Path) -> None:
    engine, rng = Engine.from_pretrained(checkpoint, seam_width=8), random.Random(3)
    docs, query = [_text(rng, n) for n in (60, 90, 120)], _text(rng, 20)
    engine.generate(SEP.join(["first system prompt", *docs, query]), max_new_tokens=1)
    leading = "another one"
    result = engine.generate(SEP.join([leading, *reversed(docs), query]), max_new_tokens=1)
    assert result.segments_hit == 3 and result.segments_missed == 0
    assert result.stats.combine_tokens == len(leading) + 2 * 8 * 3 + len(query)
    assert result.cached_tokens == sum(len(d) - 16 for d in docs)


@pytest.mark.parametrize("window_budget", [None, 0])
def test_a_resume_point_without_its_window_tail_is_no_hit(checkpoint: Path, window_budget: int | None) -> None:
    """The private pool keeps a sliding layer's last W tokens only in its resume points; under a
    window budget of 0 every tail is evicted at once (the full-attention KV stays), so a prompt
    sharing the prefix must not resume there: it recomputes, with full's output. Unbounded, it
    resumes at the deepest resume point, with full's output too."""
    engine = Engine.from_pretrained(checkpoint, snapshot_interval=32, private_window_bytes=window_budget)
    rng = random.Random(4)
    shared = _text(rng, 130)
    engine.generate(shared + _text(rng, 20), max_new_tokens=1, mode="prefix")
    other = shared + _text(rng, 25)
    resumed = engine.generate(other, max_new_tokens=6, mode="prefix")
    assert resumed.output_ids == engine.generate(other, max_new_tokens=6, mode="full").output_ids
    pool = engine.cache.private
    if window_budget == 0:
        assert resumed.cached_tokens == 0 and pool.window_nbytes == 0 and pool.window_evictions > 0
        assert len(pool) > 0  # the edges' full-attention KV is still there
    else:
        assert resumed.cached_tokens == 128  # the snapshot every 32 tokens within the shared 130
        assert pool.window_nbytes > 0 and pool.window_evictions == 0


def test_resume_points_of_sliding_window_models_are_sparser() -> None:
    """MiMo-V2-Flash: a resume point's tails are 39 sliding layers x 129 tokens x 8 heads x (192 + 128);
    one token of full-attention KV is 9 layers x 4 heads x (192 + 128): 1118 tokens cost as much,
    rounded up to 1280. Models without sliding layers keep 256."""
    config = parse_config(MIMO_V2_FLASH)
    assert (len(config.window_layers()), len(config.attention_layers())) == (39, 48)
    assert -(-(39 * 129 * 8 * 320) // (9 * 4 * 320)) == 1118
    assert default_snapshot_interval(config) == 1280
    assert default_snapshot_interval(parse_config({**MIMO_V2_FLASH, "sliding_window_size": 12})) == 256


def test_the_window_budget_drops_the_least_recently_used_tails_first(checkpoint: Path) -> None:
    """Two prompts' resume points, a window budget that holds the second's tails only: the first's
    are dropped (it recomputes), the second's kept (it resumes), both with full's output."""
    rng = random.Random(5)
    first, second = _text(rng, 100), _text(rng, 100)
    probe = Engine.from_pretrained(checkpoint, snapshot_interval=32)
    probe.generate(first + _text(rng, 10), max_new_tokens=1, mode="prefix")
    first_bytes = probe.cache.private.window_nbytes
    probe.generate(second + _text(rng, 10), max_new_tokens=1, mode="prefix")
    budget = probe.cache.private.window_nbytes - first_bytes
    engine = Engine.from_pretrained(checkpoint, snapshot_interval=32, private_window_bytes=budget)
    engine.generate(first + _text(rng, 10), max_new_tokens=1, mode="prefix")
    engine.generate(second + _text(rng, 10), max_new_tokens=1, mode="prefix")
    assert engine.cache.private.window_evictions > 0
    for shared, resumes in ((second, True), (first, False)):
        prompt = shared + _text(rng, 12)
        result = engine.generate(prompt, max_new_tokens=4, mode="prefix")
        assert (result.cached_tokens > 0) == resumes
        assert result.output_ids == engine.generate(prompt, max_new_tokens=4, mode="full").output_ids
