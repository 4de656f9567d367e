"""SGLang's ``bench_serving`` against a real server, request by request as it sends them.

Mirrors sgl-project/sglang ``python/sglang/bench_serving.py`` (the ``--backend sglang`` /
``sglang-native`` request of ``async_request_sglang_generate``, ``sglang-oai`` / ``vllm`` of
``async_request_openai_completions``, ``sglang-oai-chat`` / ``vllm-chat`` of
``async_request_openai_chat_completions``, and ``benchmark()`` / ``run_benchmark()`` around them;
``python/sglang/benchmark/backends/{sglang,oai,oai_chat}_client.py`` hold the same requests in the
refactored layout). Every body below is the one it sends with its default flags (no
``--extra-request-body``, no LoRA, no images); each parse function reads a response exactly as that
client does, and the asserts check what it ends up with against an independent oracle (the same
request not streamed, ``/tokenize``'s count, the requested length under ``ignore_eos``).
"""
from typing import Any

import pytest

from .conftest import Wire, client_chunks, text

# bench_serving's headers: get_auth_headers() -> {"Authorization": "Bearer $OPENAI_API_KEY"} when the
# variable is set (else nothing); aiohttp adds Content-Type: application/json for json=payload.
AUTH = {"Authorization": "Bearer sk-unused"}
OUTPUT_LEN = 12


def sglang_generate_payload(prompt: str | list[int], output_len: int, stream: bool = True,
                            return_logprob: bool = False) -> dict[str, Any]:
    """async_request_sglang_generate's payload: lora_path is the request's LoRA name (None without
    --lora-name), return_logprob / return_routed_experts the flags (False unless given)."""
    return {
        ("text" if isinstance(prompt, str) else "input_ids"): prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
        "stream": stream,
        "lora_path": None,
        "return_logprob": return_logprob,
        "return_routed_experts": False,
        "logprob_start_len": -1,
    }


def read_sglang_generate(lines: list[str]) -> dict[str, Any]:
    """What async_request_sglang_generate keeps: the cumulative ``text`` of the last chunk that had
    text, ``meta_info.completion_tokens`` of it, and how many chunks counted as tokens arriving.
    It iterates over the body's lines, so with --disable-stream the one JSON body must be one line."""
    generated, output_len, arrivals, last_len = "", None, 0, 0
    for data in client_chunks(lines):
        if "text" in data and data["text"]:
            generated = data["text"]
            output_len = data["meta_info"]["completion_tokens"]
            if arrivals == 0 or output_len - last_len > 0:
                arrivals += 1
            last_len = output_len
    return {"generated_text": generated, "output_len": output_len, "arrivals": arrivals}


@pytest.mark.parametrize("tokenize_prompt", [False, True], ids=["text", "input_ids"])
def test_sglang_backend_streams_what_bench_serving_reads(wire: Wire, tokenize_prompt: bool) -> None:
    model = wire.model_id()  # run_benchmark() asks /v1/models when --model is not given
    assert model
    prompt_text = text(101 + tokenize_prompt, 120)
    prompt = wire.post("/tokenize", {"prompt": prompt_text}).json()["tokens"] if tokenize_prompt else prompt_text
    # benchmark(): one warm-up request first (output_len capped at 32), then the measured ones
    warm = wire.stream("/generate", sglang_generate_payload(prompt, min(OUTPUT_LEN, 32)), AUTH)
    warm.assert_sse()
    streamed = wire.stream("/generate", sglang_generate_payload(prompt, OUTPUT_LEN), AUTH)
    streamed.assert_sse()
    chunks = streamed.chunks()
    # every chunk is the cumulative object: text, output_ids, meta_info (completion_tokens counts up)
    assert all({"text", "output_ids", "meta_info"} <= set(c) for c in chunks)
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == list(range(1, OUTPUT_LEN + 1))
    assert all(c["output_ids"] == chunks[-1]["output_ids"][:i + 1] for i, c in enumerate(chunks))
    final = chunks[-1]["meta_info"]
    assert final["finish_reason"] == {"type": "length", "length": OUTPUT_LEN} and final["e2e_latency"] > 0
    assert final["prompt_tokens"] == wire.count(prompt_text)
    # the warm-up sent the same prompt: only its last token is computed again (README, private pool)
    assert final["cached_tokens"] == final["prompt_tokens"] - 1
    # oracle: greedy, so the same request not streamed gives the same tokens and text
    whole = wire.post("/generate", sglang_generate_payload(prompt, OUTPUT_LEN, stream=False), AUTH)
    assert whole.status_code == 200, whole.text
    assert whole.json()["output_ids"] == chunks[-1]["output_ids"]
    read = read_sglang_generate(streamed.lines)
    if read["output_len"] is not None:  # the tiny random model may emit only invisible special tokens
        assert read["generated_text"] == whole.json()["text"]
        assert read["output_len"] == OUTPUT_LEN
    assert whole.json()["meta_info"]["completion_tokens"] == OUTPUT_LEN


