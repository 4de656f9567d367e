"""The public pool (LRU, byte budget, pins) and the private pool (radix tree of snapshots) against
closed-form accounting and full recompute."""
import gc
import pickle
import random
import weakref
from pathlib import Path

import pytest
import torch

from hypic import DEFAULT_SEPARATOR as SEP, Engine, InvalidRequest
from hypic.assembler import combine, drain
from hypic.cache.composition import Family, Transition
from hypic.cache.prefix_cache import PrefixCache, cache_key
from hypic.cache.segments import PromptParts, Run, Seams
from hypic.state import AttentionLayerState, LinearLayerState, RequestState
from hypic.models.families import empty_state
from hypic.cache.store import AttentionInterior, LinearInterior, SegmentEntry, SegmentStore, entry_tensors


def _entry(key: str, floats: int) -> SegmentEntry:
    values = torch.full((1, floats, 1), float("nan"))  # NaN-poisoned: the pool must never read it
    return SegmentEntry(key, (len(key),), Seams(0, 0), 0, floats, [AttentionInterior(values, values.clone())])


def test_public_pool_lru_budget_and_pins() -> None:
    size = _entry("a", 10).nbytes  # 2 tensors x 10 floats x 4 bytes
    assert size == 80
    store = SegmentStore(budget_bytes=3 * size)
    for key in "abc":
        assert store.put(_entry(key, 10))
    assert store.get("a", (1,)) is not None  # a becomes most recent: b is now the oldest
    store.pin("b")
    assert store.put(_entry("d", 10))
    assert set(store.entries) == {"a", "b", "d"} and store.nbytes == 3 * size  # c evicted, b pinned
    assert not store.put(_entry("huge", 40))  # larger than the budget: refused, nothing evicted
    store.pin("a"), store.pin("d")
    assert not store.put(_entry("e", 10))  # every byte pinned
    assert store.nbytes == 3 * size and store.rejected == 2 and store.evictions == 1
    store.unpin("a")
    assert store.put(_entry("e", 10)) and "a" not in store.entries
    assert store.clear() == 1 and set(store.entries) == {"b", "d"}  # pinned entries survive a flush
    assert store.nbytes == sum(e.nbytes for e in store.entries.values())


def test_public_pool_rejects_wrong_tokens_under_same_key() -> None:
    store = SegmentStore()
    store.put(_entry("k", 4))
    assert store.get("k", (1,)) is not None and store.get("k", (2,)) is None


def _linear_entry(key: str, seed: int) -> SegmentEntry:
    gen = torch.Generator().manual_seed(seed)
    layer = LinearInterior(Transition(Family.DENSE, torch.randn(2, 4, 4, generator=gen)), torch.randn(2, 4, 5, generator=gen),
                           torch.randn(3, 8, generator=gen))
    kv = AttentionInterior(torch.randn(1, 6, 4, generator=gen), torch.randn(1, 6, 4, generator=gen))
    return SegmentEntry(key, (seed,), Seams(0, 0), 0, 6, [layer, kv])


def _same(a: SegmentEntry, b: SegmentEntry) -> bool:
    return all(torch.equal(x, y) for x, y in zip(entry_tensors(a), entry_tensors(b), strict=True))


def test_public_pool_hits_read_its_slots_and_a_held_entry_outlives_its_eviction() -> None:
    """Stored entries' (T_C, S_C|0) sit in the pool's slots, the same memory for every hit; an entry
    a request still holds after it was evicted keeps its values while later entries take slots
    (the originals are the oracle), and its slot is free once it is dropped."""
    originals = {key: _linear_entry(key, seed) for seed, key in enumerate("abcdef")}
    store = SegmentStore(budget_bytes=originals["a"].nbytes)
    assert store.put(originals["a"])
    held = store.get("a", (0,))
    assert held is not None and held is not originals["a"] and _same(held, originals["a"])
    linear = held.layers[0]
    assert isinstance(linear, LinearInterior) and linear.owner is not None
    again = store.get("a", (0,))
    assert again is not None and again.layers[0].zero_start_state.data_ptr() == linear.zero_start_state.data_ptr()
    for key in "bcdef":
        assert store.put(originals[key])
    assert store.evictions == 5 and _same(held, originals["a"])  # its slot was never handed to b..f
    assert store.arenas.used_slots == 2  # f's, and the evicted a's a request holds
    del held, again, linear
    assert store.arenas.used_slots == 1


