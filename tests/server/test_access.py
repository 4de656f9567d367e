"""A server safe to share: API keys, cache namespaces per salt and per key, and request bounds,
against real ``hypic serve`` processes. The oracle for a namespace that must not see another's cache
is a cold request: the counters of the same prompt sent first in a fresh namespace."""
import hmac
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pytest

from hypic import DEFAULT_SEPARATOR as SEP
from hypic.server.launch import ServerProcess
from hypic.server.tenancy import ApiKeys, namespace_of

KEY_A, KEY_B, KEY_FILE = "sk-team-a-0b5e1c", "sk-team-b-77d2aa", "sk-from-file-9c41"
WRONG = "sk-wrong-31f0d9"
ROUTES = [("GET", "/v1/models"), ("GET", "/v1/models/x"), ("GET", "/get_model_info"), ("GET", "/get_server_info"),
          ("GET", "/server_info"), ("GET", "/metrics"), ("POST", "/generate"), ("POST", "/v1/completions"),
          ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/v1/tokenize"), ("POST", "/detokenize"),
          ("POST", "/v1/detokenize"), ("POST", "/warmup"), ("POST", "/flush_cache"), ("GET", "/no/such/endpoint")]
DOCS = [f"Record {i}: the {animal} was born by the {place} and studied {topic} for many quiet years."
        for i, (animal, place, topic) in enumerate([("heron", "river", "reeds"), ("lynx", "mill", "weather"),
                                                    ("otter", "lake", "stones"), ("crane", "valley", "frogs")])]
PROMPT = SEP.join(["Answer from the records.", *DOCS, "Who studied frogs?"])


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _meta(server: ServerProcess, key: str | None = None, **fields: object) -> dict:
    status, body, _ = server.exchange("POST", "/generate", {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0}, **fields}, headers=_bearer(key) if key else None)
    assert status == 200, body
    return {**body["meta_info"], "output_ids": body["output_ids"]}


def _reuse(meta: dict) -> tuple[int, ...]:
    return tuple(meta[k] for k in ("cached_tokens", "prefix_hit_tokens", "segments_hit", "segments_missed",
                                   "recomputed_tokens", "combine_tokens"))


@pytest.fixture(scope="module")
def keyed(launch, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# team keys\n\n{KEY_FILE}\n")
    return launch("--api-key", KEY_A, "--api-key", KEY_B, "--api-key-file", str(keys), "--isolate-by-key",
                  "--log-level", "debug")


def test_every_endpoint_but_health_needs_a_key(keyed: ServerProcess) -> None:
    """401 (OpenAI-shaped, WWW-Authenticate) without a key or with a wrong one, on every route and
    on unknown paths alike; /health is open; each configured key works; no key reaches the log."""
    for method, path in ROUTES:
        for headers in (None, _bearer(WRONG), {"Authorization": KEY_A}, {"Authorization": f"Basic {KEY_A}"}):
            status, body, got = keyed.exchange(method, path, raw=b"{}" if method == "POST" else None, headers=headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", (method, path, headers, body)
            assert got["www-authenticate"] == "Bearer"
    assert keyed.request("GET", "/health")[0] == 200
    info = keyed.exchange("GET", "/get_server_info", headers=_bearer(KEY_A))[1]
    assert info["api_keys"] == 3 and info["isolate_by_key"] and KEY_A not in json.dumps(info)
    for key in (KEY_A, KEY_B, KEY_FILE):
        assert keyed.exchange("GET", "/v1/models", headers=_bearer(key))[0] == 200
        assert keyed.exchange("POST", "/tokenize", {"prompt": "hi"}, headers=_bearer(key))[0] == 200
    _meta(keyed, KEY_A)
    time.sleep(0.5)  # the log is flushed line by line
    log = keyed.log.read_text()
    assert "401" in log and "POST /generate" in log  # the access log is on, and it is the right log
    for secret in (KEY_A, KEY_B, KEY_FILE, WRONG):
        assert secret not in log


def test_keys_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stored key is compared, with ``hmac.compare_digest``, on equal-length digests, whatever
    is presented and wherever the match is: the time taken says nothing about the keys."""
    keys = ApiKeys.of([KEY_A, KEY_B, KEY_FILE])
    seen: list[tuple[int, int]] = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: seen.append((len(a), len(b))) or real(a, b))
    for presented in (f"Bearer {KEY_A}", f"Bearer {KEY_FILE}", f"Bearer {WRONG}", "Bearer x", None, "Bearer " + "k" * 900):
        seen.clear()
        found = keys.identify(presented)
        assert seen == [(32, 32)] * 3, presented
        assert (found is not None) == (presented in (f"Bearer {KEY_A}", f"Bearer {KEY_FILE}"))
    assert keys.identify(f"Bearer {KEY_A}") != keys.identify(f"Bearer {KEY_B}")
    assert KEY_A not in repr(keys) and KEY_A not in (keys.identify(f"Bearer {KEY_A}") or "")


def test_each_key_is_its_own_namespace(keyed: ServerProcess) -> None:
    """--isolate-by-key: documents and request states cached for key A are hits for A only; key B
    takes exactly the cold path for them (the counters of a cold request: the same prompt sent first
    with a fresh salt), with the same output; a flush by B empties B's namespace only."""
    headers = _bearer(KEY_A)
    cold = _meta(keyed, KEY_FILE, cache_salt="fresh")
    assert keyed.exchange("POST", "/warmup", {"documents": DOCS}, headers=headers)[0] == 200
    warm = _meta(keyed, KEY_A)  # its documents, or its request state from the first test
    assert warm["cached_tokens"] > 0 and warm["output_ids"] == cold["output_ids"]
    as_b = _meta(keyed, KEY_B)
    assert _reuse(as_b) == _reuse(cold) and as_b["cached_tokens"] == 0 and as_b["output_ids"] == cold["output_ids"]
    assert _reuse(_meta(keyed, KEY_B, cache_salt="other")) == _reuse(cold)  # a salt is a namespace within the key
    status, flushed, _ = keyed.exchange("POST", "/flush_cache", None, headers=_bearer(KEY_B))
    assert status == 200 and flushed["namespace"] == "one" and flushed["public_entries_dropped"] == 4
    assert _meta(keyed, KEY_A)["prefix_hit_tokens"] > 0  # A's request state survived B's flush


def test_a_cache_salt_is_a_namespace(launch) -> None:
    """Without keys, cache_salt (vLLM) or extra_key (SGLang) on /generate, OpenAI bodies and /warmup
    name a namespace; requests naming none share one, as before."""
    server = launch("--public-pool-size", "64M")
    cold = _meta(server, cache_salt="first-look")
    assert server.post("/warmup", {"documents": DOCS, "cache_salt": "tenant-1"})["documents"] == 4
    assert _meta(server, cache_salt="tenant-1")["segments_hit"] == 4
    assert _meta(server, extra_key="tenant-1")["segments_hit"] == 0  # another field: another namespace
    completion = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "cache_salt": "tenant-1"})
    assert completion["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    chat = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
                                                "cache_salt": "tenant-1"})  # its documents are tenant-1's
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for salt in ("tenant-2", None):  # the shared namespace has seen nothing of this yet
        assert _reuse(_meta(server, cache_salt=salt)) == _reuse(cold)
    assert server.post("/flush_cache", {"cache_salt": "tenant-1"})["public_entries_dropped"] == 4
    assert _meta(server, cache_salt="tenant-1")["segments_hit"] == 0


