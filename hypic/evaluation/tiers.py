"""``hypic eval tiers``: what the public pool's lower tiers buy (the disk, Mooncake, host memory), in process.

Three parts, each one run on this machine, ratios taken within the run:

- ``latency``: the time to load one document's entry (1k tokens by default) from each tier, read +
  checksum + decode, median of ``--repeats``, and the rate (GB/s) it comes to: memory (a dictionary hit, the baseline), the disk with
  the file in the page cache, the disk with the file dropped from it (``posix_fadvise``), and
  Mooncake (with ``--mooncake``: a master started here on loopback). For the shipped model (a real
  entry) and for Qwen3.5-35B-A3B's shapes (random tensors of its entry's shapes: 30 Gated DeltaNet
  layers' T_C and S_C|0, 10 attention layers' KV). Beside it: rebuilding the document (the shipped
  model only).
- ``restart``: time to the first hit after a restart: ``--restart-docs`` documents warmed into a
  disk tier, the engine closed, a new one started on the directory, and one request over all of
  them in a new order; against a restart without the tier (the same request, every document cold).
- ``capacity``: hit rate and p50/p90 TTFT of a Prod-RAG trace (Zipf-popular documents, four per
  request, sequential) as the document set grows from ``--fractions`` x what the public pool holds
  (``--memory-docs`` documents' worth): memory only vs memory + disk (vs + Mooncake), each with
  ``--eviction lru`` and ``cost``. The private pool is off, so every reuse is a document's.
- ``conversation`` (with ``--mooncake``): a chat of ``--turns`` turns (a system prompt, then each
  turn the whole history, a new user message of ``--turn-words`` words and ``--turn-tokens``
  greedy output tokens) where every turn lands on a server that has not seen the conversation (the
  private pool emptied before each turn, as behind a load balancer that does not stick): with the
  private pool's resume points in Mooncake the turn resumes where the previous one ended; without
  them it is recomputed; the same server keeping its memory is the reference. Also the bytes put
  in Mooncake against the size of the states resumed (a turn writes only its new KV chunks).

Writes ``OUT/tiers.jsonl`` (every measurement), ``OUT/tiers_summary.json`` and ``OUT/tiers.png``,
and prints the tables. Timings on a shared CPU box are indicative; the ratios are the result.
"""
import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hypic import Engine
from hypic.cache.composition import Family, Transition
from hypic.models.arch import parse_config
from hypic.models.families import linear_shapes
from hypic.cache.eviction import Eviction
from hypic.cache.segments import Seams
from hypic.server.launch import free_port
from hypic.cache.store import AttentionInterior, LinearInterior, Role, SegmentEntry, entry_key
from hypic.cache.tiers.entry_file import EntryIdentity, decode_entry, encode_entry
from hypic.cache.tiers.options import TierOptions

from .studies import plain_log_ticks, pyplot, save_figure
from .trace import Trace, TraceConfig