def test_sglang_backend_with_disable_stream_and_return_logprob(wire: Wire) -> None:
    """--disable-stream: the client still iterates over lines, so the JSON body must be one line;
    --return-logprob: return_logprob true with logprob_start_len -1 (output logprobs only)."""
    prompt = text(103, 90)
    body = sglang_generate_payload(prompt, OUTPUT_LEN, stream=False, return_logprob=True)
    response = wire.post("/generate", body, AUTH)
    assert response.status_code == 200, response.text
    assert response.text.strip().count("\n") == 0  # one line: read_sglang_generate can parse it
    data = response.json()
    assert data["meta_info"]["completion_tokens"] == OUTPUT_LEN == len(data["output_ids"])
    logprobs = data["meta_info"]["output_token_logprobs"]
    assert [token for _, token, _ in logprobs] == data["output_ids"]
    assert all(isinstance(lp, float) and lp <= 0 for lp, _, _ in logprobs)
    read = read_sglang_generate(response.text.splitlines())
    if data["text"]:
        assert read["generated_text"] == data["text"] and read["output_len"] == OUTPUT_LEN


def openai_completions_payload(model: str, prompt: str, output_len: int, stream: bool = True) -> dict[str, Any]:
    """async_request_openai_completions (backends sglang-oai, vllm, lmdeploy)."""
    return {"model": model, "prompt": prompt, "best_of": 1, "max_tokens": output_len, "stream": stream,
            "temperature": 0.0, "ignore_eos": True}


def read_openai_completions(lines: list[str], output_len: int) -> dict[str, Any]:
    """It reads ``data["choices"][0]["text"]`` of every chunk before [DONE] (a chunk without a
    choice would raise), concatenates the texts, and takes ``usage.completion_tokens`` if a chunk
    carrying text has usage; the same loop parses a non-streamed one-line body."""
    generated, arrivals = "", 0
    for data in client_chunks(lines):
        if data["choices"][0]["text"]:
            arrivals += 1
            generated += data["choices"][0]["text"]
            output_len = (data.get("usage") or {}).get("completion_tokens", output_len)
    return {"generated_text": generated, "output_len": output_len, "arrivals": arrivals}


@pytest.mark.parametrize("backend", ["sglang-oai", "vllm"])
def test_openai_completions_backend(wire: Wire, backend: str) -> None:
    model = wire.model_id()
    prompt = text(110 if backend == "vllm" else 111, 100)
    streamed = wire.stream("/v1/completions", openai_completions_payload(model, prompt, OUTPUT_LEN), AUTH)
    streamed.assert_sse()
    chunks = streamed.chunks()
    assert all(len(c["choices"]) == 1 and "text" in c["choices"][0] for c in chunks)  # no choice-less chunk
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    read = read_openai_completions(streamed.lines, OUTPUT_LEN)
    whole = wire.post("/v1/completions", openai_completions_payload(model, prompt, OUTPUT_LEN, stream=False), AUTH)
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert read["generated_text"] == body["choices"][0]["text"]  # oracle: greedy, streamed or not
    assert body["usage"]["completion_tokens"] == OUTPUT_LEN
    assert body["usage"]["prompt_tokens"] == wire.count(prompt)
    # --disable-stream: the same line loop over a one-line JSON body
    assert whole.text.strip().count("\n") == 0
    assert read_openai_completions(whole.text.splitlines(), OUTPUT_LEN)["generated_text"] == read["generated_text"]