@pytest.fixture(scope="module")
def bounded(launch) -> ServerProcess:
    return launch("--max-request-bytes", "4K", "--max-concurrent-per-key", "1", "--max-warmup-documents", "2")


def test_request_bounds(bounded: ServerProcess) -> None:
    """413 for a body over --max-request-bytes (declared or streamed without a length), 400 for a
    /warmup of too many documents, 429 with Retry-After for a key's request over
    --max-concurrent-per-key while its stream runs; the server serves on."""
    server = bounded
    info = server.get("/get_server_info")
    assert (info["max_request_bytes"], info["max_concurrent_per_key"], info["max_warmup_documents"]) == (4096, 1, 2)
    assert info["api_keys"] == 0 and not info["isolate_by_key"]
    big = json.dumps({"text": "x" * 5000}).encode()
    status, body, _ = server.exchange("POST", "/generate", raw=big)
    assert status == 413 and "--max-request-bytes" in body["error"]["message"]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        streamed = client.post("/generate", content=iter([big[:3000], big[3000:]]))  # chunked: no length
        assert streamed.status_code == 413 and "--max-request-bytes" in streamed.json()["error"]["message"]
    status, body, _ = server.exchange("POST", "/warmup", {"documents": DOCS[:3]})
    assert status == 400 and "--max-warmup-documents" in body["error"]["message"]
    started = threading.Event()

    def long_stream() -> int:
        payload = {"text": "a long answer", "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        with httpx.Client(base_url=server.url, timeout=120) as client, client.stream("POST", "/generate", json=payload) as r:
            for _ in r.iter_lines():
                started.set()
            return r.status_code

    runner = threading.Thread(target=lambda: results.append(long_stream()))
    results: list[int] = []
    runner.start()
    assert started.wait(60)
    status, body, headers = server.exchange("POST", "/tokenize", {"prompt": "hi"})
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded" and int(headers["retry-after"]) >= 1
    assert server.exchange("GET", "/get_server_info")[0] == 200  # reads are not counted
    runner.join()
    assert results == [200]
    assert server.exchange("POST", "/tokenize", {"prompt": "hi"})[0] == 200


def test_a_client_that_sends_its_whole_body_first_reads_the_413(bounded: ServerProcess) -> None:
    """urllib (like most simple clients) sends all of a body before it reads the answer: a body
    far over --max-request-bytes must still come back as a 413, not as a reset connection."""
    for body in (b"x" * (4 * 2**20), iter([b"x" * 2**20] * 4)):  # declared, and chunked without a length
        request = urllib.request.Request(bounded.url + "/generate", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 413
        assert "--max-request-bytes" in json.loads(refused.value.read())["error"]["message"]
    assert bounded.request("GET", "/health")[0] == 200


@pytest.mark.parametrize(("args", "message"), [
    (["--isolate-by-key"], "--isolate-by-key needs API keys"),
    (["--api-key", "two words"], "empty or holds whitespace"),
    (["--api-key-file", "/no/such/file"], "cannot read --api-key-file"),
    (["--max-concurrent-per-key", "0"], "--max-concurrent-per-key must be >= 1"),
    (["--max-request-bytes", "10"], "--max-request-bytes must be at least 1K")])
def test_bad_access_options_are_refused(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from hypic.cli import main

    assert main(["serve", *args]) == 2
    assert message in capsys.readouterr().err


def test_namespaces_are_digests_of_what_names_them() -> None:
    """"" when nothing names a namespace; the key counts only under isolation; distinct names never collide."""
    assert namespace_of((), None, True) == namespace_of((), "k1", False) == ""
    names = {namespace_of(salt, key, isolate) for salt in [(), ("cache_salt=a",), ("cache_salt=a", "extra_key=b")]
             for key in ("k1", "k2") for isolate in (True,)}
    assert len(names) == 6 and all(len(n) == 32 for n in names)
    assert namespace_of(("cache_salt=a\\", "extra_key=b"), None, False) != namespace_of(("cache_salt=a", "extra_key=\\b"), None, False)
