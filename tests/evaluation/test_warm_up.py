"""The studies' warm-up: every document seen before in another prompt, for each method alike."""
from pathlib import Path

import pytest

from hypic import Engine
from hypic.cache.modes import Mode
from hypic.evaluation.data import Sample
from hypic.evaluation.methods import Method, run_sample

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
