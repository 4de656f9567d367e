"""Resuming from the private pool: what a hit costs, and what concurrent hits hold in memory.

Part ``cost``: a prompt of P tokens (default 1,024 and 7,936: multiples of the snapshot interval,
so the hit resumes exactly at P) is prefilled once, its states kept in the private pool; then the
same P tokens with a new 16-token tail, --repeats times. Reported: the hit alone
(``PrefixCache.match``: what the request gets to resume from) and the whole prefill (hit + the
tail's combine pass + first-token logits), medians, and their ratio between the two lengths.

Part ``memory``: a P-token prefix (default 4,096) is cached, then --concurrent requests resume from
it at once, each keeping its state (its prefill, then one decode step for all of them in one
batch, as the server's loop runs them); the process's RSS growth against one copy of the prefix's
KV (closed form: tokens x attention layers x (K + V) elements x dtype size), measured from before
the prefix was cached, less what the requests hold of their own (closed form) and what the private
pool added besides the prefix (its count): ``copies_held``, 1 when hits share the prefix. Run in a
child process in which glibc maps every block over 64 KiB on its own (``MALLOC_MMAP_THRESHOLD_``),
so freed tensors leave the RSS.

Part ``decode``: one batched decode step of those --concurrent requests, resumed (attention reads
the shared pages, gathered per step) against the same requests each owning its prefix (``full``
mode, no private pool), medians of --steps.

Model: the shipped default model (``--model`` for another), float32, one thread (``--threads``).

    python eval/bench_prefix_hits.py [--part cost|memory|all] [--json OUT]
"""
import argparse
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hypic import Engine
from hypic.decode import decode_batch
from hypic.cache.prefix_cache import cache_key
from hypic.models.families import empty_state

TAIL = 16


def _engine(args: argparse.Namespace) -> Engine:
    return Engine.from_pretrained(args.model, dtype="float32", private_pool_bytes=2 << 30, public_pool_bytes=2 << 30)


def _ids(count: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(count)]


def resume_cost(args: argparse.Namespace) -> dict[str, Any]:
    """Median seconds of the hit alone and of the whole prefill, per prefix length."""
    engine = _engine(args)
    vocab, tree = engine.model.config.vocab_size, engine.policy("hypic").tree
    assert tree is not None
    rows: dict[str, Any] = {}
    for length in args.lengths:
        prefix = _ids(length, length, vocab)
        engine.prefill(engine.parse(prefix + _ids(TAIL, 0, vocab)))
        template = empty_state(engine.model.config, engine.model.device, engine.model.dtype)
        hits, prefills = [], []
        for repeat in range(args.repeats + 1):  # the first is a warm-up
            prompt = prefix + _ids(TAIL, 1000 + repeat, vocab)
            key = cache_key(prompt, {})
            start = time.perf_counter()
            hit = engine.cache.private.match(tree, key, len(key) - 1, template)
            hit_s = time.perf_counter() - start
            assert hit is not None and hit.length == length, (hit and hit.length, length)
            del hit
            start = time.perf_counter()
            prefill = engine.prefill(engine.parse(prompt))
            prefill_s = time.perf_counter() - start
            assert prefill.stats.prefix_hit_tokens == length
            if repeat:
                hits.append(hit_s)
                prefills.append(prefill_s)
        rows[str(length)] = {"hit_ms": 1e3 * statistics.median(hits), "prefill_ms": 1e3 * statistics.median(prefills),
                             "hit_ms_all": [1e3 * s for s in hits], "prefill_ms_all": [1e3 * s for s in prefills]}
    short, long = (rows[str(n)] for n in (min(args.lengths), max(args.lengths)))
    ratios = {"hit": long["hit_ms"] / short["hit_ms"], "prefill": long["prefill_ms"] / short["prefill_ms"]}
    return {"lengths": rows, "long_over_short": ratios}