def openai_chat_payload(model: str, messages: list[dict[str, str]], output_len: int,
                        stream: bool = True) -> dict[str, Any]:
    """async_request_openai_chat_completions (backends sglang-oai-chat, vllm-chat, lmdeploy-chat);
    the older bench_serving sent ``max_tokens`` instead of ``max_completion_tokens`` and no ignore_eos."""
    return {"model": model, "messages": messages, "max_completion_tokens": output_len, "stream": stream,
            "temperature": 0.0, "ignore_eos": True}


def read_openai_chat(lines: list[str], output_len: int) -> dict[str, Any]:
    """It takes ``usage.completion_tokens`` from any chunk that has usage, skips chunks whose
    ``choices`` is empty, and concatenates ``delta.reasoning_content`` and ``delta.content``."""
    generated, arrivals = "", 0
    for data in client_chunks(lines):
        output_len = (data.get("usage") or {}).get("completion_tokens", output_len)
        choices = data.get("choices") or []
        if not choices:
            continue
        delta = choices[0].get("delta") or {}
        content = (delta.get("reasoning_content") or "") + (delta.get("content") or "")
        if content:
            arrivals += 1
            generated += content
    return {"generated_text": generated, "output_len": output_len, "arrivals": arrivals}


def test_openai_chat_backend_multi_turn(wire: Wire) -> None:
    """sglang-oai-chat, streamed, through wrap_multi_turn_request_func: each round sends the
    conversation so far (user, assistant, user, ...) with the assistant turns the client read."""
    model = wire.model_id()
    rounds = [text(120, 60), text(121, 40)]
    messages: list[dict[str, str]] = []
    for number, prompt in enumerate(rounds):
        messages.append({"role": "user", "content": prompt})
        streamed = wire.stream("/v1/chat/completions", openai_chat_payload(model, messages, OUTPUT_LEN), AUTH)
        streamed.assert_sse()
        chunks = streamed.chunks()
        assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        read = read_openai_chat(streamed.lines, OUTPUT_LEN)
        whole = wire.post("/v1/chat/completions", openai_chat_payload(model, messages, OUTPUT_LEN, stream=False), AUTH)
        assert whole.status_code == 200, whole.text
        body = whole.json()  # --disable-stream: response_json["choices"][0]["message"]["content"], usage
        assert read["generated_text"] == body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] == OUTPUT_LEN
        if number:  # the second round repeats the first one's prompt: its prefix is cached
            assert 0 < body["usage"]["prompt_tokens_details"]["cached_tokens"] < body["usage"]["prompt_tokens"]
        messages.append({"role": "assistant", "content": read["generated_text"]})


def test_benchmark_run_endpoints(wire: Wire) -> None:
    """Around the requests: /v1/models (model id), /flush_cache with the auth headers and no body
    (--flush-cache, or SGLANG_IS_IN_CI), /get_server_info after the run (JSON; it looks for
    ``internal_states[0].avg_spec_accept_length`` and a ``decode`` list only when present)."""
    models = wire.get("/v1/models", AUTH)
    assert models.status_code == 200 and models.json()["data"][0]["id"]
    flushed = wire.post("/flush_cache", None, AUTH)
    assert flushed.status_code == 200, flushed.text
    info = wire.get("/get_server_info", AUTH)
    assert info.status_code == 200
    states = info.json().get("internal_states")
    assert states is None or isinstance(states, list)
