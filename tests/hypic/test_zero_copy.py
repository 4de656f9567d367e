"""Private-pool hits copy nothing. Oracles: the process's RSS (concurrent requests
resuming from one prefix hold one copy of its KV), the storage a resumed state reads (the pool's
own pages), full recompute (what resumed and forked states compute), and closed-form accounting of
what eviction may and may not drop."""
import gc
import json
import pickle
import random
import subprocess
import sys
from pathlib import Path

import torch

from hypic import Engine
from hypic.assembler import combine
from hypic.cache.prefix_cache import PAGE_TOKENS, PrefixCache, cache_key
from hypic.cache.segments import Run
from hypic.cache.tiers.resume_objects import resume_parts
from hypic.state import AttentionLayerState, LinearLayerState, RequestState, WindowLayerState
from hypic.models.families import empty_state

ROOT = Path(__file__).resolve().parents[2]


def _ids(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(count)]


def _full(engine: Engine, ids: list[int]) -> torch.Tensor:
    empty = empty_state(engine.model.config, "cpu", torch.float32)
    return combine(engine.model, ids, [Run(0, len(ids))], empty).logits


def _pool_pages(engine: Engine) -> set[int]:
    return {t.data_ptr() for node in engine.cache.private._nodes() for pages in node.pages.values()
            for block in pages for t in block}