def _rss() -> int:
    gc.collect()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def concurrent_memory(engine: Engine, prefix_tokens: int, concurrent: int) -> dict[str, Any]:
    """RSS growth from before a ``prefix_tokens``-token prefix is cached until ``concurrent`` requests
    hold states resumed from it, against one copy of its KV plus what the requests and the private
    pool hold besides (closed form: each request's own tokens and linear states; the pool's count of
    its new nodes but the prefix's KV). Ideally 1 copy; a hit that copies the prefix costs one more each."""
    config, vocab = engine.model.config, engine.model.config.vocab_size
    engine.prefill(engine.parse(_ids(prefix_tokens + TAIL, 99, vocab)))  # warm: the allocator's and the model's first use
    prefix = _ids(prefix_tokens, 7, vocab)
    copy = prefix_tokens * sum(config.kv_elements(i) for i in config.attention_layers()) * engine.model.dtype.itemsize
    before, pool_before = _rss(), engine.cache.private.nbytes
    engine.prefill(engine.parse(prefix + _ids(TAIL, 0, vocab)))
    prefills = [engine.prefill(engine.parse(prefix + _ids(TAIL, 100 + r, vocab))) for r in range(concurrent)]
    states = [p.state for p in prefills]
    for state in states:
        state.reserve(state.length + 1)
    decode_batch(engine.model, states, [int(p.logits.argmax()) for p in prefills])
    assert all(p.stats.prefix_hit_tokens == prefix_tokens for p in prefills)
    grown, pool = _rss() - before, engine.cache.private.nbytes - pool_before
    own = concurrent * engine.state_bytes(TAIL + 1)
    return {"prefix_tokens": prefix_tokens, "concurrent": concurrent, "one_copy_bytes": copy,
            "rss_growth_bytes": grown, "own_state_bytes": own, "private_pool_growth_bytes": pool,
            "copies_held": (grown - own - (pool - copy)) / copy}


def decode_steps(args: argparse.Namespace) -> dict[str, Any]:
    """Median seconds of one batched decode step of ``args.concurrent`` requests resumed from one
    ``args.prefix``-token prefix (attention reads the shared pages), and of the same requests each
    owning a copy of it, after --warm steps."""
    engine = _engine(args)
    vocab = engine.model.config.vocab_size
    prefix = _ids(args.prefix, 7, vocab)
    engine.prefill(engine.parse(prefix + _ids(TAIL, 0, vocab)))
    rows = {}
    for label, mode in (("resumed", "hypic"), ("own copy", "full")):
        prefills = [engine.prefill(engine.parse(prefix + _ids(TAIL, 100 + r, vocab)), mode) for r in range(args.concurrent)]
        assert all((p.stats.prefix_hit_tokens == args.prefix) == (mode == "hypic") for p in prefills)
        states, times = [p.state for p in prefills], []
        for state in states:
            state.reserve(state.length + args.steps + args.warm)
        for step in range(args.steps + args.warm):
            start = time.perf_counter()
            decode_batch(engine.model, states, [5] * len(states))
            times.append(time.perf_counter() - start)
        rows[label] = {"step_ms": 1e3 * statistics.median(times[args.warm:]), "step_ms_all": [1e3 * t for t in times[args.warm:]]}
    return {"prefix_tokens": args.prefix, "concurrent": args.concurrent, **rows,
            "resumed_over_own_copy": rows["resumed"]["step_ms"] / rows["own copy"]["step_ms"]}


def _child(args: argparse.Namespace) -> dict[str, Any]:
    """The memory part in a fresh process with large blocks mapped (and unmapped) one by one."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
    command = [sys.executable, __file__, "--part", "memory-child", "--prefix", str(args.prefix), "--concurrent",
               str(args.concurrent), "--model", args.model, "--threads", str(args.threads)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["cost", "memory", "decode", "all", "memory-child"], default="all")
    parser.add_argument("--model", default="default", help="checkpoint directory (default: the shipped model)")
    parser.add_argument("--lengths", type=int, nargs=2, default=[1024, 7936], help="prefix lengths of the cost part")
    parser.add_argument("--repeats", type=int, default=7, help="timed hits per length (after one warm-up)")
    parser.add_argument("--prefix", type=int, default=4096, help="prefix tokens of the memory part")
    parser.add_argument("--concurrent", type=int, default=16, help="requests holding states at once")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps of the decode part")
    parser.add_argument("--warm", type=int, default=2, help="untimed decode steps before them")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.part == "memory-child":
        print(json.dumps(concurrent_memory(_engine(args), args.prefix, args.concurrent)))
        return
    result: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
                              "torch": torch.__version__}
    if args.part in ("cost", "all"):
        result["cost"] = resume_cost(args)
    if args.part in ("memory", "all"):
        result["memory"] = _child(args)
    if args.part in ("decode", "all"):
        result["decode"] = decode_steps(args)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
