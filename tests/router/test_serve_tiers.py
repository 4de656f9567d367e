"""``hypic serve --workers 2 --cache-dir``: documents on disk come up into the server's memory
before the request is planned, so no worker rebuilds them, and the client is told they came from
disk. Oracle: one in-process engine's greedy answer."""
from collections.abc import Callable
from pathlib import Path

from hypic import Engine
from hypic.server.launch import start_server
from hypic.cache.tiers.options import TierOptions


def test_documents_on_disk_are_not_rebuilt_by_the_workers(tmp_path: Path, docs: list[str],
                                                          pic_prompt: Callable[[list[int], str], str]) -> None:
    cache = tmp_path / "cache"
    warm = Engine.from_pretrained("default", tiers=TierOptions(str(cache)))
    prompt = pic_prompt([4, 0, 2, 5], "Who studied ibises?")
    warm.warmup([docs[i] for i in (0, 2, 4, 5)])
    expected = warm.generate(prompt, max_new_tokens=8)
    warm.close()
    server = start_server(["--workers", "2", "--threads", "1", "--public-pool-size", "12M", "--log-level", "warning",
                           "--cache-dir", str(cache)], tmp_path / "server.log", threads=None)
    try:
        served = server.post("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        meta = served["meta_info"]
        assert served["output_ids"] == expected.output_ids
        assert meta["segments_hit"] == 4 and meta["segments_missed"] == 0 and meta["segments_built_remotely"] == 0
        # the documents, and the leading part's end the warm engine left as a resume point, came from disk
        assert meta["cached_tokens_by_tier"]["disk"] == meta["cached_tokens"] > meta["prefix_hit_tokens"] > 0
        assert server.get("/get_server_info")["tiers"]["tiers"]["disk"]["hits"] == 4
    finally:
        server.stop()
