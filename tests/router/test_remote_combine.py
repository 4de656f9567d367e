"""The server's combine node is the worker holding the most hit tokens: a peer that holds most of a
request's documents runs its combine pass and sends the state back; the server decodes it. Outputs
equal one engine's; a combine node lost meanwhile costs only the remote prefill (done here instead)."""
from collections.abc import Callable, Iterator

import pytest
import ray
from fastapi.testclient import TestClient

from hypic import DEFAULT_SEPARATOR, Engine, default_model_path
from hypic.cli import _parser, peer_engine_options
from hypic.planner import Planner
from hypic.router import PeerPrefill, document_jobs
from hypic.server.app import ServerInfo, build_app
from hypic.server.chat import load_chat_template
from hypic.scheduler.loop import EngineLoop

Prompt = Callable[[list[int], str], str]


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[tuple[TestClient, PeerPrefill, EngineLoop]]:
    """The server's engine and its peer configured exactly as ``hypic serve --workers 2`` does
    (indirect parameter: more command-line options)."""
    args = _parser().parse_args(["serve", "--workers", "2", "--threads", "1", *getattr(request, "param", [])])
    template, from_model = load_chat_template(default_model_path())
    info = ServerInfo(str(default_model_path()), "default", "test", False, from_model, template, "hypic", 8,
                      DEFAULT_SEPARATOR, 256, 8, args.public_pool_size, args.private_pool_size, "cpu", "float32")
    peers = PeerPrefill("default", 2, threads=1, engine_options=peer_engine_options(args))
    loop = EngineLoop(Engine.from_pretrained("default", dtype=args.dtype, public_pool_bytes=args.public_pool_size,
                                             private_pool_bytes=args.private_pool_size,
                                             chunk_tokens=args.chunked_prefill_size), "hypic",
                      max_state_bytes=args.max_state_memory)
    loop.start()
    try:
        yield TestClient(build_app(loop, info, peers)), peers, loop
    finally:
        loop.stop()
        peers.shutdown()
        ray.shutdown()


def _warm_peer(peers: PeerPrefill, docs: list[str]) -> None:
    planner = Planner.for_model("default")
    ray.get(peers.pool.workers[1].build.remote(document_jobs(planner.plan(planner.documents(docs))), "hypic"))
    peers.pool.sync(1)


def _generate(client: TestClient, prompt: str) -> dict:
    response = client.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert response.status_code == 200, response.text
    return response.json()


def test_the_peer_holding_most_documents_combines(served, pic_prompt: Prompt, docs: list[str]) -> None:
    client, peers, loop = served
    _warm_peer(peers, docs[:4])
    prompt = pic_prompt([2, 0, 3, 1, 4], "Who studied lynxes?")
    plan = peers.plan(loop.engine.plan(loop.engine.parse(prompt)), set())
    assert plan.combine == 1 and [job.key for job in plan.builds[0]] == [plan.builds[0][0].key]  # doc 4 built here
    engine = Engine.from_pretrained("default")
    engine.warmup(docs[:4])  # what the system held when the request came: document 4 is built for it
    expected = engine.generate(prompt, max_new_tokens=8)
    result = _generate(client, prompt)
    meta = result["meta_info"]
    assert result["output_ids"] == expected.output_ids
    assert (meta["cached_tokens"], meta["segments_hit"], meta["segments_missed"]) == (
        expected.cached_tokens, 4, 1)  # the head combined early on the peer counts as its own reuse
    assert meta["segments_built_remotely"] == 0  # document 4 was built by this server
    parts = loop.engine.parse(prompt)  # the peer combined the head it held while document 4 was on its way
    assert meta["combined_early_tokens"] == len(parts.leading) + sum(len(s) for s in parts.segments[:4])
    assert len(loop.engine.cache.document_keys()) == 1  # only its own build is here: it was shipped, not spliced here
    counts = ray.get(peers.pool.workers[1].receive_counts.remote())  # ... from this process over gloo
    assert (counts.point_to_point, counts.object_store, counts.failed) == (1, 0, 0)
    assert plan.builds[0][0].key in peers.pool.index.keys_of(1)


