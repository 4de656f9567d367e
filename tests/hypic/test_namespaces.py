"""Cache namespaces (a request's ``cache_salt`` / ``extra_key``, or its API key under
``--isolate-by-key``): an entry or a request state cached in one namespace is never
reused in another, and a request for another namespace's documents takes exactly the cold path.
The oracle for "cold" is an engine that has never seen anything: same logits, same counters."""
import random
from pathlib import Path

import pytest
import torch

from hypic import DEFAULT_SEPARATOR as SEP
from hypic import Engine
from hypic.cache.segments import PromptParts


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnop ,.") for _ in range(n))


def _prompt(rng: random.Random, docs: list[str]) -> str:
    return SEP.join([_text(rng, 20), *docs, _text(rng, 12)])


def _counters(engine: Engine, prompt: str, namespace: str) -> tuple[tuple[int, ...], torch.Tensor]:
    result = engine.prefill(engine.parse(prompt, namespace), "hypic")
    s = result.stats
    return (s.cached_tokens, s.prefix_hit_tokens, s.segments_hit, s.segments_missed, s.combine_tokens), result.logits


@pytest.fixture
def engine(tiny_checkpoint: Path) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint, seam_width=8)


def test_another_namespaces_documents_take_the_cold_path(engine: Engine, tiny_checkpoint: Path) -> None:
    """A's warmed documents and A's request state: hits for A; for B exactly what a fresh engine
    computes (counters and logits), however often A used them."""
    rng = random.Random(1)
    docs = [_text(rng, 90) for _ in range(3)]
    prompt = _prompt(rng, docs)
    engine.warmup(docs, namespace="team-a")
    warm_a, _ = _counters(engine, prompt, "team-a")
    again_a, _ = _counters(engine, prompt, "team-a")
    cold, cold_logits = _counters(Engine.from_pretrained(tiny_checkpoint, seam_width=8), prompt, "")
    as_b, b_logits = _counters(engine, prompt, "team-b")
    assert warm_a[2] == 3 and again_a[1] > 0  # A: its documents, then its own request state
    assert as_b == cold and cold[0] == 0 and cold[3] == 3
    assert torch.equal(b_logits, cold_logits)
    shared, _ = _counters(engine, prompt, "")  # the shared namespace is another namespace too
    assert shared == cold


def test_namespaces_are_cached_apart_and_flushed_apart(engine: Engine) -> None:
    """Each namespace's entries are its own (keys differ, so do the private-pool trees); flushing one
    namespace leaves the others' entries and states."""
    rng = random.Random(2)
    docs = [_text(rng, 80) for _ in range(2)]
    for namespace in ("", "team-a", "team-b"):
        engine.warmup(docs, namespace=namespace)
    assert len(engine.cache.public) == 6 and {e.namespace for e in engine.cache.public.entries.values()} == {"", "team-a", "team-b"}
    prompt = _prompt(rng, docs)
    for namespace in ("", "team-a", "team-b"):
        assert _counters(engine, prompt, namespace)[0][2] == 2
    public, private, _ = engine.flush("team-a")
    assert public == 2 and private > 0 and len(engine.cache.public) == 4
    assert _counters(engine, prompt, "team-a")[0][:4] == (0, 0, 0, 2)  # cold again
    for namespace in ("", "team-b"):  # untouched: their request states resume the whole prompt but its last token
        counters, _ = _counters(engine, prompt, namespace)
        assert counters[1] == len(engine.parse(prompt).token_ids) - 1
    engine.flush("")
    assert {e.namespace for e in engine.cache.public.entries.values()} == {"team-a", "team-b"}
    assert engine.cache.private.nbytes == sum(n.nbytes for n in engine.cache.private._nodes())


def test_a_conversation_resumes_in_its_own_namespace_only(engine: Engine) -> None:
    """A finished request's state (kept for its next turn) is resumed by the next turn in its
    namespace, by no request elsewhere."""
    rng = random.Random(3)
    prompt = _prompt(rng, [_text(rng, 80), _text(rng, 70)])
    first = engine.generate(prompt, max_new_tokens=5, ignore_eos=True, namespace="team-a")
    parts = engine.parse(prompt)
    turn = (*parts.trailing, *first.output_ids, 65, 66, 67)
    resumed = {namespace: engine.prefill(PromptParts(parts.leading, parts.segments, turn, namespace),
                                         "hypic").stats.prefix_hit_tokens for namespace in ("team-b", "", "team-a")}
    assert resumed == {"team-b": 0, "": 0, "team-a": first.prompt_tokens + len(first.output_ids) - 1}


def test_a_flush_takes_its_own_namespace_only_however_names_nest(engine: Engine) -> None:
    """Namespace "team-a" is not "x@team-a": flushing one leaves the other's entries and request states."""
    rng = random.Random(4)
    docs = [_text(rng, 80) for _ in range(2)]
    prompt = _prompt(rng, docs)
    for namespace in ("team-a", "x@team-a"):
        engine.prefill(engine.parse(prompt, namespace), "hypic")
    engine.flush("team-a")
    assert {e.namespace for e in engine.cache.public.entries.values()} == {"x@team-a"}
    assert _counters(engine, prompt, "x@team-a")[0][1] == len(engine.parse(prompt).token_ids) - 1
    assert _counters(engine, prompt, "team-a")[0][:4] == (0, 0, 0, 2)
