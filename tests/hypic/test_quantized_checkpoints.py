"""FP8 (block-scaled) and MXFP4 checkpoints, dequantized at load, against two oracles:
``transformers``' own dequantizing loaders (``FineGrainedFP8Config`` / ``Mxfp4Config`` with
``dequantize=True``, on the CPU), and, where those cannot follow the format (FP8 edge blocks that
are partial: transformers 5 derives the block from the scale grid, so a 192-row matrix in
128-row blocks becomes two 96-row ones), the float checkpoint of weights dequantized by the
reference below, written from the formats' definitions. fp32 logits agree within 1e-4 (the bound
of the float checkpoints' own tests: both sides sum in other orders; quantization itself moves
these logits by more than 1e-3, which the tests check so that they could tell)."""
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from hypic import DEFAULT_SEPARATOR as SEP, Engine
from hypic.assembler import combine
from hypic.cache.segments import Run
from hypic.checkpoints import reference_classes
from hypic.errors import CheckpointError, UnsupportedModel
from hypic.loader import load_model
from hypic.parallel import TensorParallel
from hypic.parallel.launch import run_ranks
from hypic.state import RequestState
from hypic_testing import tp as rank_code
from hypic_testing.quantized import write_fp8_checkpoint, write_mxfp4_checkpoint

LOGIT_BOUND = 1e-4
QUANTIZATION_SHIFT = 1e-3  # quantizing moves the tiny models' logits by more than this
PROMPT_LENGTH = 150
FORMATS: dict[str, Callable[[Path, Path], Path]] = {  # name -> writer of a quantized copy
    "fp8-16": lambda src, dst: write_fp8_checkpoint(src, dst, (16, 16)),
    "fp8-32x16-bf16-scales": lambda src, dst: write_fp8_checkpoint(src, dst, (32, 16), torch.bfloat16),
    "fp8-128": lambda src, dst: write_fp8_checkpoint(src, dst, (128, 128)),  # partial: 192 = 128 + 64 rows
    "fp8-24x40": lambda src, dst: write_fp8_checkpoint(src, dst, (24, 40)),  # partial edges on both axes
    "fp8-per-matrix": lambda src, dst: write_fp8_checkpoint(src, dst, None),
    "fp8-24x40-e8m0": lambda src, dst: write_fp8_checkpoint(src, dst, (24, 40), torch.uint8),
    "mxfp4": write_mxfp4_checkpoint,
}


