"""FP8 (block-scaled) and MXFP4 checkpoints, dequantized at load, against two oracles:
``transformers``' own dequantizing loaders (``FineGrainedFP8Config`` / ``Mxfp4Config`` with
``dequantize=True``, on the CPU), and, where those cannot follow the format (FP8 edge blocks that
are partial: transformers 5 derives the block from the scale grid, so a 192-row matrix in
128-row blocks becomes two 96-row ones), the float checkpoint of weights dequantized by the
reference below, written from the formats' definitions. fp32 logits agree within 1e-4 (the bound
of the float checkpoints' own tests: both sides sum in other orders; quantization itself moves
these logits by more than 1e-3, which the tests check so that they could tell). PIC layouts of
test_fidelity run on quantized long-memory copies against ``tests/reference``'s HYPIC generation on
the reference-dequantized float checkpoint (its 1e-4 bound), and ``hypic serve`` on a damaged
checkpoint exits, naming what is wrong, without leaving a port or a process behind."""
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

import hypic
from hypic import DEFAULT_SEPARATOR as SEP, Engine
from hypic.assembler import combine
from hypic.cache.segments import Run
from hypic.loading.checkpoints import reference_classes
from hypic.errors import CheckpointError, UnsupportedModel
from hypic.loading.loader import load_model
from hypic.parallel import TensorParallel
from hypic.parallel.launch import run_ranks
from hypic.server.launch import free_port, port_in_use
from hypic.models.families import empty_state
from hypic_reference.model import ReferenceModel
from hypic_testing import tp as rank_code
from hypic_testing.fidelity import (TOLERANCE, Layout, Oracle, assert_same_generation, engine_generation,
                                    layout)
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
    """``quantized(name, form, long_memory=False)`` -> a copy of the tiny checkpoint ``name`` (or of its
    long-memory copy) written in ``form``."""
    made: dict[tuple[str, str, bool], Path] = {}

    def make(name: str, form: str, long_memory: bool = False) -> Path:
        if (name, form, long_memory) not in made:
            source = checkpoint_factory(name, long_memory=long_memory)
            made[name, form, long_memory] = FORMATS[form](source, tmp_path_factory.mktemp(name) / form)
        return made[name, form, long_memory]

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
    empty = empty_state(engine.model.config, "cpu", torch.float32)
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
        monkeypatch.setattr("hypic.loading.quantization.CHUNK_ELEMENTS", chunk)
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
    engine.cache.private.clear()  # else the whole prompt resumes from the private pool, past the documents
    hit = engine.generate(prompt, max_new_tokens=8)
    assert (miss.segments_missed, hit.segments_hit) == (2, 2)
    assert hit.output_ids == miss.output_ids and hit.cached_tokens > 0


def test_two_ranks_of_a_quantized_checkpoint_match_one(quantized) -> None:
    path = str(quantized("qwen3_next-moe", "fp8-24x40"))
    expected = rank_code.greedy_run(TensorParallel(), path)
    for got in run_ranks(rank_code.greedy_run, 2, path):
        for (logits, tokens), (want_logits, want_tokens) in zip(got, expected):
            assert tokens == want_tokens and (logits - want_logits).abs().max().item() < LOGIT_BOUND


# ----- PIC layouts against the reference model of the reference-dequantized weights -------------
# test_fidelity's layouts on the long-memory copies, quantized: the oracle is tests/reference's HYPIC
# generation on the float checkpoint of the weights dequantized by ``write_reference_float`` above, so
# no number of the oracle's comes from HYPIC's dequantizer.
FIDELITY = [("qwen3_next-moe", "fp8-24x40"), ("qwen3_5_moe_text", "fp8-16"), ("gpt_oss", "mxfp4")]
FIDELITY_SEAM = 8


@pytest.fixture(scope="module")
def quantized_fidelity(quantized, tmp_path_factory: pytest.TempPathFactory
                       ) -> Callable[[str, str], tuple[Path, Oracle]]:
    """``(name, form)`` -> (the quantized long-memory checkpoint, the oracle of its reference-dequantized float
    checkpoint)."""
    made: dict[tuple[str, str], tuple[Path, Oracle]] = {}

    def make(name: str, form: str) -> tuple[Path, Oracle]:
        if (name, form) not in made:
            path = quantized(name, form, long_memory=True)
            reference_float = write_reference_float(path, tmp_path_factory.mktemp(f"{name}-{form}-reference") / "ckpt")
            made[name, form] = path, Oracle(ReferenceModel(reference_float), reference_float, FIDELITY_SEAM)
        return made[name, form]

    return make


def _quantized_engine(path: Path) -> Engine:
    return Engine.from_pretrained(path, dtype="float32", seam_width=FIDELITY_SEAM)


@pytest.mark.parametrize("name, form", FIDELITY)
def test_cold_and_warm_documents_of_a_quantized_checkpoint_match_reference(quantized_fidelity, name: str,
                                                                          form: str) -> None:
    path, oracle = quantized_fidelity(name, form)
    case = layout(1, [70, 260, 41])
    cold, warm = _quantized_engine(path), _quantized_engine(path)
    warm.warmup(list(case.documents))
    cold_prefill, warm_prefill = cold.prefill(cold.parse(case.text)), warm.prefill(warm.parse(case.text))
    assert cold_prefill.stats.segments_missed == 3 and warm_prefill.stats.segments_hit == 3
    expected = oracle.generate(case)
    assert_same_generation(engine_generation(cold, cold_prefill), expected, "cold")
    assert_same_generation(engine_generation(warm, warm_prefill), expected, "warm")


