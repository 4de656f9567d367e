"""``hypic serve --dp-size 2`` over two hosts: two network namespaces joined by a veth pair, a Ray
node in each (``ray start``), the service started in the first with ``--ray-address``. One replica
lands on each node, so the routing, the replicas' announcements, the requests and the streamed
answers all cross a real (virtual) link. The oracle of a replica is one in-process engine that ran
what that replica ran, in order. Then the link is cut: the service must go on answering from the
first host, a request that had not answered retried there."""
import ctypes
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hypic import DEFAULT_SEPARATOR, Engine
from hypic.server.launch import ServerProcess, start_server

SUBNET = "10.213.0"
HOST_A, HOST_B = f"{SUBNET}.1", f"{SUBNET}.2"
GCS_PORT = 6390  # inside host A's own network: nothing else listens there
CLONE_NEWNET = 0x40000000
# Ray's defaults notice a node cut off after about 65 s (5 health checks of 10 s each); these notice it
# in about 20 s and still allow a busy raylet 3 s to answer a check
RAY_HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_timeout_ms": 3000,
                     "health_check_failure_threshold": 5}
GREEDY = {"max_new_tokens": 6, "temperature": 0}
DOCS = [f"Record {i}: the {a} of {p} was born in {1900 + 7 * i} and studied {a}s near the river of {p}. "
        f"It was known for a red coat and a loud call at dawn."
        for i, (a, p) in enumerate(zip(["otter", "heron", "badger", "lynx", "marten", "ibis"],
                                       ["Tarsk", "Welby", "Oxmoor", "Quill", "Dunmere", "Pellow"]))]


def _prompt(indices: list[int], question: str = "Who was born first?") -> str:
    return DEFAULT_SEPARATOR.join(["Answer from the records.", *(DOCS[i] for i in indices), f"Question: {question}"])


# ----- the two hosts -------------------------------------------------------------------------------
@dataclass
class Hosts:
    """Two network namespaces ``a`` and ``b`` joined by the veth pair ``veth_a``/``veth_b``."""

    a: str
    b: str
    veth_a: str
    veth_b: str