PARTS = ("latency", "restart", "capacity", "conversation")
CAPACITY_CONFIGS = ("memory/lru", "+disk/lru", "+mooncake/lru", "memory/cost", "+disk/cost", "+mooncake/cost")
CONVERSATION_WAYS = ("another server, memory only", "another server, resume points in Mooncake", "same server")
QWEN35_SHAPES = dict(  # Qwen3.5-35B-A3B's text config: what its entry holds per layer
    model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
    full_attention_interval=4, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The tiers study's options."""
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run")
    parser.add_argument("--model", default="default", help="checkpoint directory, or default (the shipped model)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--doc-tokens", type=int, default=1024, help="tokens of the document the latency part loads")
    parser.add_argument("--shapes", nargs="+", choices=("model", "qwen3.5"), default=["model", "qwen3.5"],
                        help="the latency part's entries: the model's own, and/or Qwen3.5-35B-A3B's shapes")
    parser.add_argument("--decayed-heads", type=float, default=0.0, metavar="FRACTION",
                        help="share of the Qwen3.5-shaped entry's T_C heads decayed to zero, stored as flags")
    parser.add_argument("--repeats", type=int, default=7, help="latency and restart measurements per point (median)")
    parser.add_argument("--request-words", type=int, default=960,
                        help="mean words of a request's four documents together (the Prod-RAG trace's input length)")
    parser.add_argument("--restart-docs", type=int, default=8, help="documents warmed before the restart")
    parser.add_argument("--memory-docs", type=int, default=8, help="the public pool's budget, in mean documents")
    parser.add_argument("--pool-bytes", type=int, default=None,
                        help="the public pool's budget in bytes (default: --memory-docs mean documents' entries, sized "
                             "from the model's shapes); fix it to compare runs whose entries differ in size")
    parser.add_argument("--configs", nargs="+", choices=CAPACITY_CONFIGS, default=list(CAPACITY_CONFIGS),
                        help="the capacity part's configurations (the +mooncake ones need --mooncake)")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 1, 2, 5, 10, 20],
                        help="document-set sizes, in multiples of what the public pool holds")
    parser.add_argument("--requests", type=int, default=60, help="timed requests per capacity point")
    parser.add_argument("--warm-requests", type=int, default=30, help="untimed requests before them")
    parser.add_argument("--turns", type=int, default=8, help="turns of the conversation part's chat")
    parser.add_argument("--turn-words", type=int, default=150, help="words of each user message of that chat")
    parser.add_argument("--turn-tokens", type=int, default=32, help="greedy output tokens of each of its turns")
    parser.add_argument("--mooncake", action="store_true",
                        help="also measure Mooncake Store (a master started here on loopback)")
    parser.add_argument("--out", type=Path, default=Path("eval/runs"), help="folder of the JSONL, summary and figure")


# ----- shared helpers ---------------------------------------------------------------------------
def _timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


@contextlib.contextmanager
def _mooncake(enabled: bool, folder: Path) -> Iterator[dict[str, Any]]:
    """Tier options for a Mooncake master started here (empty if not ``enabled``)."""
    if not enabled:
        yield {}
        return
    from hypic.cache.tiers.mooncake import start_master

    master = start_master(folder / "mooncake_master.log", free_port(), free_port(), free_port(), lease_ms=200)
    try:
        yield {"mooncake_master": master.address, "mooncake_metadata": master.metadata_server,
               "mooncake_segment_bytes": 2 << 30}
    finally:
        master.stop()


def _connected(engine: Engine, timeout_s: float = 60.0) -> None:
    """Wait until every tier of ``engine`` is usable (Mooncake connects in the background)."""
    deadline = time.monotonic() + timeout_s
    while not engine.cache.tiers_ready() and time.monotonic() < deadline:
        time.sleep(0.2)


# ----- latency ----------------------------------------------------------------------------------
def _decayed(transition: torch.Tensor, fraction: float, generator: torch.Generator) -> Transition:
    """T_C [H, K, K] with each head zeroed with probability ``fraction``, those heads flagged."""
    transition[torch.rand(transition.shape[0], generator=generator) < fraction] = 0
    return Transition(Family.DENSE, transition).without_decayed()


def _qwen35_entry(tokens: int, decayed: float = 0.0) -> tuple[SegmentEntry, EntryIdentity]:
    """An entry of Qwen3.5-35B-A3B's shapes (random values; each head of T_C decayed, a flag, with
    probability ``decayed``) and the identity that decodes it."""
    config = parse_config(dict(QWEN35_SHAPES))
    seams, generator = Seams(8, 8), torch.Generator().manual_seed(0)
    length = tokens - 16
    layers = []
    for index in range(config.num_hidden_layers):
        if config.layer_types[index] == "linear_attention":
            heads, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
            layers.append(LinearInterior(_decayed(torch.randn(heads, dk, dk, generator=generator), decayed, generator),
                                         torch.randn(heads, dk, dv, generator=generator),
                                         torch.randn(config.linear_conv_kernel_dim - 1, config.linear_conv_channels,
                                                     generator=generator).bfloat16()))
        else:
            shape = (config.num_key_value_heads, length, config.head_dim)
            layers.append(AttentionInterior(torch.randn(*shape, generator=generator).bfloat16(),
                                            torch.randn(*shape, generator=generator).bfloat16()))
    ids = tuple(range(tokens))
    key = entry_key("qwen3.5-35b-a3b-shapes", seams, Role.SEGMENT, ids)
    entry = SegmentEntry(key, ids, seams, 8, length, layers)
    return entry, EntryIdentity("qwen3.5-35b-a3b-shapes", torch.bfloat16, torch.float32, config, linear_shapes(config))


