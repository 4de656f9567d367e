"""``hypic serve --tp-size 2`` (two gloo ranks of one thread each) against ``hypic serve`` in one process
on the same tiny float32 checkpoint: the same requests get the same answers and the same cache
behaviour (misses, hits, prefix hits, warm-ups, namespaces, flushes), streams, seeded samples,
structured output and logprobs included; a restart hits its shards on disk, which another TP size
never reads; a rank that dies takes the server down; what cannot be served is refused up front."""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from hypic import DEFAULT_SEPARATOR as SEP
from hypic.engine import Engine
from hypic.parallel import TensorParallel
from hypic.parallel.launch import run_ranks
from hypic.server.launch import ServerProcess, start_server
from hypic_testing import tp as rank_code
from hypic_testing.exits import exits_within

CHECKPOINT = "qwen3_5_text-ratio2"  # its heads divide 2, not 3
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
COUNTERS = ("segments_hit_total", "segments_missed_total", "cached_tokens_total", "recomputed_tokens_total",
            "prompt_tokens_total", "requests_finished_total", "generated_tokens_total")


@dataclass
class Pair:
    tp2: ServerProcess
    tp1: ServerProcess
    root: Path


def _serve(path: Path, log: Path, *args: str) -> ServerProcess:
    return start_server(["--model", str(path), "--dtype", "float32", "--log-level", "warning", *args], log)


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory: Any) -> Path:
    return checkpoint_factory(CHECKPOINT)


@pytest.fixture(scope="module")
def pair(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """A TP=2 server and a one-process server, each on a cache directory of its own."""
    root = tmp_path_factory.mktemp("serve-tp")
    tp2 = _serve(checkpoint, root / "tp2.log", "--tp-size", "2", "--cache-dir", str(root / "cache-tp2"))
    try:
        tp1 = _serve(checkpoint, root / "tp1.log", "--cache-dir", str(root / "cache-tp1"))
    except BaseException:
        tp2.stop()
        raise
    yield Pair(tp2, tp1, root)
    for server in (tp2, tp1):
        server.stop()


def _both(pair: Pair, path: str, body: dict) -> tuple[Any, Any]:
    """The TP=2 server's answer and the one-process server's, to the same request."""
    return pair.tp2.post(path, body), pair.tp1.post(path, body)


def _essence(answer: dict) -> dict:
    """What two servers of one model must agree on in a /generate answer (not its timings or ids)."""
    meta = answer["meta_info"]
    keys = ("cached_tokens", "prefix_hit_tokens", "segments_hit", "segments_missed", "prompt_tokens", "finish_reason")
    return {"text": answer["text"], "output_ids": answer["output_ids"], **{k: meta[k] for k in keys}}


def _generate_alike(pair: Pair, text: str, **extra: Any) -> dict:
    got, want = _both(pair, "/generate", {"text": text, "sampling_params": GREEDY, **extra})
    assert _essence(got) == _essence(want)
    return got["meta_info"]


def _doc(tag: str) -> str:
    return f" document {tag}: the river {tag} runs past the mill and the orchard of {tag}."


def _pic(*tags: str, question: str = "what runs past the mill?") -> str:
    return SEP.join([f"system prompt for {tags[0]}", *map(_doc, tags), f" {question}"])


def _metrics(server: ServerProcess) -> dict[str, float]:
    status, text = server.request("GET", "/metrics")
    assert status == 200
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("hypic_") and "{" not in line)
    return {name.removeprefix("hypic_"): float(value) for name, value in values.items()}


# ----- the same answers ----------------------------------------------------------------------------
def test_pic_documents_miss_then_hit(pair: Pair) -> None:
    first = _generate_alike(pair, _pic("alpha", "beta"))
    second = _generate_alike(pair, _pic("beta", "alpha", question="and the orchard?"))
    assert first["segments_missed"] == 2 and first["segments_hit"] == 0
    assert second["segments_hit"] == 2 and second["cached_tokens"] > 0


