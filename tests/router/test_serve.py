"""``hypic serve --workers 2``: the server process and one Ray worker prefill a request's cold
documents together; every endpoint answers as with one worker, and outputs equal one engine's.
Each pool holds about six entries (12M), so requests of five or six documents evict."""
import json
import random
import signal
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hypic import Engine, default_model_path
from hypic.cli import parse_size
from hypic.server.launch import ServerProcess, start_server
from hypic.tokenizer import TextTokenizer

Prompt = Callable[[list[int], str], str]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # float32 whatever the CPU (auto is bf16 where it is native): outputs are compared with in-process engines,
    # and bf16's rounding differs between a state resumed from the private pool and one computed in a chunk
    process = start_server(["--workers", "2", "--threads", "1", "--public-pool-size", "12M", "--dtype", "float32",
                            "--log-level", "warning"], log, threads=None)
    yield process
    process.stop()


def _generate(server: ServerProcess, prompt: str) -> dict:
    return server.post("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})


def _streamed(server: ServerProcess, prompt: str) -> tuple[dict, float, float]:
    """A streamed /generate: the last chunk, and the client's own TTFT and latency (seconds)."""
    body = json.dumps({"text": prompt, "stream": True, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    request = urllib.request.Request(server.url + "/generate", data=body.encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    start, first, chunks = time.perf_counter(), None, []
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if line.startswith(b"data: {"):
                first = first or time.perf_counter()
                chunks.append(json.loads(line[len(b"data: "):]))
    assert first is not None
    return chunks[-1], first - start, time.perf_counter() - start


def test_two_workers_answer_and_count_as_one_engine(server: ServerProcess, pic_prompt: Prompt) -> None:
    """Outputs equal one engine's, and so do the statistics a client reads: a document built for the
    request (here or on the peer) is a miss, the peer's counted apart, and TTFT and latency run from
    the request's arrival (the server once reported documents the peer built for the request as hits,
    and a TTFT without the peers' prefill)."""
    engine = Engine.from_pretrained("default", dtype="float32", public_pool_bytes=parse_size("12M"))  # the server's pools
    for indices, question in (([0, 1, 2, 3, 4, 5], "Where was the lynx born?"), ([5, 3, 1, 6], "Who studied ibises?")):
        prompt = pic_prompt(indices, question)
        served, client_ttft, client_latency = _streamed(server, prompt)
        expected = engine.generate(prompt, max_new_tokens=8)
        meta = served["meta_info"]
        assert served["output_ids"] == expected.output_ids
        assert (meta["cached_tokens"], meta["segments_hit"], meta["segments_missed"]) == (
            expected.cached_tokens, expected.segments_hit, expected.segments_missed), meta
        assert 0 < meta["segments_built_remotely"] <= meta["segments_missed"] and meta["remote_prefill_tokens"] > 0
        assert 0.9 * client_ttft <= meta["ttft"] <= client_ttft, (meta["ttft"], client_ttft)
        assert 0.9 * client_latency <= meta["e2e_latency"] <= client_latency
    assert expected.segments_hit == 3  # the second request holds three of its documents from the first
    info = server.get("/get_server_info")
    assert info["workers"]["workers"] == [0, 1] and info["workers"]["lost_workers"] == []
    assert info["workers"]["held_entries"]["1"] >= 3  # LPT gave the peer half of the six cold documents
    received = info["workers"]["received_entries"]  # the peer's entries came point-to-point (gloo)
    assert received["point_to_point"] >= 3 and received["object_store"] == received["failed"] == 0
    metrics = server.get("/metrics")
    assert "hypic_workers_live 2" in metrics
    assert f"hypic_peer_entries_received_point_to_point_total {received['point_to_point']}" in metrics
    assert f"hypic_segments_built_remotely_total {info['segments_built_remotely']}" in metrics


def test_every_endpoint_still_answers(server: ServerProcess, pic_prompt: Prompt) -> None:
    """Each endpoint gives what one engine gives: token counts, tokens, a greedy completion."""
    engine = Engine.from_pretrained("default", dtype="float32")
    assert server.request("GET", "/health")[0] == 200
    note = "A short note about herons and their river."
    assert server.post("/warmup", {"documents": [note]})["token_counts"] == [len(engine.tokenizer.encode(note))]
    prompt = pic_prompt([7, 8], "Where was the crane born?")
    completion = server.post("/v1/completions", {"model": server.get("/v1/models")["data"][0]["id"], "prompt": prompt,
                                                 "max_tokens": 4, "temperature": 0})
    assert completion["choices"][0]["text"] == engine.generate(prompt, max_new_tokens=4).text
    assert server.post("/tokenize", {"prompt": "hello"})["tokens"] == engine.tokenizer.encode("hello")
    held = server.get("/get_server_info")["workers"]["held_entries"]["1"]  # synced after every request
    assert server.post("/flush_cache", {})["peer_entries_dropped"] == held
    assert server.get("/get_server_info")["workers"]["held_entries"]["1"] == 0


def test_warmup_spreads_documents_and_requests_pull_them(server: ServerProcess, pic_prompt: Prompt,
                                                          docs: list[str]) -> None:
    """Documents warmed on either worker: a request holding some here and some on the peer pulls
    the peer's, and every document is a hit, as on one warmed engine."""
    server.post("/flush_cache", {})
    warmed = server.post("/warmup", {"documents": docs[:4]})
    assert warmed["documents"] == 4
    assert server.get("/get_server_info")["workers"]["held_entries"]["1"] == 2  # LPT: two documents each
    engine = Engine.from_pretrained("default", dtype="float32")
    engine.warmup(docs[:4])
    prompt = pic_prompt([3, 1, 0, 2], "Who studied badgers?")
    expected = engine.generate(prompt, max_new_tokens=8)
    served = _generate(server, prompt)
    assert served["output_ids"] == expected.output_ids and served["meta_info"]["segments_missed"] == 0
    assert served["meta_info"]["cached_tokens"] == expected.cached_tokens  # a held head combined early is no extra hit


def test_namespaces_never_share_through_the_router(server: ServerProcess, pic_prompt: Prompt, docs: list[str]) -> None:
    """cache_salt namespaces with both workers: documents warmed for team A (on either worker) and
    A's request state are hits for A only; team B's request for them takes exactly the cold path
    (the counters of the same prompt sent first with nothing cached, built here and on the peer
    alike) with one engine's output; flushing A's namespace leaves B's entries on both workers."""
    prompt = pic_prompt([3, 1, 0, 2], "Who studied owls?")
    expected = Engine.from_pretrained("default", dtype="float32").generate(prompt, max_new_tokens=8).output_ids

    def ask(salt: str) -> tuple[int, ...]:
        served = server.post("/generate", {"text": prompt, "cache_salt": salt,
                                           "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        assert served["output_ids"] == expected
        meta = served["meta_info"]
        return tuple(meta[k] for k in ("cached_tokens", "prefix_hit_tokens", "segments_hit", "segments_missed",
                                       "segments_built_remotely", "remote_prefill_tokens", "combine_tokens"))

    server.post("/flush_cache", {})
    cold = ask("first-look")
    assert cold[0] == 0 and cold[3] == 4 and cold[4] > 0  # the peer built some of the cold documents
    server.post("/flush_cache", {})
    server.post("/warmup", {"documents": docs[:4], "cache_salt": "team-a"})
    assert server.get("/get_server_info")["workers"]["held_entries"]["1"] == 2  # A's documents on both workers
    assert ask("team-a")[2] == 4
    assert ask("team-b") == cold
    flushed = server.post("/flush_cache", {"cache_salt": "team-a"})
    assert flushed["public_entries_dropped"] + flushed["peer_entries_dropped"] >= 4  # A's, and the copies pulled
    assert server.get("/get_server_info")["workers"]["held_entries"]["1"] > 0  # B's stay
    assert ask("team-b")[0] > 0
    assert ask("") == cold  # nothing B's request built went to the shared namespace, here or on the peer
    assert ask("team-a")[:4] == (0, 0, 0, 4)  # cold again


def test_concurrent_requests_under_eviction(server: ServerProcess, pic_prompt: Prompt) -> None:
    """Six requests at once, five documents each out of ten, pools of about six entries: the index
    goes stale under the requests' feet; outputs stay one engine's."""
    engine = Engine.from_pretrained("default", dtype="float32")
    rng = random.Random(11)
    prompts = [pic_prompt(rng.sample(range(10), 5), f"Question {i}: where was the egret born?") for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        served = list(pool.map(lambda p: _generate(server, p)["output_ids"], prompts))
    assert served == [engine.generate(p, max_new_tokens=8).output_ids for p in prompts]
    status = server.get("/get_server_info")["workers"]
    assert status["lost_workers"] == [] and set(status["queued_tokens"].values()) == {0}  # all released


def test_warmup_refuses_a_document_longer_than_the_context(server: ServerProcess) -> None:
    """With peers as without: a document no prompt could hold is refused, naming its length and the
    context, before it is planned or built anywhere."""
    context = server.get("/get_model_info")["max_position_embeddings"]
    document = "a long account of the heron's river, " * (context // 6)
    tokens = len(TextTokenizer.from_dir(default_model_path()).encode(document))
    status, payload = server.request("POST", "/warmup", {"documents": ["a short note", document]})
    assert tokens > context and status == 400
    assert payload["error"]["message"].startswith(
        f"document 1 has {tokens} tokens, over the model's context of {context} tokens")
    assert server.get("/get_server_info")["workers"]["queued_tokens"] == {"0": 0, "1": 0}


@pytest.mark.parametrize(("args", "message"), [(["--workers", "0"], "--workers must be >= 1"),
                                               (["--workers", "2", "--worker-timeout", "0"], "--worker-timeout must be > 0")])
def test_bad_worker_options_are_refused(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from hypic.cli import main

    assert main(["serve", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_clean_stop_removes_the_ray_session_folder(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The local Ray runtime a server starts writes a session folder (logs, sockets) named after the
    server's pid; a SIGTERM stops the server, its Ray runtime, and removes that folder."""
    server = start_server(["--model", str(tiny_checkpoint), "--workers", "2", "--log-level", "warning"],
                          tmp_path / "server.log")
    try:
        sessions = list((Path(tempfile.gettempdir()) / "ray").glob(f"session_*_{server.process.pid}"))
        assert len(sessions) == 1 and (sessions[0] / "logs").is_dir()
    finally:
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=60)
    assert server.process.returncode == 0, (tmp_path / "server.log").read_text()
    assert not sessions[0].exists()


def test_warmup_takes_documents_that_fit_the_context_alone_though_not_together(server: ServerProcess) -> None:
    """With peers as without: each document is checked against the context on its own (they are never one
    prompt), so three that each fit, and do not fit together, are warmed, each with its own token count."""
    context = server.get("/get_model_info")["max_position_embeddings"]
    tokenizer = TextTokenizer.from_dir(default_model_path())
    documents = [f"report {tag}: the heron waits by the {tag} river for the fish, " * (context // 60)
                 for tag in ("north", "south", "east")]
    counts = [len(tokenizer.encode(document)) for document in documents]
    assert all(count <= context for count in counts) and sum(counts) > context
    server.post("/flush_cache", {})
    warmed = server.post("/warmup", {"documents": documents})
    assert warmed["documents"] == 3 and warmed["token_counts"] == counts
