"""The HTTP server end to end: a real process per configuration, driven over HTTP."""
import json
import random
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from hypic import DEFAULT_SEPARATOR as SEP
from hypic.cache.segments import split_prompt
from hypic.tokenizer import TextTokenizer
from hypic.server.launch import ServerProcess, start_server

GREEDY = {"temperature": 0, "max_new_tokens": 8}


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnop ,.") for _ in range(n))


def _docs(seed: int, count: int, length: int = 80) -> list[str]:
    rng = random.Random(seed)
    return [_text(rng, length + rng.randrange(40)) for _ in range(count)]


def _prompt(leading: str, docs: list[str], question: str) -> str:
    return SEP.join([leading, *docs, question])


@pytest.fixture(scope="module")
def hypic_server(launch) -> ServerProcess:
    return launch("--seam-width", "4")


@pytest.fixture(scope="module", params=["qwen3_5_text-ratio2", "minimax", "granitemoehybrid", "hypic_gla",
                                        "hypic_scalar_rope", "kimi_linear", "nemotron_h", "gpt_oss", "mimo_v2_flash",
                                        "bailing_hybrid"])
def family_server(request: pytest.FixtureRequest, checkpoint_factory: Callable[..., Path],
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A hypic server (w = 4) on the tiny checkpoint of each linear-attention family and each
    sliding-window hybrid."""
    log = tmp_path_factory.mktemp("family-server") / "server.log"
    server = start_server(["--model", str(checkpoint_factory(request.param)), "--log-level", "warning",
                           "--seam-width", "4"], log)
    yield server
    server.stop()


def test_warmup_then_reordered_documents_are_cached(family_server: ServerProcess) -> None:
    hypic_server = family_server
    a, b, c = _docs(1, 3)
    counts = hypic_server.post("/warmup", {"documents": [a, b]})["token_counts"]
    assert counts == [len(a.encode()), len(b.encode())]  # byte-level tokenizer
    hypic_server.post("/generate", {"text": SEP + c + SEP, "sampling_params": GREEDY})  # warm via separators
    out = hypic_server.post("/generate", {"text": _prompt("another system prompt", [c, b, a], "which?"),
                                          "sampling_params": GREEDY})
    meta = out["meta_info"]
    assert meta["segments_hit"] == 3 and meta["segments_missed"] == 0
    assert meta["cached_tokens"] == sum(len(d.encode()) - 2 * 4 for d in (a, b, c)) > 0
    assert meta["cached_tokens"] == meta["prompt_tokens"] - meta["recomputed_tokens"]
    assert meta["completion_tokens"] == len(out["output_ids"]) == 8
    private = hypic_server.get("/get_server_info")["private_pool"]  # the SWA pool is reported apart
    windows = hypic_server.get("/get_model_info").get("model_type") in ("gpt_oss", "mimo_v2_flash")
    assert (private["window_bytes"] > 0) == windows and private["window_bytes"] <= private["bytes"]


def test_no_interior_hypic_equals_full_recompute(launch) -> None:
    wide, full = launch("--seam-width", "1000"), launch("--mode", "full")
    prompt = _prompt("sys", _docs(2, 4), "question?")
    for server in (wide, full):
        server.post("/generate", {"text": prompt, "sampling_params": GREEDY})  # the second run sees warm caches
    first, second = (s.post("/generate", {"text": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 16}})
                     for s in (wide, full))
    assert first["output_ids"] == second["output_ids"]
    assert second["meta_info"]["cached_tokens"] == 0 and second["meta_info"]["mode"] == "full"


def test_openai_client_completions_and_chat(hypic_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=hypic_server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    prompt = _prompt("sys", _docs(3, 2), "q")
    done = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    assert done.choices[0].finish_reason in ("length", "stop") and done.usage.prompt_tokens == len(prompt.replace(SEP, "").encode())
    streamed = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, stream=True)
    pieces = [chunk.choices[0].text for chunk in streamed]
    assert "".join(pieces) == done.choices[0].text
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": _prompt("hi", _docs(4, 2), "q")}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the documents in the message were reused


def test_generate_streams_server_sent_events(hypic_server: ServerProcess) -> None:
    body = json.dumps({"text": "stream me", "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": 5}}).encode()
    request = urllib.request.Request(hypic_server.url + "/generate", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = [line.decode().strip() for line in response if line.strip()]
    assert lines[-1] == "data: [DONE]"
    final = json.loads(lines[-2][len("data: "):])
    assert final["meta_info"]["completion_tokens"] == 5 and len(final["output_ids"]) == 5


def test_multi_turn_reuses_private_state(hypic_server: ServerProcess, tiny_checkpoint: Path) -> None:
    """A plain conversation sent as token ids: the second turn resumes from the first's end state
    (a PIC prompt's state is resumed only under the same segmentation: see test_pools)."""
    ids = TextTokenizer.from_dir(tiny_checkpoint).encode("chat" + "".join(_docs(5, 2)) + "first question")
    first = hypic_server.post("/generate", {"input_ids": ids, "sampling_params": {**GREEDY, "ignore_eos": True}})
    turn = ids + first["output_ids"] + list(b" and then?")
    second = hypic_server.post("/generate", {"input_ids": turn, "sampling_params": GREEDY})["meta_info"]
    assert second["prefix_hit_tokens"] == len(ids) + len(first["output_ids"]) - 1
    assert second["cached_tokens"] == second["prefix_hit_tokens"] == second["prompt_tokens"] - second["recomputed_tokens"]


BAD_REQUESTS = [
    ("POST", "/generate", b"{not json", "not valid JSON"),
    ("POST", "/generate", b"", "empty"),
    ("POST", "/generate", json.dumps({"sampling_params": {}}).encode(), "missing prompt"),
    ("POST", "/generate", json.dumps({"text": "a", "input_ids": [1]}).encode(), "exactly one"),
    ("POST", "/generate", json.dumps({"text": "a", "sampling_params": {"max_new_tokens": -1}}).encode(), "max_new_tokens"),
    ("POST", "/generate", json.dumps({"text": "a", "sampling_params": {"temperature": -0.5}}).encode(), "temperature"),
    ("POST", "/generate", json.dumps({"text": "a", "sampling_params": {"top_p": 0}}).encode(), "top_p"),
    ("POST", "/generate", json.dumps({"text": "a", "sampling_params": {"top_p": 1.5}}).encode(), "top_p"),
    ("POST", "/generate", json.dumps({"text": "x" * 5000}).encode(), "over the model's limit"),
    ("POST", "/generate", json.dumps({"text": SEP * 3}).encode(), "no tokens"),
    ("POST", "/generate", json.dumps({"text": SEP.join(["d"] * 400)}).encode(), "segments, over the limit"),
    ("POST", "/generate", json.dumps({"text": 5}).encode(), "'text' must be a string"),
    ("POST", "/generate", json.dumps({"input_ids": [1, 10**9]}).encode(), "input_ids must be integers"),
    ("POST", "/generate", json.dumps(["text"]).encode(), "JSON object"),
    ("POST", "/v1/completions", json.dumps({"prompt": "a", "suffix": "b"}).encode(), "'suffix' = b in /v1/completions is not supported"),
    ("POST", "/v1/completions", json.dumps({"prompt": "a", "model": "gpt-9"}).encode(), "does not exist"),
    ("POST", "/v1/completions", json.dumps({"prompt": "a", "n": 2, "best_of": 3}).encode(), "best_of"),
    ("POST", "/v1/completions", json.dumps({"prompt": "a", "logprobs": 9}).encode(), "'logprobs' must be in [0, 5]"),
    ("POST", "/v1/completions", json.dumps({"prompt": "a", "logit_bias": {"5": 300}}).encode(), "[-100, 100]"),
    ("POST", "/v1/completions", json.dumps({"prompt": "a", "logit_bias": {"99999": 1}}).encode(), "outside the vocabulary"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "a"}], "tools": [
        {"type": "function", "function": {"name": "f"}}]}).encode(), "'tools' = [{\"type\""),
    ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "a"}]}).encode(),
     "messages[0].role = wizard is not supported"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "a"}],
                                                 "stream_options": {"include_usage": True}}).encode(),
     "'stream_options' is only allowed when 'stream' is true"),
    ("POST", "/v1/completions", json.dumps({"prompt": "a", "stream": False,
                                            "stream_options": {"include_usage": True}}).encode(), "only allowed when"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "assistant", "content": "a"}],
                                                 "continue_final_message": True, "add_generation_prompt": True}).encode(),
     "cannot both be true"),
    ("POST", "/v1/completions", json.dumps({"prompt": "a", "cache_salt": 7}).encode(), "'cache_salt' must be a string"),
    ("POST", "/generate", json.dumps({"text": "a", "extra_key": "x" * 1025}).encode(), "over the limit of 1024"),
    ("POST", "/warmup", json.dumps({"documents": ["a"], "cache_salt": ["t"]}).encode(), "'cache_salt' must be a string"),
    ("POST", "/flush_cache", json.dumps({"cache_salt": 1}).encode(), "'cache_salt' must be a string"),
    ("POST", "/flush_cache", json.dumps({"tiers": ["tape"]}).encode(), "unknown tier tape in 'tiers'"),
    ("POST", "/v1/completions", json.dumps({"prompt": "a", "max_tokenz": 5}).encode(), "unsupported field 'max_tokenz'"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "a"}],
                                                 "top_logprobs": 2}).encode(), "needs 'logprobs'"),
    ("POST", "/generate", json.dumps({"text": "a", "sampling_params": {"repetition_penalty": 3}}).encode(), "(0, 2]"),
    ("POST", "/generate", json.dumps({"text": "a", "sampling_params": {"frequency_penalty": -3}}).encode(), "[-2, 2]"),
    ("POST", "/generate", json.dumps({"text": "a", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}).encode(),
     "min_new_tokens"),
    ("POST", "/generate", json.dumps({"text": "a", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}).encode(),
     "at most one"),
    ("POST", "/generate", json.dumps({"text": "a", "sampling_params": {"regex": "(unclosed"}}).encode(), "invalid regex"),
    ("POST", "/generate", json.dumps({"text": "a", "sampling_params": {"json_schema": "{not json"}}).encode(), "json_schema"),
    ("POST", "/generate", json.dumps({"text": "a", "sampling_params": {"stop_regex": "x+"}}).encode(),
     "'stop_regex' = x+ in sampling_params is not supported"),
    ("POST", "/generate", json.dumps({"text": "a", "sampling_params": {"n": 0}}).encode(), "n must be"),
    ("POST", "/generate", json.dumps({"text": "a", "sampling_params": {"n": True}}).encode(),
     "'n' must be an integer, got true"),  # values as the client wrote them, not as Python shows them
    ("POST", "/generate", json.dumps({"text": "a", "sampling_params": {"temperature": "hot"}}).encode(),
     "'temperature' must be a number >= 0, got hot"),
    ("POST", "/generate", json.dumps({"text": "a", "sampling_params": {"seed": "7"}}).encode(),
     "'seed' must be an integer, got \"7\""),
    ("POST", "/generate", json.dumps({"text": "a", "lora_path": "x"}).encode(),
     "'lora_path' = x in /generate is not supported: LoRA adapters are not served"),
    ("POST", "/generate", json.dumps({"text": "a", "return_hidden_states": True}).encode(), "'return_hidden_states'"),
    ("POST", "/generate", json.dumps({"text": "abc", "return_logprob": True, "logprob_start_len": 7}).encode(),
     "outside the prompt"),
    ("POST", "/generate", json.dumps({"text": "a", "top_logprobs_num": 2}).encode(), "needs 'return_logprob'"),
    ("POST", "/tokenize", json.dumps({"prompt": 5}).encode(), "'prompt'"),
    ("POST", "/detokenize", json.dumps({"tokens": [1, -2]}).encode(), "token ids"),
    ("POST", "/v1/chat/completions", json.dumps({"messages": []}).encode(), "messages"),
    ("POST", "/warmup", json.dumps({"documents": "abc"}).encode(), "documents"),
    ("POST", "/warmup", json.dumps({"documents": [""]}).encode(), "document 0 is empty"),
    ("GET", "/no/such/endpoint", None, "unknown endpoint"),
    ("GET", "/generate", None, "not allowed"),
]


