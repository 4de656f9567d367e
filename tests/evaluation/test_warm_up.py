"""The studies' warm-up: every document seen before in another prompt, for each method alike."""
from pathlib import Path

import pytest
import torch

from hypic import Engine
from hypic.cache.modes import Mode
from hypic.cache.store import LinearInterior
from hypic.evaluation.data import Sample
from hypic.evaluation.methods import Method, fresh_engine, parse_method, run_sample

SAMPLE = Sample("s", "synthetic", "Answer from the passages below.",
                tuple(f"\n\nPassage {i}: the {word} is kept in room {i}." for i, word in enumerate(("key", "map", "lamp"))),
                "\n\nQuestion: where is the map?\nAnswer:", ("room 1",), "exact", 4)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint)


def test_prefix_reuses_the_instruction_and_first_document_it_saw_before_not_the_whole_prompt(engine: Engine) -> None:
    """Each document came in an earlier prompt of its own after the instruction: a prefix cache holds
    the timed prompt's instruction and first document, and recomputes the rest (its best case, this
    prompt or its documents in this order seen before, is not the scenario)."""
    seen_first = len(engine.parse(SAMPLE.earlier_prompts(engine.pic_separator)[0]).token_ids)
    result = run_sample(engine, SAMPLE, Method(Mode("prefix")), warm=True)
    assert result.cached_tokens == seen_first < result.prompt_tokens
    cold = run_sample(engine, SAMPLE, Method(Mode("prefix")), warm=False)
    assert cold.cached_tokens == 0


def test_hypic_reuses_every_document_it_saw_before(engine: Engine) -> None:
    result = run_sample(engine, SAMPLE, Method(Mode("hypic")), warm=True)
    assert result.segments_hit == len(SAMPLE.documents)


@pytest.mark.parametrize("name, stored", [("hypic", torch.float32), ("hypic-bf16", torch.bfloat16)])
def test_a_hypic_method_s_public_pool_stores_t_c_and_s_c0_in_its_dtype(engine: Engine, name: str,
                                                                        stored: torch.dtype) -> None:
    """``hypic-bf16``'s engine keeps every cached document's T_C and S_C|0 in bfloat16, ``hypic``'s in
    fp32: the dtypes of the public pool's entries, which a hit composes from."""
    warmed = fresh_engine(engine, SAMPLE, parse_method(name), warm=True)
    linear = [layer for entry in warmed.cache.public.entries.values() for layer in entry.layers
              if isinstance(layer, LinearInterior)]
    assert len(warmed.cache.public.entries) >= len(SAMPLE.documents) and linear
    assert {layer.zero_start_state.dtype for layer in linear} == {stored}
    assert {layer.transition.value.dtype for layer in linear if layer.transition is not None} == {stored}


@pytest.mark.parametrize("text, method", [("hypic-bf16", Method(Mode("hypic"), 8, "bfloat16")),
                                          ("hypic-bf16:4", Method(Mode("hypic"), 4, "bfloat16")),
                                          ("hypic:4", Method(Mode("hypic"), 4, "float32"))])
def test_hypic_bf16_parses_to_its_own_label(text: str, method: Method) -> None:
    """A label keys a study's records: hypic-bf16's must differ from hypic's and parse back to it."""
    assert parse_method(text) == method and parse_method(method.label) == method
    assert method.label.startswith("hypic-bf16:") == (method.state_cache_dtype == "bfloat16")


def test_a_server_target_warms_prefix_the_same_way() -> None:
    """Against a server: flushed, one earlier request per document, then the timed prompt."""
    from hypic import DEFAULT_SEPARATOR
    from hypic.evaluation.targets import ServerTarget

    target = object.__new__(ServerTarget)  # no server: its calls are recorded
    target.url, target.method, target.separator, sent = "http://test", Method(Mode("prefix")), DEFAULT_SEPARATOR, []

    def call(verb: str, path: str, body: dict | None = None) -> dict:
        sent.append((path, body["text"] if body else None))
        return {"text": "", "output_ids": [], "meta_info": {"ttft": 0.1, "prompt_tokens": 10, "cached_tokens": 0}}

    target._call = call
    target.run(SAMPLE, target.method, warm=True)
    earlier = [("/generate", text) for text in SAMPLE.earlier_prompts(DEFAULT_SEPARATOR)]
    assert sent == [("/flush_cache", None), *earlier, ("/generate", SAMPLE.prompt(DEFAULT_SEPARATOR))]
