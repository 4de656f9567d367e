"""LMCache's CacheBlend online client against the server, with HYPIC's separator.

Mirrors LMCache/LMCache ``examples/blend_kv_v1/blend_online_client.py``: an ``openai`` client
(``api_key="EMPTY"``) takes the model from ``models.list().data[0].id``, sends a few precompute
prompts, then documents joined by the blend separator in another order, each as
``completions.create(prompt=..., model=..., temperature=0, top_p=0.95, max_tokens=10, stream=True)``
and iterates over the chunks. Its separator is ``-b/--blend-special-str`` (the client puts a space
in front of it): here ``-b "<<PIC_SEP>>"``, so the server splits the documents out. Its texts are
``"Hello, how are you?" * 250`` and the like, shortened to fit the tiny model's 4096 positions;
after the online client's precompute and blended request, one more permutation follows as in the
offline ``examples/blend_kv_v1/blend.py`` (first, second, third prompt over the same chunks).

The client reads nothing back but the streamed text, and sends no ``stream_options``, so what the
server reused is read from its own counters (``/get_server_info``) around each request.
"""
from typing import Any

import openai

from .conftest import Wire

SEPARATOR = " " + "<<PIC_SEP>>"  # blend_special_str = f" {args.blend_special_str}"
SYS_PROMPT = "You are a very helpful assistant."
CHUNK1 = "Hello, how are you?" * 10
CHUNK2 = "Hello, what's up?" * 10
CHUNK3 = "Hey, how can i do" * 10


def _send(client: openai.OpenAI, model: str, prompt: str, wire: Wire) -> dict[str, Any]:
    """print_output(): one streamed completion, iterated to the end; the server's counters moved by it."""
    counters = ("prompt_tokens", "cached_tokens", "segments_hit", "segments_missed", "requests_finished")
    before = wire.server_info()
    chunks = list(client.completions.create(prompt=prompt, model=model, temperature=0, top_p=0.95, max_tokens=10,
                                            stream=True))
    after = wire.server_info()  # counted before its last chunk was sent
    assert chunks and all(len(c.choices) == 1 for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    moved = {name: after[name] - before[name] for name in counters}
    assert moved["requests_finished"] == 1 and moved["prompt_tokens"] == wire.count(prompt)
    return moved


def test_blend_online_client_reuses_permuted_documents(wire: Wire) -> None:
    assert wire.post("/flush_cache").status_code == 200
    client = openai.OpenAI(api_key="EMPTY", base_url=wire.url + "/v1", max_retries=0)
    model = client.models.list().data[0].id
    for prompt in [SYS_PROMPT + SEPARATOR + CHUNK1, SYS_PROMPT + SEPARATOR + CHUNK2, SYS_PROMPT + SEPARATOR + CHUNK3]:
        _send(client, model, prompt, wire)  # precompute: each chunk is the trailing part, recomputed
    blended = SEPARATOR.join([SYS_PROMPT, CHUNK2, CHUNK1, CHUNK3, "Hello, how are you?"])
    first = _send(client, model, blended, wire)
    assert first["segments_missed"] == 3 and first["segments_hit"] == 0  # documents seen for the first time
    permuted = SEPARATOR.join([SYS_PROMPT, CHUNK3, CHUNK1, CHUNK2, "Hello, what's up?"])
    second = _send(client, model, permuted, wire)
    assert second["segments_hit"] == 3 and second["segments_missed"] == 0
    # each document's interior is reused wherever it now sits: all of it but its seams
    seam = wire.server_info()["seam_width"]
    documents = [wire.count(chunk + " ") for chunk in (CHUNK3, CHUNK1, CHUNK2)]
    question = wire.count("Hello, what's up?")
    assert sum(d - 2 * seam for d in documents) <= second["cached_tokens"] <= second["prompt_tokens"] - question