def test_a_stored_entry_pickles_as_copies_of_its_own_bytes() -> None:
    """An entry sent to a peer goes as its own tensors (equal values), not the slab its slot is in."""
    store = SegmentStore()
    original = _linear_entry("a", 0)
    store.put(original)
    stored = store.get("a", (0,))
    assert stored is not None and stored.layers[0].owner is not None
    sent = pickle.dumps(stored)
    assert len(sent) < 8192 and _same(pickle.loads(sent), original)
    assert pickle.loads(sent).layers[0].owner is None


def test_a_stored_interior_recast_keeps_its_slot_only_while_it_views_it() -> None:
    """``stored_as`` the dtype it has returns the slot's views (the slot must stay held); another
    dtype makes tensors of their own (holding the slot would keep memory nothing reads)."""
    store = SegmentStore()
    store.put(_linear_entry("a", 0))
    stored = store.get("a", (0,))
    assert stored is not None
    linear = stored.layers[0]
    assert isinstance(linear, LinearInterior) and linear.owner is not None
    assert linear.stored_as(torch.float32).owner is linear.owner
    assert linear.stored_as(torch.bfloat16).owner is None


class _OneEntryBelow:
    """A lower tier holding one entry (what a disk or Mooncake load hands memory)."""

    def __init__(self, entry: SegmentEntry) -> None:
        self.entry, self.offered = entry, []

    def place_loads_in(self, arenas) -> None:
        pass  # its entry is made before the pool: it arrives in tensors of its own

    def take(self, key: str, token_ids: tuple[int, ...], namespace: str):
        return (self.entry, "disk") if key == self.entry.key else None

    def offer(self, entry: SegmentEntry, event, origin: str = "") -> None:
        self.offered.append(entry)


def test_an_entry_loaded_from_below_is_served_from_its_stored_copy() -> None:
    """A load's entry is copied into the pool's slots and the request gets that copy (one copy in
    memory, not the loaded one beside it): the same memory a later hit reads."""
    loaded = _linear_entry("a", 0)
    store = SegmentStore(lower=_OneEntryBelow(loaded))  # type: ignore[arg-type]
    served, tier = store.fetch("a", (0,))
    assert tier == "disk" and served is not None and _same(served, loaded)
    assert served.layers[0].owner is not None and served is store.entries["a"]


def test_a_built_document_is_returned_as_the_pools_copy(engine: Engine) -> None:
    """``Prefiller.document_steps`` hands the request the entry in the pool's slots when it fits (the built
    tensors go), and the built one when it does not."""
    policy = engine.policy("hypic")
    ids = tuple(engine.tokenizer.encode("the heron studied reeds by the river " * 3))
    key = engine.cache.lookup_document(ids, policy)[1]
    built = drain(engine.prefiller.document_steps(key, ids, policy))
    assert built is engine.cache.public.peek(key, ids)
    assert any(isinstance(layer, LinearInterior) and layer.owner is not None for layer in built.layers)


def _random_state(length: int, seed: int) -> RequestState:
    gen = torch.Generator().manual_seed(seed)
    linear = LinearLayerState(torch.randn(2, 4, 4, generator=gen), torch.randn(3, 8, generator=gen))
    attention = AttentionLayerState(torch.randn(1, length, 4, generator=gen), torch.randn(1, length, 4, generator=gen))
    return RequestState([linear, attention], length, [random.Random(seed).randrange(5) for _ in range(length)])


def _template() -> RequestState:
    return RequestState([LinearLayerState(torch.zeros(2, 4, 4), torch.zeros(3, 8)),
                         AttentionLayerState(torch.zeros(1, 0, 4), torch.zeros(1, 0, 4))])


