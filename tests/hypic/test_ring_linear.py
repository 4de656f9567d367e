"""Ring-linear-2.0 (``bailing_moe_linear``) against the independent reference of ``tests/reference``:
there is no ``transformers`` class, so the tiny checkpoint is written in the published tensor names
(``hypic_testing.tiny_models.write_published_checkpoint``) and the reference's token loop, written from the
architecture's definition, is the oracle. Also the published Ring-mini-linear-2.0 config, the slopes'
closed form, and the RoPE-in-state identity of its Lightning layers."""
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hypic import Engine
from hypic.assembler import combine
from hypic.cache.segments import Run
from hypic.errors import UnsupportedModel
from hypic.loading.loader import parameter_sources
from hypic.models.arch import parse_config
from hypic.models.families import empty_state, family_of
from hypic.models.rotary_linear import ring_slopes
from hypic.loading.safetensors_reader import TensorReader
from hypic_reference.model import ReferenceModel
from hypic_testing.tiny_models import write_published_checkpoint

BOUND = 1e-5  # fp32 logits: the same sums in another order (chunked recurrence, fused projections)
NAME = "bailing_moe_linear"
RING_MINI = {  # inclusionAI/Ring-mini-linear-2.0's config.json, the fields that shape the model
    "architectures": ["BailingMoeLinearV2ForCausalLM"], "model_type": "bailing_moe_linear", "eos_token_id": 156892,
    "first_k_dense_replace": 1, "group_norm_size": 4, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 5120, "layer_group_size": 5, "linear_silu": False, "max_position_embeddings": 131072,
    "moe_intermediate_size": 512, "moe_router_enable_expert_bias": True, "moe_shared_expert_intermediate_size": 512,
    "n_group": 8, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 256, "num_experts_per_tok": 8,
    "num_hidden_layers": 20, "num_key_value_heads": 4, "num_nextn_predict_layers": 0, "num_shared_experts": 1,
    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "routed_scaling_factor": 2.5, "router_dtype": "fp32", "score_function": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "use_bias": False, "use_qk_norm": True, "use_qkv_bias": False, "use_rmsnorm": True,
    "vocab_size": 157184,
}


def _prompt(seed: int, length: int = 150) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("seed, long_memory", [(0, False), (1, False), (0, True)])
def test_every_positions_logits_equal_the_reference(checkpoint_factory: Callable[..., Path], seed: int,
                                                    long_memory: bool) -> None:
    path = checkpoint_factory(NAME, seed, long_memory)
    engine, reference = Engine.from_pretrained(path), ReferenceModel(path)
    ids = _prompt(seed)
    expected = reference.run(reference.empty_state(), ids)[0]
    empty = empty_state(engine.model.config, "cpu", torch.float32)
    ours = combine(engine.model, ids, [Run(0, len(ids))], empty, logits_from=0).row_logits
    assert expected.std() > 100 * BOUND  # logits far from constant: the bound below means something
    assert (ours - expected).abs().max().item() <= BOUND


def test_greedy_decode_equals_the_reference(checkpoint_factory: Callable[..., Path]) -> None:
    """32 greedy tokens from a 150-token prefill, each step's logits within the bound."""
    path = checkpoint_factory(NAME, long_memory=True)
    engine, reference = Engine.from_pretrained(path), ReferenceModel(path)
    ids, expected_state = _prompt(7), reference.empty_state()
    prefill = engine.prefill(engine.parse(bytes(ids).decode("latin-1")), "full")
    logits, state = prefill.logits, prefill.state
    expected = reference.run(expected_state, state.token_ids)[0][-1]
    for _ in range(32):
        assert (logits - expected).abs().max().item() <= BOUND
        token = int(expected.argmax())
        assert int(logits.argmax()) == token
        logits, state = engine.decode_step(state, token)
        expected = reference.run(expected_state, [token])[0][-1]


def test_every_published_tensor_fills_a_parameter(checkpoint_factory: Callable[..., Path]) -> None:
    path = checkpoint_factory(NAME)
    reader = TensorReader(sorted(path.glob("*.safetensors")))
    try:
        config = parse_config(json.loads((path / "config.json").read_text()))
        sources, unused = parameter_sources(config, list(reader.index))
        past_the_stack = ["model.layers.4.attention.dense.weight", "model.layers.4.mlp.gate.weight"]  # an MTP layer
        assert parameter_sources(config, [*reader.index, *past_the_stack])[1] == []
    finally:
        reader.close()
    assert unused == []
    assert {"layers.1.mixer.q_proj.weight", "layers.1.mixer.v_proj.weight", "layers.0.mixer.qkv_proj.weight",
            "layers.2.mixer.q_norm.weight", "layers.3.mlp.router_bias"} <= set(sources)