def test_a_shared_leading_part_is_a_prefix_hit(pair: Pair) -> None:
    head = "a long plain system prompt that both requests share, word for word, " * 8  # past a snapshot
    _generate_alike(pair, head + "first question?")
    again = _generate_alike(pair, head + "second question?")
    assert again["prefix_hit_tokens"] > 0


def test_warmed_documents_are_hits(pair: Pair) -> None:
    got, want = _both(pair, "/warmup", {"documents": [_doc("gamma"), _doc("delta")]})
    assert got["token_counts"] == want["token_counts"]
    meta = _generate_alike(pair, _pic("gamma", "delta"))
    assert meta["segments_hit"] == 2 and meta["segments_missed"] == 0


def test_a_document_warmed_in_one_namespace_is_a_miss_in_another(pair: Pair) -> None:
    _both(pair, "/warmup", {"documents": [_doc("epsilon")], "cache_salt": "tenant-a"})
    other = _generate_alike(pair, _pic("epsilon"), cache_salt="tenant-b")
    same = _generate_alike(pair, _pic("epsilon", question="who runs?"), cache_salt="tenant-a")
    assert other["segments_hit"] == 0 and other["segments_missed"] == 1
    assert same["segments_hit"] == 1


def _chunks(server: ServerProcess, body: dict) -> list[str]:
    request = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return [line.decode().strip() for line in response if line.strip()]


def test_streamed_chunks_are_the_same(pair: Pair) -> None:
    body = {"text": _pic("zeta"), "stream": True, "sampling_params": GREEDY}
    got, want = _chunks(pair.tp2, body), _chunks(pair.tp1, body)
    texts = [[json.loads(c[len("data: "):])["text"] for c in chunks[:-1]] for chunks in (got, want)]
    assert texts[0] == texts[1] and len(texts[0]) == GREEDY["max_new_tokens"]


def test_seeded_samples_are_the_same(pair: Pair) -> None:
    body = {"text": _pic("eta"), "sampling_params": {**GREEDY, "temperature": 1.0, "seed": 7, "n": 3}}
    got, want = _both(pair, "/generate", body)
    assert [a["output_ids"] for a in got] == [a["output_ids"] for a in want]
    assert len({tuple(a["output_ids"]) for a in got}) > 1  # the samples do differ from each other


def test_structured_output_is_the_same(pair: Pair) -> None:
    schema = {"type": "object", "properties": {"river": {"type": "string", "maxLength": 6}}, "required": ["river"],
              "additionalProperties": False}
    body = {"messages": [{"role": "user", "content": _pic("theta")}], "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
    got, want = _both(pair, "/v1/chat/completions", body)
    content = got["choices"][0]["message"]["content"]
    assert content == want["choices"][0]["message"]["content"]
    assert set(json.loads(content, strict=False)) == {"river"}  # the random model writes control characters


def test_logprobs_are_the_same(pair: Pair) -> None:
    body = {"prompt": _pic("iota"), "max_tokens": 6, "temperature": 0, "logprobs": 3}
    got, want = (answer["choices"][0]["logprobs"] for answer in _both(pair, "/v1/completions", body))
    assert got["tokens"] == want["tokens"]
    assert [sorted(t) for t in got["top_logprobs"]] == [sorted(t) for t in want["top_logprobs"]]
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-4)


def test_a_flush_empties_every_rank(pair: Pair) -> None:
    """After memory is flushed the documents come back from each server's disk (TP=2: every rank's shard)."""
    _generate_alike(pair, _pic("kappa"))
    for server in (pair.tp2, pair.tp1):
        assert server.post("/flush_cache", {})["public_entries_dropped"] > 0
    meta = _generate_alike(pair, _pic("kappa", question="again?"))
    assert meta["segments_hit"] == 1 and meta["cached_tokens_by_tier"].get("disk", 0) > 0


def test_the_counters_agree(pair: Pair) -> None:
    got, want = _metrics(pair.tp2), _metrics(pair.tp1)
    assert {name: got[name] for name in COUNTERS} == {name: want[name] for name in COUNTERS}
    assert got["segments_hit_total"] > 0 and got["segments_missed_total"] > 0
    pools = [{pool: {k: info[pool][k] for k in ("hits", "misses", "evictions")} for pool in ("public_pool", "private_pool")}
             for info in (pair.tp2.get("/get_server_info"), pair.tp1.get("/get_server_info"))]
    assert pools[0] == pools[1]


