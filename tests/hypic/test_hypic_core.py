"""HYPIC's cache operations vs full recompute: layer-0 exactness, seams, re-rotation, reuse."""
import random
from pathlib import Path

import pytest
import torch

from hypic import DEFAULT_SEPARATOR as SEP, Engine
from hypic.config import RopeConfig
from hypic.models.rope import RotaryEmbedding
from hypic.cache.segments import (Run, Seams, Splice, build_layout, document_boundaries, separator_near_misses,
                                  spliceable, split_prompt)


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnop ,.") for _ in range(n))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def engine(family_checkpoint: Path) -> Engine:
    return Engine.from_pretrained(family_checkpoint, seam_width=8)


def _request(seed: int, documents: int = 4) -> tuple[str, list[str], str]:
    rng = random.Random(seed)
    return _text(rng, 24), [_text(rng, rng.randint(40, 160)) for _ in range(documents)], _text(rng, 20)


@pytest.mark.parametrize("seam_width", [0, 1, 2, 3, 8])
def test_layer0_composed_state_equals_full_recompute(family_checkpoint: Path, seam_width: int) -> None:
    """Every family (Gated DeltaNet: dense T_C; Lightning, Mamba2: scalar T_C): composing cached (T_C, S_C|0)
    is exact at layer 0 for every w, the conv warm-up included (the head seam is at least k - 1 tokens)."""
    engine = Engine.from_pretrained(family_checkpoint, seam_width=seam_width)
    for seed in range(3):
        leading, docs, query = _request(seed)
        prompt = leading + SEP + SEP.join(docs) + SEP + query
        engine.warmup(docs)
        hypic = engine.prefill(engine.parse(prompt), "hypic")
        full = engine.prefill(engine.parse(prompt), "full")
        assert hypic.stats.segments_hit == 4
        first = engine.model.config.linear_layers()[0]
        error = _rel(hypic.state.layers[first].recurrent, full.state.layers[first].recurrent)
        assert error <= 1e-5, f"seed {seed}: layer-0 relative error {error:.2e}"
        assert torch.allclose(hypic.state.layers[first].conv, full.state.layers[first].conv, atol=1e-6)


def test_naive_addition_differs_measurably_hypic_does_not(engine: Engine) -> None:
    leading, docs, query = _request(11)
    prompt = leading + SEP + SEP.join(docs) + SEP + query
    states = {mode: engine.prefill(engine.parse(prompt), mode).state for mode in ("full", "hypic", "naive")}
    first = engine.model.config.linear_layers()[0]
    errors = {mode: _rel(states[mode].layers[first].recurrent, states["full"].layers[first].recurrent)
              for mode in ("hypic", "naive")}
    print(f"layer-0 relative state error: hypic {errors['hypic']:.2e}, naive {errors['naive']:.3f}")
    assert errors["hypic"] <= 1e-5 and errors["naive"] >= 0.05