def test_the_published_ring_mini_config() -> None:
    config = parse_config(RING_MINI)
    assert [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] == [4, 9, 14, 19]
    assert config.linear_family == "scalar_rope" and config.ring_linear.norm_groups == 4
    assert (config.linear_num_value_heads, config.linear_value_head_dim, config.linear_conv_kernel_dim) == (16, 128, 1)
    assert (config.num_key_value_heads, config.rotary_dim, config.rope.theta) == (4, 64, 1e6)
    assert config.mlp_only_layers == (0,) and config.shared_expert_intermediate_size == 512
    assert (config.routing.groups, config.routing.top_groups, config.routing.scaling) == (8, 4, 2.5)
    assert family_of(config).transition_shape(config) == (16,)  # T_C: one scalar per head
    longer = parse_config({**RING_MINI, "num_hidden_layers": 22})  # the vendor's rule for layers past the last group
    assert [i for i, kind in enumerate(longer.layer_types) if kind == "full_attention"] == [4, 9, 14, 19, 20, 21]


@pytest.mark.parametrize("change", [{"rope_scaling": {"type": "yarn", "factor": 4.0}}, {"linear_silu": True},
                                    {"use_qk_norm": False}, {"use_qkv_bias": True}, {"score_function": "softmax"},
                                    {"group_norm_size": 3}])
def test_what_hypic_does_not_model_is_refused(change: dict) -> None:
    with pytest.raises(UnsupportedModel):
        parse_config({**RING_MINI, **change})


def test_slopes_are_alibis_scaled_by_depth() -> None:
    """16 heads: 2^(-(h+1)/2); 12 heads (not a power of two): the 8-head slopes 2^-(h+1), then every other
    16-head slope 2^(-(2j+1)/2); both times 1 - l / (L - 1) + 1e-5 with l counted from 0 (the training
    code's form): Ring-mini's first layer decays at ALiBi's rates, its last at 1e-5 of them."""
    for layer in range(20):
        depth = 1 - layer / 19 + 1e-5
        expected = [2 ** (-(h + 1) / 2) * depth for h in range(16)]
        torch.testing.assert_close(ring_slopes(16, layer, 20), torch.tensor(expected), rtol=1e-6, atol=0)
    torch.testing.assert_close(ring_slopes(16, 0, 20)[0], torch.tensor(2 ** -0.5 * (1 + 1e-5)), rtol=1e-7, atol=0)
    torch.testing.assert_close(ring_slopes(16, 19, 20)[0], torch.tensor(2 ** -0.5 * 1e-5), rtol=1e-6, atol=0)
    twelve = [2.0 ** -(h + 1) for h in range(8)] + [2 ** (-(2 * j + 1) / 2) for j in range(4)]
    for layer in range(4):
        expected = torch.tensor(twelve) * (1 - layer / 3 + 1e-5)
        torch.testing.assert_close(ring_slopes(12, layer, 4), expected, rtol=1e-6, atol=0)


def test_a_zero_start_state_turns_with_its_start(tmp_path: Path) -> None:
    """A run's state from zero at start b equals the same run's at start a turned by R(b - a): what
    splicing a cached interior at another position relies on (q / k norms before RoPE included)."""
    engine = Engine.from_pretrained(write_published_checkpoint(tmp_path, NAME, seed=3))
    mixer = engine.model.layers[2].mixer
    x = torch.randn(40, engine.model.config.hidden_size, generator=torch.Generator().manual_seed(4))

    def zero_start(start: int) -> torch.Tensor:
        proj = mixer.project(x, torch.arange(start, start + x.shape[0]))
        inputs = mixer.recurrence_inputs(mixer.convolve(proj.pre_conv), proj)
        return mixer.recur(inputs, torch.zeros(mixer.heads, mixer.head_dim, mixer.head_dim)).state

    at_five, at_937 = zero_start(5), zero_start(937)
    assert (at_five - at_937).abs().max() > 1e-2  # the start matters ...
    torch.testing.assert_close(mixer.rotate_state(at_five, 932), at_937, atol=1e-5, rtol=1e-5)  # ... as a rotation
