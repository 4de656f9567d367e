"""``hypic serve --dp-size 2``: two replicas on Ray Serve behind the document-aware router. Each
replica is a whole instance, so the oracle of a replica is one engine that ran the same requests in
the same order: every answer, and every hit and miss, must equal that engine's. The router must send a
request to the replica that holds its documents, in whatever order the prompt names them."""
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hypic import DEFAULT_SEPARATOR, Engine
from hypic.server.launch import ServerProcess, start_server

ANIMALS = ["otter", "heron", "badger", "lynx", "marten", "ibis", "stoat", "crane"]
PLACES = ["Tarsk", "Welby", "Oxmoor", "Quill", "Dunmere", "Pellow", "Ravia", "Scoll"]
DOCS = [f"Record {i}: the {a} of {p} was born in {1900 + 7 * i} and studied {a}s near the river of {p}. "
        f"It was known for a red coat and a loud call at dawn." for i, (a, p) in enumerate(zip(ANIMALS, PLACES))]


def _prompt(indices: list[int], question: str = "Who was born first?") -> str:
    return DEFAULT_SEPARATOR.join(["Answer from the records.", *(DOCS[i] for i in indices), f"Question: {question}"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("replicas") / "server.log"
    # float32: answers are compared with in-process engines (bf16 rounds a resumed state differently)
    process = start_server(["--dp-size", "2", "--dtype", "float32", "--log-level", "info"], log, threads=1,
                           timeout_s=300)
    yield process
    process.stop()


class Replay:
    """One engine per replica, running what the cluster ran there, in order (the oracle)."""

    def __init__(self) -> None:
        self.engines: dict[str, Engine] = {}

    def generate(self, replica: str, prompt: str, **sampling) -> object:
        if replica not in self.engines:
            self.engines[replica] = Engine.from_pretrained("default", dtype="float32")
        return self.engines[replica].generate(prompt, **sampling)

    def check(self, answer: dict, prompt: str) -> dict:
        """Assert a 6-token greedy ``answer`` to ``prompt`` is its replica's engine's (tokens, hits and
        misses); its ``meta_info``."""
        meta = answer["meta_info"]
        expected = self.generate(meta["replica"], prompt, max_new_tokens=6)
        assert answer["output_ids"] == expected.output_ids
        assert (meta["segments_hit"], meta["segments_missed"]) == (expected.segments_hit, expected.segments_missed)
        return meta


def _generate(cluster: ServerProcess, prompt: str, **extra) -> dict:
    return cluster.post("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0},
                                      **extra})


def _held(cluster: ServerProcess, settled: Callable[[dict[str, int]], bool] = lambda _: True) -> dict[str, int]:
    """Replica -> documents its memory holds, as /get_server_info reports them: the report refreshes
    every second, so this waits (10 s at most) until ``settled`` holds of it."""
    deadline = time.monotonic() + 10
    while True:
        held = {r["replica"]: r["documents_held"] for r in cluster.get("/get_server_info")["data_parallel"]["replicas"]}
        if settled(held) or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def test_a_reordered_request_follows_its_documents_and_answers_as_one_engine(cluster: ServerProcess) -> None:
    """Two requests on documents 0-2 and two on 3-5, the second of each pair naming them in another
    order: the second goes where the first left its documents and hits all three, and every answer,
    hit and miss equals that of an engine that served what that replica served."""
    cluster.post("/flush_cache", {})
    replay, served = Replay(), {}
    for first, again in (([0, 1, 2], [2, 0, 1]), ([3, 4, 5], [5, 3, 4])):
        for indices in (first, again):
            served[tuple(indices)] = replay.check(_generate(cluster, _prompt(indices)), _prompt(indices))
        assert served[tuple(again)]["replica"] == served[tuple(first)]["replica"]
        assert served[tuple(again)]["segments_hit"] == 3


def test_warmed_documents_are_spread_and_each_request_finds_its_holder(cluster: ServerProcess) -> None:
    """A warm-up of four documents of about equal length puts two on each replica; a request for any
    one of them is routed to the replica holding it (a hit every time: a router blind to documents
    would miss about half)."""
    cluster.post("/flush_cache", {})
    warmed = cluster.post("/warmup", {"documents": DOCS[:4]})
    assert warmed["documents"] == 4
    assert sorted(_held(cluster, lambda held: sorted(held.values()) == [2, 2]).values()) == [2, 2]
    for i in (3, 0, 2, 1):
        meta = _generate(cluster, _prompt([i], "Where was it born?"))["meta_info"]
        assert (meta["segments_hit"], meta["segments_missed"]) == (1, 0), (i, meta)
    routing = cluster.get("/get_server_info")["routing"]
    assert routing["routed_by_cache"] >= 4


def test_flush_empties_every_replica_and_the_index(cluster: ServerProcess) -> None:
    """After /flush_cache no replica holds a document, and a request for a warmed one misses."""
    cluster.post("/warmup", {"documents": DOCS[4:8]})
    flushed = cluster.post("/flush_cache", {})
    assert flushed["public_entries_dropped"] >= 4
    assert set(_held(cluster, lambda held: set(held.values()) == {0}).values()) == {0}
    meta = _generate(cluster, _prompt([4, 5]))["meta_info"]
    assert (meta["segments_hit"], meta["segments_missed"]) == (0, 2)


def test_a_batch_streams_and_samples_as_one_engine(cluster: ServerProcess) -> None:
    """A streamed request with n = 2 and a batch of two prompts in one call: every sample equals one
    engine's greedy answer (the batch's two prompts are two calls to the replicas from one request)."""
    cluster.post("/flush_cache", {})
    body = json.dumps({"text": _prompt([6, 7]), "stream": True,
                       "sampling_params": {"max_new_tokens": 6, "temperature": 0, "n": 2}}).encode()
    request = urllib.request.Request(cluster.url + "/generate", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    last: dict[int, dict] = {}
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[len(b"data: "):])
                last[chunk["index"]] = chunk
    expected = Engine.from_pretrained("default", dtype="float32").generate(_prompt([6, 7]), max_new_tokens=6)
    assert sorted(last) == [0, 1] and all(c["output_ids"] == expected.output_ids for c in last.values())
    batch = cluster.post("/generate", {"text": [_prompt([0]), _prompt([1])],
                                       "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    engine = Engine.from_pretrained("default", dtype="float32")
    assert [b["output_ids"] for b in batch] == [engine.generate(_prompt([i]), max_new_tokens=6).output_ids for i in (0, 1)]


def test_a_namespace_never_reuses_another_namespaces_documents(cluster: ServerProcess) -> None:
    """Documents cached in the shared namespace are a miss for a request with a cache_salt; the
    salted request's own documents are then hits for its next request, on the same replica."""
    cluster.post("/flush_cache", {})
    cluster.post("/warmup", {"documents": DOCS[:2]})
    salted = _generate(cluster, _prompt([0, 1]), cache_salt="tenant-a")["meta_info"]
    assert (salted["segments_hit"], salted["segments_missed"]) == (0, 2)
    again = _generate(cluster, _prompt([1, 0]), cache_salt="tenant-a")["meta_info"]
    assert again["segments_hit"] == 2 and again["replica"] == salted["replica"]


def test_the_service_reports_its_replicas(cluster: ServerProcess) -> None:
    """/get_server_info lists both replicas with their processes; its counters and /metrics sum the
    replicas': two more requests (each a fresh namespace's, so they spread) count two more."""
    info = cluster.get("/get_server_info")
    replicas = info["data_parallel"]["replicas"]
    assert info["data_parallel"]["dp_size"] == 2 and info["data_parallel"]["policy"] == "cache_aware"
    assert len({r["pid"] for r in replicas}) == 2 and all(r["healthy"] for r in replicas)
    # one machine, one Ray node: both replicas name it (a Ray node id is 28 bytes, in hex)
    assert len({r["node_id"] for r in replicas}) == 1 and len(replicas[0]["node_id"]) == 56
    model = Engine.from_pretrained("default", dtype="float32").model  # what one replica holds
    weights = sum(t.numel() * 4 for t in (*model.parameters(), *model.buffers()))
    assert info["tensor_parallel"]["per_rank"]["weight_bytes"] == weights  # the replicas', not the ingress's 0
    assert all(r["weight_bytes"] == weights for r in replicas)
    before = _settled_finished(cluster)
    for salt in ("count-a", "count-b"):
        _generate(cluster, _prompt([0]), cache_salt=salt)
    finished = _settled_finished(cluster)
    assert finished == before + 2
    metrics = cluster.get("/metrics")
    assert "hypic_replicas_live 2" in metrics and f"hypic_requests_finished_total {finished}" in metrics


def _settled_finished(cluster: ServerProcess) -> int:
    """requests_finished once two reports a second and a half apart agree (the report refreshes every second)."""
    deadline, last = time.monotonic() + 15, None
    while True:
        now = cluster.get("/get_server_info")["requests_finished"]
        if now == last or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(1.5)


def test_cold_documents_are_built_on_both_replicas_and_answer_as_one_engine(cluster: ServerProcess) -> None:
    """Four cold documents long enough to be worth shipping: the other replica builds some of them
    (longest first to the least loaded) while the chosen one builds the rest, and the answer, hits and
    misses equal one engine's that built all four itself; the builder ships what it built and keeps
    none of it (its pool is for its own requests), and the replica that served the request holds all
    four (a reordered request hits them all there)."""
    cluster.post("/flush_cache", {})
    long_docs = [" ".join(DOCS[i:i + 3]) for i in (0, 2, 4, 5)]
    prompt = DEFAULT_SEPARATOR.join(["Answer from the records.", *long_docs, "Question: who was born first?"])
    answer = _generate(cluster, prompt)
    meta = answer["meta_info"]
    expected = Engine.from_pretrained("default", dtype="float32").generate(prompt, max_new_tokens=6)
    assert answer["output_ids"] == expected.output_ids
    assert (meta["segments_hit"], meta["segments_missed"]) == (0, 4) == (expected.segments_hit, expected.segments_missed)
    assert 1 <= meta["segments_built_remotely"] <= 3 and meta["remote_prefill_tokens"] > 0
    held = _held(cluster, lambda held: held[meta["replica"]] == 4)
    assert sorted(held.values()) == [0, 4] and held[meta["replica"]] == 4
    reordered = DEFAULT_SEPARATOR.join(["Answer from the records.", *reversed(long_docs), "Question: who?"])
    again = _generate(cluster, reordered)["meta_info"]
    assert (again["replica"], again["segments_hit"]) == (meta["replica"], 4)


def test_each_request_leaves_an_access_line_in_the_services_output(cluster: ServerProcess) -> None:
    """As one server's uvicorn writes one: the client, the request line and the status, printed by
    ``hypic serve`` itself (the ingress runs in a Ray process of its own)."""
    for probe in range(3):
        assert cluster.request("GET", f"/get_server_info?probe={probe}")[0] == 200
    assert cluster.request("POST", "/generate", {"text": ""})[0] == 400
    lines = r'"GET /get_server_info\?probe=(\d) HTTP/1.1" 200'
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = cluster.log.read_text()
        if sorted(re.findall(lines, text)) == ["0", "1", "2"] and '"POST /generate HTTP/1.1" 400' in text:
            return
        time.sleep(0.2)
    raise AssertionError(f"no access lines for the requests in the service's output:\n{cluster.log.read_text()[-2000:]}")


def _tree(root: int) -> dict[int, str]:
    """pid -> command name of ``root`` and every process below it (read from /proc)."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                names[int(entry.name)] = stat[stat.index("(") + 1 : stat.rindex(")")]
                parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    tree, grown = {root}, True
    while grown:
        below = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree, grown = tree | below, bool(below)
    return {pid: names.get(pid, "?") for pid in tree}


def _listening(pids: set[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket these processes listen on (``ss``)."""
    found = []
    for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines():
        local = line.split()[3]
        address, _, port = local.rpartition(":")
        found += [(address.strip("[]"), int(port), int(pid)) for pid in re.findall(r"pid=(\d+)", line)
                  if int(pid) in pids]
    return found


def test_the_service_listens_where_asked_and_its_ray_refuses_a_stranger(cluster: ServerProcess) -> None:
    """``--host 127.0.0.1``: the service's own HTTP socket is on loopback alone. Ray's daemons (its GCS,
    raylet, agents, workers) listen on every interface whatever its node address (Ray has no bind
    setting for them): every other socket of the service's processes is theirs, and the local Ray
    runs with Ray's token auth, so a client holding another token is refused by its GCS."""
    tree = _tree(cluster.process.pid)
    sockets = _listening(set(tree))
    port = int(cluster.url.rsplit(":", 1)[1])
    assert {address for address, at, _ in sockets if at == port} == {"127.0.0.1"}
    elsewhere = {tree[pid] for address, at, pid in sockets if at != port}
    assert "gcs_server" in elsewhere and "raylet" in elsewhere
    gcs = next(at for address, at, pid in sockets if tree[pid] == "gcs_server" and address in ("*", "0.0.0.0"))
    stranger = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "f" * 32}
    done = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='127.0.0.1:{gcs}')"], env=stranger,
                          capture_output=True, text=True, timeout=90)
    assert done.returncode != 0 and ("InvalidAuthToken" in done.stderr or "AuthenticationError" in done.stderr), \
        done.stderr[-2000:]