def _default_entry(engine: Engine, tokens: int) -> tuple[SegmentEntry, EntryIdentity, float]:
    """A real entry of a ``tokens``-token document on ``engine``, its identity, and its build time."""
    ids = tuple((i * 7919 + 13) % (engine.model.config.vocab_size - 1) for i in range(tokens))
    policy = engine.policy("hypic")
    def rebuild() -> None:
        engine.flush()
        engine.segment_entry(ids, policy)

    build = statistics.median([_timed(rebuild) for _ in range(3)])
    entry, _ = engine.cache.lookup_document(ids, policy)
    assert entry is not None
    identity = EntryIdentity(engine.fingerprint, engine.model.dtype, engine.state_cache_dtype, engine.model.config,
                             linear_shapes(engine.model.config))
    return entry, identity, build


def _latency_records(label: str, entry: SegmentEntry, identity: EntryIdentity, folder: Path, repeats: int,
                     mooncake: dict[str, Any]) -> list[dict[str, Any]]:
    from hypic.cache.tiers.disk import DiskTier
    data = encode_entry(entry, identity)
    disk = DiskTier(folder / f"disk-{label}")
    disk.open()
    address = identity.address(entry.key, "")
    disk.write(address, data)
    path = disk.path(address)

    def from_disk(drop: bool) -> None:
        if drop:
            with path.open("rb") as handle:
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        with disk.reading(address) as buffer:
            decode_entry(buffer, identity, entry.key, entry.token_ids)

    points = {"memory": lambda: {entry.key: entry}.get(entry.key),
              "disk (page cache)": lambda: from_disk(False), "disk (dropped)": lambda: from_disk(True)}
    if mooncake:
        from hypic.cache.tiers.mooncake import MooncakeTier
        tier = MooncakeTier(mooncake["mooncake_master"], mooncake["mooncake_metadata"], 256 << 20, 512 << 20)
        with contextlib.suppress(ConnectionError):
            tier.open()
        deadline = time.monotonic() + 60
        while tier.client is None and time.monotonic() < deadline:
            time.sleep(0.2)
        tier.write(address, data)

        def from_mooncake() -> None:
            with tier.reading(address) as buffer:
                decode_entry(buffer, identity, entry.key, entry.token_ids)
        points["mooncake"] = from_mooncake
    records = []
    for tier_name, action in points.items():
        action()  # warm-up
        runs = [_timed(action) for _ in range(repeats)]
        records.append({"part": "latency", "model": label, "tier": tier_name, "entry_bytes": len(data),
                        "seconds": runs, "median_s": statistics.median(runs)})
    return records


def run_latency(args: argparse.Namespace, folder: Path, mooncake: dict[str, Any]) -> list[dict[str, Any]]:
    records = []
    if "model" in args.shapes:
        engine = Engine.from_pretrained(args.model, public_pool_bytes=None)
        entry, identity, build_s = _default_entry(engine, args.doc_tokens)
        records += _latency_records(args.model, entry, identity, folder, args.repeats, mooncake)
        records.append({"part": "latency", "model": args.model, "tier": "rebuild", "entry_bytes": entry.nbytes,
                        "seconds": [build_s], "median_s": build_s})
    if "qwen3.5" in args.shapes:
        qwen, qwen_identity = _qwen35_entry(args.doc_tokens, args.decayed_heads)
        records += _latency_records("qwen3.5-35b-a3b shapes", qwen, qwen_identity, folder, args.repeats, mooncake)
    return records


