"""``hypic serve --device cuda`` end to end, on the model the README serves: the same requests get the
same greedy answers and the same cache behaviour as the same server on the CPU (float32 on both), over
plain and streamed /generate, /warmup and the OpenAI route; needs a CUDA GPU."""
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hypic import DEFAULT_SEPARATOR as SEP
from hypic.server.launch import ServerProcess, start_server

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
KEYS = ("cached_tokens", "segments_hit", "segments_missed", "prompt_tokens", "finish_reason")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    root = tmp_path_factory.mktemp("serve-cuda")
    started: dict[str, ServerProcess] = {}
    try:
        for device in ("cuda", "cpu"):
            started[device] = start_server(["--device", device, "--dtype", "float32", "--log-level", "warning"],
                                           root / f"{device}.log", threads=4)
        yield started
    finally:
        for server in started.values():
            server.stop()


def _doc(tag: str) -> str:
    return f" document {tag}: the river {tag} runs past the mill and the orchard of {tag}, twice a day."


def _pic(*tags: str, question: str = "what runs past the mill?") -> str:
    return SEP.join(["You answer from the documents.", *map(_doc, tags), f" {question}"])


def _alike(servers: dict[str, ServerProcess], text: str) -> dict:
    body = {"text": text, "sampling_params": GREEDY}
    got, want = (servers[d].post("/generate", body) for d in ("cuda", "cpu"))
    assert got["output_ids"] == want["output_ids"]
    assert {k: got["meta_info"][k] for k in KEYS} == {k: want["meta_info"][k] for k in KEYS}
    return got["meta_info"]


def test_documents_miss_then_hit_in_another_order_as_on_the_cpu(servers: dict[str, ServerProcess]) -> None:
    first = _alike(servers, _pic("alpha", "beta", "gamma"))
    second = _alike(servers, _pic("gamma", "alpha", "beta", question="and the orchard?"))
    assert first["segments_missed"] == 3 and second["segments_hit"] == 3 and second["cached_tokens"] > 0


def test_warmed_documents_are_hits_as_on_the_cpu(servers: dict[str, ServerProcess]) -> None:
    counts = [servers[d].post("/warmup", {"documents": [_doc("delta"), _doc("eps")]})["token_counts"]
              for d in ("cuda", "cpu")]
    assert counts[0] == counts[1]
    assert _alike(servers, _pic("eps", "delta"))["segments_hit"] == 2


def _streamed(server: ServerProcess, body: dict) -> list[Any]:
    request = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        lines = [line.decode().strip() for line in response if line.strip()]
    return [json.loads(line.removeprefix("data: "))["text"] for line in lines if line != "data: [DONE]"]


def test_a_stream_on_cuda_is_the_cpu_stream(servers: dict[str, ServerProcess]) -> None:
    body = {"text": _pic("zeta", "alpha"), "stream": True, "sampling_params": GREEDY}
    got, want = _streamed(servers["cuda"], body), _streamed(servers["cpu"], body)
    assert got == want and len(got) == GREEDY["max_new_tokens"]


def test_the_openai_route_on_cuda_answers_as_on_the_cpu(servers: dict[str, ServerProcess]) -> None:
    model = servers["cpu"].get("/v1/models")["data"][0]["id"]
    body = {"model": model, "prompt": _pic("beta", "zeta"), "max_tokens": 8, "temperature": 0}
    got, want = (servers[d].post("/v1/completions", body) for d in ("cuda", "cpu"))
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["usage"] == want["usage"]