@pytest.fixture(scope="module")
def quantized(checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``quantized(name, form)`` -> a copy of the tiny checkpoint ``name`` written in ``form``."""
    made: dict[tuple[str, str], Path] = {}

    def make(name: str, form: str) -> Path:
        if (name, form) not in made:
            made[name, form] = FORMATS[form](checkpoint_factory(name), tmp_path_factory.mktemp(name) / form)
        return made[name, form]

    return make


# ----- the reference dequantization, from the formats' definitions ----------------------------

def reference_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: list[int] | None) -> torch.Tensor:
    """Element (i, j) of each matrix times the scale of block (i // block_rows, j // block_cols); an
    e8m0 scale (uint8) is 2^(byte - 127)."""
    rows, cols = weight.shape[-2:]
    block_rows, block_cols = block or (rows, cols)
    scale_inv = 2.0 ** (scale_inv.double() - 127) if scale_inv.dtype == torch.uint8 else scale_inv
    scales = scale_inv.float().reshape(*weight.shape[:-2], -1, scale_inv.shape[-1])
    per_element = scales[..., (torch.arange(rows) // block_rows)[:, None], (torch.arange(cols) // block_cols)[None, :]]
    return weight.float() * per_element


def e2m1(code: torch.Tensor) -> torch.Tensor:
    """OCP e2m1: 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal."""
    sign = 1.0 - 2.0 * (code >> 3).double()
    exponent, mantissa = ((code >> 1) & 3).double(), (code & 1).double()
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, 2.0 ** (exponent - 1) * (1.0 + 0.5 * mantissa))
    return sign * magnitude


def reference_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Byte k of a group holds elements 2k (low nibble) and 2k + 1 (high nibble); the group's value is
    e2m1 times 2^(scale - 127). gpt-oss's [E, out, in/32, 16] become the float layout [E, in, out]."""
    codes = torch.stack([blocks.long() & 0xF, blocks.long() >> 4], dim=-1).flatten(-2)
    values = e2m1(codes) * 2.0 ** (scales.double() - 127)[..., None]
    return values.flatten(-2).float().transpose(1, 2).contiguous()


def write_reference_float(path: Path, target: Path) -> Path:
    """The float checkpoint of ``path``'s weights, each dequantized by the references above."""
    target = Path(shutil.copytree(path, target))
    config = json.loads((path / "config.json").read_text())
    quantization = config.pop("quantization_config")
    stored, out = load_file(str(path / "model.safetensors")), {}
    for name, tensor in stored.items():
        if name.endswith("_blocks"):
            out[name.removesuffix("_blocks")] = reference_mxfp4(tensor, stored[name.replace("_blocks", "_scales")])
        elif tensor.dtype == torch.float8_e4m3fn:
            out[name] = reference_fp8(tensor, stored[name + "_scale_inv"], quantization.get("weight_block_size"))
        elif not name.endswith(("_scale_inv", "_scales")):
            out[name] = tensor
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(config))
    return target


# ----- oracles --------------------------------------------------------------------------------

def _prompt(seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(seed)).tolist()


def _transformers(path: Path, dequantizing: bool) -> torch.nn.Module:
    from transformers import FineGrainedFP8Config, Mxfp4Config

    config = json.loads((path / "config.json").read_text())
    extra = {}
    if dequantizing:
        method = config["quantization_config"]["quant_method"]
        extra["quantization_config"] = Mxfp4Config(dequantize=True) if method == "mxfp4" else FineGrainedFP8Config(
            dequantize=True, weight_block_size=config["quantization_config"]["weight_block_size"])
    model_class = reference_classes(config["model_type"])[1]
    return model_class.from_pretrained(path, dtype=torch.float32, **extra).eval()


def _last_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def _hypic_logits(path: Path, ids: list[int]) -> torch.Tensor:
    engine = Engine.from_pretrained(path, dtype="float32")
    empty = RequestState.empty(engine.model.config, "cpu", torch.float32)
    return combine(engine.model, ids, [Run(0, len(ids))], empty).logits


@pytest.mark.parametrize("name, form", [("qwen3_next-moe", "fp8-16"), ("qwen3_5_moe_text", "fp8-32x16-bf16-scales"),
                                        ("gpt_oss", "fp8-16"), ("gpt_oss", "mxfp4")])
def test_logits_equal_transformers_dequantizing_the_same_checkpoint(quantized, checkpoint_factory, name: str,
                                                                     form: str) -> None:
    path, ids = quantized(name, form), _prompt()
    expected = _last_logits(_transformers(path, dequantizing=True), ids)
    ours = _hypic_logits(path, ids)
    float_logits = _last_logits(_transformers(checkpoint_factory(name), dequantizing=False), ids)
    assert (float_logits - expected).abs().max().item() > QUANTIZATION_SHIFT
    assert (ours - expected).abs().max().item() <= LOGIT_BOUND


@pytest.mark.parametrize("name, form", [("qwen3_next-moe", "fp8-128"), ("qwen3_next-moe", "fp8-24x40"),
                                        ("qwen3_5_moe_text", "fp8-per-matrix"), ("gpt_oss", "mxfp4")])
def test_logits_equal_the_float_model_of_reference_dequantized_weights(quantized, checkpoint_factory, tmp_path: Path,
                                                                        name: str, form: str) -> None:
    path, ids = quantized(name, form), _prompt(1)
    expected = _last_logits(_transformers(write_reference_float(path, tmp_path / "float"), dequantizing=False), ids)
    float_logits = _last_logits(_transformers(checkpoint_factory(name), dequantizing=False), ids)
    assert (float_logits - expected).abs().max().item() > QUANTIZATION_SHIFT
    assert (_hypic_logits(path, ids) - expected).abs().max().item() <= LOGIT_BOUND


@pytest.mark.parametrize("name, form", [("qwen3_next-moe", "fp8-24x40"), ("qwen3_5_moe_text", "fp8-128"),
                                        ("qwen3_next-moe", "fp8-24x40-e8m0"), ("gpt_oss", "mxfp4")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [TensorParallel(), TensorParallel(1, 2)])
@pytest.mark.parametrize("chunk", [None, 1])
def test_every_weight_is_the_reference_dequantization_rounded_once(quantized, tmp_path: Path, monkeypatch, name: str,
                                                                   form: str, dtype: torch.dtype, tp: TensorParallel,
                                                                   chunk: int | None) -> None:
    """Dequantized in float32 and rounded once to the compute dtype, before the rank's share is cut:
    each parameter equals, bit for bit, the float reference checkpoint's loaded the same way
    (``chunk`` 1: the float32 scratch is one block row or group at a time)."""
    if chunk is not None:
        monkeypatch.setattr("hypic.quantization.CHUNK_ELEMENTS", chunk)
    path = quantized(name, form)
    ours = load_model(path, dtype=dtype, tp=tp)
    reference = load_model(write_reference_float(path, tmp_path / "float"), dtype=dtype, tp=tp)
    expected = dict(reference.named_parameters())
    for key, param in ours.named_parameters():
        assert param.dtype == dtype and torch.equal(param, expected[key]), key


@pytest.mark.parametrize("name, form", [("qwen3_next-moe", "fp8-16"), ("qwen3_5_moe_text", "fp8-128"),
                                        ("gpt_oss", "mxfp4")])
def test_pic_hits_give_the_tokens_of_misses(quantized, name: str, form: str) -> None:
    engine = Engine.from_pretrained(quantized(name, form), seam_width=4)
    documents = [bytes(_prompt(seed)[:90]).decode("latin-1") for seed in (2, 3)]
    prompt = "leading part" + SEP + SEP.join(documents) + SEP + "the question"
    miss = engine.generate(prompt, max_new_tokens=8)
    engine.prefix_cache.clear()  # else the whole prompt resumes from the private pool, past the documents
    hit = engine.generate(prompt, max_new_tokens=8)
    assert (miss.segments_missed, hit.segments_hit) == (2, 2)
    assert hit.output_ids == miss.output_ids and hit.cached_tokens > 0


def test_two_ranks_of_a_quantized_checkpoint_match_one(quantized) -> None:
    path = str(quantized("qwen3_next-moe", "fp8-24x40"))
    expected = rank_code.greedy_run(TensorParallel(), path)
    for got in run_ranks(rank_code.greedy_run, 2, path):
        for (logits, tokens), (want_logits, want_tokens) in zip(got, expected):
            assert tokens == want_tokens and (logits - want_logits).abs().max().item() < LOGIT_BOUND


# ----- refusals ---------------------------------------------------------------------------------

def _rewrite(path: Path, target: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    target = Path(shutil.copytree(path, target))
    tensors = load_file(str(target / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


FP8_KEY = "model.layers.0.mlp.experts.1.up_proj.weight"
MXFP4_KEY = "model.layers.1.mlp.experts.down_proj"


def test_a_misshapen_block_scale_is_named(quantized, tmp_path: Path) -> None:
    def damage(tensors: dict[str, torch.Tensor]) -> None:
        tensors[FP8_KEY + "_scale_inv"] = tensors[FP8_KEY + "_scale_inv"][:1]

    path = _rewrite(quantized("qwen3_next-moe", "fp8-16"), tmp_path / "ckpt", damage)
    with pytest.raises(CheckpointError, match=f"scale tensor {FP8_KEY}_scale_inv has shape \\(1, 4\\).*\\(2, 4\\)"):
        load_model(path)


def test_a_misshapen_mxfp4_scale_is_named(quantized, tmp_path: Path) -> None:
    def damage(tensors: dict[str, torch.Tensor]) -> None:
        tensors[MXFP4_KEY + "_scales"] = tensors[MXFP4_KEY + "_scales"][..., :1].repeat(1, 1, 2)

    path = _rewrite(quantized("gpt_oss", "mxfp4"), tmp_path / "ckpt", damage)
    with pytest.raises(CheckpointError, match=f"scale tensor {MXFP4_KEY}_scales"):
        load_model(path)


@pytest.mark.parametrize("name, form, key", [("qwen3_next-moe", "fp8-16", FP8_KEY + "_scale_inv"),
                                             ("gpt_oss", "mxfp4", MXFP4_KEY + "_scales")])
def test_a_missing_scale_tensor_is_named(quantized, tmp_path: Path, name: str, form: str, key: str) -> None:
    path = _rewrite(quantized(name, form), tmp_path / "ckpt", lambda tensors: tensors.pop(key))
    with pytest.raises(CheckpointError, match=f"scales {key} are missing"):
        load_model(path)


def test_a_scale_tensor_with_nothing_to_scale_is_refused(quantized, tmp_path: Path) -> None:
    def unquantize(tensors: dict[str, torch.Tensor]) -> None:
        tensors[FP8_KEY] = tensors[FP8_KEY].float()

    path = _rewrite(quantized("qwen3_next-moe", "fp8-16"), tmp_path / "ckpt", unquantize)
    with pytest.raises(CheckpointError, match=f"scale tensor {FP8_KEY}_scale_inv has no fp8 tensor"):
        load_model(path)


def test_a_module_kept_float_by_the_config_but_stored_quantized_is_refused(quantized, tmp_path: Path) -> None:
    path = Path(shutil.copytree(quantized("qwen3_next-moe", "fp8-16"), tmp_path / "ckpt"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append("model.layers.2.mlp.experts.*.down_proj")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model.layers.2.mlp.experts.0.down_proj is listed"):
        load_model(path)


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors", "bitsandbytes"])
def test_other_quantization_methods_are_refused_by_name(tiny_copy: Path, method: str) -> None:
    config = json.loads((tiny_copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (tiny_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match=f"quantized \\('{method}' in quantization_config\\)"):
        Engine.from_pretrained(tiny_copy)


def test_model_info_reports_the_checkpoint_quantization(quantized) -> None:
    from hypic.scheduler.loop import EngineLoop
    from hypic.server.app import ServerInfo, build_app

    path = quantized("qwen3_next-moe", "fp8-16")
    loop = EngineLoop(Engine.from_pretrained(path, dtype="bfloat16"), "hypic")
    loop.start()
    try:
        info = ServerInfo(str(path), "tiny", "test", True, False, "", "hypic", 4, SEP, 256, 8, None, None, "cpu",
                          "bfloat16")
        reported = TestClient(build_app(loop, info)).get("/get_model_info").json()
    finally:
        loop.stop()
    assert reported["dtype"] == "bfloat16"
    assert reported["quantization"] == {
        "method": "fp8", "weight_block_size": [16, 16], "activation_scheme": "dynamic", "weights_held": "dequantized",
        "modules_to_not_convert": json.loads((path / "config.json").read_text())["quantization_config"][
            "modules_to_not_convert"]}
