"""The disk tier through ``hypic serve``: persistence across a SIGKILL, what the server reports,
and flushes that name their tiers. Oracle: the first server's own greedy answers (and a cold
server's) for the same request."""
import os
import signal
import time
from pathlib import Path

import pytest

from hypic import DEFAULT_SEPARATOR as SEP
from hypic.server.launch import ServerProcess, start_server

DOCUMENTS = [f"Report {i}. " + " ".join(f"item{i}_{j} measured {j * i % 97}" for j in range(18)) for i in range(8)]


def serve(checkpoint: Path, log: Path, *args: str) -> ServerProcess:
    return start_server(["--model", str(checkpoint), "--log-level", "warning", *args], log)


def ask(server: ServerProcess, order: list[int]) -> dict:
    text = SEP.join(["You answer from the reports.", *(DOCUMENTS[i] for i in order), "Which item is largest?"])
    return server.post("/generate", {"text": text, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})


def settled(server: ServerProcess, entries: int, timeout_s: float = 60) -> dict:
    """/get_server_info once the disk tier holds ``entries`` files and nothing waits to be written."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tiers = server.get("/get_server_info")["tiers"]
        if tiers["write_queue"] == 0 and tiers["tiers"]["disk"]["entries"] >= entries:
            return tiers
        time.sleep(0.2)
    raise AssertionError(f"the disk tier did not settle: {tiers}")


def test_documents_survive_a_sigkill(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Warm 8 documents with --cache-dir, kill -9, restart on the directory: the same reordered
    request is all hits, from disk, with the first server's greedy answer."""
    cache = tmp_path / "cache"
    first = serve(tiny_checkpoint, tmp_path / "first.log", "--cache-dir", str(cache))
    try:
        first.post("/warmup", {"documents": DOCUMENTS})
        settled(first, 8)
        expected = ask(first, [7, 2, 5, 0, 3, 6, 1, 4])
    finally:
        os.kill(first.process.pid, signal.SIGKILL)
        first.process.wait()
    restarted = serve(tiny_checkpoint, tmp_path / "restarted.log", "--cache-dir", str(cache))
    cold = serve(tiny_checkpoint, tmp_path / "cold.log")
    try:
        answer = ask(restarted, [7, 2, 5, 0, 3, 6, 1, 4])
        meta = answer["meta_info"]
        assert meta["segments_hit"] == 8 and meta["segments_missed"] == 0
        assert meta["cached_tokens_by_tier"]["disk"] == meta["cached_tokens"] > 0
        assert answer["output_ids"] == expected["output_ids"] == ask(cold, [7, 2, 5, 0, 3, 6, 1, 4])["output_ids"]
        info = restarted.get("/get_server_info")["tiers"]
        assert info["write_policy"] == "write_through" and info["tiers"]["disk"]["hits"] == 8
        assert info["tiers"]["disk"]["directory"] == str(cache) and info["tiers"]["disk"]["healthy"]
        metrics = restarted.get("/metrics")
        assert 'hypic_tier_hits_total{tier="disk"} 8.0' in metrics and 'hypic_tier_healthy{tier="disk"} 1.0' in metrics
        loaded, seconds = sample(metrics, "tier_loaded_bytes_total"), sample(metrics, "tier_load_seconds_total")
        assert loaded == sum(p.stat().st_size for p in cache.rglob("*.safetensors") if p.name[0] not in "rk")
        assert seconds > 0 and sample(metrics, "tier_load_gigabytes_per_second") == pytest.approx(loaded / seconds / 1e9)
    finally:
        restarted.stop()
        cold.stop()


def sample(metrics: str, name: str, tier: str = "disk") -> float:
    """The value of ``hypic_<name>{tier="<tier>"}`` in a /metrics page."""
    prefix = f'hypic_{name}{{tier="{tier}"}} '
    return float(next(line[len(prefix):] for line in metrics.splitlines() if line.startswith(prefix)))


