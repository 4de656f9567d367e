"""What SGLang's and OpenAI's clients expect of the HTTP surface, against a real server process:
streaming shapes, sampling controls, logprobs (against ``transformers``), batches, n > 1, prefix
caching of plain prompts, the small endpoints, and named refusals."""
import json
import random
import re
import urllib.request
from pathlib import Path

import jsonschema
import hypic
import openai
import pytest
import torch

from hypic.loading.checkpoints import reference_classes
from hypic.server.launch import ServerProcess
from hypic.tokenizer import TextTokenizer
from hypic_reference.sampling import argmax, processed_logits

ALPHABET = "abcdefghijklmnop ,."


def _text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(ALPHABET) for _ in range(n))


@pytest.fixture(scope="module")
def server(launch) -> ServerProcess:
    return launch("--seam-width", "4", "--snapshot-interval", "256")


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint: Path) -> torch.nn.Module:
    return reference_classes("qwen3_5_text")[1].from_pretrained(tiny_checkpoint).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(tiny_checkpoint)


def _stream(server: ServerProcess, path: str, body: dict) -> list[str]:
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return [line.decode().strip()[len("data: "):] for line in response if line.strip()]


def _logits(oracle: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' logits [len, vocab] of a plain forward over ``ids``."""
    with torch.no_grad():
        return oracle(torch.tensor([ids])).logits[0].float()


# ----- streaming ---------------------------------------------------------------------------------
def test_generate_stream_sends_one_cumulative_chunk_per_token(server: ServerProcess) -> None:
    body = {"text": _text(1, 40), "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    whole = server.post("/generate", body)
    lines = _stream(server, "/generate", {**body, "stream": True})
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert len(chunks) == 16  # no repeated final chunk
    for number, chunk in enumerate(chunks, 1):
        meta = chunk["meta_info"]
        assert chunk["output_ids"] == whole["output_ids"][:number] and meta["completion_tokens"] == number
        assert meta["id"] == chunks[0]["meta_info"]["id"] and meta["prompt_tokens"] == 40
        assert "cached_tokens" in meta and (meta["finish_reason"] is None) == (number < 16)
    assert chunks[-1]["text"] == whole["text"] and "e2e_latency" in chunks[-1]["meta_info"]


# ----- sampling controls -------------------------------------------------------------------------
def _generate(server: ServerProcess, prompt: str, **params) -> dict:
    return server.post("/generate", {"text": prompt, "sampling_params": {"temperature": 0, **params}})


def test_logit_bias_forces_and_forbids(server: ServerProcess) -> None:
    prompt = _text(2, 30)
    free = _generate(server, prompt, max_new_tokens=8, ignore_eos=True)
    forced = _generate(server, prompt, max_new_tokens=8, ignore_eos=True, logit_bias={"65": 100})
    assert forced["output_ids"] == [65] * 8
    banned = free["output_ids"][0]
    forbidden = _generate(server, prompt, max_new_tokens=8, ignore_eos=True, logit_bias={str(banned): -100})
    assert banned not in forbidden["output_ids"]


def test_min_new_tokens_suppresses_eos(server: ServerProcess) -> None:
    prompt, eos = _text(3, 30), 256
    eager = _generate(server, prompt, max_new_tokens=10, logit_bias={str(eos): 100})
    patient = _generate(server, prompt, max_new_tokens=10, min_new_tokens=4, logit_bias={str(eos): 100})
    assert eager["output_ids"] == [eos] and eager["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert len(patient["output_ids"]) == 5 and eos not in patient["output_ids"][:4]


def test_penalties_follow_the_reference_processing(server: ServerProcess, oracle: torch.nn.Module,
                                                   tokenizer: TextTokenizer) -> None:
    """Greedy under logit bias and the three penalties: each token is the argmax of the reference
    processing of transformers' logits for its prefix."""
    prompt = _text(4, 30)
    params = dict(max_new_tokens=10, ignore_eos=True, logit_bias={"70": 1.0}, frequency_penalty=0.3,
                  presence_penalty=0.2, repetition_penalty=1.3)
    out = _generate(server, prompt, **params)["output_ids"]
    assert 1 < out.count(70) < 10
    ids = tokenizer.encode(prompt)
    for step, token in enumerate(out):
        logits = _logits(oracle, ids + out[:step])[-1]
        processed = processed_logits(logits.tolist(), ids, out[:step], repetition_penalty=1.3, frequency_penalty=0.3,
                                     presence_penalty=0.2, logit_bias=[(70, 1.0)])
        assert token == argmax(processed)


def test_regex_and_json_schema_constrain_the_output(server: ServerProcess) -> None:
    text = _generate(server, _text(5, 20), max_new_tokens=30, regex=r"[a-c]{3}@[0-9]{2}\.com")["text"]
    assert re.fullmatch(r"[a-c]{3}@[0-9]{2}\.com", text), text
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}
    out = _generate(server, _text(6, 20), max_new_tokens=60, json_schema=json.dumps(schema))["text"]
    jsonschema.validate(json.loads(out), schema)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    chat = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "give json"}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        seed=1)  # seeded: an unseeded sample may write integer digits until max_tokens (seen once in a full run)
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)