# ----- restart ----------------------------------------------------------------------------------
def run_restart(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    trace = Trace(TraceConfig(documents=args.restart_docs, docs_per_request=args.restart_docs, seed=3,
                              mean_input_words=args.request_words * args.restart_docs // 4))
    documents, sep = trace.documents, "<<PIC_SEP>>"
    prompt = sep.join(["A new system prompt after the restart.", *reversed(documents), "Question: which one?"])
    records = []
    for repeat in range(args.repeats):
        cache = folder / f"restart-{repeat}"
        first = Engine.from_pretrained(args.model, tiers=TierOptions(str(cache)))
        first.warmup(documents)
        first.close()
        for with_disk in (True, False):
            start = time.perf_counter()
            engine = Engine.from_pretrained(args.model, tiers=TierOptions(str(cache)) if with_disk else TierOptions())
            started = time.perf_counter() - start
            result = engine.generate(prompt, max_new_tokens=1)
            records.append({"part": "restart", "disk": with_disk, "repeat": repeat, "startup_s": started,
                            "ttft_s": result.ttft_s, "first_hit_s": started + result.ttft_s,
                            "segments_hit": result.segments_hit, "prompt_tokens": result.prompt_tokens})
            engine.close()
    return records


# ----- capacity ---------------------------------------------------------------------------------
def _configurations(chosen: list[str], mooncake: dict[str, Any], folder: Path) -> list[tuple[str, Eviction, dict[str, Any]]]:
    configs = []
    for eviction in Eviction:
        configs.append((f"memory/{eviction.value}", eviction, {}))
        configs.append((f"+disk/{eviction.value}", eviction, {"cache_dir": str(folder / f"capacity-{eviction.value}")}))
        if mooncake:
            configs.append((f"+mooncake/{eviction.value}", eviction, dict(mooncake)))
    return [config for config in configs if config[0] in chosen]


def _pool_budget(args: argparse.Namespace) -> int:
    """The public pool's bytes: ``--pool-bytes``, else ``--memory-docs`` mean documents' entries as the
    model's shapes size them (every T_C head counted, whether or not it decays to a flag)."""
    if args.pool_bytes is not None:
        return args.pool_bytes
    probe = Trace(TraceConfig(documents=40, seed=1, mean_input_words=args.request_words))
    engine = Engine.from_pretrained(args.model, public_pool_bytes=None)
    return int(args.memory_docs * statistics.mean(engine.entry_bytes(len(engine.tokenizer.encode(d)))
                                                  for d in probe.documents))


def run_capacity(args: argparse.Namespace, folder: Path, mooncake: dict[str, Any]) -> list[dict[str, Any]]:
    budget = _pool_budget(args)
    records = []
    for fraction in args.fractions:
        documents = max(4, round(fraction * args.memory_docs))
        trace = Trace(TraceConfig(documents=documents, seed=1, mean_input_words=args.request_words))
        prompts = trace.prompts(args.warm_requests + args.requests, 0)
        for label, eviction, options in _configurations(args.configs, mooncake, folder):
            records += _capacity_point(args, label, eviction, options, budget, fraction, documents, prompts)
    return records


def _capacity_point(args: argparse.Namespace, label: str, eviction: Eviction, options: dict[str, Any], budget: int,
                    fraction: float, documents: int, prompts: list[str]) -> list[dict[str, Any]]:
    tiers = TierOptions(**options) if options else TierOptions()
    if tiers.cache_dir is not None:
        shutil.rmtree(tiers.cache_dir, ignore_errors=True)
    engine = Engine.from_pretrained(args.model, public_pool_bytes=budget, private_pool_bytes=0, tiers=tiers,
                                    eviction=eviction)
    _connected(engine)
    if engine.cache.describe_tiers() is not None and "mooncake" in label:
        engine.flush(tiers=frozenset({"mooncake"}))
    records = []
    for index, text in enumerate(prompts):
        result = engine.generate(text, max_new_tokens=1)
        engine.cache.drain()  # a sequential replay: what was written is there for the next request
        if index >= args.warm_requests:
            pool = engine.cache.describe()["public_pool"]
            records.append({"part": "capacity", "config": label, "eviction": eviction.value, "fraction": fraction,
                            "documents": documents, "budget_bytes": budget, "ttft_s": result.ttft_s,
                            "segments_hit": result.segments_hit, "segments_missed": result.segments_missed,
                            "by_tier": result.stats.cached_tokens_by_tier, "prompt_tokens": result.prompt_tokens,
                            "pool_entries": pool["entries"], "pool_bytes": pool["bytes"]})
    engine.close()
    return records


# ----- conversation ---------------------------------------------------------------------------------
def _chat_messages(args: argparse.Namespace, seed: int) -> list[str]:
    """The system prompt and the user messages of one chat."""
    trace = Trace(TraceConfig(documents=args.turns + 1, docs_per_request=1, seed=seed,
                              mean_input_words=args.turn_words))
    return ["You are a helpful assistant. Answer briefly. " + trace.documents[0],
            *(f" User: {d} Assistant:" for d in trace.documents[1:])]


def _conversation_engine(args: argparse.Namespace, way: str, mooncake: dict[str, Any]) -> Engine:
    tiers = TierOptions(**mooncake) if "Mooncake" in way else TierOptions()
    engine = Engine.from_pretrained(args.model, tiers=tiers)
    _connected(engine)
    if "Mooncake" in way:
        engine.flush(tiers=frozenset({"mooncake"}))
    return engine


def _chat(args: argparse.Namespace, engine: Engine, way: str, repeat: int) -> list[dict[str, Any]]:
    """One chat's turns on ``engine``, each after emptying its memory unless ``way`` keeps it."""
    records, history = [], []
    for turn, message in enumerate(_chat_messages(args, 100 + repeat)):
        history += engine.tokenizer.encode(message)
        if way != "same server":
            engine.flush()
        written = _shared_bytes(engine)
        result = engine.generate(list(history), max_new_tokens=args.turn_tokens, ignore_eos=True)
        engine.cache.drain()  # the next turn comes after this one's resume point is stored
        records.append({"part": "conversation", "way": way, "repeat": repeat, "turn": turn,
                        "prompt_tokens": result.prompt_tokens, "ttft_s": result.ttft_s,
                        "prefix_hit_tokens": result.stats.prefix_hit_tokens,
                        "by_tier": result.stats.cached_tokens_by_tier,
                        "mooncake_written_bytes": _shared_bytes(engine) - written,
                        "state_bytes": engine.state_bytes(result.prompt_tokens + args.turn_tokens - 1)})
        history += result.output_ids
    return records


def _shared_bytes(engine: Engine) -> int:
    """Bytes of resume points ``engine`` has put in Mooncake so far."""
    resume = engine.cache.describe()["resume_points"]
    shared = resume["tiers"].get("mooncake") if resume is not None else None
    return shared["written_bytes"] if shared is not None else 0


def run_conversation(args: argparse.Namespace, mooncake: dict[str, Any]) -> list[dict[str, Any]]:
    if not mooncake:
        print("the conversation part needs --mooncake: skipped", file=sys.stderr)
        return []
    records = []
    for way in CONVERSATION_WAYS:
        engine = _conversation_engine(args, way, mooncake)
        for repeat in range(args.repeats):
            records += _chat(args, engine, way, repeat)
        engine.close()
    return records


# ----- summary and report -----------------------------------------------------------------------
def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    latency = [r for r in records if r["part"] == "latency"]
    if latency:
        summary["latency"] = {f"{r['model']} | {r['tier']}": _latency_row(r) for r in latency}
    restart = [r for r in records if r["part"] == "restart"]
    if restart:
        summary["restart"] = {("with disk" if disk else "without disk"): {
            "first_hit_s": statistics.median([r["first_hit_s"] for r in restart if r["disk"] == disk]),
            "startup_s": statistics.median([r["startup_s"] for r in restart if r["disk"] == disk]),
            "ttft_s": statistics.median([r["ttft_s"] for r in restart if r["disk"] == disk]),
            "segments_hit": min(r["segments_hit"] for r in restart if r["disk"] == disk)} for disk in (True, False)}
    capacity = [r for r in records if r["part"] == "capacity"]
    if capacity:
        points: dict[str, dict[str, Any]] = {}
        for config in dict.fromkeys(r["config"] for r in capacity):
            for fraction in sorted({r["fraction"] for r in capacity}):
                chosen = [r for r in capacity if r["config"] == config and r["fraction"] == fraction]
                hits = sum(r["segments_hit"] for r in chosen)
                ttfts = sorted(r["ttft_s"] for r in chosen)
                points[f"{config} @ {fraction:g}x"] = {
                    "hit_rate": hits / max(1, hits + sum(r["segments_missed"] for r in chosen)),
                    "p50_ttft_s": ttfts[len(ttfts) // 2], "p90_ttft_s": ttfts[int(0.9 * (len(ttfts) - 1))],
                    "requests": len(chosen)}
        summary["capacity"] = points
    chats = [r for r in records if r["part"] == "conversation"]
    conversation = [r for r in chats if r["turn"] > 0]  # TTFT and reuse: the turns that can resume
    if conversation:
        summary["conversation"] = {way: {
            "median_ttft_s": statistics.median(r["ttft_s"] for r in conversation if r["way"] == way),
            "resumed_fraction": sum(r["prefix_hit_tokens"] for r in conversation if r["way"] == way)
                                / sum(r["prompt_tokens"] for r in conversation if r["way"] == way),
            "mooncake_written_mb": sum(r["mooncake_written_bytes"] for r in chats if r["way"] == way) / 2**20,
            "resume_states_mb": sum(r["state_bytes"] for r in chats if r["way"] == way) / 2**20,
            "turns": sum(1 for r in conversation if r["way"] == way)} for way in CONVERSATION_WAYS}
    return summary


def _latency_row(record: dict[str, Any]) -> dict[str, float]:
    """Median load time, the entry's size, and the rate it loads at (GB/s: 1e9 bytes a second; for
    ``rebuild`` the rate the document's prefill makes its entry at)."""
    median = record["median_s"]
    row = {"median_ms": 1000 * median, "entry_mb": record["entry_bytes"] / 2**20}
    if record["tier"] != "memory":  # a dictionary hit moves no bytes
        row["gb_per_s"] = record["entry_bytes"] / median / 1e9
    return row


def format_summary(summary: dict[str, Any]) -> str:
    lines = []
    for name, rows in summary.items():
        lines.append(f"\n{name}")
        for label, values in rows.items():
            lines.append(f"  {label:<44} " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                     for k, v in values.items()))
    return "\n".join(lines)


def figure(summary: dict[str, Any], path: Path) -> None:
    capacity = summary.get("capacity")
    if not capacity:
        return
    plt = pyplot()
    fig, (hits, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    configs = dict.fromkeys(label.split(" @ ")[0] for label in capacity)
    for config in configs:
        points = sorted((float(label.split(" @ ")[1].rstrip("x")), values) for label, values in capacity.items()
                        if label.startswith(config + " @"))
        xs = [x for x, _ in points]
        hits.plot(xs, [v["hit_rate"] for _, v in points], marker="o", label=config)
        ttft.plot(xs, [v["p50_ttft_s"] for _, v in points], marker="o", label=config)
    for axis, title in ((hits, "document hit rate"), (ttft, "p50 TTFT (s)")):
        axis.set_xscale("log")
        plain_log_ticks(axis.xaxis)
        axis.set_xlabel("document set / public pool")
        axis.set_title(title)
    hits.legend(fontsize=7)
    save_figure(fig, path)


def run_tiers(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hypic-tiers-") as scratch, _mooncake(args.mooncake, Path(scratch)) as mooncake:
        folder = Path(scratch)
        if "latency" in args.parts:
            records += run_latency(args, folder, mooncake)
        if "restart" in args.parts:
            records += run_restart(args, folder)
        if "capacity" in args.parts:
            records += run_capacity(args, folder, mooncake)
        if "conversation" in args.parts:
            records += run_conversation(args, mooncake)
    with (args.out / "tiers.jsonl").open("w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    summary = summarize(records)
    summary["machine"] = {"cpu": _cpu_name(), "threads": args.threads, "torch": torch.__version__}
    (args.out / "tiers_summary.json").write_text(json.dumps(summary, indent=1))
    figure(summary, args.out / "tiers.png")
    print(format_summary({k: v for k, v in summary.items() if k != "machine"}), file=sys.stdout)
    return summary


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"
