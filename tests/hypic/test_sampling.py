"""Sampling controls against plain references: logits processing, stops, grammars, detokenization,
and prompt logits against ``transformers``."""
import json
import random
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from hypic import DEFAULT_SEPARATOR as SEP, Engine, InvalidRequest
from hypic.loading.checkpoints import reference_classes
from hypic.sampling.detokenize import IncrementalDetokenizer
from hypic.sampling.logits_processing import process_logits
from hypic.sampling.params import SamplingParams, sample
from hypic_reference.sampling import argmax, processed_logits


def reference_processing(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int],
                         stop_tokens: set[int]) -> list[float]:
    return processed_logits(logits, prompt, output, repetition_penalty=params.repetition_penalty,
                            frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
                            logit_bias=params.logit_bias, min_new_tokens=params.min_new_tokens, stop_tokens=stop_tokens)


@pytest.mark.parametrize("seed", range(4))
def test_logits_processing_matches_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    vocab = 50
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed))
    prompt = [rng.randrange(vocab) for _ in range(12)]
    output = [rng.randrange(vocab) for _ in range(rng.randint(0, 9))]
    params = SamplingParams(max_new_tokens=20, min_new_tokens=rng.choice([0, 5, 20]),
                            frequency_penalty=rng.uniform(-2, 2), presence_penalty=rng.uniform(-2, 2),
                            repetition_penalty=rng.uniform(0.5, 2), logit_bias=((3, 7.5), (11, -40.0)))
    stop_tokens = {0, 7}
    ours = process_logits(logits, params, prompt, output, stop_tokens)
    expected = torch.tensor(reference_processing(logits.tolist(), params, prompt, output, stop_tokens))
    assert torch.allclose(ours, expected, atol=1e-5)
    assert torch.equal(logits, torch.randn(vocab, generator=torch.Generator().manual_seed(seed)))  # input untouched


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint, seam_width=4)


PROMPT = "system" + SEP + "the first document, long enough to have an interior" + SEP + "a question?"


@pytest.mark.parametrize("temperature", [5e-324, 1e-90, 1e-6])
def test_a_vanishing_temperature_is_greedy(temperature: float) -> None:
    """Temperatures too small to divide by (the fuzz test found 2.7e-90 answered 500: the logits
    overflowed to inf, then NaN probabilities) pick the argmax, as vLLM and SGLang do."""
    logits = torch.randn(300, generator=torch.Generator().manual_seed(1)) * 30
    logits[7] = float("-inf")  # a grammar's mask
    params = SamplingParams(temperature=temperature, top_k=5, top_p=0.9)
    assert sample(logits, params, torch.Generator().manual_seed(0)) == argmax(logits.tolist())


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -1e-9])
def test_a_temperature_that_is_no_finite_number_is_refused(temperature: float) -> None:
    with pytest.raises(InvalidRequest, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=temperature)


def test_logit_bias_forces_and_forbids(engine: Engine) -> None:
    greedy = engine.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
    forced = engine.generate(PROMPT, max_new_tokens=8, ignore_eos=True, logit_bias=((65, 100.0),))
    assert forced.output_ids == [65] * 8
    banned = greedy.output_ids[0]
    forbidden = engine.generate(PROMPT, max_new_tokens=8, ignore_eos=True, logit_bias=((banned, -100.0),))
    assert banned not in forbidden.output_ids


def test_min_new_tokens_suppresses_stop_tokens(engine: Engine) -> None:
    eos = engine.model.config.eos_token_ids[0]
    eager = engine.generate(PROMPT, max_new_tokens=10, logit_bias=((eos, 100.0),))
    assert eager.output_ids == [eos] and eager.finish_reason == "stop"
    patient = engine.generate(PROMPT, max_new_tokens=10, min_new_tokens=5, logit_bias=((eos, 100.0),))
    assert len(patient.output_ids) == 6 and eos not in patient.output_ids[:5]
    assert patient.output_ids[5] == eos and patient.finish_reason == "stop"