def test_a_document_another_replica_holds_is_fetched_from_it_and_answers_as_one_engine(cluster: ServerProcess) -> None:
    """Two documents of over 128 tokens warmed, one on each replica: a request naming both goes to
    one of them and gets the other's document from the replica that holds it (a hit, counted as
    fetched; nothing missed or built), and answers as an engine that holds both; the service counts
    the fetch and its bytes."""
    cluster.post("/flush_cache", {})
    before = cluster.get("/get_server_info")
    long_docs = [" ".join(DOCS[0:3]), " ".join(DOCS[3:6])]
    assert cluster.post("/warmup", {"documents": long_docs})["documents"] == 2
    assert sorted(_held(cluster, lambda held: sorted(held.values()) == [1, 1]).values()) == [1, 1]
    prompt = DEFAULT_SEPARATOR.join(["Answer from the records.", *long_docs, "Question: who was born first?"])
    answer = _generate(cluster, prompt)
    meta = answer["meta_info"]
    engine = Engine.from_pretrained("default", dtype="float32")
    engine.warmup(long_docs)
    assert answer["output_ids"] == engine.generate(prompt, max_new_tokens=6).output_ids
    assert (meta["segments_hit"], meta["segments_missed"], meta["segments_fetched"]) == (2, 0, 1), meta
    assert meta["cached_tokens_by_tier"]["replica"] > 0 and meta["segments_built_remotely"] == 0
    deadline, fetched = time.monotonic() + 10, before.get("fetched_documents", 0)
    while (after := cluster.get("/get_server_info")).get("fetched_documents", 0) <= fetched:
        assert time.monotonic() < deadline, after  # the replicas' statuses refresh every second
        time.sleep(0.2)
    assert after["routing"]["documents_fetched"] == before["routing"]["documents_fetched"] + 1
    assert after["fetched_documents"] == fetched + 1 and after["fetched_bytes"] > 0
    metrics = cluster.request("GET", "/metrics")[1]
    assert re.search(r"^hypic_fetched_bytes_total [1-9]", metrics, re.M), metrics[-2000:]