def test_n_samples_share_one_prefill_and_batches_keep_their_order(server: ServerProcess) -> None:
    prompts = [_text(7, 25), _text(8, 35)]
    body = {"text": prompts, "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "n": 2, "seed": 5,
                                                 "ignore_eos": True}}
    items = server.post("/generate", body)
    assert len(items) == 4 and [i["meta_info"]["prompt_tokens"] for i in items] == [25, 25, 35, 35]
    assert items[0]["output_ids"] != items[1]["output_ids"]  # seeds 5 and 6
    alone = server.post("/generate", {"text": prompts[1], "sampling_params": {**body["sampling_params"], "n": 1,
                                                                              "seed": 6}})
    assert alone["output_ids"] == items[3]["output_ids"]
    lines = _stream(server, "/generate", {**body, "stream": True})
    finals = {}
    for chunk in map(json.loads, lines[:-1]):
        if chunk["meta_info"]["finish_reason"] is not None:
            finals[chunk["index"]] = chunk["output_ids"]
    assert finals == {i: item["output_ids"] for i, item in enumerate(items)}


# ----- logprobs ----------------------------------------------------------------------------------
def test_scoring_a_prompt_gives_transformers_logprobs(server: ServerProcess, oracle: torch.nn.Module,
                                                      tokenizer: TextTokenizer) -> None:
    prompt = _text(9, 50)
    ids = tokenizer.encode(prompt)
    scored = server.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                       "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3})
    entries = scored["meta_info"]["input_token_logprobs"]
    expected = torch.log_softmax(_logits(oracle, ids), dim=-1)
    assert [t for _, t, _ in entries] == ids and entries[0][0] is None and scored["output_ids"] == []
    for position in range(1, len(ids)):
        assert abs(entries[position][0] - expected[position - 1, ids[position]].item()) <= 1e-4
    top = scored["meta_info"]["input_top_logprobs"][5]
    assert [t for _, t, _ in top] == expected[4].topk(3).indices.tolist()


def test_output_logprobs_match_the_scoring_of_the_output(server: ServerProcess, tokenizer: TextTokenizer) -> None:
    prompt = _text(10, 40)
    made = server.post("/generate", {"text": prompt, "return_logprob": True,
                                     "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
    out, ids = made["output_ids"], tokenizer.encode(prompt)
    scored = server.post("/generate", {"input_ids": ids + out, "sampling_params": {"max_new_tokens": 0},
                                       "return_logprob": True, "logprob_start_len": len(ids) - 1})
    rescored = [lp for lp, _, _ in scored["meta_info"]["input_token_logprobs"][1:]]
    given = [lp for lp, _, _ in made["meta_info"]["output_token_logprobs"]]
    assert given == pytest.approx(rescored, abs=1e-4)


def test_openai_client_parses_n_logprobs_echo_and_streams(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    assert client.models.retrieve(model).id == model
    done = client.completions.create(model=model, prompt=["first prompt", "second"], max_tokens=4, n=2, logprobs=2,
                                     echo=True, temperature=0.8, seed=1)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    first = done.choices[0]
    assert first.text.startswith("first prompt") and first.logprobs.token_logprobs[0] is None
    assert len(first.logprobs.tokens) == len("first prompt") + 4 and len(first.logprobs.top_logprobs[1]) >= 2
    assert done.usage.completion_tokens == 16 and done.usage.prompt_tokens == len("first prompt") + len("second")
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          n=2, logprobs=True, top_logprobs=2, seed=1)  # seeded: a sample may stop early
    assert len(chat.choices) == 2 and len(chat.choices[1].logprobs.content) == chat.usage.completion_tokens // 2
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    for include in (False, True):
        chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=5, stream=True, temperature=0,
                                                     stream_options={"include_usage": include}))
        usage = [c for c in chunks if c.usage is not None]
        assert (usage == [chunks[-1]] and chunks[-1].choices == []) if include else not usage
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        whole = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5, temperature=0)
        assert content == whole.choices[0].message.content


