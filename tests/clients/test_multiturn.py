"""SGLang's multi-turn cache benchmarks against a real server: the requests they send and the
cache numbers they read back.

- sgl-project/sglang ``benchmark/hicache/bench_multiturn.py`` (``gen_payload`` and
  ``async_request_sglang_generate``): clients whose history grows by the generated text and a new
  question each round; it reads ``meta_info.prompt_tokens`` / ``cached_tokens`` from the first
  streamed chunk that has text and reports ``cache_hit_rate = sum(cached) / sum(prompt)``.
- sgl-project/sglang ``python/sglang/test/kits/cache_hit_kit.py`` (SGLang's cache-hit test kit:
  ``run_multiturn_cache_hit_test`` and ``run_fixed_prefix_cache_hit_test``): the same over token ids
  with round barriers; it reads the first chunk with ``output_ids`` and asserts
  ``cached_tokens >= (previous prompt + output - miss_tolerance) // page_size * page_size``
  (``page_size`` from ``GET /server_info``, 1 when absent) and, for a shared prefix,
  ``cached_tokens >= prefix_len // page_size * page_size``.
"""
import random
from typing import Any

from .conftest import Wire, client_chunks, text

OUTPUT_LEN = 8


def multiturn_payload(prompt: str, output_len: int, lora_path: str = "") -> dict[str, Any]:
    """bench_multiturn.py's gen_payload (``--lora-path`` defaults to "")."""
    return {
        "text": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
        "stream": True,
        "stream_options": {"include_usage": True},
        "lora_path": lora_path,
        "return_logprob": False,
        "logprob_start_len": -1,
    }


def read_multiturn(lines: list[str]) -> dict[str, Any]:
    """bench_multiturn's reader: ``data["text"]`` of every chunk (a chunk without it raises); the
    first chunk with text gives prompt_tokens and cached_tokens; the last text is the answer."""
    generated, prompt_tokens, cached_tokens, first = "", 0, 0, True
    for data in client_chunks(lines):
        if data["text"]:
            if first:
                prompt_tokens = (data.get("meta_info") or {}).get("prompt_tokens", 0)
                cached_tokens = (data.get("meta_info") or {}).get("cached_tokens", 0)
                first = False
            generated = data["text"]
    return {"generated_text": generated, "prompt_len": prompt_tokens, "cached_tokens": cached_tokens}


def test_bench_multiturn_reads_cached_tokens_from_the_first_chunk(wire: Wire) -> None:
    flushed = wire.post("/flush_cache")  # requests.post(flush_cache_url): no body, no headers
    assert flushed.status_code == 200, flushed.text
    clients = {i: text(200 + i, 150) for i in range(2)}  # --request-length (sub-questions alike)
    rng = random.Random(7)
    rounds: list[list[dict[str, Any]]] = []
    for _ in range(3):
        results = []
        for client, history in clients.items():
            streamed = wire.stream("/generate", multiturn_payload(history, OUTPUT_LEN))
            streamed.assert_sse()
            chunks = streamed.chunks()
            assert all("text" in c for c in chunks)
            # cached_tokens is a fact of the prefill: every chunk reports the same as the first
            assert len({(c["meta_info"]["prompt_tokens"], c["meta_info"]["cached_tokens"]) for c in chunks}) == 1
            read = read_multiturn(streamed.lines)
            first = chunks[0]["meta_info"]
            if read["prompt_len"]:  # the client saw text (the tiny model may emit only special tokens)
                assert (read["prompt_len"], read["cached_tokens"]) == (first["prompt_tokens"], first["cached_tokens"])
            assert first["prompt_tokens"] == wire.count(history)
            results.append({"prompt": first["prompt_tokens"], "cached": first["cached_tokens"],
                            "answer": read["generated_text"] or chunks[-1]["text"]})
            clients[client] = history + results[-1]["answer"] + "".join(rng.choice("qrstuvw ") for _ in range(60))
        rounds.append(results)
    assert all(r["cached"] == 0 for r in rounds[0])  # after the flush, distinct prompts: cold
    for before, after in zip(rounds, rounds[1:]):
        for previous, current in zip(before, after):
            # the new prompt starts with the whole previous prompt: at least all of it but its last
            # token is reused (the answer's text need not re-tokenize to the generated ids)
            assert previous["prompt"] - 1 <= current["cached"] < current["prompt"]
    hit_rate = sum(r["cached"] for rs in rounds for r in rs) / sum(r["prompt"] for rs in rounds for r in rs)
    assert 0.4 < hit_rate < 1


def kit_payload(input_ids: list[int], output_len: int, lora_path: str = "") -> dict[str, Any]:
    """cache_hit_kit.py's gen_payload: bench_multiturn's body with token ids for the text."""
    body = multiturn_payload("", output_len, lora_path)
    del body["text"]
    return {"input_ids": input_ids, **body}