def test_radix_tree_hits_longest_snapshot_and_splits_edges() -> None:
    cache = PrefixCache(page_tokens=8)  # slots of 8 positions, and 4, 2, 1 for shorter pages
    state = _random_state(20, 0)
    snap = {5: {0: LinearLayerState(torch.ones(2, 4, 4), torch.ones(3, 8))},
            20: {0: state.layers[0]}}
    cache.insert("m", state, snap)
    ids = state.token_ids
    hit = cache.match("m", cache_key(ids + [9], {}), limit=20, template=_template())
    assert hit is not None and hit.length == 20 and hit.state.token_ids == ids
    assert torch.equal(hit.state.layers[1].keys, state.layers[1].keys)
    assert cache.match("m", cache_key(ids, {}), limit=19, template=_template()).length == 5
    assert cache.match("other", cache_key(ids, {}), limit=20, template=_template()) is None  # namespaces are separate
    diverging = ids[:12] + [(ids[12] + 1) % 5] + ids[13:]
    assert cache.match("m", cache_key(diverging, {}), limit=20, template=_template()).length == 5
    # a second state sharing 12 tokens splits the edge (and the page [8, 16) it cuts through)
    other = _random_state(20, 1)
    other.token_ids = diverging
    cache.insert("m", other, {16: {0: other.layers[0]}})
    hit = cache.match("m", cache_key(diverging, {}), limit=19, template=_template())
    assert hit.length == 16
    assert torch.equal(hit.state.layers[1].keys[:, :12], state.layers[1].keys[:, :12])  # shared prefix kept
    assert torch.equal(hit.state.layers[1].keys[:, 12:], other.layers[1].keys[:, 12:16])
    # slots held, in positions: [0, 5) -> 8; [5, 8) [8, 12) | [12, 16) [16, 20) -> 4 each; [12, 16) -> 4
    kv_bytes = (8 + 4 * 5) * 2 * 4 * 4  # x (K, V) x 4 floats x 4 bytes
    snapshot_bytes = 3 * (2 * 4 * 4 + 3 * 8) * 4  # 3 snapshots x (recurrent + conv) floats x 4 bytes
    assert cache.nbytes == kv_bytes + snapshot_bytes


def test_radix_tree_evicts_lru_leaves_within_budget() -> None:
    cache = PrefixCache(budget_bytes=2000)
    for seed in range(6):
        state = _random_state(10, 100 + seed)
        state.token_ids = [seed] + state.token_ids[1:]
        cache.insert("m", state, {10: {0: state.layers[0]}})
        assert cache.nbytes <= 2000
    assert cache.evictions > 0 and len(cache) < 6
    newest = [5] + _random_state(10, 105).token_ids[1:]
    assert cache.match("m", cache_key(newest + [0], {}), limit=10, template=_template()).length == 10


def test_eviction_climbs_a_chain_once_its_leaves_are_gone() -> None:
    """One request with a snapshot every 4 tokens is a chain of nodes (one leaf); a budget for about
    two of them evicts from the leaf upward: each parent becomes a leaf in turn, and the nodes left
    are the chain's head (closed form: node sizes from the first insert)."""
    state = _random_state(24, 7)
    unbounded = PrefixCache()
    unbounded.insert("m", state, {p: {0: state.layers[0]} for p in range(4, 25, 4)})
    sizes = sorted((n.depth, n.nbytes) for n in unbounded._nodes() if n.parent is not None)
    assert len(sizes) == 6
    budget = sizes[0][1] + sizes[1][1] + sizes[2][1] // 2
    cache = PrefixCache(budget_bytes=budget)
    cache.insert("m", state, {p: {0: state.layers[0]} for p in range(4, 25, 4)})
    assert cache.nbytes == sizes[0][1] + sizes[1][1] and cache.evictions == 4
    assert cache.peek("m", cache_key(state.token_ids, {}), limit=24) == 8