@pytest.mark.parametrize("name, form", FIDELITY)
def test_quantized_hits_reordered_behind_another_leading_part_match_reference(quantized_fidelity, name: str,
                                                                              form: str) -> None:
    path, oracle = quantized_fidelity(name, form)
    first = layout(2, [120, 60, 200])
    second = Layout("another leading part", tuple(first.documents[i] for i in (2, 0, 1)), "and a new query?")
    engine = _quantized_engine(path)
    engine.prefill(engine.parse(first.text))
    prefill = engine.prefill(engine.parse(second.text))
    assert prefill.stats.segments_hit == 3 and prefill.stats.prefix_hit_tokens == 0
    assert_same_generation(engine_generation(engine, prefill), oracle.generate(second))


@pytest.mark.parametrize("name, form", FIDELITY)
def test_the_quantized_oracle_tells_quantization_and_full_recompute_apart(quantized_fidelity, checkpoint_factory,
                                                                         name: str, form: str) -> None:
    """Guards the guard: the reference's HYPIC logits of the dequantized weights are far from those of
    the float weights they were quantized from (an engine that lost the scales, or read another
    checkpoint, fails above), and, for the linear-attention models, from the same weights' full
    recompute (so does a combine pass that recomputed everything; on gpt-oss's tiny copy the two are
    only about 2e-4 apart, which test_fidelity's guard does not claim either)."""
    _, oracle = quantized_fidelity(name, form)
    case = layout(1, [70, 260, 41])
    ours = oracle.generate(case, steps=1).logits[0]
    float_path = checkpoint_factory(name, long_memory=True)
    from_float = Oracle(ReferenceModel(float_path), float_path, FIDELITY_SEAM).generate(case, steps=1).logits[0]
    assert (ours - from_float).abs().max().item() > QUANTIZATION_SHIFT
    if name != "gpt_oss":
        assert (ours - oracle.full(case)).abs().max().item() > 100 * TOLERANCE


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
    with pytest.raises(UnsupportedModel, match=f"quantized \\({method} in quantization_config\\)"):
        Engine.from_pretrained(tiny_copy)


def _last_fp8_key(tensors: dict[str, torch.Tensor]) -> str:
    """The FP8 weight of the deepest layer: damage there is met after most of the model has loaded."""
    quantized = [name for name, tensor in tensors.items() if tensor.dtype == torch.float8_e4m3fn]
    return max(quantized, key=lambda name: int(name.split(".")[2]))


def _shorten_scale(tensors: dict[str, torch.Tensor]) -> None:
    key = _last_fp8_key(tensors) + "_scale_inv"
    tensors[key] = tensors[key][:1]


def _drop_scale(tensors: dict[str, torch.Tensor]) -> None:
    tensors.pop(_last_fp8_key(tensors) + "_scale_inv")


def _unknown_method(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "hqq"
    (path / "config.json").write_text(json.dumps(config))


SERVER_EXIT_S = 120  # a guard against a server left running, not a timing claim (imports alone take seconds)


def _serve_until_exit(path: Path) -> tuple[int, str, int, int]:
    """``hypic serve --model path`` in its own process group; (exit status, output, its port, the group's id)."""
    port, package_root = free_port(), Path(hypic.__file__).resolve().parents[1]  # the hypic under test
    process = subprocess.Popen([sys.executable, "-m", "hypic.cli", "serve", "--model", str(path), "--port", str(port),
                                "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=package_root, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=SERVER_EXIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"hypic serve on a damaged checkpoint was still running after {SERVER_EXIT_S} s")
    return process.returncode, output, port, process.pid


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("damage, names", [
    (_shorten_scale, lambda tensors: _last_fp8_key(tensors) + "_scale_inv"),
    (_drop_scale, lambda tensors: _last_fp8_key(tensors) + "_scale_inv"),
    (_unknown_method, lambda tensors: "hqq in quantization_config")],
    ids=["misshapen-scale", "missing-scale", "unknown-method"])
def test_a_damaged_checkpoint_stops_the_server_before_it_listens(quantized, tmp_path: Path, damage, names) -> None:
    """``hypic serve`` on an FP8 checkpoint with a misshapen or missing block scale (in its deepest layer,
    met late in the load), or with a quant_method HYPIC does not know: the process exits non-zero and
    says which tensor or method, and leaves nothing behind: no port listening, no process of its group."""
    source = quantized("qwen3_next-moe", "fp8-16")
    expected = names(load_file(str(source / "model.safetensors")))
    if damage is _unknown_method:
        path = Path(shutil.copytree(source, tmp_path / "ckpt"))
        damage(path)
    else:
        path = _rewrite(source, tmp_path / "ckpt", damage)
    status, output, port, group = _serve_until_exit(path)
    assert status != 0 and "hypic: error:" in output and expected in output, output
    assert "hypic: serving" not in output
    assert not port_in_use(port) and not _group_alive(group)


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