def test_a_lost_remote_combine_node_falls_back_here(served, pic_prompt: Prompt, docs: list[str]) -> None:
    client, peers, loop = served
    _warm_peer(peers, docs[:4])
    ray.kill(peers.pool.workers[1])
    prompt = pic_prompt([3, 2, 1, 0], "Where was the heron born?")
    expected = Engine.from_pretrained("default").generate(prompt, max_new_tokens=8)
    assert _generate(client, prompt)["output_ids"] == expected.output_ids
    assert client.get("/get_server_info").json()["workers"]["lost_workers"] == [1]
    assert _generate(client, pic_prompt([0, 1], "Who had a red coat?"))["output_ids"]  # the next one runs here


def test_the_server_combines_its_held_head_while_the_peer_builds(served, pic_prompt: Prompt, docs: list[str]) -> None:
    """The server holds the first two documents, the third is cold and goes to the peer, kept busy
    first: the server's loop combines the two-document head before the third arrives, and the
    request resumes at that head's end with one engine's output and statistics."""
    client, peers, loop = served
    loop.warmup(docs[:2]).result(timeout=60)
    busy_plan = loop.engine.plan(loop.engine.planner.documents([" ".join(docs * 3) + " Busy."]))
    busy = peers.pool.workers[1].build.remote(document_jobs(busy_plan),
                                              "hypic", 0)
    prompt = pic_prompt([0, 1, 2], "Who studied herons?")
    engine = Engine.from_pretrained("default")
    engine.warmup(docs[:2])  # what the system held when the request came
    expected = engine.generate(prompt, max_new_tokens=8)
    plan = peers.plan(loop.engine.plan(loop.engine.parse(prompt)), loop.engine.cache.document_keys())
    assert plan.combine == 0 and list(plan.builds) == [1]
    result = _generate(client, prompt)
    ray.get(busy)
    parts = loop.engine.parse(prompt)
    head = len(parts.leading) + len(parts.segments[0]) + len(parts.segments[1])
    meta = result["meta_info"]
    assert result["output_ids"] == expected.output_ids and meta["combined_early_tokens"] == head
    fields = ("cached_tokens", "prefix_hit_tokens", "segments_hit", "segments_missed", "combine_tokens")
    assert {f: meta[f] for f in fields} == {f: getattr(expected.stats, f) for f in fields}
    assert (meta["segments_built_remotely"], meta["remote_prefill_tokens"]) == (1, len(parts.segments[2]))


@pytest.mark.parametrize("served", [["--max-state-memory", "1.25M", "--dtype", "float32"]], indirect=True)
def test_a_request_that_can_never_fit_is_refused_before_anything_is_built(served, pic_prompt: Prompt) -> None:
    """Admission comes first: a prompt whose state cannot fit --max-state-memory is a 400 before any
    of its documents is built here or on the peer, or shipped."""
    client, peers, loop = served
    prompt = pic_prompt([0, 1, 2, 3, 4], "Who studied lynxes?")
    parts = loop.engine.parse(prompt)
    assert loop.engine.state_bytes(len(parts.token_ids) + 8) > 1.25 * 2**20
    response = client.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 8}})
    assert response.status_code == 400 and "--max-state-memory" in response.json()["error"]["message"]
    assert len(loop.engine.cache.document_keys()) == 0 and ray.get(peers.pool.workers[1].held.remote()) == []
    counts = ray.get(peers.pool.workers[1].receive_counts.remote())
    assert (counts.point_to_point, counts.object_store, counts.failed) == (0, 0, 0)
    fits = pic_prompt([0], "Who?")  # a small one still runs
    assert _generate(client, fits)["output_ids"]