def test_snapshots_a_prompt_leaves_on_its_way_go_before_the_end_its_conversation_resumes_at() -> None:
    """A prompt's prefill leaves a snapshot every 4 tokens (one insert); its request's end is kept
    later (another insert). Over budget, the inner snapshots go first, least recently taken first
    (4, then 8), their KV kept; the end stays the longest resume point (closed form: sizes from an
    unbounded pool). Evicting leaves only would have dropped the end (a resume at 20)."""
    state = _random_state(24, 7)
    on_the_way, end = {p: {0: state.layers[0]} for p in range(4, 21, 4)}, {24: {0: state.layers[0]}}
    unbounded = PrefixCache()
    unbounded.insert("m", state, on_the_way)
    unbounded.insert("m", state, end)
    snap, total = state.layers[0].nbytes, unbounded.nbytes
    cache = PrefixCache(budget_bytes=total - snap - snap // 2)
    cache.insert("m", state, on_the_way)
    assert cache.snapshot_evictions == cache.evictions == 0
    cache.insert("m", state, end)
    key = cache_key(state.token_ids, {})
    assert (cache.snapshot_evictions, cache.evictions, cache.nbytes) == (2, 0, total - 2 * snap)
    assert [cache.peek("m", key, limit) for limit in (24, 23, 11)] == [24, 20, 0]
    hit = cache.match("m", key, 24, _template())
    assert hit is not None and torch.equal(hit.state.layers[1].keys, state.layers[1].keys)


def test_kv_no_snapshot_resumes_from_goes_with_the_leaf_that_needed_it() -> None:
    """When every inner snapshot is gone and the leaf goes too, the chain's KV has no resume point
    left: it goes at once, under budget or not (nothing can resume from KV without linear states)."""
    state = _random_state(24, 7)
    snap = state.layers[0].nbytes
    cache = PrefixCache()
    cache.insert("m", state, {p: {0: state.layers[0]} for p in range(4, 21, 4)})
    total = cache.nbytes + snap + 2 * 4 * 4 * 4  # the end's snapshot and 4 more positions of KV (float32)
    cache.budget_bytes = total - 5 * snap - 1
    cache.insert("m", state, {24: {0: state.layers[0]}})
    assert (cache.snapshot_evictions, cache.evictions, cache.nbytes, len(cache)) == (5, 6, 0, 0)


def test_a_flushed_tree_frees_its_tensors_at_once() -> None:
    """A flushed tree's nodes and states are freed when it is dropped, by reference counting, not at
    the interpreter's next full garbage collection: a soak with flushes once grew the server by
    hundreds of MB of parent <-> child cycles waiting for one. (The slots' tensors are views their
    arena cuts once per slab and keeps: what frees memory is every slot going back.)"""
    cache = PrefixCache()
    for seed in range(8):
        state = _random_state(12, 200 + seed)
        state.token_ids = [seed % 3] + state.token_ids[1:]  # three trees' worth of shared first tokens
        cache.insert("m", state, {6: {0: state.layers[0]}, 12: {0: state.layers[0]}})
    held = [weakref.ref(n) for n in cache._nodes()] + [weakref.ref(s) for n in cache._nodes()
                                                       for s in (n.snapshot or {}).values()]
    assert len(cache) > 8 and cache.arenas.used_slots > 0  # split edges: parents with children
    gc.disable()
    try:
        alive = len(held) - sum(ref() is None for ref in held)
        assert cache.clear() > 0 and cache.nbytes == 0
        assert [ref for ref in held if ref() is not None] == [], f"{alive} nodes and states waited for the collector"
        assert cache.arenas.used_slots == cache.state_arenas.used_slots == 0  # every slot is back in its arena
    finally:
        gc.enable()


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint, seam_width=8)


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnop ,.") for _ in range(n))


def _bytes_only_the_collector_frees(work) -> int:
    """Tensor bytes that ``work`` left in reference cycles (freed only by a full collection)."""
    gc.collect()
    gc.disable()
    try:
        work()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in gc.garbage if isinstance(t, torch.Tensor)}
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()
    return sum(storages.values())


def test_requests_and_flushes_leave_nothing_for_the_collector(engine: Engine) -> None:
    """Many PIC and plain requests with pool flushes between them: what they leave behind is freed
    by reference counting (a server's full collections are rare; cycles holding states grew one by
    ~14 MB a minute under a 25-minute soak)."""
    rng = random.Random(12)

    def work() -> None:
        for round_ in range(6):
            docs = [_text(rng, 80) for _ in range(3)]
            engine.generate(SEP.join([_text(rng, 10), *docs, _text(rng, 10)]), max_new_tokens=3, mode="hypic")
            engine.generate(_text(rng, 60), max_new_tokens=3, mode="prefix")
            engine.cache.public.clear(), engine.cache.private.clear()

    held = _bytes_only_the_collector_frees(work)
    assert held < 64 * 1024, f"{held / 1e6:.1f} MB of tensors waited for the collector"