@pytest.mark.parametrize(("method", "path", "raw", "message"), BAD_REQUESTS)
def test_bad_input_gets_4xx_and_server_keeps_serving(hypic_server: ServerProcess, method: str, path: str,
                                                      raw: bytes | None, message: str) -> None:
    status, payload = hypic_server.request(method, path, raw=raw)
    assert 400 <= status < 500, payload
    assert message in payload["error"]["message"]
    assert hypic_server.request("GET", "/health")[0] == 200


def test_client_disconnect_cancels_the_request(hypic_server: ServerProcess) -> None:
    before = hypic_server.get("/get_server_info")["requests_cancelled"]
    body = json.dumps({"text": "long one", "stream": True,
                       "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}}).encode()
    response = urllib.request.urlopen(urllib.request.Request(hypic_server.url + "/generate", data=body, method="POST"))
    response.readline()
    response.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        info = hypic_server.get("/get_server_info")
        if info["requests_cancelled"] > before and info["running_requests"] == 0:
            break
        time.sleep(0.2)
    assert info["requests_cancelled"] > before and info["running_requests"] == 0


def test_non_streaming_client_that_disconnects_is_cancelled(hypic_server: ServerProcess) -> None:
    """A plain /generate whose client goes away mid-decode stops being served within a second or two,
    although tokens keep flowing on the server side."""
    before = hypic_server.get("/get_server_info")["requests_cancelled"]
    body = json.dumps({"text": "long one", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}).encode()
    host, port = hypic_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as client:
        client.sendall(b"POST /generate HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                       + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 30
        while hypic_server.get("/get_server_info")["generated_tokens"] < 20 and time.monotonic() < deadline:
            time.sleep(0.05)  # decoding is under way
    closed = time.monotonic()
    while time.monotonic() < closed + 10:
        info = hypic_server.get("/get_server_info")
        if info["requests_cancelled"] > before and info["running_requests"] == 0:
            break
        time.sleep(0.1)
    assert info["requests_cancelled"] == before + 1 and info["running_requests"] == 0
    assert info["generated_tokens"] < 3000


@pytest.mark.parametrize("mode", ["naive", "prefix"])
def test_warmup_honours_the_server_mode(launch, mode: str) -> None:
    server, docs = launch("--mode", mode), _docs(14, 2)
    status, payload = server.request("POST", "/warmup", {"documents": docs})
    if mode == "prefix":
        assert status == 400 and "caches no segments" in payload["error"]["message"]
        return
    assert status == 200
    meta = server.post("/generate", {"text": _prompt("sys", docs, "q"), "sampling_params": GREEDY})["meta_info"]
    assert meta["segments_hit"] == 2 and meta["segments_missed"] == 0


def test_info_models_metrics_and_flush(hypic_server: ServerProcess) -> None:
    info = hypic_server.get("/get_model_info")
    assert info["model_type"] == "qwen3_5_text" and info["is_generation"]
    assert hypic_server.get("/v1/models")["data"][0]["id"] == info["served_model_name"]
    status, text = hypic_server.request("GET", "/metrics")
    assert status == 200 and "hypic_cached_tokens_total" in text and "hypic_public_pool_bytes" in text
    assert "hypic_private_pool_pages" in text and "hypic_private_pool_arena_reserved_bytes" in text
    assert "hypic_public_pool_arena_reserved_bytes" in text and "hypic_heap_trimmed_bytes_total" in text
    hypic_server.post("/generate", {"text": "a prompt the private pool keeps", "sampling_params": GREEDY})
    assert hypic_server.get("/get_server_info")["private_pool"]["pages"] > 0
    hypic_server.post("/warmup", {"documents": _docs(9, 1)})
    assert hypic_server.get("/get_server_info")["public_pool"]["entries"] > 0
    assert hypic_server.post("/flush_cache", {})["flushed"]
    server_info = hypic_server.get("/get_server_info")
    assert server_info["public_pool"]["bytes"] == server_info["private_pool"]["bytes"] == 0
    assert server_info["private_pool"]["pages"] == 0  # nothing holds a page once the tree is flushed


def test_concurrent_clients_under_eviction_budgets(launch, tiny_checkpoint: Path) -> None:
    """32 clients, overlapping documents, pools too small for the working set: every response is
    well-formed and equals the same request served alone by a server with unbounded pools."""
    budget = 400_000  # a document entry of the tiny model is ~70-100 kB: eviction is certain
    small = launch("--seam-width", "4", "--public-pool-size", str(budget), "--private-pool-size", str(budget))
    reference = launch("--seam-width", "4", "--private-pool-size", "0")
    pool, rng = _docs(11, 10), random.Random(12)
    prompts = [_prompt(f"system {i % 3}", rng.sample(pool, rng.randint(2, 4)), f"question {i}") for i in range(32)]
    samples, stop = [], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            info = small.get("/get_server_info")
            samples.append((info["public_pool"]["bytes"], info["private_pool"]["bytes"]))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    body = lambda p: {"text": p, "sampling_params": GREEDY, "return_logprob": True}  # noqa: E731
    with ThreadPoolExecutor(32) as executor:
        results = list(executor.map(lambda p: small.post("/generate", body(p)), prompts))
    stop.set()
    watcher.join()
    expected = [reference.post("/generate", body(p)) for p in prompts]
    info = small.get("/get_server_info")
    assert info["requests_finished"] >= 32 and info["requests_failed"] == 0
    assert info["public_pool"]["evictions"] + info["public_pool"]["rejected"] > 0
    assert samples and all(public <= budget and private <= budget for public, private in samples)
    for got, want in zip(results, expected):
        assert len(got["output_ids"]) == got["meta_info"]["completion_tokens"] == 8
        assert got["meta_info"]["cached_tokens"] == got["meta_info"]["prompt_tokens"] - got["meta_info"]["recomputed_tokens"]
        got_lp = [lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]]
        want_lp = [lp for lp, _, _ in want["meta_info"]["output_token_logprobs"]]
        assert got_lp[0] == pytest.approx(want_lp[0], abs=1e-3)  # the prefill's first token, from the pools
        assert got["output_ids"] == want["output_ids"]


def test_stop_string_cuts_the_text(hypic_server: ServerProcess) -> None:
    body = {"text": _prompt("stop", _docs(13, 1), "q"), "sampling_params": {**GREEDY, "max_new_tokens": 12, "ignore_eos": True}}
    free = hypic_server.post("/generate", body)
    stop = free["text"][4:6]
    cut = hypic_server.post("/generate", {**body, "sampling_params": {**body["sampling_params"], "stop": stop}})
    assert cut["text"] == free["text"][: free["text"].index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["output_ids"] == free["output_ids"][: len(cut["output_ids"])]


def test_warmup_refuses_a_document_longer_than_the_context_before_any_work(hypic_server: ServerProcess) -> None:
    """No prompt could hold a document over the model's context, so its entry could never be used:
    /warmup answers 400 naming its length and the context, and builds none of the call's documents."""
    context = hypic_server.get("/get_model_info")["max_position_embeddings"]
    hypic_server.post("/flush_cache", {})
    before = hypic_server.get("/get_server_info")["public_pool"]
    status, payload = hypic_server.request("POST", "/warmup", {"documents": ["a short note", "x" * (context + 1)]})
    assert status == 400, payload
    assert payload["error"]["message"].startswith(
        f"document 1 has {context + 1} tokens, over the model's context of {context} tokens")  # byte-level tokenizer
    after = hypic_server.get("/get_server_info")["public_pool"]
    assert after["entries"] == 0 and after["misses"] == before["misses"]  # nothing was looked up or built
    assert hypic_server.post("/warmup", {"documents": ["x" * context]})["token_counts"] == [context]  # the context fits


@pytest.mark.parametrize("stream", [False, True])
def test_a_near_miss_of_the_separator_is_served_as_text_with_a_warning(hypic_server: ServerProcess,
                                                                       stream: bool) -> None:
    """``<<PIC_SEP>`` is not the separator ``<<PIC_SEP>>``: the prompt is one plain part (every byte a
    token), and meta_info says what was seen; ``<<PIC_SEP>>>`` splits at the separator, the extra
    ``>`` is text, and meta_info says that too. A prompt with exact separators only gets no warnings."""
    near = SEP[:-1]  # <<PIC_SEP>
    plain, extra, exact = f"lead {near} a document", f"lead{SEP}> a document{SEP} q", _prompt("lead", ["doc"], "q")
    metas = [_final_meta(hypic_server, prompt, stream) for prompt in (plain, extra, exact)]
    assert metas[0]["prompt_tokens"] == len(plain.encode()) and metas[0]["segments_missed"] == 0
    assert metas[0]["warnings"] == [f"the prompt holds {near} at character 5, which looks like the PIC separator "
                                    f"{SEP} but is not it: it was served as text (only the exact separator marks a "
                                    "segment)"]
    assert metas[1]["prompt_tokens"] == len(extra.replace(SEP, "").encode())
    assert len(metas[1]["warnings"]) == 1 and f"holds {SEP}> at character 4" in metas[1]["warnings"][0]
    assert "warnings" not in metas[2]


def _final_meta(server: ServerProcess, prompt: str, stream: bool) -> dict:
    """The meta_info of a /generate of ``prompt``: of its last chunk when streamed."""
    if not stream:
        return server.post("/generate", {"text": prompt, "sampling_params": GREEDY})["meta_info"]
    body = json.dumps({"text": prompt, "stream": True, "sampling_params": GREEDY}).encode()
    request = urllib.request.Request(server.url + "/generate", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        chunks = [line for line in response if line.startswith(b"data: {")]
    return json.loads(chunks[-1][len(b"data: "):])["meta_info"]
