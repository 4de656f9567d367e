"""Mooncake Store as the tier servers share: two ``hypic serve`` processes on one real
``mooncake_master`` (the package's own, on loopback). A document warmed on one is a hit on the
other with the same greedy answer; with the master killed requests still succeed (cold) and the
tier is reported unhealthy; with it back, sharing resumes."""
import signal
import time
from pathlib import Path

import pytest

from hypic import DEFAULT_SEPARATOR as SEP
from hypic.server.launch import ServerProcess, free_port, start_server
from hypic.cache.tiers import mooncake as mooncake_tier

try:
    import mooncake.store  # noqa: F401  (needs the system's libibverbs1 and librdmacm1)
except ImportError as err:  # the README's test command installs them; say so if it could not
    pytest.fail(f"Mooncake is not usable here ({err}): run scripts/system-deps.sh as root, then reinstall",
                pytrace=False)

DOCUMENTS = [f"Ledger {i}. " + " ".join(f"entry{i}_{j} balance {j * (i + 3) % 89}" for j in range(16))
             for i in range(7)]


def ask(server: ServerProcess, order: list[int]) -> dict:
    text = SEP.join(["Answer from the ledgers.", *(DOCUMENTS[i] for i in order), "Which balance is lowest?"])
    return server.post("/generate", {"text": text, "sampling_params": {"max_new_tokens": 10, "temperature": 0}})


def tier(server: ServerProcess) -> dict:
    return server.get("/get_server_info")["tiers"]["tiers"]["mooncake"]


def wait_for(check, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def written(server: ServerProcess, count: int) -> None:
    wait_for(lambda: tier(server)["writes"] >= count and server.get("/get_server_info")["tiers"]["write_queue"] == 0,
             f"{count} writes to Mooncake")


def test_two_servers_share_documents_through_one_master(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ports = dict(rpc_port=free_port(), http_port=free_port(), metrics_port=free_port())
    master = mooncake_tier.start_master(tmp_path / "master.log", lease_ms=200, **ports)
    servers: list[ServerProcess] = []
    try:
        for name in ("a", "b"):
            servers.append(start_server(["--model", str(tiny_checkpoint), "--log-level", "warning",
                                         "--mooncake-master", master.address,
                                         "--mooncake-metadata-server", master.metadata_server,
                                         "--mooncake-segment-size", "64M"], tmp_path / f"{name}.log"))
        a, b = servers
        for server in servers:
            wait_for(lambda s=server: tier(s)["connected"] and tier(s)["healthy"], "a connection to the master")
        a.post("/warmup", {"documents": DOCUMENTS[:3]})
        written(a, 3)
        expected = ask(a, [2, 0, 1])
        shared = ask(b, [2, 0, 1])
        meta = shared["meta_info"]
        assert meta["segments_hit"] == 3 and meta["cached_tokens_by_tier"]["mooncake"] == meta["cached_tokens"] > 0
        assert shared["output_ids"] == expected["output_ids"]

        # a conversation's turn 2 on the other server resumes where turn 1 ended (the private pool's
        # resume point in the store); the same request recomputed from scratch answers the same
        prompt1 = a.post("/tokenize", {"prompt": DOCUMENTS[6] + DOCUMENTS[5]})["tokens"]
        turn1 = a.post("/generate", {"input_ids": prompt1,
                                     "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
        wait_for(lambda: a.get("/get_server_info")["resume_points"]["write_queue"] == 0, "turn 1's resume point")
        turn2 = {"input_ids": prompt1 + turn1["output_ids"] + [65, 66],
                 "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        continued = b.post("/generate", turn2)
        assert continued["meta_info"]["prefix_hit_tokens"] == len(prompt1) + 5
        assert continued["meta_info"]["cached_tokens_by_tier"]["mooncake"] == len(prompt1) + 5
        metrics = dict(line.rsplit(" ", 1) for line in b.get("/metrics").splitlines() if not line.startswith("#"))
        assert float(metrics["hypic_resume_hits_total"]) >= 1
        assert float(metrics['hypic_resume_points_written_total{tier="mooncake"}']) >= 1
        time.sleep(0.5)  # past the read's lease (200 ms), which keeps an object from removal
        b.post("/flush_cache?tiers=memory,mooncake", {})
        recomputed = b.post("/generate", turn2)
        assert recomputed["meta_info"]["prefix_hit_tokens"] == 0 and recomputed["output_ids"] == continued["output_ids"]

        master.stop(signal.SIGKILL)
        down = ask(b, [3, 4])["meta_info"]  # never an error: built here
        assert down["segments_missed"] == 2 and down["cached_tokens_by_tier"]["mooncake"] == 0
        wait_for(lambda: not tier(b)["healthy"], "the tier reported unhealthy", 30)
        assert 'hypic_tier_healthy{tier="mooncake"} 0.0' in b.get("/metrics")

        master = mooncake_tier.start_master(tmp_path / "master.log", lease_ms=200, **ports)
        for server in servers:
            wait_for(lambda s=server: tier(s)["healthy"], "the tier healthy again")
        before = tier(a)["writes"]
        a.post("/warmup", {"documents": DOCUMENTS[5:7]})
        written(a, before + 2)
        resumed = ask(b, [6, 5])["meta_info"]
        assert resumed["segments_hit"] == 2
        assert resumed["cached_tokens_by_tier"]["mooncake"] == resumed["cached_tokens"] - resumed["prefix_hit_tokens"] > 0
    finally:
        for server in servers:
            server.stop()
        master.stop(signal.SIGKILL)