def test_server_info_reports_the_ranks(pair: Pair) -> None:
    info = pair.tp2.get("/get_server_info")["tensor_parallel"]
    alone = pair.tp1.get("/get_server_info")["tensor_parallel"]
    assert info["tp_size"] == 2 and len(info["rank_pids"]) == 2 and alone["tp_size"] == 1
    assert 0.45 < info["per_rank"]["weight_bytes"] / alone["per_rank"]["weight_bytes"] < 0.6
    assert info["per_rank"]["public_pool_budget_bytes"] == alone["per_rank"]["public_pool_budget_bytes"]


# ----- what only the TP=2 server must survive ----------------------------------------------------
def test_unseeded_samples_keep_the_ranks_in_step(pair: Pair) -> None:
    """Rank 0 draws the seed of an unseeded request for every rank: else the ranks' states would follow
    different tokens and the group would stop (or answer wrongly)."""
    for _ in range(2):
        pair.tp2.post("/generate", {"text": _pic("lambda"), "sampling_params": {**GREEDY, "temperature": 1.0, "n": 2}})
    _generate_alike(pair, _pic("mu"))
    assert pair.tp2.request("GET", "/health")[0] == 200


def test_a_client_that_disconnects_is_dropped_on_every_rank(pair: Pair) -> None:
    before = pair.tp2.get("/get_server_info")["requests_cancelled"]
    body = json.dumps({"text": _pic("nu"), "stream": True,
                       "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}}).encode()
    response = urllib.request.urlopen(urllib.request.Request(pair.tp2.url + "/generate", data=body, method="POST"))
    response.readline()
    response.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        info = pair.tp2.get("/get_server_info")
        if info["requests_cancelled"] > before and info["running_requests"] == 0:
            break
        time.sleep(0.2)
    assert info["requests_cancelled"] > before and info["running_requests"] == 0
    _generate_alike(pair, _pic("xi"))  # the ranks are still in step


# ----- disk shards, restarts, faults -------------------------------------------------------------
def test_a_rank_that_misses_its_shard_makes_every_rank_rebuild(checkpoint: Path, tmp_path: Path) -> None:
    """Rank 0 finds its shards (documents, resume point) on disk, rank 1 none: both treat them as
    misses and answer as one process does (without the collective decision they would fall out of step)."""
    ranks = run_ranks(rank_code.pic_after_rank_one_lost_its_shards, 2, str(checkpoint), str(tmp_path), timeout_s=180)
    alone = Engine.from_pretrained(checkpoint, dtype="float32", tp=TensorParallel()).generate(
        rank_code.PROMPTS[1][0], max_new_tokens=4)
    assert ranks[0] == ranks[1] == (alone.text, 0, alone.segments_missed, 0)


def test_a_restart_hits_its_shards_on_disk_and_one_process_reads_none(pair: Pair, checkpoint: Path) -> None:
    prompts = [_pic("alpha", "beta"), _pic("gamma", "delta"), _pic("zeta")]
    want = [pair.tp1.post("/generate", {"text": p, "sampling_params": GREEDY}) for p in prompts]
    for prompt in prompts:  # built (or hit) on the TP=2 server: its shards are on its disk
        pair.tp2.post("/generate", {"text": prompt, "sampling_params": GREEDY})
    pair.tp2.stop()
    assert pair.tp2.process.returncode == 0  # a graceful stop: every rank finished its writes
    pair.tp2 = _serve(checkpoint, pair.root / "tp2-again.log", "--tp-size", "2", "--cache-dir",
                      str(pair.root / "cache-tp2"))
    for prompt, expected in zip(prompts, want):
        got = pair.tp2.post("/generate", {"text": prompt + " (after the restart)", "sampling_params": GREEDY})
        assert got["meta_info"]["segments_missed"] == 0 and got["meta_info"]["cached_tokens_by_tier"]["disk"] > 0
    alone = _serve(checkpoint, pair.root / "tp1-on-tp2-dir.log", "--cache-dir", str(pair.root / "cache-tp2"))
    try:
        for prompt, expected in zip(prompts, want):
            got = alone.post("/generate", {"text": prompt, "sampling_params": GREEDY})
            assert got["meta_info"]["segments_hit"] == 0 and got["text"] == expected["text"]
    finally:
        alone.stop()


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie counts: it runs no more)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (FileNotFoundError, IndexError):
        return True


def test_a_rank_killed_takes_the_server_down(pair: Pair) -> None:
    server = pair.tp2
    pids = server.get("/get_server_info")["tensor_parallel"]["rank_pids"]
    assert pids[0] == server.process.pid
    os.kill(pids[1], signal.SIGKILL)
    start, unhealthy = time.monotonic(), False
    while server.process.poll() is None and time.monotonic() - start < 30:
        try:
            unhealthy |= server.request("GET", "/health", timeout=2)[0] == 503
        except OSError:
            pass
        time.sleep(0.1)
    assert server.process.poll() not in (None, 0)
    assert "tensor-parallel rank 1" in server.log.read_text()
    assert all(_gone(pid) for pid in pids)


def test_a_rank_that_hangs_takes_the_server_down(checkpoint: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 stopped (SIGSTOP: alive, but silent) while rank 0 serves: the server exits non-zero
    within 15 s (``HYPIC_RANK_HANG_S`` of 6 s, against 20 by default), naming the rank, and leaves no
    process."""
    monkeypatch.setenv("HYPIC_RANK_HANG_S", "6")
    server = _serve(checkpoint, tmp_path / "hang.log", "--tp-size", "2")
    try:
        pids = server.get("/get_server_info")["tensor_parallel"]["rank_pids"]
        os.kill(pids[1], signal.SIGSTOP)
        start = time.monotonic()
        server.process.wait(timeout=30)
        assert time.monotonic() - start < 15
    finally:
        if server.process.poll() is None:
            server.stop()
    assert server.process.returncode not in (None, 0)
    assert "tensor-parallel rank 1" in server.log.read_text() and "hangs" in server.log.read_text()
    assert all(_gone(pid) for pid in pids)


def test_the_lockstep_loop_trims_the_heap_as_often_as_the_environment_says(checkpoint: Path, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``HYPIC_HEAP_TRIM_S`` reaches the tensor-parallel loop too (it has a main loop of its own): an idle
    rank 0 wakes every 0.5 s, so 1.6 s after a request it has trimmed at least twice, and still serves."""
    monkeypatch.setenv("HYPIC_HEAP_TRIM_S", "0.05")
    server = _serve(checkpoint, tmp_path / "trim.log", "--tp-size", "2")
    try:
        server.post("/generate", {"text": _pic("nu"), "sampling_params": GREEDY})
        time.sleep(1.6)
        server.post("/generate", {"text": _pic("xi"), "sampling_params": GREEDY})  # publishes the counters
        assert server.get("/get_server_info")["heap_trims"] >= 2
        assert server.request("GET", "/health")[0] == 200
    finally:
        server.stop()


@pytest.mark.parametrize("args, message", [
    (["--tp-size", "2", "--workers", "2"], "--tp-size above 1 with --workers above 1 is not served"),
    (["--tp-size", "3"], "is not divisible by the tensor-parallel size 3"),
    (["--device", "tpu"], "--device 'tpu' is not served"),
    (["--device", "cuda", "--tp-size", str(torch.cuda.device_count() + 1)], "GPU(s), one per rank; this machine has"),
])
def test_what_cannot_be_served_is_refused_before_any_rank_starts(checkpoint: Path, args: list[str],
                                                                 message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "hypic.cli", "serve", "--model", str(checkpoint), *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr


def _with_fault(checkpoint: Path, log: Path, fault: str, monkeypatch: pytest.MonkeyPatch) -> ServerProcess:
    """A ``--tp-size 2`` server whose processes carry ``fault`` (``tests/helpers/faults``)."""
    helpers = Path(rank_code.__file__).parents[1]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(helpers / "faults"), str(helpers.parents[1]),
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("HYPIC_TEST_FAULT", fault)
    return _serve(checkpoint, log, "--tp-size", "2")


def _two_at_once(server: ServerProcess) -> None:
    """Two greedy requests decoding side by side."""
    bodies = [{"text": _pic(tag), "sampling_params": {**GREEDY, "max_new_tokens": 24}} for tag in ("rho", "tau")]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda body: server.request("POST", "/generate", body, timeout=30), bodies))


OUT_OF_STEP = {  # fault -> what trips it, and what the log then says
    "follower_warmup": (lambda s: s.request("POST", "/warmup", {"documents": ["hi"]}, timeout=30),
                        "disagree on an iteration's outcome"),
    "follower_record": (lambda s: s.request("POST", "/generate", {"text": _pic("phi"), "sampling_params": GREEDY},
                                            timeout=30), "disagree on the iteration's requests"),
    "follower_rows": (_two_at_once, "disagree on an iteration's outcome"),
    "follower_flush": (lambda s: s.request("POST", "/flush_cache", timeout=30), "disagree on an iteration's outcome"),
}


@pytest.mark.parametrize("fault", sorted(OUT_OF_STEP))
def test_a_follower_out_of_step_ends_the_server_within_10_s(checkpoint: Path, tmp_path: Path, fault: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A follower that fails a warm-up rank 0 completes (no model call: only the outcome check can tell),
    reads a perturbed record, samples its rows' tokens swapped (the same tokens in another order), or
    fails a flush: the ranks disagree, and the server exits non-zero within 10 s naming what they
    disagree on, rather than hang in mismatched collectives or serve from pools that differ."""
    trip, cause = OUT_OF_STEP[fault]
    server = _with_fault(checkpoint, tmp_path / f"{fault}.log", fault, monkeypatch)
    start = time.monotonic()
    try:
        trip(server)
    except OSError:
        pass  # the server went away under the request
    exits_within(server, 10, start)
    assert cause in server.log.read_text()


def test_a_follower_whose_clock_runs_fast_serves_as_one_process(pair: Pair, checkpoint: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Priorities rank by rank 0's arrival times, never a follower's clock: a follower whose clock runs 1000
    times fast, under requests that arrive while a long one is prefilled (their order is then decided by
    their waits), answers as the one-process server does and stays up."""
    server = _with_fault(checkpoint, tmp_path / "clock.log", "follower_clock", monkeypatch)
    try:
        long_body = {"text": _pic(*(f"long{i}" for i in range(12))), "sampling_params": GREEDY}
        bodies = [long_body] + [{"text": _pic(tag), "sampling_params": GREEDY} for tag in ("chi", "psi", "omega")]
        with ThreadPoolExecutor(len(bodies)) as pool:
            futures = []
            for body in bodies:
                futures.append(pool.submit(server.post, "/generate", body))
                time.sleep(0.05)
            answers = [future.result(timeout=120) for future in futures]
        assert [a["output_ids"] for a in answers] == [pair.tp1.post("/generate", b)["output_ids"] for b in bodies]
        assert server.request("GET", "/health")[0] == 200
    finally:
        server.stop()


def test_a_follower_whose_rank_zero_hangs_stops(checkpoint: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 stopped (SIGSTOP: alive, but silent): its followers see its heartbeat age and exit within
    15 s (``HYPIC_RANK_HANG_S`` of 6 s, which they inherit), naming it, instead of waiting in a
    collective for gloo's 300 s."""
    monkeypatch.setenv("HYPIC_RANK_HANG_S", "6")
    server = _serve(checkpoint, tmp_path / "rank0.log", "--tp-size", "2")
    follower = server.get("/get_server_info")["tensor_parallel"]["rank_pids"][1]
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 15
        while not _gone(follower) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(follower)
    finally:
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=30)
        if not _gone(follower):
            os.kill(follower, signal.SIGKILL)
    assert "tensor-parallel rank 0" in server.log.read_text() and "hangs" in server.log.read_text()