def _on(namespace: str) -> list[str]:
    """The prefix that runs a command on ``namespace``'s network."""
    return ["ip", "netns", "exec", namespace]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _make_hosts(hosts: Hosts) -> None:
    """Host B's namespace, the link, the addresses (host A's namespace exists already)."""
    _ip("netns", "add", hosts.b)
    _ip("link", "add", hosts.veth_a, "type", "veth", "peer", "name", hosts.veth_b)
    for namespace, veth, address in ((hosts.a, hosts.veth_a, HOST_A), (hosts.b, hosts.veth_b, HOST_B)):
        _ip("link", "set", veth, "netns", namespace)
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", veth)
        _ip("-n", namespace, "link", "set", veth, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        # a default route: Ray finds a process's own address by the route out (no packet is sent)
        _ip("-n", namespace, "route", "add", "default", "dev", veth)


def _kill_everything_in(namespace: str) -> None:
    """SIGKILL every process on ``namespace``'s network: only what this test started runs there."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30)
    for pid in listed.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _remove_hosts(hosts: Hosts) -> None:
    for namespace in (hosts.a, hosts.b):
        _kill_everything_in(namespace)
    time.sleep(0.5)
    for args in (("netns", "del", hosts.a), ("netns", "del", hosts.b), ("link", "del", hosts.veth_a)):
        subprocess.run(["ip", *args], capture_output=True, timeout=30)  # the veth goes with its namespace


@contextmanager
def on_network(namespace: str) -> Iterator[None]:
    """Run this thread (and the threads and processes it starts) on ``namespace``'s network."""
    libc = ctypes.CDLL(None, use_errno=True)
    home, there = os.open("/proc/thread-self/ns/net", os.O_RDONLY), os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(there, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"cannot join the network of {namespace}")
        yield
    finally:
        libc.setns(home, CLONE_NEWNET)
        os.close(home)
        os.close(there)


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's ip")
    pid = os.getpid()
    made = Hosts(f"hypic-a-{pid}", f"hypic-b-{pid}", f"hyva{pid}", f"hyvb{pid}")
    created = subprocess.run(["ip", "netns", "add", made.a], capture_output=True, text=True, timeout=30)
    if created.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {created.stderr.strip()}")
    try:
        _make_hosts(made)
        yield made
    finally:
        _remove_hosts(made)


# ----- Ray on both hosts, the service on the first -------------------------------------------------
def _ray_node(namespace: str, address: str, temp_dir: Path, log: Path) -> subprocess.Popen:
    """``ray start --block`` on ``namespace`` (the head when ``address`` is host A's)."""
    common = ["--node-ip-address", address, "--num-cpus", "1", "--temp-dir", str(temp_dir), "--disable-usage-stats",
              "--block"]
    role = (["--head", "--port", str(GCS_PORT), "--include-dashboard", "false",
             "--system-config", json.dumps(RAY_HEALTH_CHECKS)] if address == HOST_A
            else ["--address", f"{HOST_A}:{GCS_PORT}"])
    return subprocess.Popen([*_on(namespace), "ray", "start", *role, *common], stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


def _wait(condition: Callable[[], Any], timeout_s: float, what: str) -> float:
    """Seconds until ``condition()`` holds (polled every 0.2 s); fails after ``timeout_s``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what} did not happen in {timeout_s} s"
        time.sleep(0.2)
    return time.monotonic() - start


def _two_nodes_alive(hosts: Hosts) -> bool:
    status = subprocess.run([*_on(hosts.a), "ray", "status", "--address", f"{HOST_A}:{GCS_PORT}"],
                            capture_output=True, text=True, timeout=60)
    active = status.stdout.split("Active:")[-1].split("Pending:")[0]
    return active.count(" node_") == 2


@pytest.fixture(scope="module")
def cluster(hosts: Hosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("two-hosts")
    # Ray's sockets live under --temp-dir and a socket's path has at most 107 characters: a short folder
    temp = Path(tempfile.mkdtemp(prefix="hypic-ray-"))
    patch = pytest.MonkeyPatch()
    patch.setenv("RAY_AUTH_MODE", "disabled")  # a cluster of its own, on a network of its own
    patch.setenv("OMP_NUM_THREADS", "1")
    nodes: list[subprocess.Popen] = []
    try:
        with on_network(hosts.a):
            nodes.append(_ray_node(hosts.a, HOST_A, temp / "a", logs / "ray-a.log"))
            _wait(lambda: (temp / "a" / "session_latest").exists(), 60, "the head node to start")
            nodes.append(_ray_node(hosts.b, HOST_B, temp / "b", logs / "ray-b.log"))
            _wait(lambda: _two_nodes_alive(hosts), 90, "host B's node to join")
            server = start_server(["--dp-size", "2", "--ray-address", f"{HOST_A}:{GCS_PORT}", "--dtype", "float32",
                                   "--log-level", "warning"], logs / "server.log", threads=1, timeout_s=300,
                                  host=HOST_A, prefix=_on(hosts.a))
            try:
                _wait(lambda: len(_replicas(server)) == 2, 120, "both replicas to report")
                yield server
            finally:
                server.stop()
    finally:
        patch.undo()
        for namespace in (hosts.a, hosts.b):
            _kill_everything_in(namespace)
        for node in nodes:
            node.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)


# ----- the oracle ----------------------------------------------------------------------------------
@dataclass
class Replay:
    """One engine per replica, running what the cluster ran there, in order."""

    engines: dict[str, Engine] = field(default_factory=dict)

    def engine(self, replica: str) -> Engine:
        if replica not in self.engines:
            self.engines[replica] = Engine.from_pretrained("default", dtype="float32")
        return self.engines[replica]

    def check(self, answer: dict, prompt: str, **sampling: Any) -> None:
        """``answer`` equals its replica's engine's answer to ``prompt``: tokens, hits and misses."""
        meta = answer["meta_info"]
        expected = self.engine(meta["replica"]).generate(prompt, **sampling)
        assert answer["output_ids"] == expected.output_ids, (prompt[:60], meta)
        assert (meta["segments_hit"], meta["segments_missed"]) == (expected.segments_hit, expected.segments_missed)


def _replicas(server: ServerProcess) -> list[dict[str, Any]]:
    return server.get("/get_server_info")["data_parallel"]["replicas"]


def _node_of(server: ServerProcess) -> dict[str, str]:
    return {r["replica"]: r["node_ip"] for r in _replicas(server)}


def _generate(server: ServerProcess, prompt: str, sampling: dict[str, Any] = GREEDY) -> dict:
    return server.post("/generate", {"text": prompt, "sampling_params": sampling})


def _stream(server: ServerProcess, prompt: str, sampling: dict[str, Any]) -> list[dict]:
    body = json.dumps({"text": prompt, "stream": True, "sampling_params": sampling}).encode()
    request = urllib.request.Request(server.url + "/generate", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    chunks: list[dict] = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if line.startswith(b"data: {"):
                chunks.append(json.loads(line[len(b"data: "):]))
            elif line.strip() == b"data: [DONE]":
                chunks.append({"done": True})
    return chunks


@dataclass
class Warmed:
    """Where the warm-up put each document: replica -> indices, and each replica's host address."""

    holders: dict[str, list[int]]
    node: dict[str, str]

    def on(self, address: str) -> str:
        return next(r for r, ip in self.node.items() if ip == address)


def _warm_and_find_holders(server: ServerProcess, replay: Replay) -> Warmed:
    """Warm documents 0-3; each request for one of them must hit on its holder. Their holders
    (the replicas that hit) get the same warm-up in their replay engines."""
    server.post("/flush_cache", {})
    assert server.post("/warmup", {"documents": DOCS[:4]})["documents"] == 4
    node = _node_of(server)
    held = {r["node_ip"]: r["documents_held"] for r in _replicas(server)}
    assert held == {HOST_A: 2, HOST_B: 2}, held
    assert len({r["node_id"] for r in _replicas(server)}) == 2  # two Ray nodes, one replica each
    answers = {i: _generate(server, _prompt([i], "Where was it born?")) for i in (3, 0, 2, 1)}
    holders: dict[str, list[int]] = {}
    for i in sorted(answers):
        holders.setdefault(answers[i]["meta_info"]["replica"], []).append(i)
    assert sorted(len(docs) for docs in holders.values()) == [2, 2], holders
    for replica, docs in holders.items():
        replay.engine(replica).warmup([DOCS[i] for i in docs])
    for i in (3, 0, 2, 1):
        assert (answers[i]["meta_info"]["segments_hit"], answers[i]["meta_info"]["segments_missed"]) == (1, 0)
        replay.check(answers[i], _prompt([i], "Where was it born?"), max_new_tokens=6)
    return Warmed(holders, node)


@pytest.fixture(scope="module")
def warmed(cluster: ServerProcess) -> tuple[Warmed, Replay]:
    replay = Replay()
    return _warm_and_find_holders(cluster, replay), replay


def test_warmed_documents_are_spread_over_both_hosts_and_found_there(warmed: tuple[Warmed, Replay]) -> None:
    """Four warmed documents: two held on each host, and each request for one was routed across the
    link to its holder when that is on host B (hit there, answered as that replica's engine)."""
    found, _ = warmed
    assert {found.node[r] for r in found.holders} == {HOST_A, HOST_B}


def test_a_reordered_request_follows_its_documents_to_either_host(cluster: ServerProcess,
                                                                  warmed: tuple[Warmed, Replay]) -> None:
    """On each host: a request naming its two warmed documents in reverse with a new one between
    goes there; the same three again in another order go there too and miss nothing. Every answer,
    hit and miss is that host's engine's."""
    found, replay = warmed
    for address, new in ((HOST_B, 4), (HOST_A, 5)):
        holder = found.on(address)
        first, second = found.holders[holder]
        for indices in ([second, new, first], [new, first, second]):
            answer = _generate(cluster, _prompt(indices))
            assert answer["meta_info"]["replica"] == holder, (address, indices, answer["meta_info"])
            replay.check(answer, _prompt(indices), max_new_tokens=6)
        assert answer["meta_info"]["segments_missed"] == 0


def test_a_stream_from_host_b_arrives_whole(cluster: ServerProcess, warmed: tuple[Warmed, Replay]) -> None:
    """A streamed answer from the replica on host B: many chunks, each a longer prefix of the one
    answer its engine gives, the last one whole, then the end of the stream."""
    found, replay = warmed
    holder = found.on(HOST_B)
    prompt = _prompt([found.holders[holder][0]], "Tell its story.")
    sampling = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    chunks = _stream(cluster, prompt, sampling)
    assert chunks[-1] == {"done": True}
    answers = chunks[:-1]
    expected = replay.engine(holder).generate(prompt, max_new_tokens=24, ignore_eos=True)
    assert len(answers) > 1 and all(c["meta_info"]["replica"] == holder for c in answers)
    assert all(expected.output_ids[:len(c["output_ids"])] == c["output_ids"] for c in answers)
    assert answers[-1]["output_ids"] == expected.output_ids and len(expected.output_ids) == 24


def test_the_service_goes_on_from_host_a_when_the_link_is_cut(hosts: Hosts, cluster: ServerProcess,
                                                              warmed: tuple[Warmed, Replay]) -> None:
    """A long request runs on host B when the link goes down: it is retried on host A and answered
    as host A's engine answers it; /health stays 200; host B's replica leaves the report; a new
    request for a document host B held is answered on host A."""
    found, replay = warmed
    on_a, on_b = found.on(HOST_A), found.on(HOST_B)
    prompt = _prompt([found.holders[on_b][1]], "Tell its whole story.")
    sampling = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    answers: list[tuple[int, Any]] = []
    waiting = threading.Thread(target=lambda: answers.append(cluster.request(
        "POST", "/generate", {"text": prompt, "sampling_params": sampling}, timeout=240)))
    waiting.start()
    _wait(lambda: any(r["replica"] == on_b and r["running"] for r in _replicas(cluster)), 60, "host B to start it")
    _ip("-n", hosts.b, "link", "set", hosts.veth_b, "down")
    cut = time.monotonic()
    assert cluster.request("GET", "/health", timeout=10)[0] == 200
    # the router drops host B's replica once Ray declares host B dead; the report, once its status times out
    dead_s = _wait(lambda: cluster.get("/get_server_info")["data_parallel"]["dp_size"] == 1, 120,
                   "host B to be declared dead")
    waiting.join(timeout=240)
    answered_s = time.monotonic() - cut
    _wait(lambda: set(_node_of(cluster)) == {on_a}, 60, "host B's replica to leave the report")
    gone_s = time.monotonic() - cut
    print(f"link cut: host B noticed dead after {dead_s:.1f} s, out of the report after {gone_s:.1f} s; the request "
          f"it ran ended after {answered_s:.1f} s")
    status, answer = answers[0]
    assert status == 200, answer
    assert answer["meta_info"]["replica"] == on_a
    # retried by the ingress, or re-sent by Ray Serve itself once host B's node is declared dead (seen
    # once); the ingress's own retry is what test_replica_faults guards
    assert cluster.get("/get_server_info")["routing"]["retried"] <= 1
    assert cluster.request("GET", "/health", timeout=10)[0] == 200
    replay.check(answer, prompt, max_new_tokens=400, ignore_eos=True)
    again = _prompt([found.holders[on_b][0]], "Where was it born?")
    answer = _generate(cluster, again)
    assert answer["meta_info"]["replica"] == on_a
    replay.check(answer, again, max_new_tokens=6)