def test_penalised_greedy_generation_follows_the_reference(tiny_checkpoint: Path, engine: Engine) -> None:
    """Each greedy token under penalties is the argmax of the reference processing of
    ``transformers``' logits for the same prefix (full recompute of a plain prompt)."""
    bias = ((65, 1.0),)  # token 65 would win every step; the penalties must make it give way
    params = dict(max_new_tokens=12, ignore_eos=True, logit_bias=bias, frequency_penalty=0.3, presence_penalty=0.2,
                  repetition_penalty=1.3)
    prompt = "abcabcabc" * 4
    result = engine.generate(prompt, mode="full", **params)
    oracle = reference_classes("qwen3_5_text")[1].from_pretrained(tiny_checkpoint).eval()
    ids = engine.parse(prompt).token_ids
    assert engine.generate(prompt, mode="full", max_new_tokens=12, ignore_eos=True, logit_bias=bias).output_ids == [65] * 12
    assert 1 < result.output_ids.count(65) < 12
    for step, token in enumerate(result.output_ids):
        with torch.no_grad():
            logits = oracle(torch.tensor([ids + result.output_ids[:step]])).logits[0, -1].float()
        processed = reference_processing(logits.tolist(), SamplingParams(**params), ids, result.output_ids[:step], set())
        assert token == argmax(processed)


def test_stop_strings_are_trimmed_unless_asked_not_to(engine: Engine) -> None:
    free = engine.generate(PROMPT, max_new_tokens=12, ignore_eos=True, logit_bias=((70, 5.0), (71, 5.0)))
    stop = free.text[3:5]
    assert len(stop) == 2
    cut = engine.generate(PROMPT, max_new_tokens=12, ignore_eos=True, logit_bias=((70, 5.0), (71, 5.0)), stop=(stop,))
    kept = engine.generate(PROMPT, max_new_tokens=12, ignore_eos=True, logit_bias=((70, 5.0), (71, 5.0)), stop=(stop,),
                           no_stop_trim=True)
    assert cut.text == free.text[: free.text.index(stop)] and cut.finish_reason == "stop"
    assert kept.text == free.text[: free.text.index(stop) + 2]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_regex_output_matches(engine: Engine, ignore_eos: bool) -> None:
    """The grammar's end is the output's end, with ignore_eos too (the fuzz test found ignore_eos with
    a regex answered 500: the grammar took EOS as its end and was then asked for another token)."""
    result = engine.generate(PROMPT, max_new_tokens=30, regex=r"(cat|dog)-[0-9]{2,4}", ignore_eos=ignore_eos)
    assert re.fullmatch(r"(cat|dog)-[0-9]{2,4}", result.text), result.text
    assert result.finish_reason == "stop"  # the grammar ends, then only EOS is allowed


def test_json_schema_output_validates(engine: Engine) -> None:
    # (no maxLength: xgrammar 0.2.8 lets control characters into length-bounded strings)
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    result = engine.generate(PROMPT, max_new_tokens=80, json_schema=json.dumps(schema), temperature=0.7, seed=3)
    jsonschema.validate(json.loads(result.text), schema)


def test_bad_grammar_is_refused(engine: Engine) -> None:
    with pytest.raises(InvalidRequest, match="invalid regex"):
        engine.generate(PROMPT, regex="(open")


@pytest.mark.parametrize("seed", range(3))
def test_incremental_detokenizer_equals_full_decode(engine: Engine, seed: int) -> None:
    """Random byte-level tokens (multi-byte characters split across tokens): the text grows to the
    full decode, and never shows an incomplete character."""
    rng = random.Random(seed)
    text = "".join(rng.choice(["a", " ", "é", "漢", "🙂", "\n", "x"]) for _ in range(40))
    ids = engine.tokenizer.encode(text)
    detok = IncrementalDetokenizer(engine.tokenizer)
    for token in ids:
        detok.add(token)
        assert "\ufffd" not in detok.text
    assert detok.text == engine.tokenizer.decode(ids) == text


def test_prompt_logits_equal_transformers(tiny_checkpoint: Path, engine: Engine) -> None:
    """Scoring a prompt: the logits of every position from ``logits_from`` (nothing spliced or
    resumed after it, even with the documents cached) equal transformers' full forward."""
    engine.generate(PROMPT, max_new_tokens=1)  # documents and snapshots cached
    parts = engine.parse(PROMPT)
    prefill = engine.prefill(parts, "hypic", logits_from=3)
    oracle = reference_classes("qwen3_5_text")[1].from_pretrained(tiny_checkpoint).eval()
    with torch.no_grad():
        expected = oracle(torch.tensor([parts.token_ids])).logits[0].float()
    assert prefill.prompt_logits is not None and prefill.prompt_logits.shape[0] == len(parts.token_ids) - 3
    assert (prefill.prompt_logits - expected[3:]).abs().max().item() <= 1e-4
    assert prefill.stats.segments_hit == 0 and prefill.stats.prefix_hit_tokens <= 3