# ----- prefix caching of plain prompts -----------------------------------------------------------
def test_plain_prompts_hit_the_prefix_cache(server: ServerProcess) -> None:
    prompt = _text(11, 300)
    first, again = (_generate(server, prompt, max_new_tokens=1)["meta_info"] for _ in range(2))
    assert first["cached_tokens"] == 0 and again["cached_tokens"] == again["prompt_tokens"] - 1 == 299
    system = _text(12, 512)
    hits = [_generate(server, system + _text(100 + i, 30), max_new_tokens=1)["meta_info"]["cached_tokens"]
            for i in range(10)]
    assert hits[0] == 0 and all(hit >= 512 for hit in hits[1:]), hits


# ----- small endpoints ---------------------------------------------------------------------------
def test_tokenize_detokenize_models_and_server_info(server: ServerProcess, tokenizer: TextTokenizer) -> None:
    for prefix in ("", "/v1"):
        tokens = server.post(f"{prefix}/tokenize", {"prompt": "hello world"})
        assert tokens["tokens"] == tokenizer.encode("hello world") and tokens["count"] == 11
        assert server.post(f"{prefix}/detokenize", {"tokens": tokens["tokens"]})["text"] == "hello world"
    info = server.get("/server_info")
    assert info["version"] == hypic.__version__ and info["max_total_num_tokens"] > 0
    name, path = info["served_model_name"], info["model_path"]
    assert server.get(f"/v1/models/{name}")["id"] == name
    assert server.post("/v1/completions", {"model": path, "prompt": "x", "max_tokens": 1})["model"] == name
    status, body = server.request("GET", "/v1/models/gpt-9")
    assert status == 404 and body["error"]["code"] == "model_not_found"


# ----- the context limit -------------------------------------------------------------------------
def _chatml(*turns: tuple[str, str], open_end: bool = False) -> str:
    """ChatML written out by hand (the tiny checkpoint ships no template, so the server uses ChatML)."""
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    if open_end:
        return text[:-len("<|im_end|>\n")]
    return text + "<|im_start|>assistant\n"


def test_output_past_the_context_is_refused_on_every_endpoint(server: ServerProcess, tokenizer: TextTokenizer) -> None:
    """prompt + max_new_tokens over the model's positions: a 400 naming the numbers and the limit; exactly
    at the limit: served in full (the server once ran such a request and cut its output short)."""
    limit = server.get("/get_model_info")["max_position_embeddings"]
    prompt = _text(21, 100)
    over = limit - 100 + 1
    bodies = {"/generate": {"text": prompt, "sampling_params": {"max_new_tokens": over}},
              "/v1/completions": {"prompt": prompt, "max_tokens": over},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": prompt}], "max_tokens": over}}
    for path, body in bodies.items():
        status, payload = server.request("POST", path, body)
        message, field = payload["error"]["message"], "max_new_tokens" if path == "/generate" else "max_tokens"
        assert status == 400 and f"{field} asks for {over} more" in message, (path, payload)
        assert f"context of {limit} tokens" in message
    assert "the prompt has 100 tokens" in server.request("POST", "/generate", bodies["/generate"])[1]["error"]["message"]
    ids = tokenizer.encode(_text(22, limit - 2))
    fits = server.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True,
                                                                           "temperature": 0}})
    assert len(fits["output_ids"]) == 2 and fits["meta_info"]["finish_reason"]["type"] == "length"


