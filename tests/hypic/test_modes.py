"""Mode policies: what each mode caches (closed-form entry sizes) and how warm-up honours the mode."""
import random
from pathlib import Path

import pytest

from hypic import DEFAULT_SEPARATOR as SEP, Engine, InvalidRequest
from hypic.cache.composition import Family
from hypic.config import ModelConfig
from hypic.cache.store import LinearInterior

FP32 = 4
TRANSITION_FAMILY = {"gated_delta": Family.DENSE, "lightning": Family.SCALAR, "mamba2": Family.SCALAR,
                     "scalar_rope": Family.SCALAR, "gla": Family.DIAGONAL, "kda": Family.DENSE}


def _text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnop ,.") for _ in range(n))


def _entry_bytes(config: ModelConfig, interior: int, with_transition: bool) -> int:
    """Closed form of a public-pool entry of an fp32 model (paper Table 3): per linear layer S_C|0
    [Hv, K, V], with transitions T_C ([Hv, K, K] dense, [Hv, K] diagonal, [Hv] scalar), plus the conv tail [k-1, C]
    (none without a conv); per attention layer K and V of the interior (latent attention: one head of
    the normalised latent and the shared rope key part, the latent again as values)."""
    hv, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    channels = 2 * config.linear_num_key_heads * dk + hv * dv
    transition = {Family.DENSE: hv * dk * dk, Family.DIAGONAL: hv * dk, Family.SCALAR: hv}[
        TRANSITION_FAMILY[config.linear_family]]
    linear = hv * dk * dv + (config.linear_conv_kernel_dim - 1) * channels + (transition if with_transition else 0)
    mla = config.latent_attention
    if mla is None:
        attention = 2 * config.num_key_value_heads * interior * config.head_dim
    else:
        attention = interior * (mla.kv_lora_rank + mla.rope_dim + mla.kv_lora_rank)
    return FP32 * (len(config.linear_layers()) * linear + len(config.attention_layers()) * attention)


@pytest.fixture
def engine(family_checkpoint: Path) -> Engine:
    return Engine.from_pretrained(family_checkpoint, seam_width=8)


def test_naive_entries_hold_no_transition(engine: Engine) -> None:
    """The paper's naive addition caches S_C|0 of the whole segment only: no T_C is stored (the
    capture derives S_C|0 from the run's transition, then drops it)."""
    document = _text(1, 90)
    assert engine.warmup([document], mode="naive") == [90]
    (entry,) = engine.cache.public.entries.values()
    assert entry.local_start == 0 and entry.length == 90  # the whole segment, no seams
    assert all(layer.transition is None for layer in entry.layers if isinstance(layer, LinearInterior))
    assert entry.nbytes == engine.cache.public.nbytes == _entry_bytes(engine.model.config, 90, with_transition=False)


def test_hypic_entries_hold_transitions(engine: Engine) -> None:
    engine.warmup([_text(2, 90)])
    (entry,) = engine.cache.public.entries.values()
    assert (entry.local_start, entry.length) == (8, 90 - 16)
    assert entry.nbytes == _entry_bytes(engine.model.config, 90 - 16, with_transition=True)
    family = TRANSITION_FAMILY[engine.model.config.linear_family]
    assert {layer.transition.family for layer in entry.layers if isinstance(layer, LinearInterior)} == {family}


@pytest.mark.parametrize("mode", ["hypic", "naive"])
def test_warmed_documents_hit_in_the_same_mode(engine: Engine, mode: str) -> None:
    docs = [_text(3, 70), _text(4, 50)]
    engine.warmup(docs, mode=mode)
    result = engine.generate(SEP.join(["lead", *docs, "query"]), max_new_tokens=1, mode=mode)
    assert result.segments_hit == 2 and result.segments_missed == 0


@pytest.mark.parametrize("mode", ["prefix", "full"])
def test_warmup_refuses_modes_that_cache_no_segments(engine: Engine, mode: str) -> None:
    with pytest.raises(InvalidRequest, match=f"mode {mode} caches no segments"):
        engine.warmup([_text(5, 70)], mode=mode)
    assert len(engine.cache.public) == 0


def test_unknown_mode_is_refused(engine: Engine) -> None:
    with pytest.raises(InvalidRequest, match="mode must be one of"):
        engine.warmup([_text(6, 70)], mode="fast")


@pytest.mark.parametrize("dtype, size, bound", [("bfloat16", 2, 1e-2), ("float16", 2, 2e-3)])
def test_narrow_state_cache_halves_entries_and_stays_near_exact(tiny_checkpoint: Path, dtype: str, size: int,
                                                              bound: float) -> None:
    """T_C and S_C|0 stored in 16 bits: the entry's state bytes halve (closed form) and layer 0 is
    off full recompute by the storage rounding only."""
    wide = Engine.from_pretrained(tiny_checkpoint, seam_width=8)
    narrow = Engine.from_pretrained(tiny_checkpoint, seam_width=8, state_cache_dtype=dtype)
    docs = [_text(20, 120), _text(21, 90)]
    prompt = SEP.join(["lead", *docs, "query"])
    for engine in (wide, narrow):
        engine.warmup(docs)
    config = wide.model.config
    hv, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    state_bytes = len(config.linear_layers()) * hv * dk * (dk + dv)
    assert wide.cache.public.nbytes - narrow.cache.public.nbytes == 2 * state_bytes * (FP32 - size)
    first = config.linear_layers()[0]
    full = wide.prefill(wide.parse(prompt), "full").state.layers[first].recurrent
    errors = {}
    for name, engine in (("wide", wide), ("narrow", narrow)):
        state = engine.prefill(engine.parse(prompt), "hypic").state.layers[first].recurrent
        errors[name] = ((state - full).norm() / full.norm()).item()
    assert errors["wide"] <= 1e-5 and 1e-6 < errors["narrow"] <= bound, errors