def test_concurrent_hits_on_one_prefix_hold_one_copy_of_its_kv(checkpoint_factory) -> None:
    """16 requests resume from one cached 4k-token prefix and each keeps its state (prefill, then a
    batched decode step): from before the prefix was cached, the RSS grows by one copy of its KV
    plus what the requests own and what the pool added besides (x 1.2). Copying hits hold 17 copies
    (measured: 17.05); the pool's own count stands in only for what it added besides the prefix."""
    path = checkpoint_factory("qwen3_5_text-kv-heavy")
    out = subprocess.run([sys.executable, str(ROOT / "eval" / "bench_prefix_hits.py"), "--part", "memory",
                          "--model", str(path), "--prefix", "4096", "--concurrent", "16"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    memory = json.loads(out.stdout[out.stdout.index("{"):])["memory"]
    copy, own, pool = memory["one_copy_bytes"], memory["own_state_bytes"], memory["private_pool_growth_bytes"]
    assert copy == 4096 * 3 * 2 * 2 * 256 * 4  # tokens x attention layers x (K, V) x heads x head_dim x fp32
    assert pool - copy < 0.1 * copy  # the pool's other new bytes are small beside the prefix for this model
    assert memory["rss_growth_bytes"] <= 1.2 * copy + own + (pool - copy), memory


def test_a_resumed_request_reads_the_pools_pages_in_place(tiny_checkpoint: Path) -> None:
    """A plain prompt sharing 600 tokens with an earlier one resumes at 512 (interval 128): its
    attention layers read the pool's pages (same storage, nothing of the prefix owned), and its
    logits and greedy continuation equal full recompute's."""
    engine = Engine.from_pretrained(tiny_checkpoint, snapshot_interval=128)
    rng, vocab = random.Random(3), engine.model.config.vocab_size
    prefix = _ids(rng, 600, vocab)
    engine.prefill(engine.parse(prefix + _ids(rng, 20, vocab)))
    prompt = prefix + _ids(rng, 20, vocab)
    resumed = engine.prefill(engine.parse(prompt))
    assert resumed.stats.prefix_hit_tokens == 512
    pages = _pool_pages(engine)
    attention = [layer for layer in resumed.state.layers if isinstance(layer, AttentionLayerState)]
    assert attention and all(layer.shared_length == 512 for layer in attention)
    assert all(t.data_ptr() in pages for layer in attention for block in layer.shared for t in block)
    config = engine.model.config
    prefix_kv = 512 * sum(config.kv_elements(i) for i in config.attention_layers()) * 4
    assert sum(layer.nbytes for layer in attention) < prefix_kv / 4  # owns its 108 new tokens' KV only
    assert (resumed.logits - _full(engine, prompt)).abs().max().item() < 1e-4
    state, token, tokens = resumed.state, int(resumed.logits.argmax()), prompt
    for _ in range(4):  # decode on the shared pages, against full recompute of each longer prompt
        tokens = tokens + [token]
        logits, state = engine.decode_step(state, token)
        assert (logits - _full(engine, tokens)).abs().max().item() < 1e-4
        token = int(logits.argmax())


def test_forked_samples_share_the_prompt_and_decode_apart(tiny_checkpoint: Path) -> None:
    """n samples of one prompt share its KV (no copy at fork) and each decodes its own tokens:
    each equals full recompute of the prompt and its own tokens."""
    engine = Engine.from_pretrained(tiny_checkpoint)
    rng, vocab = random.Random(4), engine.model.config.vocab_size
    prompt = _ids(rng, 300, vocab)
    state = engine.prefill(engine.parse(prompt)).state
    samples = [state] + [state.fork() for _ in range(2)]
    first = [layer for layer in samples[0].layers if isinstance(layer, AttentionLayerState)]
    assert all(layer.nbytes == 0 and layer.shared_length == 300 for s in samples for layer in s.layers
               if isinstance(layer, AttentionLayerState))
    assert [t.data_ptr() for layer in first for t in layer.shared[0]] == [
        t.data_ptr() for layer in samples[2].layers if isinstance(layer, AttentionLayerState) for t in layer.shared[0]]
    tokens = [[7, 8, 9], [10, 11, 12], [13, 14, 15]]
    for step in range(3):
        for sample, own in zip(samples, tokens):
            logits, _ = engine.decode_step(sample, own[step])
            assert (logits - _full(engine, prompt + own[: step + 1])).abs().max().item() < 1e-4


def _state(first: int, length: int, seed: int) -> RequestState:
    gen = torch.Generator().manual_seed(seed)
    linear = LinearLayerState(torch.randn(2, 4, 4, generator=gen), torch.randn(3, 8, generator=gen))
    attention = AttentionLayerState(torch.randn(1, length, 4, generator=gen), torch.randn(1, length, 4, generator=gen))
    return RequestState([linear, attention], length, [first] + [(first + i) % 7 for i in range(1, length)])


def _template() -> RequestState:
    return RequestState([LinearLayerState(torch.zeros(2, 4, 4), torch.zeros(3, 8)),
                         AttentionLayerState(torch.zeros(1, 0, 4), torch.zeros(1, 0, 4))])


def test_nodes_a_request_reads_are_not_evicted_until_it_lets_go() -> None:
    """A budget for 2.5 states: state a is resumed (its pages read), then b and c arrive. Eviction
    passes a by, although it is the least recently used, and drops b; once the resumed state is
    gone, the next arrival evicts a. Sizes in closed form; a's path spans several pages."""
    length = 3 * PAGE_TOKENS + 10
    rows = 3 * PAGE_TOKENS + PAGE_TOKENS // 8  # three full pages' slots, the last 10 positions in a 16-row one
    size = rows * 2 * 4 * 4 + (2 * 4 * 4 + 3 * 8) * 4  # K and V of 1 head x 4 floats; one snapshot
    cache = PrefixCache(budget_bytes=int(2.5 * size))
    states = {name: _state(first, length, first) for name, first in zip("abcd", range(4))}
    key = {name: cache_key(s.token_ids, {}) for name, s in states.items()}
    cache.insert("m", states["a"], {length: {0: states["a"].layers[0]}})
    hit = cache.match("m", key["a"] + [1], length, _template())
    assert hit is not None and len(hit.state.layers[1].shared) == 4  # pages cut at multiples of PAGE_TOKENS
    for name in "bc":
        cache.insert("m", states[name], {length: {0: states[name].layers[0]}})
    held = {name: cache.peek("m", key[name] + [1], length) for name in "abc"}
    assert held == {"a": length, "b": 0, "c": length} and cache.nbytes == 2 * size
    assert torch.equal(hit.state.layers[1].keys, states["a"].layers[1].keys)  # pages read, never dropped
    del hit
    cache.insert("m", states["d"], {length: {0: states["d"].layers[0]}})
    assert cache.peek("m", key["a"] + [1], length) == 0 and cache.nbytes == 2 * size


def test_a_reader_keeps_its_pages_after_their_node_is_evicted_and_slots_are_reused() -> None:
    """A resumed state lets go of its lease (its nodes become evictable) but is still read: the
    nodes go, other states fill the arena, and its KV is still the KV it resumed (no slot of its
    pages was reused); once it is dropped, its slots are free."""
    cache = PrefixCache(budget_bytes=1, page_tokens=8)  # every insert evicts what is not pinned
    first = _state(0, 30, 0)
    cache.budget_bytes = None
    cache.insert("m", first, {30: {0: first.layers[0]}})
    hit = cache.match("m", cache_key(first.token_ids, {}) + [1], 30, _template())
    assert hit is not None
    hit.state.release()
    cache.budget_bytes = 1
    for seed in range(1, 6):
        other = _state(seed, 30, seed)
        cache.insert("m", other, {30: {0: other.layers[0]}})
    assert cache.evictions >= 5 and len(cache) == 0
    attention = hit.state.layers[1]
    assert isinstance(attention, AttentionLayerState)
    assert torch.equal(attention.keys, first.layers[1].keys) and torch.equal(attention.values, first.layers[1].values)
    linear = hit.state.layers[0]
    assert isinstance(linear, LinearLayerState) and torch.equal(linear.recurrent, first.layers[0].recurrent)
    assert torch.equal(linear.conv, first.layers[0].conv)  # the snapshot's slot was not reused either
    assert cache.arenas.used_slots == len(attention.shared)  # only the reader's pages are held
    assert cache.state_arenas.used_slots == 1  # and its snapshot's linear state
    del hit, attention, linear
    gc.collect()
    assert cache.arenas.used_slots == cache.state_arenas.used_slots == 0


def test_a_resume_point_being_written_keeps_its_kv_after_its_node_is_gone() -> None:
    """What write-back writes (``resume_parts`` of the state at an evicted node) stays the node's KV
    while the writer reads it, though the tree is flushed and new states take slots meanwhile (one
    page: the parts are views of it, not a gathered copy)."""
    cache = PrefixCache(page_tokens=32)
    first = _state(0, 20, 0)
    cache.insert("m", first, {20: {0: first.layers[0]}})
    node = next(node for _, node in cache.resume_points())
    assert node.snapshot is not None
    parts = resume_parts(cache.state_at(node, _template()), 20, node.snapshot)
    assert parts is not None
    del node
    cache.clear()
    for seed in range(1, 4):
        other = _state(seed, 20, seed)
        cache.insert("m", other, {20: {0: other.layers[0]}})
    keys, values = parts.kv[1]
    assert torch.equal(keys, first.layers[1].keys) and torch.equal(values, first.layers[1].values)


def test_churn_under_a_budget_reuses_slots_instead_of_allocating() -> None:
    """Many states inserted through a budget for about three: the arenas' reserved bytes stay within
    the budget plus one slab per size class (slots are reused), and every page left is the tree's."""
    probe, unbounded = _state(0, 40, 0), PrefixCache(page_tokens=8)
    unbounded.insert("m", probe, {40: {0: probe.layers[0]}})
    cache = PrefixCache(budget_bytes=3 * unbounded.nbytes, page_tokens=8)
    cache.arenas.slab_bytes = 4 * 8 * 2 * 4 * 4  # four full pages a slab
    for seed in range(60):
        state = _state(seed, 40, seed)
        cache.insert("m", state, {40: {0: state.layers[0]}})
        slab_room = sum(a.slab_slots * a.slot_bytes for a in cache.arenas.arenas.values())
        assert cache.arenas.reserved_bytes <= cache.budget_bytes + slab_room
    in_tree = sum(len(pages) for node in cache._nodes() for pages in node.pages.values())
    assert cache.evictions > 50 and cache.arenas.used_slots == in_tree


def test_pooled_states_pickle_as_copies_of_their_own_bytes() -> None:
    """A snapshot's states in pool slots go to another process as their own tensors (equal values,
    no slab, no slot): a view would pickle its whole slab."""
    cache = PrefixCache(page_tokens=8)
    cache.state_arenas.slab_bytes = 1 << 20
    first = _state(0, 8, 0)
    window = WindowLayerState(torch.randn(1, 4, 4), torch.randn(1, 4, 4), window=4, length=6)
    cache.insert("m", RequestState([first.layers[0], first.layers[1], window], 8, first.token_ids),
                 {8: {0: first.layers[0], 2: window}})
    node = next(node for _, node in cache.resume_points())
    linear, ring = node.snapshot[0], node.snapshot[2]
    for pooled, own in ((linear, first.layers[0]), (ring, window)):
        assert pooled.owner is not None
        copied = pickle.loads(pickle.dumps(pooled))
        assert len(pickle.dumps(pooled)) < 4096 and getattr(copied, "owner", None) is None
        assert all(torch.equal(a, b) for a, b in zip(copied.tensors(), own.tensors()))