def test_without_a_budget_the_output_may_fill_the_context(server: ServerProcess, tokenizer: TextTokenizer) -> None:
    """Chat without max_tokens, and any endpoint with a null budget, get what the prompt leaves (vLLM's
    and SGLang's reading); completions without max_tokens get OpenAI's 16."""
    limit = server.get("/get_model_info")["max_position_embeddings"]
    content = _text(23, limit - 60)
    prompt_tokens = len(tokenizer.encode(_chatml(("user", content))))
    chat = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": content}], "temperature": 0,
                                                "ignore_eos": True})
    assert chat["usage"]["prompt_tokens"] == prompt_tokens
    assert chat["usage"]["completion_tokens"] == limit - prompt_tokens and chat["choices"][0]["finish_reason"] == "length"
    text = _text(24, limit - 20)
    for path, body in (("/v1/completions", {"prompt": text, "max_tokens": None}),
                       ("/generate", {"text": text, "sampling_params": {"max_new_tokens": None}})):
        params = body.get("sampling_params", body)
        params.update(temperature=0, ignore_eos=True)
        out = server.post(path, body)
        generated = out["usage"]["completion_tokens"] if "usage" in out else out["meta_info"]["completion_tokens"]
        assert generated == 20, path
    short = server.post("/v1/completions", {"prompt": "abc", "temperature": 0, "ignore_eos": True})
    assert short["usage"]["completion_tokens"] == 16


# ----- chat templates and tokenize -------------------------------------------------------------------
def test_tokenize_renders_chat_messages(server: ServerProcess, tokenizer: TextTokenizer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    for prefix in ("", "/v1"):
        rendered = server.post(f"{prefix}/tokenize", {"messages": messages})
        assert rendered["tokens"] == tokenizer.encode(_chatml(("system", "be brief"), ("user", "hi")))
        bare = server.post(f"{prefix}/tokenize", {"messages": messages, "add_generation_prompt": False})
        assert bare["tokens"] == tokenizer.encode(_chatml(("system", "be brief"), ("user", "hi"))[:-len(
            "<|im_start|>assistant\n")])
    status, body = server.request("POST", "/tokenize", {"messages": messages, "prompt": "x"})
    assert status == 400 and "one of 'prompt' and 'messages'" in body["error"]["message"]


def test_continue_final_message_continues_the_assistant_turn(server: ServerProcess, tokenizer: TextTokenizer) -> None:
    """The prompt ends inside the last message (no end-of-turn, no new turn): it equals the hand-written
    ChatML prefix, and the chat continues exactly as /generate does from that text."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    options = {"continue_final_message": True, "add_generation_prompt": False}
    expected = _chatml(("user", "hi"), ("assistant", "The answer is"), open_end=True)
    assert server.post("/tokenize", {"messages": messages, **options})["tokens"] == tokenizer.encode(expected)
    chat = server.post("/v1/chat/completions", {"messages": messages, **options, "max_tokens": 6, "temperature": 0})
    plain = _generate(server, expected, max_new_tokens=6)
    assert chat["choices"][0]["message"]["content"] == plain["text"]
    assert chat["usage"]["prompt_tokens"] == len(expected)
    open_default = server.post("/tokenize", {"messages": messages, "continue_final_message": True})
    assert open_default["tokens"] == tokenizer.encode(expected)  # the generation prompt defaults off with it


def test_continuous_usage_stats_count_every_chunk(server: ServerProcess) -> None:
    """vLLM's continuous_usage_stats: each chunk carries the usage so far (a token whose text is still
    incomplete sends no chunk), the last one the total."""
    chunks = [json.loads(line) for line in _stream(server, "/v1/completions", {
        "prompt": "abcdef", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts[0] == 1 and counts[-1] == 5 and counts == sorted(set(counts)), counts
    assert all(c["usage"]["prompt_tokens"] == 6 for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 11
