"""Private-pool hits copy nothing (issue 27, L1). Oracles: the process's RSS (concurrent requests
resuming from one prefix hold one copy of its KV), the storage a resumed state reads (the pool's
own pages), full recompute (what resumed and forked states compute), and closed-form accounting of
what eviction may and may not drop."""
import json
import random
import subprocess
import sys
from pathlib import Path

import torch

from hypic import Engine
from hypic.assembler import combine
from hypic.cache.prefix_cache import PAGE_TOKENS, PrefixCache, cache_key
from hypic.cache.segments import Run
from hypic.state import AttentionLayerState, LinearLayerState, RequestState

ROOT = Path(__file__).resolve().parents[2]


def _ids(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(count)]


def _full(engine: Engine, ids: list[int]) -> torch.Tensor:
    empty = RequestState.empty(engine.model.config, "cpu", torch.float32)
    return combine(engine.model, ids, [Run(0, len(ids))], empty).logits


def _pool_pages(engine: Engine) -> set[int]:
    return {t.data_ptr() for node in engine.prefix_cache._nodes() for pages in node.pages.values()
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
    size = length * 2 * 4 * 4 + (2 * 4 * 4 + 3 * 8) * 4  # K and V of 1 head x 4 floats; one snapshot
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