def test_flush_names_its_tiers(tiny_checkpoint: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    server = serve(tiny_checkpoint, tmp_path / "server.log", "--cache-dir", str(cache))
    try:
        server.post("/warmup", {"documents": DOCUMENTS[:3]})
        settled(server, 3)
        flushed = server.post("/flush_cache", {})
        assert flushed["public_entries_dropped"] == 3 and flushed["tier_entries_dropped"] == {}
        assert len(list(cache.rglob("*.safetensors"))) == 3  # a plain flush never wipes the disk
        meta = ask(server, [2, 0])["meta_info"]
        assert meta["segments_hit"] == 2 and meta["cached_tokens_by_tier"]["disk"] == meta["cached_tokens"]
        for bad in ({"tiers": ["memory", "tape"]}, {"tiers": 3}, {"tiers": []}):
            status, body = server.request("POST", "/flush_cache", bad)
            assert status == 400, (bad, body)
        flushed = server.post("/flush_cache?tiers=disk", {})
        assert flushed["tier_entries_dropped"] == {"disk": 3} and flushed["public_entries_dropped"] == 0
        assert list(cache.rglob("*.safetensors")) == []
        flushed = server.post("/flush_cache", {"tiers": "all"})  # the two loaded back into memory
        assert flushed["tier_entries_dropped"] == {"disk": 0} and flushed["public_entries_dropped"] == 2
        assert ask(server, [2, 0])["meta_info"]["segments_missed"] == 2
    finally:
        server.stop()


def test_a_cache_dir_that_cannot_be_made_is_reported_not_fatal(tiny_checkpoint: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    server = serve(tiny_checkpoint, tmp_path / "server.log", "--cache-dir", str(blocker / "cache"))
    try:
        disk = server.get("/get_server_info")["tiers"]["tiers"]["disk"]
        assert not disk["healthy"] and "NotADirectoryError" in disk["error"]
        assert ask(server, [0, 1])["meta_info"]["segments_missed"] == 2
        assert 'hypic_tier_healthy{tier="disk"} 0.0' in server.get("/metrics")
    finally:
        server.stop()


def test_a_working_set_far_over_memory_is_served_from_disk(tmp_path: Path) -> None:
    """The shipped model, --public-pool-size 32M, a 2G disk tier, 20 documents of ~1k tokens whose
    entries take 2.5x the pool: the second pass over the set hits every document (from disk or
    memory), memory within its budget all along."""
    from hypic import Engine

    documents = [f"Dossier {i}. " + " ".join(f"clause {i}.{j} sets rate {(i * 31 + j * 7) % 1000} for zone {j % 13};"
                                              for j in range(110)) for i in range(20)]
    probe = Engine.from_pretrained("default", dtype="float32")  # sizes below are float32's (auto is bf16 on some CPUs)
    entries = sum(probe.entry_bytes(len(probe.tokenizer.encode(d))) for d in documents)
    assert entries > 2.4 * 32 * 2**20
    server = start_server(["--public-pool-size", "32M", "--cache-dir", str(tmp_path / "cache"), "--disk-cache-size",
                           "2G", "--private-pool-size", "0", "--dtype", "float32", "--log-level", "warning"],
                          tmp_path / "server.log")
    try:
        def ask_one(index: int, question: str) -> dict:
            text = SEP.join(["Use the dossier.", documents[index], question])
            return server.post("/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}})["meta_info"]

        first = [ask_one(i, "What is the first rate?") for i in range(20)]
        settled(server, 20)
        second = [ask_one(i, "What is the last rate?") for i in range(20)]
        assert all(m["segments_missed"] == 1 for m in first) and all(m["segments_hit"] == 1 for m in second)
        assert sum(m["cached_tokens_by_tier"]["disk"] > 0 for m in second) >= 12  # memory holds at most ~8
        info = server.get("/get_server_info")
        assert info["public_pool"]["bytes"] <= 32 * 2**20 and info["public_pool"]["evictions"] >= 12
    finally:
        server.stop()