def read_kit(lines: list[str]) -> dict[str, Any]:
    """cache_hit_kit's async_request_sglang_generate: chunks with non-empty ``output_ids``; the
    first gives prompt_tokens and cached_tokens, the last ``output_ids`` (cumulative) is the answer."""
    output_ids: list[int] = []
    prompt_tokens = cached_tokens = 0
    arrivals = 0
    for data in client_chunks(lines):
        if data.get("output_ids"):
            output_ids = data["output_ids"]
            if arrivals == 0:
                prompt_tokens = (data.get("meta_info") or {}).get("prompt_tokens", 0)
                cached_tokens = (data.get("meta_info") or {}).get("cached_tokens", 0)
            arrivals += 1
    return {"output_ids": output_ids, "prompt_len": prompt_tokens, "cached_tokens": cached_tokens,
            "generated_len": arrivals}


def _page_size(wire: Wire) -> int:
    """cache_hit_kit's _get_page_size: ``GET /server_info`` -> ``page_size``, 1 when absent."""
    response = wire.get("/server_info")
    assert response.status_code == 200, response.text
    return response.json().get("page_size", 1)


def test_cache_hit_kit_multiturn(wire: Wire) -> None:
    """run_multiturn_cache_hit_test with round barriers, its defaults scaled down (2 clients,
    3 rounds, 150-token requests, 8 output tokens, miss_tolerance 1)."""
    page_size = _page_size(wire)
    assert wire.post("/flush_cache").status_code == 200
    rng = random.Random(11)
    histories = [[rng.randrange(32, 127) for _ in range(150)] for _ in range(2)]
    previous = [0, 0]
    total_prompt = total_cached = 0
    for round_number in range(3):
        for client, history in enumerate(histories):
            streamed = wire.stream("/generate", kit_payload(history, OUTPUT_LEN))
            streamed.assert_sse()
            read = read_kit(streamed.lines)
            assert read["prompt_len"] == len(history) and read["generated_len"] == OUTPUT_LEN
            assert len(read["output_ids"]) == OUTPUT_LEN
            expected = 0 if round_number == 0 else (previous[client] + OUTPUT_LEN - 1) // page_size * page_size
            assert read["cached_tokens"] >= expected, (round_number, client, read, expected)
            assert read["cached_tokens"] < read["prompt_len"]
            if round_number == 0:
                assert read["cached_tokens"] == 0
            previous[client] = read["prompt_len"]
            total_prompt, total_cached = total_prompt + read["prompt_len"], total_cached + read["cached_tokens"]
            history.extend(read["output_ids"])
            if round_number < 2:
                history.extend(rng.randrange(32, 127) for _ in range(150))
    assert total_cached / total_prompt > 0.45


def test_cache_hit_kit_fixed_prefix(wire: Wire) -> None:
    """run_fixed_prefix_cache_hit_test (one group of 4 prompts: warm-up, branch seed, 2 measured):
    every measured prompt reuses the whole shared prefix. prefix_len 256, the server's snapshot
    interval, so the prefix ends where a linear state is kept (a prefix of another length is
    reused up to the last snapshot before it, not to its end)."""
    page_size = _page_size(wire)
    assert wire.post("/flush_cache").status_code == 200
    rng = random.Random(13)
    prefix_len = wire.server_info()["snapshot_interval"]
    prefix = [rng.randrange(32, 127) for _ in range(prefix_len)]
    suffixes = [[rng.randrange(32, 127) for _ in range(64)] for _ in range(4)]
    reads = []
    for suffix in suffixes:
        streamed = wire.stream("/generate", kit_payload(prefix + suffix, OUTPUT_LEN))
        streamed.assert_sse()
        reads.append(read_kit(streamed.lines))
    assert reads[0]["cached_tokens"] == 0
    expected = prefix_len // page_size * page_size
    for read in reads[2:]:
        assert expected <= read["cached_tokens"] < read["prompt_len"] == prefix_len + 64
    hit_rate = sum(r["cached_tokens"] for r in reads[2:]) / sum(r["prompt_len"] for r in reads[2:])
    assert hit_rate >= 0.45  # the kit's default min_hit_rate


def test_cache_hit_kit_openai_chat_reads_usage(wire: Wire) -> None:
    """cache_hit_kit's OpenAI variant (gen_payload_openai, async_request_openai_chat_completions):
    streamed chat with stream_options.include_usage; it reads usage.prompt_tokens,
    completion_tokens and prompt_tokens_details.cached_tokens from the usage chunk."""
    model = wire.model_id()
    assert wire.post("/flush_cache").status_code == 200
    messages = [{"role": "user", "content": text(230, 200)}]
    usages = []
    for _ in range(2):
        body = {"model": model, "messages": messages, "max_tokens": OUTPUT_LEN, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        streamed = wire.stream("/v1/chat/completions", body)
        streamed.assert_sse()
        chunks = streamed.chunks()
        with_usage = [c for c in chunks if c.get("usage")]
        assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1]["choices"] == []
        usages.append(with_usage[0]["usage"])
    for usage in usages:
        assert usage["completion_tokens"] <= OUTPUT_LEN
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == usages[1]["prompt_tokens"] - 1
