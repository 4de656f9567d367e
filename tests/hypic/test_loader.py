"""The loader: streamed tensors (bounded host memory), dtype auto, and float8 tensors refused without a
quantization_config (quantized checkpoints: test_quantized_checkpoints.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hypic import Engine, UnsupportedModel
from hypic.loading.checkpoints import write_random_checkpoint
from hypic.models.arch import parse_config
from hypic.models import HybridModel

PEAK_SCRIPT = """
import re, sys
from pathlib import Path
from hypic.loading.loader import load_model
from hypic.loading.safetensors_reader import TensorReader

def status(field):
    return int(re.search(rf"{field}:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

path, warm = Path(sys.argv[1]), Path(sys.argv[2])
largest = max(i.end - i.begin for i in TensorReader(sorted(path.glob("*.safetensors"))).index.values())
load_model(warm)  # first-use costs (imports, thread pools, allocator set-up) stay outside the measurement
open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) from here
base = status("VmRSS")
model = load_model(path)
size = sum(p.numel() * p.element_size() for p in model.parameters())
print(status("VmHWM") - base, size, largest)
"""


def test_peak_host_memory_is_the_model_plus_about_one_tensor(tmp_path: Path, checkpoint_factory) -> None:
    """A ~70 MB MoE checkpoint (packed qkvz, per-expert tensors) loaded in a fresh process: the peak
    resident memory it adds stays under the model's size + 1.5 x its largest tensor."""
    path = write_random_checkpoint(tmp_path / "ckpt", "qwen3_next", 0, hidden_size=512, intermediate_size=1024,
                                   vocab_size=8000, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                   linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4,
                                   linear_num_value_heads=8, num_experts=8, num_experts_per_tok=2,
                                   moe_intermediate_size=256, shared_expert_intermediate_size=256)
    warm = checkpoint_factory("qwen3_next-moe")
    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path), str(warm)], capture_output=True, text=True,
                          check=True)
    peak, size, largest = map(int, done.stdout.split())
    print(f"peak {peak / 1e6:.1f} MB, model {size / 1e6:.1f} MB, largest tensor {largest / 1e6:.1f} MB")
    assert size > 50e6 and peak <= size + 1.5 * largest


def test_float8_tensors_are_refused_by_dtype(tiny_copy: Path) -> None:
    path = tiny_copy
    tensors = load_file(str(path / "model.safetensors"))
    key = "model.layers.0.mlp.up_proj.weight"
    tensors[key] = tensors[key].to(torch.float8_e4m3fn)
    tensors[key.replace("weight", "weight_scale")] = torch.ones(1)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match="F8_E4M3.*up_proj"):
        Engine.from_pretrained(path)


def test_dtype_auto_is_the_checkpoint_dtype_where_the_cpu_computes_it(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "ckpt", "qwen3_5_text", 0)
    assert Engine.from_pretrained(path).model.dtype == torch.float32
    tensors = {k: v.bfloat16() for k, v in load_file(str(path / "model.safetensors")).items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert Engine.from_pretrained(path).model.dtype == (torch.bfloat16 if native else torch.float32)
    assert Engine.from_pretrained(path, dtype="bfloat16").model.dtype == torch.bfloat16
    state = Engine.from_pretrained(path, dtype="bfloat16").prefill(Engine.from_pretrained(path).parse("abc"), "full").state
    assert state.layers[0].recurrent.dtype == torch.float32  # linear states stay fp32


NEMOTRON_FIELDS = dict(model_type="nemotron_h", vocab_size=320, hidden_size=64, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=4, mamba_head_dim=32,
                       ssm_state_size=16, n_groups=2, conv_kernel=4, n_routed_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, moe_shared_expert_intermediate_size=48)


def test_nemotron_blocks_group_into_mixer_layers() -> None:
    """Each Mamba2 / attention block starts a layer of ours; an MLP / MoE block right after it joins it."""
    config = parse_config({**NEMOTRON_FIELDS, "hybrid_override_pattern": "M-*EMM-"})
    assert config.layer_types == ("linear_attention", "full_attention", "linear_attention", "linear_attention")
    assert config.blocks.mixer_blocks == (0, 2, 4, 5) and config.blocks.ffn_blocks == (1, 3, None, 6)
    assert [config.has_feed_forward(i) for i in range(4)] == [True, True, False, True]
    assert [config.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    model = HybridModel(config)  # Nemotron-H's norms multiply their weight in fp32 (tests/hypic/test_norms.py)
    assert model.norm.weight_in_fp32 and model.layers[0].input_layernorm.weight_in_fp32
    assert not hasattr(model.layers[2], "post_attention_layernorm") and model.layers[2].mlp is None


@pytest.mark.parametrize("pattern", ["-M", "M--", "MEE*"])
def test_nemotron_feed_forward_without_a_mixer_before_it_is_refused(pattern: str) -> None:
    with pytest.raises(UnsupportedModel, match="does not follow a Mamba2 or attention block"):
        parse_config({**NEMOTRON_FIELDS, "hybrid_override_pattern": pattern})


def test_bailing_loads_from_transformers_names_as_from_lings(tmp_path: Path, checkpoint_factory) -> None:
    """A Bailing-hybrid checkpoint saved under transformers' module names (self_attn, forget_gate.*, one packed
    conv1d, o_proj, e_score_correction_bias, embed_tokens) instead of Ling's (attention, separate q/k/v convs,
    dense, expert_bias, word_embeddings) gives the same logits as transformers' model of the original."""
    from hypic.assembler import combine
    from hypic.cache.segments import Run
    from hypic.loading.checkpoints import reference_classes
    from hypic.models.families import empty_state

    original = checkpoint_factory("bailing_hybrid")
    reference = reference_classes("bailing_hybrid")[1].from_pretrained(original).eval()
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    state = {name: tensor.contiguous() for name, tensor in reference.state_dict().items()}
    assert any(".forget_gate.f_proj." in name for name in state) and any(name.endswith("conv1d.weight") for name in state)
    save_file(state, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json"):
        (renamed / name).write_bytes((original / name).read_bytes())
    ids = list(range(3, 120))
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1].float()
    engine = Engine.from_pretrained(renamed)
    empty = empty_state(engine.model.config, "cpu", torch.float32)
    assert (combine(engine.model, ids, [Run(0, len(ids))], empty).logits - expected).abs().max().item() <= 1e-4


def test_bailing_with_scaled_rope_is_refused() -> None:
    from hypic.loading.checkpoints import FAMILY_CONFIGS

    raw = {**FAMILY_CONFIGS["bailing_hybrid"], "model_type": "bailing_hybrid",
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}
    with pytest.raises(UnsupportedModel, match="rope_type yarn is"):
        parse_config(raw)


def test_initialisation_is_skipped_only_while_the_model_is_built() -> None:
    from hypic.loading.loader import initialisation_skipped
    before = torch.nn.init.normal_
    with pytest.raises(RuntimeError), initialisation_skipped():
        weight = torch.zeros(3)
        assert torch.nn.init.normal_(weight) is weight and not weight.any()
        raise RuntimeError("a constructor failing half way")
    assert torch.nn.init.normal_ is before and torch.nn.init.normal_(torch.zeros(64)).any()
