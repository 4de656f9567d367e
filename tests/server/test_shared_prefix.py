"""``hypic serve`` as shipped (default pools) under 16 concurrent requests that resume from one
cached 4k-token prefix: the server process holds one copy of the prefix's KV, not one per request
(private-pool hits copy nothing). Oracle: the server's RSS, read from /proc while all 16 are decoding."""
import json
import os
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from hypic.loading.loader import read_config
from hypic.server.launch import ServerProcess, start_server

PREFIX, TAIL, NEW, CONCURRENT = 4096, 16, 24, 16


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _ids(seed: int, count: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 251 + 3 for i in range(count)]


def _stream_batch(server: ServerProcess, prompts: list[list[int]], started: threading.Event,
                  finals: dict[int, dict]) -> None:
    """One streamed batch request; ``started`` is set once every prompt has its first token."""
    body = json.dumps({"input_ids": prompts, "stream": True,
                       "sampling_params": {"max_new_tokens": NEW, "ignore_eos": True, "temperature": 0}}).encode()
    request = urllib.request.Request(server.url + "/generate", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[len(b"data: "):])
                finals[chunk["index"]] = chunk
                if len(finals) == len(prompts):
                    started.set()


def _settled_rss(pid: int) -> int:
    """The RSS once a finished request's own state is gone (the HTTP side drops it a moment later)."""
    time.sleep(1.5)
    return _rss(pid)


def test_concurrent_requests_resuming_one_prefix_hold_one_copy(checkpoint_factory, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """From before the prefix is cached until 16 requests resuming from it are all decoding, the
    server's RSS grows by at most 1.2 copies of the prefix's KV plus what the requests own (closed
    form: their reserved KV and linear states) and what the private pool added besides the prefix.
    A server whose hits copy the prefix holds 17 copies."""
    path = checkpoint_factory("qwen3_5_text-kv-heavy")
    config = read_config(path)
    per_token = sum(config.kv_elements(i) for i in config.attention_layers()) * 4
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    linear = len(config.linear_layers()) * (recurrent + (config.linear_conv_kernel_dim - 1) * config.linear_conv_channels) * 4
    copy, own = PREFIX * per_token, CONCURRENT * ((TAIL + NEW) * per_token + linear)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")  # freed tensors leave the RSS
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "4096")
    server = start_server(["--model", str(path), "--log-level", "warning"], tmp_path / "server.log")
    try:
        server.post("/generate", {"input_ids": _ids(99, PREFIX + TAIL), "sampling_params": {"max_new_tokens": 2}})
        before, pool_before = _settled_rss(server.process.pid), server.get("/get_server_info")["private_pool"]["bytes"]
        prefix = _ids(7, PREFIX)
        server.post("/generate", {"input_ids": prefix + _ids(0, TAIL), "sampling_params": {"max_new_tokens": 1}})
        started, finals = threading.Event(), {}
        client = threading.Thread(target=_stream_batch, args=(server, [prefix + _ids(100 + r, TAIL)
                                                                       for r in range(CONCURRENT)], started, finals))
        client.start()
        assert started.wait(120)
        info = server.get("/get_server_info")
        while info["running_requests"] < CONCURRENT and info["requests_finished"] < 3 + CONCURRENT:
            info = server.get("/get_server_info")  # counters are published at the end of a loop step
        grown = _rss(server.process.pid) - before
        client.join(300)
    finally:
        server.stop()
    pool = info["private_pool"]["bytes"] - pool_before
    print(f"RSS +{grown / copy:.2f} copies; own {own / copy:.2f}, pool besides the prefix {(pool - copy) / copy:.2f}")
    assert info["running_requests"] == CONCURRENT  # measured while every one of them held its state
    assert all(finals[r]["meta_info"]["cached_tokens"] == PREFIX for r in range(CONCURRENT))
    assert info["running_shared_bytes"] == copy  # the pool's pages, each counted once
    assert grown <= 1.2 * copy + own + (pool - copy), (grown / copy, own / copy, (pool - copy) / copy)