def test_prefix_hit_state_equals_full_prefill(engine: Engine) -> None:
    """prefix mode: a snapshot at a document boundary resumes exactly where full recompute is."""
    rng = random.Random(5)
    leading, docs, query = _text(rng, 20), [_text(rng, 60) for _ in range(3)], _text(rng, 12)
    engine.prefill(engine.parse(leading + SEP + SEP.join(docs) + SEP + query), "prefix")
    other = leading + SEP + docs[0] + SEP + docs[1] + SEP + _text(rng, 50) + SEP + query
    parts = engine.parse(other)
    resumed = engine.prefill(parts, "prefix")
    assert resumed.stats.prefix_hit_tokens == len(parts.leading) + 120
    empty = empty_state(engine.model.config, "cpu", torch.float32)
    full = combine(engine.model, parts.token_ids, [Run(0, len(parts.token_ids))], empty)
    assert (resumed.logits - full.logits).abs().max().item() < 1e-4
    for ours, ref in zip(resumed.state.layers, full.state.layers):
        for a, b in zip(ours.tensors(), ref.tensors()):
            assert torch.allclose(a, b, atol=1e-4)


def test_multi_turn_reuses_whole_first_turn(engine: Engine) -> None:
    rng = random.Random(6)
    first = _text(rng, 20) + SEP + _text(rng, 60) + SEP + _text(rng, 15)
    turn1 = engine.generate(first, max_new_tokens=6, mode="hypic", ignore_eos=True)
    # the same segmentation, the reply and a new question appended to Q (as token ids: a random
    # model's bytes need not decode to text that re-encodes the same)
    parts = engine.parse(first)
    second = PromptParts(parts.leading, parts.segments, parts.trailing + tuple(turn1.output_ids) + (65, 66, 67))
    turn2 = engine.prefill(second, "hypic")
    # the first turn's end state covers its prompt and all but the last generated token
    assert turn2.stats.prefix_hit_tokens == turn1.prompt_tokens + len(turn1.output_ids) - 1


def test_plain_prompt_never_resumes_from_a_pic_assembled_state(checkpoint_factory, reference_factory) -> None:
    """A plain prompt equal to an earlier PIC prompt's concatenation gets full recompute's logits;
    a third request with another segmentation of the same ids does not reuse the first's states
    past the point where the segmentations part (the oracle: the reference model, long-memory copy)."""
    path = checkpoint_factory("qwen3_5_text-ratio2", long_memory=True)
    engine, oracle = Engine.from_pretrained(path, seam_width=8), reference_factory(path)
    rng = random.Random(8)
    leading, docs, query = _text(rng, 20), [_text(rng, 120), _text(rng, 90)], _text(rng, 15)
    pic = engine.prefill(engine.parse(SEP.join([leading, *docs, query])), "hypic")
    assert pic.stats.segments_missed == 2
    plain = engine.prefill(engine.parse(leading + "".join(docs) + query), "hypic")
    ids = engine.parse(leading + "".join(docs) + query).token_ids
    full = oracle.run(oracle.empty_state(), ids)[0][-1]
    assert (plain.logits - full).abs().max().item() <= 1e-4
    assert plain.stats.prefix_hit_tokens == 0
    merged = engine.prefill(engine.parse(SEP.join([leading, docs[0] + docs[1], query])), "hypic")
    assert merged.stats.prefix_hit_tokens == len(leading)  # L's end: the last state both layouts share
    assert merged.stats.segments_missed == 1


