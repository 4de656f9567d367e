"""A replica of ``hypic serve --dp-size 2`` SIGKILLed while it serves: a request that had sent its
client nothing is answered by the other replica (as one engine answers it), a stream already
flowing ends with an error naming the failure, the dead replica leaves the index and the service's
report within seconds, ``/health`` stays 200, and Ray Serve starts a replacement that joins. Before
that: requests more than the replicas hold are refused with a 503, as one server refuses them."""
import json
import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hypic import DEFAULT_SEPARATOR, Engine
from hypic.server.launch import ServerProcess, start_server

PROMPT = DEFAULT_SEPARATOR.join(["Answer from the records.", "Record: the otter of Tarsk was born in 1900.",
                                 "Question: who was born?"])
LONG = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
ROOM = 2  # requests each replica holds (--max-queued-requests)
INGRESS_BACK_S = 40  # a killed ingress serves again in this long (Linux keeps a closed connection 60 s in TIME_WAIT)


def _replicas(cluster: ServerProcess) -> list[dict[str, Any]]:
    return cluster.get("/get_server_info")["data_parallel"]["replicas"]


def _wait(condition: Any, timeout_s: float, what: str) -> float:
    """Seconds until ``condition()`` holds (polled every 0.1 s); fails after ``timeout_s``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what} did not happen in {timeout_s} s"
        time.sleep(0.1)
    return time.monotonic() - start


def _busy_replica(cluster: ServerProcess) -> dict[str, Any]:
    found: list[dict[str, Any]] = []
    _wait(lambda: bool(found.extend(r for r in _replicas(cluster) if r["running"]) or found), 60, "a request to start")
    return found[0]


def test_a_killed_replica_costs_no_request_that_had_not_answered(tmp_path: Any) -> None:
    cluster = start_server(["--dp-size", "2", "--dtype", "float32", "--log-level", "warning",
                            "--max-queued-requests", str(ROOM)], tmp_path / "server.log", threads=1, timeout_s=300)
    try:
        expected = Engine.from_pretrained("default", dtype="float32").generate(PROMPT, **{
            k: v for k, v in LONG.items() if k != "temperature"})
        _more_than_fits_is_refused_as_one_server_refuses(cluster, expected.output_ids)
        retried = cluster.get("/get_server_info")["routing"]["retried"]
        answers: list[Any] = []
        waiting = threading.Thread(target=lambda: answers.append(
            cluster.request("POST", "/generate", {"text": PROMPT, "sampling_params": LONG}, timeout=120)))
        waiting.start()
        victim = _busy_replica(cluster)
        os.kill(victim["pid"], signal.SIGKILL)
        gone_s = _wait(lambda: victim["replica"] not in {r["replica"] for r in _replicas(cluster)}, 10, "the replica to leave")
        _wait(lambda: f"replica {victim['replica']} is gone" in cluster.log.read_text(), 10,
              "the loss to be told in the service's output")
        assert cluster.request("GET", "/health")[0] == 200
        waiting.join(timeout=120)
        status, answer = answers[0]
        assert status == 200, answer
        assert answer["output_ids"] == expected.output_ids and answer["meta_info"]["replica"] != victim["replica"]
        # retried by the ingress, or re-sent by Ray Serve itself (a replica dead before it sent anything
        # back); the ingress's own retry is checked on a full replica's refusal, which Serve never re-sends
        assert retried <= cluster.get("/get_server_info")["routing"]["retried"] <= retried + 1
        print(f"the killed replica left the service's report {gone_s:.2f} s after the kill")
        _wait(lambda: len(_replicas(cluster)) == 2, 180, "a replacement replica to join")
        _a_stream_cut_mid_way_ends_in_an_error(cluster)
        _a_restarted_ingress_learns_what_the_replicas_hold(cluster)
    finally:
        cluster.stop()


def _more_than_fits_is_refused_as_one_server_refuses(cluster: ServerProcess, expected: list[int]) -> None:
    """Each replica holds ``ROOM`` requests (``--max-queued-requests``); four times as many long requests
    at once are more than both hold. What neither replica takes (a full one's refusal is tried once on
    the other) is refused as one server refuses it: 503, ``retry-after``, the limit named, never a 500.
    What they take is answered as one engine answers it."""
    body = {"text": PROMPT, "sampling_params": LONG}
    retried = cluster.get("/get_server_info")["routing"]["retried"]
    with ThreadPoolExecutor(4 * ROOM) as pool:
        answers = list(pool.map(lambda _: cluster.exchange("POST", "/generate", body, timeout=120), range(4 * ROOM)))
    statuses = [status for status, _, _ in answers]
    assert set(statuses) <= {200, 503} and statuses.count(200) >= ROOM and 503 in statuses, statuses
    # each refusal was first tried on the other replica, and both are told in the service's output
    assert cluster.get("/get_server_info")["routing"]["retried"] - retried >= statuses.count(503)
    _wait(lambda: "retried on another" in cluster.log.read_text() and "refused: every replica tried was full"
          in cluster.log.read_text(), 10, "the retries and refusals to be told in the service's output")
    for status, answer, headers in answers:
        if status == 503:
            assert "retry-after" in headers and "--max-queued-requests" in answer["error"]["message"], answer
        else:
            assert answer["output_ids"] == expected


def _a_stream_cut_mid_way_ends_in_an_error(cluster: ServerProcess) -> None:
    body = json.dumps({"text": PROMPT, "stream": True, "sampling_params": LONG}).encode()
    request = urllib.request.Request(cluster.url + "/generate", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    chunks: list[dict] = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunks.append(json.loads(line[len(b"data: "):]))
            if len(chunks) == 3:
                os.kill(_busy_replica(cluster)["pid"], signal.SIGKILL)
    assert "error" in chunks[-1] and "replica" in chunks[-1]["error"]["message"], chunks[-1]
    assert len(chunks[-2]["output_ids"]) < LONG["max_new_tokens"]


def _a_restarted_ingress_learns_what_the_replicas_hold(cluster: ServerProcess) -> None:
    """Documents warmed before the ingress is SIGKILLed are hits after Ray Serve restarts it: the new
    ingress asks every replica for what it holds before it serves. It serves on the same address
    well within the minute its predecessor's connections linger there (TIME_WAIT), which a socket
    that did not reuse the address would have to wait out."""
    _wait(lambda: len(_replicas(cluster)) == 2, 180, "a replacement replica to join")
    documents = [f"Record {i}: the heron of Welby was born in {1900 + i} and fished the river at dawn." for i in range(2)]
    cluster.post("/flush_cache", {})
    cluster.post("/warmup", {"documents": documents})
    os.kill(cluster.get("/get_server_info")["data_parallel"]["ingress_pid"], signal.SIGKILL)
    time.sleep(1)
    _wait(lambda: _healthy(cluster), INGRESS_BACK_S, "a new ingress to serve")
    for document in documents:
        prompt = DEFAULT_SEPARATOR.join(["Answer from the records.", document, "Question: when?"])
        meta = cluster.post("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 2}})["meta_info"]
        assert (meta["segments_hit"], meta["segments_missed"]) == (1, 0), meta


def _healthy(cluster: ServerProcess) -> bool:
    try:
        return cluster.request("GET", "/health", timeout=5)[0] == 200
    except OSError:
        return False
