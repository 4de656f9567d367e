"""``hypic serve --workers 2``: the server process and one Ray worker prefill a request's cold
documents together; every endpoint answers as with one worker, and outputs equal one engine's.
Each pool holds about six entries (12M), so requests of five or six documents evict."""
import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hypic import Engine
from hypic.server.launch import ServerProcess, start_server

Prompt = Callable[[list[int], str], str]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve") / "server.log"
    process = start_server(["--workers", "2", "--threads", "1", "--public-pool-size", "12M", "--log-level", "warning"],
                           log, threads=None)
    yield process
    process.stop()


def _generate(server: ServerProcess, prompt: str) -> dict:
    return server.post("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})


def test_two_workers_answer_as_one_engine(server: ServerProcess, pic_prompt: Prompt, docs: list[str]) -> None:
    """Outputs equal one engine's; every cold document is a public-pool hit in the server's own
    prefill (built on the peer and shipped, or built here beforehand), as for a warm engine."""
    engine = Engine.from_pretrained("default")
    for indices, question in (([0, 1, 2, 3, 4, 5], "Where was the lynx born?"), ([5, 3, 1, 6], "Who studied ibises?")):
        prompt = pic_prompt(indices, question)
        served = _generate(server, prompt)
        engine.warmup([docs[i] for i in indices])
        expected = engine.generate(prompt, max_new_tokens=8)
        assert served["output_ids"] == expected.output_ids
        # every document a hit here (or in the head combined early here, resumed from the private pool)
        assert served["meta_info"]["segments_missed"] == 0 and served["meta_info"]["cached_tokens"] >= expected.cached_tokens > 0
    info = server.get("/get_server_info")
    assert info["workers"]["workers"] == [0, 1] and info["workers"]["lost_workers"] == []
    assert info["workers"]["held_entries"]["1"] >= 3  # LPT gave the peer half of the six cold documents
    received = info["workers"]["received_entries"]  # the peer's entries came point-to-point (gloo)
    assert received["point_to_point"] >= 3 and received["object_store"] == received["failed"] == 0
    metrics = server.get("/metrics")
    assert "hypic_workers_live 2" in metrics
    assert f"hypic_peer_entries_received_point_to_point_total {received['point_to_point']}" in metrics


def test_every_endpoint_still_answers(server: ServerProcess, pic_prompt: Prompt) -> None:
    """Each endpoint gives what one engine gives: token counts, tokens, a greedy completion."""
    engine = Engine.from_pretrained("default")
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
    engine = Engine.from_pretrained("default")
    engine.warmup(docs[:4])
    prompt = pic_prompt([3, 1, 0, 2], "Who studied badgers?")
    expected = engine.generate(prompt, max_new_tokens=8)
    served = _generate(server, prompt)
    assert served["output_ids"] == expected.output_ids and served["meta_info"]["segments_missed"] == 0
    assert served["meta_info"]["cached_tokens"] >= expected.cached_tokens  # more where a held head was combined early


def test_concurrent_requests_under_eviction(server: ServerProcess, pic_prompt: Prompt) -> None:
    """Six requests at once, five documents each out of ten, pools of about six entries: the index
    goes stale under the requests' feet; outputs stay one engine's."""
    engine = Engine.from_pretrained("default")
    rng = random.Random(11)
    prompts = [pic_prompt(rng.sample(range(10), 5), f"Question {i}: where was the egret born?") for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        served = list(pool.map(lambda p: _generate(server, p)["output_ids"], prompts))
    assert served == [engine.generate(p, max_new_tokens=8).output_ids for p in prompts]
    status = server.get("/get_server_info")["workers"]
    assert status["lost_workers"] == [] and set(status["queued_tokens"].values()) == {0}  # all released


@pytest.mark.parametrize(("args", "message"), [(["--workers", "0"], "--workers must be >= 1"),
                                               (["--workers", "2", "--worker-timeout", "0"], "--worker-timeout must be > 0")])
def test_bad_worker_options_are_refused(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from hypic.cli import main

    assert main(["serve", *args]) == 2
    assert message in capsys.readouterr().err