def test_plain_prompts_sharing_a_long_prefix_resume_at_the_last_interval_snapshot(tiny_checkpoint: Path) -> None:
    """Plain prompts (no separators) with a shared 300-token system prompt: the later ones resume at
    the interval snapshot inside it (256) and equal full recompute; a repeat resumes before its
    last token."""
    engine = Engine.from_pretrained(tiny_checkpoint, snapshot_interval=128)
    rng = random.Random(9)
    system = _text(rng, 300)
    prompts = [system + _text(rng, 40) for _ in range(3)]
    results = [engine.prefill(engine.parse(p), "hypic") for p in prompts]
    assert [r.stats.prefix_hit_tokens for r in results] == [0, 256, 256]
    for prompt, result in zip(prompts, results):
        ids = engine.parse(prompt).token_ids
        full = combine(engine.model, ids, [Run(0, len(ids))], empty_state(engine.model.config, "cpu", torch.float32))
        assert (result.logits - full.logits).abs().max().item() < 1e-4
    again = engine.prefill(engine.parse(prompts[1]), "prefix")  # another namespace: nothing shared
    assert again.stats.prefix_hit_tokens == 0
    assert engine.prefill(engine.parse(prompts[1]), "prefix").stats.prefix_hit_tokens == 339


def test_tree_keys_and_common_lengths_against_their_definitions() -> None:
    """The vectorised key (id << MARK_BITS | marks; marks past the end ignored) and the halving
    common-prefix length, against the per-token formulas on random cases."""
    from hypic.cache.prefix_cache import _common_length
    from hypic.cache.segments import MARK_BITS
    rng = random.Random(3)
    for _ in range(500):
        ids = [rng.randrange(1 << 20) for _ in range(rng.randint(0, 60))]
        marks = {rng.randint(0, len(ids) + 5): rng.randint(1, 15) for _ in range(rng.randint(0, 5))}
        assert cache_key(ids, marks) == [token << MARK_BITS | marks.get(i, 0) for i, token in enumerate(ids)]
        edge = tuple(rng.randint(0, 2) for _ in range(rng.randint(0, 40)))
        key = [rng.randint(0, 2) for _ in range(rng.randint(0, 50))]
        offset = rng.randint(0, len(key))
        if rng.random() < 0.5:  # a long shared run, then maybe a difference
            key[offset:offset + len(edge)] = list(edge)[:len(key) - offset]
        n = 0
        while n < min(len(edge), len(key) - offset) and edge[n] == key[offset + n]:
            n += 1
        assert _common_length(edge, key, offset) == n


@pytest.mark.parametrize("variant", ["qwen3_5_text-ratio2", "qwen3_next-moe", "minimax", "kimi_linear", "granitemoehybrid",
                                     "nemotron_h", "gpt_oss", "mimo_v2_flash", "bailing_hybrid"])
def test_entry_bytes_are_the_bytes_an_entry_takes(checkpoint_factory, variant: str) -> None:
    """The size the warm-up bound is judged by equals the size of the entries built (sliding-window
    layers keep a window, naive entries no transitions, a narrower state-cache dtype halves T_C and S_C|0)."""
    path = checkpoint_factory(variant)
    rng = random.Random(13)
    for mode, state_dtype in (("hypic", "float32"), ("naive", "float32"), ("hypic", "bfloat16")):
        engine = Engine.from_pretrained(path, seam_width=4, state_cache_dtype=state_dtype)
        for length in (5, 9, 40):
            ids = tuple(rng.randrange(engine.model.config.vocab_size) for _ in range(length))
            policy = engine.policy(mode)
            key = engine.cache.lookup_document(ids, policy)[1]
            has_interior = policy.seams is not None and policy.seams.interior(length) is not None
            expected = drain(engine.prefiller.document_steps(key, ids, policy)).nbytes if has_interior else 0
            assert engine.entry_bytes(length, mode) == expected, (variant, mode, state_dtype, length)


def test_a_warmup_larger_than_the_public_pool_is_refused(tiny_checkpoint: Path) -> None:
    """Entries that cannot all be held would evict each other and everyone else's: refused up front."""
    probe = Engine.from_pretrained(tiny_checkpoint)
    docs = ["the heron studied reeds by the river " * 3, "the lynx was born by the mill " * 3]
    sizes = [probe.entry_bytes(len(probe.tokenizer.encode(d))) for d in docs]
    engine = Engine.from_pretrained(tiny_checkpoint, public_pool_bytes=sum(sizes) - 1)
    with pytest.raises(InvalidRequest, match="public pool"):
        engine.warmup(docs)
    assert len(engine.cache.public) == 0
    engine.warmup(docs[:1])
    assert engine.cache.public.nbytes == sizes[0]
