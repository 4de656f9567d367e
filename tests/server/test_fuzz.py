"""Random request bodies for every endpoint against a real server: never a 5xx, never a hang, and
the server answers correctly afterwards. Bodies mix plausible fields (each endpoint's own names,
values near their valid ranges, PIC separators, chat messages) with arbitrary JSON and raw bytes,
so most examples get past the first check and reach the deeper ones. Derandomized: CI replays the
same examples every run (``HYPIC_FUZZ_EXAMPLES`` raises the count and ``HYPIC_FUZZ_RANDOM=1`` draws
new ones, for a longer hunt)."""
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hypic import DEFAULT_SEPARATOR as SEP
from hypic import Engine
from hypic.server.fields import UNSERVED
from hypic.server.launch import ServerProcess
from hypic.server.protocol import CHAT_FIELDS, COMPLETION_FIELDS, GENERATE_FIELDS, SGLANG_SAMPLING

EXAMPLES = int(os.environ.get("HYPIC_FUZZ_EXAMPLES", "40"))
REPLAY = os.environ.get("HYPIC_FUZZ_RANDOM") is None  # set it to draw new examples each run
REQUEST_TIMEOUT_S = 60  # far above any answer of the tiny model: a request taking this long is a hang

leaves = (st.none() | st.booleans() | st.integers(-3, 40) | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
          | st.text(max_size=12) | st.sampled_from(["", "hypic", SEP, "a" + SEP + "b", "\x00", "\ud7ff"]))
json_values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                                max_size=4), max_leaves=10)
words = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=40)
texts = st.lists(words, min_size=1, max_size=4).map(SEP.join)
token_ids = st.lists(st.integers(0, 300), min_size=1, max_size=12)
salts = st.text(max_size=8)
sampling = st.fixed_dictionaries({"max_new_tokens": st.integers(0, 12)}, optional={
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1),
    "n": st.integers(1, 3), "stop": st.lists(st.text(max_size=3), max_size=2), "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=2), "seed": st.integers(0, 2**31),
    "regex": st.sampled_from(["[ab]+", "x{2,3}"]), "json_schema": st.just('{"type": "integer"}'),
    "logit_bias": st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100), max_size=2)})
openai = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "n": st.integers(1, 3), "stream": st.booleans(),
          "stop": st.lists(st.text(max_size=3), max_size=2), "seed": st.integers(0, 2**31), "cache_salt": salts,
          "logit_bias": st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100), max_size=2)}
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": texts}),
                    min_size=1, max_size=3)
VALID: dict[str, st.SearchStrategy[dict]] = {  # bodies that pass every check, or nearly
    "/generate": st.fixed_dictionaries({"sampling_params": sampling}, optional={
        "stream": st.booleans(), "return_logprob": st.booleans(), "top_logprobs_num": st.integers(0, 3),
        "cache_salt": salts}).flatmap(lambda b: st.one_of(texts, token_ids, st.lists(texts, min_size=1, max_size=2)).map(
            lambda prompt: {**b, ("input_ids" if isinstance(prompt, list) and prompt and isinstance(prompt[0], int)
                                  else "text"): prompt})),
    "/v1/completions": st.fixed_dictionaries({"prompt": texts | token_ids, "max_tokens": st.integers(0, 12)}, optional={
        **openai, "logprobs": st.integers(0, 5), "echo": st.booleans()}),
    "/v1/chat/completions": st.fixed_dictionaries({"messages": messages, "max_tokens": st.integers(0, 12)}, optional={
        **openai, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 3),
        "response_format": st.just({"type": "json_object"})}),
    "/tokenize": st.one_of(st.fixed_dictionaries({"prompt": texts | st.lists(texts, max_size=2)}),
                           st.fixed_dictionaries({"messages": messages})),
    "/detokenize": st.fixed_dictionaries({"tokens": token_ids | st.lists(token_ids, max_size=2)}),
    "/warmup": st.fixed_dictionaries({"documents": st.lists(words, min_size=1, max_size=3)}, optional={"cache_salt": salts}),
    "/flush_cache": st.fixed_dictionaries({}, optional={"cache_salt": salts}),
}
FIELDS = {"/generate": GENERATE_FIELDS, "/v1/completions": COMPLETION_FIELDS, "/v1/chat/completions": CHAT_FIELDS,
          "/tokenize": {"model", "prompt", "messages"}, "/detokenize": {"model", "tokens", "skip_special_tokens"},
          "/warmup": {"documents", "cache_salt"}, "/flush_cache": {"cache_salt", "extra_key"}}


def _bodies(path: str) -> st.SearchStrategy[Any]:
    """A valid body; one with up to two fields (the endpoint's, unserved or unknown ones) set to any
    JSON; a sampling entry spoiled the same way; or any JSON at all."""
    names = st.sampled_from(sorted(FIELDS[path] | SGLANG_SAMPLING | set(UNSERVED))) | st.text(max_size=8)
    spoiled = st.tuples(VALID[path], st.dictionaries(names, json_values, min_size=1, max_size=2)).map(
        lambda pair: {**pair[0], **pair[1]})
    nested = st.tuples(VALID[path], st.dictionaries(names, json_values, min_size=1, max_size=2)).map(
        lambda pair: {**pair[0], "sampling_params": {**pair[0].get("sampling_params", {}), **pair[1]}})
    return st.one_of(VALID[path], spoiled, spoiled, nested if path == "/generate" else spoiled, json_values)


BODIES = {path: _bodies(path) for path in VALID}
raw_bodies = st.binary(max_size=64) | st.sampled_from([b"", b"{", b"[]", b"null", b'{"text": NaN}', b"\xff\xfe",
                                                       b'{"text": "a"}' * 3, b"1e999999"])


@pytest.fixture(scope="module")
def fuzzed(launch) -> ServerProcess:
    return launch("--max-running-requests", "4")


def _check(server: ServerProcess, path: str, raw: bytes) -> None:
    status, payload = server.request("POST", path, raw=raw, timeout=REQUEST_TIMEOUT_S)
    assert status < 500, (path, raw[:300], status, payload)
    if status >= 400:
        assert isinstance(payload, dict) and payload["error"]["message"], (path, raw[:300], payload)


@pytest.mark.parametrize("path", sorted(BODIES))
def test_random_bodies_never_fail_the_server(fuzzed: ServerProcess, path: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=REPLAY, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=BODIES[path], raw=raw_bodies, use_raw=st.integers(0, 9))
    def run(body: Any, raw: bytes, use_raw: int) -> None:
        _check(fuzzed, path, raw if use_raw == 0 else json.dumps(body).encode())

    run()


def test_the_server_answers_correctly_after_the_fuzzing(fuzzed: ServerProcess, tiny_checkpoint: Path) -> None:
    """After every fuzz test (this runs last in the module): healthy, and a greedy request gives one engine's output."""
    assert fuzzed.request("GET", "/health")[0] == 200
    prompt = SEP.join(["Answer.", "the heron was born by the river and studied reeds", "Who?"])
    served = fuzzed.post("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert served["output_ids"] == Engine.from_pretrained(tiny_checkpoint).generate(prompt, max_new_tokens=6).output_ids
