"""Bad prompts, parameters and checkpoints raise clear errors and cache nothing partial."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hypic import DEFAULT_SEPARATOR as SEP, CheckpointError, Engine, InvalidRequest, UnsupportedModel


@pytest.fixture
def engine(tiny_checkpoint: Path) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint, seam_width=4)


@pytest.mark.parametrize("prompt, message", [
    (SEP * 3, "no tokens"),
    ("", "no tokens"),
    ("lead" + SEP + "doc one is here" + SEP + SEP + "query", "segment 2 is empty"),
    (b"bytes", "must be a string"),
])
def test_bad_prompts_raise_and_cache_nothing(engine: Engine, prompt: object, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        engine.generate(prompt)  # type: ignore[arg-type]
    assert len(engine.cache.public) == 0


def test_prompt_over_max_positions(engine: Engine) -> None:
    limit = engine.model.config.max_position_embeddings
    with pytest.raises(InvalidRequest, match=f"over the model's limit of {limit}"):
        engine.generate("lead" + SEP + "d" * 100 + SEP + "x" * limit)
    assert len(engine.cache.public) == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(mode="fastest"), "mode must be one of"),
])
def test_bad_sampling_parameters(engine: Engine, kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        engine.generate("hello", **kwargs)


def test_bad_warmup_documents(engine: Engine) -> None:
    with pytest.raises(InvalidRequest, match="document 1 is empty"):
        engine.warmup(["a real document", ""])
    with pytest.raises(InvalidRequest, match="list of strings"):
        engine.warmup("not a list")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="document 0 contains the PIC separator"):
        engine.warmup([f"first half {engine.pic_separator} second half", "a real document"])
    assert len(engine.cache.public) == 0


def test_unknown_model_type(tiny_copy: Path) -> None:
    path = tiny_copy
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(UnsupportedModel, match="unknown model_type llama:"):
        Engine.from_pretrained(path)


def _edit_weights(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_missing_tensor(tiny_copy: Path) -> None:
    path = tiny_copy
    _edit_weights(path, lambda t: t.pop("model.layers.1.linear_attn.A_log"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*layers\.1\.mixer\.A_log"):
        Engine.from_pretrained(path)


def test_misshapen_tensor(tiny_copy: Path) -> None:
    path = tiny_copy
    _edit_weights(path, lambda t: t.update({"model.layers.3.self_attn.k_proj.weight": torch.zeros(5, 64)}))
    with pytest.raises(CheckpointError, match=r"layers\.3\.mixer\.k_proj\.weight has shape \(5, 64\)"):
        Engine.from_pretrained(path)


@pytest.mark.parametrize("missing, message", [("tokenizer.json", "no tokenizer.json"),
                                              ("model.safetensors", "no \\*.safetensors"),
                                              ("config.json", "no config.json")])
def test_missing_files(tiny_copy: Path, missing: str, message: str) -> None:
    path = tiny_copy
    (path / missing).unlink()
    with pytest.raises(CheckpointError, match=message):
        Engine.from_pretrained(path)


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="not a directory"):
        Engine.from_pretrained(tmp_path / "nowhere")


def test_engine_keeps_serving_after_errors(engine: Engine) -> None:
    for bad in (SEP, ""):
        with pytest.raises(InvalidRequest):
            engine.generate(bad)
    assert engine.generate("lead" + SEP + "a document of some length" + SEP + "q", max_new_tokens=2).output_ids
