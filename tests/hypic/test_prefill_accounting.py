"""A request's counts, derived once from what its prefill found (``Reuse``) and what was done for
it beforehand (``BuiltForRequest``), against counts worked out by hand from the rules: a document
built for the request is a miss wherever it now sits, a resume at the end of a head combined early
for it counts as that head's reuse, a document loaded from a lower tier for it counts as that
tier's, and a document a peer was to build counts as built remotely only if the prefill took its
entry from the pool (one whose build failed was recomputed). The end-to-end counts (servers, peers, tiers) are checked where those run."""
from hypic.prefill_stats import BuiltForRequest, PrefillStats, Reuse

DOCUMENTS = (("a", 50, "device"), ("b", 30, None), ("c", 40, "mooncake"), ("d", 20, "device"))


def test_nothing_built_beforehand_counts_what_the_prefill_found() -> None:
    stats = Reuse(400, (100, "disk"), DOCUMENTS, combine_tokens=90).stats()
    assert (stats.prompt_tokens, stats.cached_tokens, stats.prefix_hit_tokens) == (400, 100 + 50 + 40 + 20, 100)
    assert (stats.segments_hit, stats.segments_missed, stats.combine_tokens) == (3, 1, 90)
    assert stats.cached_tokens_by_tier == {"device": 70, "host": 0, "disk": 100, "mooncake": 40, "replica": 0}
    assert stats.recomputed_tokens == 400 - 210


def test_documents_built_for_the_request_are_misses_and_loaded_ones_count_their_tier() -> None:
    """Peers were to build b and c (of 36 and 48 tokens, seams included); b's build failed (the
    prefill built it: tier None), c's entry arrived; a was fetched from another replica's pool."""
    built = BuiltForRequest(keys=frozenset({"b", "c"}), remote=(("b", 36), ("c", 48)),
                            loaded=(("d", "disk"), ("a", "replica")))
    stats = Reuse(400, None, DOCUMENTS, combine_tokens=90).stats(built)
    assert (stats.cached_tokens, stats.segments_hit, stats.segments_missed) == (50 + 20, 2, 2)
    assert (stats.segments_built_remotely, stats.remote_prefill_tokens) == (1, 48)
    assert (stats.segments_fetched, stats.replica_cached_tokens) == (1, 50)
    assert stats.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": 20, "mooncake": 0, "replica": 50}


def test_a_resume_at_a_head_combined_early_counts_as_that_heads_reuse() -> None:
    head = PrefillStats(prompt_tokens=100, cached_tokens=60, segments_hit=1, segments_missed=1, combine_tokens=40,
                        prefix_hit_tokens=10, mooncake_cached_tokens=50, segments_built_remotely=1,
                        remote_prefill_tokens=30)
    built = BuiltForRequest(heads=(PrefillStats(prompt_tokens=70), head))
    stats = Reuse(400, (100, "device"), DOCUMENTS[:1], combine_tokens=90).stats(built)
    assert (stats.cached_tokens, stats.prefix_hit_tokens, stats.combined_early_tokens) == (60 + 50, 10, 100)
    assert (stats.segments_hit, stats.segments_missed, stats.combine_tokens) == (2, 1, 40 + 90)
    assert stats.cached_tokens_by_tier["mooncake"] == 50
    assert (stats.segments_built_remotely, stats.remote_prefill_tokens) == (1, 30)  # the head's document, a peer's
    other = Reuse(400, (80, "device"), (), combine_tokens=0).stats(built)  # no head ends there: a prefix hit
    assert (other.cached_tokens, other.prefix_hit_tokens, other.combined_early_tokens) == (80, 80, 0)
