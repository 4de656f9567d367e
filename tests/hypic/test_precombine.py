"""When a combine node has nothing to combine early (``HybridCache.held_head`` is None): no held document
past the request's resume point, every document held, a mode that splices nothing, no private pool.
That the early head then gives the reference's output is in test_fidelity.py."""
import pytest

from hypic import DEFAULT_SEPARATOR as SEP, Engine

DOCS = ["Record 1: the otter of Elm lake was born in 1921 and studied river stones at length.",
        "Record 2: the stoat of Harrow was born in 1934 and studied the old mills of the valley.",
        "Record 3: the heron of Marsh end was born in 1950 and studied reeds, frogs and the weather."]
PROMPT = SEP.join(["You answer from the records.", *DOCS, "Who studied reeds?"])


@pytest.fixture
def engine() -> Engine:
    return Engine.from_pretrained("default")


def _head_tokens(engine: Engine, documents: int) -> int:
    parts = engine.parse(PROMPT)
    return len(parts.leading) + sum(map(len, parts.segments[:documents]))


def test_the_head_stops_at_the_first_missing_document(engine: Engine) -> None:
    parts = engine.parse(PROMPT)
    assert engine.cache.held_head(engine.plan(parts)) is None  # nothing held: the head would be the leading part alone
    engine.warmup([DOCS[1]])
    assert engine.cache.held_head(engine.plan(parts)) is None  # the first document is missing
    engine.warmup([DOCS[0]])
    head = engine.cache.held_head(engine.plan(parts))
    assert head is not None and len(head.parts.token_ids) == _head_tokens(engine, 2) and head.parts.trailing == ()
    engine.warmup([DOCS[2]])
    assert engine.cache.held_head(engine.plan(parts)) is None  # all held: nothing to do before the request itself


def test_nothing_early_without_splices_or_a_private_pool(engine: Engine) -> None:
    engine.warmup(DOCS[:2])
    parts = engine.parse(PROMPT)
    assert engine.precombine(parts, "full") is None and engine.precombine(parts, "prefix") is None
    no_pool = Engine.from_pretrained("default", private_pool_bytes=0)
    no_pool.warmup(DOCS[:2])
    assert no_pool.precombine(parts) is None
    head = engine.precombine(parts)
    assert head is not None and head.prompt_tokens == _head_tokens(engine, 2)