def test_no_interior_means_hypic_is_full_recompute(family_checkpoint: Path) -> None:
    """All segments shorter than 2w+1: nothing is spliced and the output equals full recompute."""
    engine = Engine.from_pretrained(family_checkpoint, seam_width=64)
    leading, docs, query = _request(5)
    prompt = leading + SEP + SEP.join(d[:100] for d in docs) + SEP + query
    full = engine.generate(prompt, max_new_tokens=12, mode="full")
    hypic = engine.generate(prompt, max_new_tokens=12, mode="hypic")
    assert hypic.stats.segments_hit == hypic.stats.segments_missed == 0
    assert hypic.output_ids == full.output_ids
    a, b = engine.prefill(engine.parse(prompt), "full"), engine.prefill(engine.parse(prompt), "hypic")
    assert (a.logits - b.logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("partial", [0.25, 1.0])
def test_key_rerotation_equals_rotation_at_global_positions(partial: float) -> None:
    rope = RotaryEmbedding(RopeConfig(theta=10000.0, partial_rotary_factor=partial), head_dim=32)
    keys = torch.randn(3, 50, 32)  # [H, N, D] un-rotated
    local = torch.arange(8, 58)
    at_local = rope.apply(keys.transpose(0, 1), local).transpose(0, 1)
    shifts = torch.tensor([1234] * 30 + [-5] * 20)  # two interiors moved by different offsets at once
    at_global = rope.apply(keys.transpose(0, 1), local + shifts).transpose(0, 1)
    assert torch.allclose(rope.apply(at_local.transpose(0, 1), shifts).transpose(0, 1), at_global, atol=1e-4)
    if partial < 1:
        assert torch.equal(at_local[..., rope.rotary_dim :], keys[..., rope.rotary_dim :])


def test_second_request_recomputes_only_seams_and_query(engine: Engine) -> None:
    leading, docs, query = _request(21)
    first = leading + SEP + SEP.join(docs) + SEP + query
    engine.generate(first, max_new_tokens=1)
    other_leading = "a different system prompt"
    second = other_leading + SEP + SEP.join(reversed(docs)) + SEP + query
    result = engine.generate(second, max_new_tokens=1)
    w, lengths = engine.seam_width, [len(engine.tokenizer.encode(d)) for d in docs]
    assert result.segments_hit == 4 and result.segments_missed == 0
    new_leading = len(engine.tokenizer.encode(other_leading))
    assert result.stats.combine_tokens == new_leading + 2 * w * 4 + len(engine.tokenizer.encode(query))
    assert result.cached_tokens == sum(n - 2 * w for n in lengths)
    assert result.recomputed_tokens == result.prompt_tokens - result.cached_tokens == result.stats.combine_tokens


def test_prefix_mode_repeated_prompt_recomputes_only_its_last_token(engine: Engine) -> None:
    """The private pool keeps a snapshot before each prompt's last token: the same prompt again
    resumes there (the last token must run: its logits start generation), with full's output."""
    leading, docs, query = _request(31)
    prompt = leading + SEP + docs[0] + SEP + query
    first = engine.generate(prompt, max_new_tokens=1, mode="prefix")
    again = engine.generate(prompt, max_new_tokens=4, mode="prefix")
    full = engine.generate(prompt, max_new_tokens=4, mode="full")
    assert first.cached_tokens == 0
    assert again.cached_tokens == again.stats.prefix_hit_tokens == again.prompt_tokens - 1
    assert again.output_ids == full.output_ids


def test_hypic_drift_above_layer0_is_bounded(engine: Engine) -> None:
    """Deeper layers see isolated-prefill inputs (the paper's Table 4 effect): small, not zero."""
    leading, docs, query = _request(41)
    prompt = leading + SEP + SEP.join(docs) + SEP + query
    hypic, full = engine.prefill(engine.parse(prompt), "hypic"), engine.prefill(engine.parse(prompt), "full")
    deepest = engine.model.config.linear_layers()[-1]
    drift = _rel(hypic.state.layers[deepest].recurrent, full.state.layers[deepest].recurrent)
    print(f"deepest linear layer drift: {drift:.3%}")
    assert 0 < drift < 0.5


def test_layout_runs_and_splices() -> None:
    parts = split_prompt("L" + SEP + "x" * 30 + SEP + "y" * 10 + SEP + "z" * 30 + SEP + "QQ", lambda s: list(s.encode()))
    seams = Seams(4, 4)
    assert spliceable(parts, seams) == [0, 1, 2] and spliceable(parts, Seams(5, 5)) == [0, 2]
    pieces = build_layout(parts, seams, spliced={0, 2})
    assert pieces == [Run(0, 5), Splice(0, 5, 22), Run(27, 18), Splice(2, 45, 22), Run(67, 6)]
    assert build_layout(parts, Seams(3, 0), spliced={0, 1, 2})[-3:] == [Run(41, 3), Splice(2, 44, 27), Run(71, 2)]
    # resuming at 35 (inside segment 1, a private-pool hit): only what follows is laid out
    assert build_layout(parts, seams, spliced={2}, start=35) == [Run(35, 10), Splice(2, 45, 22), Run(67, 6)]
    assert document_boundaries(parts) == [1, 31, 41, 71]
    # the last token is never spliced: with no tail seam, a segment ending the prompt is recomputed
    no_query = split_prompt("L" + SEP + "x" * 30 + SEP, lambda s: list(s.encode()))
    assert spliceable(no_query, Seams(3, 0)) == [] and spliceable(no_query, Seams(3, 1)) == [0]
    with pytest.raises(ValueError, match="cannot be spliced"):
        build_layout(no_query, Seams(3, 0), spliced={0})


def _near_misses(text: str, separator: str = SEP) -> list[str]:
    """What each warning says was seen."""
    return [w.split(" at character")[0].removeprefix("the prompt holds ") for w in separator_near_misses(text, separator)]


def test_near_misses_of_the_separator_are_found_once_each() -> None:
    """Its name with other brackets, another case or ``-`` for ``_`` is a near miss; the exact
    separator, the bare name (prose) and a separator with no name are not."""
    found = _near_misses
    assert found(f"a <<PIC_SEP> b <PIC_SEP>> c <<pic-sep>> d {SEP} e <<PIC_SEP> f") == [
        "<<PIC_SEP>", "<PIC_SEP>>", "<<pic-sep>>"]
    assert found(f"{SEP}{SEP} about PIC_SEP in prose") == [] and found("a ||| b || c", "|||") == []
    assert found("x [[DOC]] y [DOC]]", "[[DOC]]") == ["[DOC]]"]
    parts = split_prompt("lead <<PIC_SEP> doc", lambda s: list(s.encode()))
    assert parts.segments == () and len(parts.warnings) == 1  # carried on the parts, served as text


def test_seams_exclude_the_conv_window_at_the_head() -> None:
    assert Seams.for_model(0, 4) == Seams(3, 0) and Seams.for_model(2, 4) == Seams(3, 2)
    assert Seams.for_model(8, 4) == Seams(8, 8) and Seams.for_model(0, 1) == Seams(0, 0)
    assert Seams(3, 2).interior(6) == (3, 4) and Seams(3, 2).interior(5) is None