def test_the_readmes_quick_start_is_all_hits_on_two_replicas(cluster: ServerProcess) -> None:
    """The README's quick start (two documents warmed, then a request naming both in another order)
    against --dp-size 2: the warm-up puts one document on each replica, and the request, wherever it
    goes, hits both: the one its replica holds, and the other fetched from the replica that holds it."""
    import shlex

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    calls = [shlex.split(line) for line in readme.splitlines() if line.startswith("curl -s localhost:30000/")]
    bodies = {argv[2].rsplit("/", 1)[1]: json.loads(argv[argv.index("-d") + 1]) for argv in calls}
    cluster.post("/flush_cache", {})
    assert cluster.post("/warmup", bodies["warmup"])["documents"] == 2
    assert sorted(_held(cluster, lambda held: sorted(held.values()) == [1, 1]).values()) == [1, 1]
    meta = cluster.post("/generate", bodies["generate"])["meta_info"]
    assert (meta["segments_hit"], meta["segments_missed"], meta["segments_fetched"]) == (2, 0, 1), meta


def test_a_system_prompt_another_replica_served_is_fetched_from_it_and_answers_as_one_engine(
        cluster: ServerProcess) -> None:
    """A request under a long system prompt lands on one replica; a long streamed decode then keeps
    that replica busy, so the next request under the same system prompt goes to the other, which
    gets the prompt's head from the first replica's private pool instead of computing it: it resumes
    from a whole snapshot interval of it (256 tokens) and answers as one engine that served both
    requests; the service counts the fetch."""
    import threading

    cluster.post("/flush_cache", {})
    system = " ".join(DOCS + DOCS) + " Answer from these records only."
    first, second = f"{system} Question: who studied herons?", f"{system} Question: who was born last?"
    before = cluster.get("/get_server_info")
    holder = _generate(cluster, first)["meta_info"]["replica"]
    stop, started = threading.Event(), threading.Event()

    def busy() -> None:  # the holder decodes 600 tokens for a client that leaves once the test is done
        body = {"text": first, "stream": True,
                "sampling_params": {"max_new_tokens": 600, "temperature": 0, "ignore_eos": True}}
        call = urllib.request.Request(cluster.url + "/generate", json.dumps(body).encode(),
                                      {"Content-Type": "application/json"})
        with urllib.request.urlopen(call, timeout=120) as response:
            for _ in response:
                started.set()
                if stop.is_set():
                    return

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        assert started.wait(60)
        answer = _generate(cluster, second)
    finally:
        stop.set()
        thread.join(30)
    meta = answer["meta_info"]
    assert meta["replica"] != holder and meta["prefix_hit_tokens"] >= 256, meta
    engine = Engine.from_pretrained("default", dtype="float32")
    engine.generate(first, max_new_tokens=6)
    assert answer["output_ids"] == engine.generate(second, max_new_tokens=6).output_ids
    deadline = time.monotonic() + 10
    while (after := cluster.get("/get_server_info")).get("fetched_prefixes", 0) <= before.get("fetched_prefixes", 0):
        assert time.monotonic() < deadline, after  # the replicas' statuses refresh every second
        time.sleep(0.2)
    assert after["routing"]["prefixes_fetched"] == before["routing"]["prefixes_fetched"] + 1
    assert after["fetched_prefix_tokens"] - before.get("fetched_prefix_tokens", 0) == meta["prefix_hit_tokens"]
