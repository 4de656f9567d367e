"""A received entry is checked against its own token ids and the model's shapes before use."""
import dataclasses

import pytest
import torch

from hypic import Engine
from hypic.router import TransferError, check_entry
from hypic.cache.store import AttentionInterior, Role
from hypic.models.families import linear_shapes


@pytest.fixture(scope="module")
def built() -> tuple[Engine, object]:
    engine = Engine.from_pretrained("default")
    ids = tuple(engine.tokenizer.encode("Record 1: the heron of Welby was born in 1907 near the river."))
    return engine, engine.segment_entry(ids, engine.policy("hypic"))[0]


def _check(engine: Engine, entry: object, role: Role = Role.SEGMENT) -> None:
    check_entry(entry, engine.fingerprint, role, engine.model.config, linear_shapes(engine.model.config))


def test_an_intact_entry_passes(built) -> None:
    _check(*built)


def test_other_token_ids_under_the_key_are_refused(built) -> None:
    engine, entry = built
    with pytest.raises(TransferError, match="does not address"):
        _check(engine, dataclasses.replace(entry, token_ids=entry.token_ids[:-1] + (entry.token_ids[-1] + 1,)))
    with pytest.raises(TransferError, match="does not address"):
        _check(engine, entry, Role.NAIVE_SEGMENT)


def test_wrong_shapes_are_refused(built) -> None:
    engine, entry = built
    index = engine.model.config.attention_layers()[0]
    layers = list(entry.layers)
    cut = layers[index]
    layers[index] = AttentionInterior(cut.keys[:, :-1], cut.values[:, :-1])
    with pytest.raises(TransferError, match=f"layer {index}"):
        _check(engine, dataclasses.replace(entry, layers=layers))
    with pytest.raises(TransferError, match="layers"):
        _check(engine, dataclasses.replace(entry, layers=entry.layers[:-1]))
    with pytest.raises(TransferError, match="interior"):
        _check(engine, dataclasses.replace(entry, length=entry.length + 1))
    linear = engine.model.config.linear_layers()[0]
    layers = list(entry.layers)
    layers[linear] = dataclasses.replace(layers[linear], zero_start_state=torch.zeros(1, 2, 3))
    with pytest.raises(TransferError, match=f"layer {linear}"):
        _check(engine, dataclasses.replace(entry, layers=layers))


def test_a_scalar_transition_entry_passes_and_a_dense_one_is_refused(checkpoint_factory) -> None:
    """Lightning layers' T_C is [H]: an intact MiniMax entry passes; one carrying a [H, K, K] T does not."""
    from hypic.cache.composition import Family, Transition

    engine = Engine.from_pretrained(checkpoint_factory("minimax"))
    entry = engine.segment_entry(tuple(range(40, 100)), engine.policy("hypic"))[0]
    _check(engine, entry)
    linear = engine.model.config.linear_layers()[0]
    heads, dim = engine.model.config.linear_num_value_heads, engine.model.config.linear_key_head_dim
    layers = list(entry.layers)
    layers[linear] = dataclasses.replace(layers[linear], transition=Transition(Family.DENSE, torch.eye(dim).repeat(heads, 1, 1)))
    with pytest.raises(TransferError, match=f"layer {linear}"):
        _check(engine, dataclasses.replace(entry, layers=layers))


def test_a_latent_attention_entry_passes_and_wide_values_are_refused(checkpoint_factory) -> None:
    """Kimi-Linear caches its latent: values kv_lora_rank wide, keys kv_lora_rank + rope: an intact entry
    passes; one whose values are as wide as its keys does not."""
    engine = Engine.from_pretrained(checkpoint_factory("kimi_linear"))
    entry = engine.segment_entry(tuple(range(40, 100)), engine.policy("hypic"))[0]
    _check(engine, entry)
    index = engine.model.config.attention_layers()[0]
    layers = list(entry.layers)
    keys = layers[index].keys
    assert layers[index].values.shape[-1] == engine.model.config.latent_attention.kv_lora_rank < keys.shape[-1]
    layers[index] = AttentionInterior(keys, torch.zeros_like(keys))
    with pytest.raises(TransferError, match=f"layer {index}"):
        _check(engine, dataclasses.replace(entry, layers=layers))


@pytest.mark.parametrize("name", ["gpt_oss", "mimo_v2_flash"])
def test_a_sliding_window_entry_passes_and_a_whole_interior_is_refused(checkpoint_factory, name: str) -> None:
    """A sliding layer ships its interior's last W tokens (MiMo: twice the KV heads, values narrower
    than keys): an intact entry passes, one carrying the sliding layer's whole interior does not."""
    engine = Engine.from_pretrained(checkpoint_factory(name))
    config = engine.model.config
    entry = engine.segment_entry(tuple(range(40, 100)), engine.policy("hypic"))[0]
    _check(engine, entry)
    index = config.window_layers()[0]
    window = config.sliding_window.size
    layer = entry.layers[index]
    assert layer.keys.shape == (config.kv_heads(index), window, config.head_dim) and entry.length > window
    assert layer.values.shape[-1] == config.attention_value_dim
    layers = list(entry.layers)
    heads = config.kv_heads(index)
    layers[index] = AttentionInterior(torch.zeros(heads, entry.length, config.head_dim),
                                      torch.zeros(heads, entry.length, config.attention_value_dim))
    with pytest.raises(TransferError, match=f"layer {index}"):
        _check(engine, dataclasses.replace(entry, layers=layers))
