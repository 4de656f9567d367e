"""``hypic`` command line: serve over HTTP, or generate from the shell, with position-independent caching."""
import argparse
import contextlib
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from . import DEFAULT_SEPARATOR, Engine, HypicError
from .cpus import allowed_cpus, physical_cores
from .errors import CheckpointError, as_written
from .evaluation.cli import add_eval_parser, eval_main
from .cache.eviction import Eviction
from .cache.modes import Mode
from .cache.tiers.hierarchy import PrefetchPolicy, WritePolicy
from .cache.tiers.options import DEFAULT_SEGMENT_BYTES, TierOptions
from .cluster.routing import POLICIES as ROUTER_POLICIES

RANDOM_MODEL_SEED = 0


def random_model_path() -> Path:
    """A deterministic random Qwen3.5-architecture model, written once to the user's cache.
    It produces meaningless text: it exists so that HYPIC runs before a trained model is shipped."""
    from .loading.checkpoints import write_random_checkpoint

    path = Path(os.environ.get("HYPIC_CACHE", Path.home() / ".cache" / "hypic")) / f"random-qwen3_5-seed{RANDOM_MODEL_SEED}"
    if not (path / "tokenizer.json").is_file():
        write_random_checkpoint(path, "qwen3_5_text", RANDOM_MODEL_SEED, hidden_size=128, num_hidden_layers=8)
    return path


@dataclass(frozen=True)
class ModelChoice:
    """Which checkpoint to load, and how to describe it to clients."""

    path: Path
    name: str
    description: str
    random_weights: bool


def choose_model(model: str | None) -> ModelChoice:
    """``--model`` if given; else the shipped default model; else (package built without it) the
    deterministic random model, labelled as such."""
    if model is not None:
        return ModelChoice(Path(model), Path(model).name or "model", f"checkpoint at {model}", False)
    try:
        from .loading.default_model import default_model_path

        return ModelChoice(default_model_path(), "hypic-default", "HYPIC's own small Qwen3.5-architecture model "
                           "trained on synthetic multi-document QA", False)
    except CheckpointError:
        return ModelChoice(random_model_path(), "hypic-random-qwen3_5", "RANDOM WEIGHTS: a deterministic random "
                           "Qwen3.5-architecture model (it produces meaningless text; pass --model for a real one)", True)


SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int | None:
    """'512M', '2G', '300000' -> bytes; 'none' -> None (unbounded)."""
    if text.strip().lower() in ("none", "unlimited"):
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {as_written(text)} (examples: 300000, 512M, 2G, none)")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).upper()])


def port_number(text: str) -> int:
    """``--port``: a TCP port, 1..65535."""
    port = _integer(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 1..65535, got {text}")
    return port


def positive(text: str) -> int:
    """A count of at least 1 (``--threads``)."""
    return _at_least(1, text)


def positive_float(text: str) -> float:
    """A number of seconds above 0 (``--ttft-slo``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {as_written(text)}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative(text: str) -> int:
    """A count that may be 0 (``--seam-width``)."""
    return _at_least(0, text)


def _at_least(least: int, text: str) -> int:
    count = _integer(text)
    if count < least:
        raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text}")
    return count


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {as_written(text)}") from None


class _Parser(argparse.ArgumentParser):
    """Reports a bad command line in one line that says where to look, not under the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class MachineShare(int):
    """``--max-state-memory auto``: bytes that are a share of the machine's memory, divided among the
    replicas that run on it once their count is known (``_check_memory``)."""


STATE_MEMORY_SHARE = 0.4  # of the machine's physical memory, for --max-state-memory auto


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def state_memory(text: str) -> int | None:
    """``--max-state-memory``: a size, none, or auto (40 % of the machine's physical memory)."""
    if text.strip().lower() == "auto":
        return MachineShare(STATE_MEMORY_SHARE * physical_memory())
    return parse_size(text)


def _model_options(parser: argparse.ArgumentParser, threads_default: str) -> None:
    parser.add_argument("--model", help="local HF checkpoint directory (default: the model shipped with hypic)")
    parser.add_argument("--mode", type=Mode, choices=list(Mode), default=Mode.HYPIC,
                        help="reuse strategy: hypic (segments + prefix cache), prefix (prefix cache only), "
                             "naive (segments without transitions: the baseline), full (no reuse) (default: hypic)")
    parser.add_argument("--seam-width", type=non_negative, default=8, help="tokens recomputed at each segment end (default: 8)")
    parser.add_argument("--pic-separator", default=DEFAULT_SEPARATOR, help=f"segment separator (default: {DEFAULT_SEPARATOR})")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weight dtype; auto: the checkpoint's, except half precision on a CPU that does not "
                             "multiply it natively, which runs in float32 (default: auto). Linear-attention "
                             "states and T_C are float32 in every case")
    parser.add_argument("--threads", type=positive, default=None,
                        help=f"torch CPU threads (of each rank with --tp-size; default: {threads_default})")
    parser.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=positive, default=1,
                        help="tensor-parallel ranks: the model's heads and widths are split over this many "
                             "processes (gloo on the CPU, with --threads torch threads each, default 1; NCCL on "
                             "GPUs 0..N-1 with --device cuda), each holding 1/N of the weights and of every cache, "
                             "with the pool sizes given here each; N must divide the model's head counts. hypic "
                             "serve starts ranks 1..N-1 itself and keeps them in step with its scheduler; a rank "
                             "that dies stops the server; not combined with --workers (default: 1)")
    parser.add_argument("--state-cache-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="precision of the cached T_C and S_C|0 in the public pool (composition computes in "
                             "float32 either way; bfloat16 halves their bytes) (default: float32)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hypic", description="Position-independent caching for hybrid-attention LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="prefill a prompt (separators mark reusable segments) and decode",
                              description="Generate from PROMPT. Parts between separators are PIC segments: "
                                          f"'system {DEFAULT_SEPARATOR} doc1 {DEFAULT_SEPARATOR} doc2 {DEFAULT_SEPARATOR} "
                                          "question'. The first request a process runs is slow (weights paged in, "
                                          "kernels and allocators set up): generate runs a throwaway warm-up first and "
                                          "reports its time apart, so the timings shown are the prompts' own.")
    add_eval_parser(commands)
    gen.add_argument("prompt", nargs="+", help="one or more prompts, run in order on one engine (later ones reuse the cache)")
    _model_options(gen, "the physical cores this process may run on, split between the ranks")
    gen.add_argument("--max-new-tokens", type=non_negative, default=16, help="tokens to generate (default: 16)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    serve = commands.add_parser("serve", help="run the HTTP server (SGLang /generate and OpenAI-compatible APIs)",
                                description="Serve a hybrid model over HTTP with position-independent caching. "
                                            "Endpoints: /generate, /v1/completions, /v1/chat/completions, /v1/models, "
                                            "/tokenize, /detokenize, /warmup, /health, /get_model_info, "
                                            "/get_server_info (/server_info), /flush_cache, /metrics. The first "
                                            "request after a start is slower than the rest (weights paged in, "
                                            "kernels and allocators set up): time the second one.")
    _model_options(serve, "torch's choice, 1 per rank")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=port_number, default=30000, help="port, 1..65535 (default: 30000)")
    serve.add_argument("--public-pool-size", type=parse_size, default=parse_size("2G"),
                       help="byte budget of the public pool of cached documents, e.g. 512M, 2G, none (default: 2G)")
    serve.add_argument("--private-pool-size", type=parse_size, default=parse_size("2G"),
                       help="byte budget of the private pool (prefix cache of request states) (default: 2G)")
    serve.add_argument("--private-window-pool-size", type=parse_size, default=None,
                       help="byte budget, within the private pool, of the sliding-window layers' tails kept at resume "
                            "points (models with sliding-window attention); over it the least recently used resume "
                            "points lose their tails and stop being hits (default: no separate limit)")
    serve.add_argument("--max-running-requests", type=int, default=64, help="requests decoding at once (default: 64)")
    serve.add_argument("--max-queued-requests", type=positive, default=256,
                       help="requests that may wait for a start; more are answered 503 (default: 256)")
    serve.add_argument("--max-state-memory", type=state_memory, default="auto",
                       help="memory the states of running and prefilling requests may take together (KV of the "
                            "prompt, shared by its samples, plus max_new_tokens and linear states per sample); a "
                            "request starts only when it fits, "
                            "e.g. 8G, none; auto: 40%% of the machine's memory (with --dp-size on this machine, shared by the "
                            "replicas) (default: auto)")
    serve.add_argument("--chunked-prefill-size", type=int, default=1024,
                       help="most prefill tokens run between two decode steps (a chunk of one long prompt, or the "
                            "passes of several requests together), so long prompts do not stall running requests "
                            "(default: 1024)")
    serve.add_argument("--max-prefill-batch", type=int, default=None,
                       help="most requests whose prefill passes run through the model together in one step, "
                            "within --chunked-prefill-size tokens; 1: one at a time (default: 16 on a GPU, 1 on a "
                            "CPU, where prefill is compute-bound and batching measured no gain: "
                            "eval/results/batched_prefill.md)")
    serve.add_argument("--watchdog-timeout", type=float, default=300.0,
                       help="seconds the engine loop may spend in one step; past it the server tells every waiting "
                            "client why and exits non-zero (a --dp-size replica is replaced), instead of hanging "
                            "on a stuck kernel or a tensor-parallel rank that never answers; raise it where one "
                            "--chunked-prefill-size chunk can take longer (a large model on a CPU); 0: no watchdog "
                            "(default: 300)")
    serve.add_argument("--snapshot-interval", type=non_negative, default=None,
                       help="keep the linear layers' states (sliding-window layers' last window) every this many "
                            "prompt tokens in the private pool, so prompts sharing a long plain prefix (a system "
                            "prompt, a chat history) resume from it; 0: only at document edges and before each "
                            "prompt's last token (default: 256; for sliding-window models, the tokens whose "
                            "full-attention KV costs what one resume point's window tails cost, e.g. 1280 for "
                            "MiMo-V2-Flash)")
    serve.add_argument("--max-segments", type=int, default=256, help="most PIC segments in one prompt (default: 256)")
    serve.add_argument("--workers", type=int, default=1,
                       help="engines prefilling a request's cold documents in parallel: this process and N-1 Ray "
                            "worker processes (the CPU threads are split between them; --threads sets each one's); "
                            "1: no Ray (default: 1)")
    serve.add_argument("--ray-address", help="join this Ray cluster for the workers or the replicas instead of starting "
                                              "a local one")
    serve.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=positive, default=1,
                       help="data-parallel replicas: N whole instances (each its own pools, tiers, scheduler and "
                            "decode; with --tp-size M each a group of M ranks) served as one on Ray Serve, a request "
                            "routed to the replica that holds its documents (--router-policy); --threads and the "
                            "pool sizes are per replica; 1: no Ray (default: 1)")
    serve.add_argument("--ingress-replicas", type=positive, default=1,
                       help="with --dp-size: ingresses serving --host:--port together (the kernel spreads the "
                            "connections), each following every replica's holdings; one killed costs only the "
                            "requests it held, and Ray Serve restarts it (default: 1)")
    serve.add_argument("--allow-cpu-oversubscription", action="store_true",
                       help="with --dp-size on this machine alone: start even if the replicas' threads (--dp-size x "
                            "--threads x --tp-size) outnumber the CPUs this process may use (each then computes "
                            "slower; refused otherwise)")
    serve.add_argument("--ttft-slo", type=positive_float, default=None,
                       help="with --dp-size: refuse at once (503 with retry-after) a request every replica is predicted "
                            "to give its first token later than this many seconds (the prefill queued on it and its "
                            "own at the prefill rate each replica measured, and its decode steps meanwhile), instead of "
                            "letting it wait in a queue; "
                            "counted in /metrics (hypic_refused_for_slo_total) (default: none)")
    serve.add_argument("--tbt-slo", type=positive_float, default=None,
                       help="with --dp-size: refuse at once (503 with retry-after) a request no replica is predicted to "
                            "decode with at most this many seconds between two tokens (its decode step as measured, "
                            "and the prefill chunk its loop runs between two steps while prefill is queued there); "
                            "with --ttft-slo, a replica must meet both (default: none)")
    serve.add_argument("--router-policy", choices=ROUTER_POLICIES, default="cache_aware",
                       help="how --dp-size routes a request: cache_aware = the replica with the fewest tokens to "
                            "prefill given the documents and prefix it holds, plus its queued work, skipping one far "
                            "above the mean; ttft = the replica predicted to give the first token soonest, in seconds "
                            "at the rates each replica measures (prefill, decode step, fetch from another replica), "
                            "cache_aware until the first rate is measured; prefix = by the leading prefix only (what "
                            "other routers do); "
                            "round_robin; power_of_two = the less loaded of two at random (default: cache_aware)")
    serve.add_argument("--transfer", choices=["torch", "ray"], default="torch",
                       help="how documents' cache entries travel between workers: torch = point-to-point over "
                            "torch.distributed (gloo), rebuilt without a lost worker; ray = Ray's object store "
                            "(default: torch)")
    serve.add_argument("--worker-timeout", type=float, default=300.0,
                       help="seconds a worker may take to answer any call (build or ship a request's documents, "
                            "report what it holds, combine a request) before it is declared lost and killed; a "
                            "request whose peer work takes longer is prefilled here; with --dp-size, the longest a request's "
                            "replica may stay silent (it sends a keepalive every 2 s) before the request is retried "
                            "elsewhere or failed, and the longest it waits for documents other replicas build for "
                            "it before it builds them itself (default: 300)")
    serve.add_argument("--served-model-name", help="model name reported to OpenAI clients (default: from the model)")
    _tier_options(serve)
    access = serve.add_argument_group("access and limits")
    access.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health (repeatable; also "
                             "read from $HYPIC_API_KEY). Keys are compared in constant time and never logged; a "
                             "key on the command line is visible to other local users, --api-key-file is not")
    access.add_argument("--api-key-file", action="append", default=[], metavar="FILE",
                        help="a file of API keys, one per line (# comments and blank lines skipped) (repeatable)")
    access.add_argument("--isolate-by-key", action="store_true",
                        help="each API key is its own cache namespace: documents and prompt prefixes one key's "
                             "requests cached are never reused for another's, and a request for them takes the cold "
                             "path (needs --api-key). Without it, requests share the cache unless they name a "
                             "cache_salt")
    access.add_argument("--max-request-bytes", type=parse_size, default=parse_size("32M"),
                        help="largest request body; a larger one is answered 413 (default: 32M)")
    access.add_argument("--max-concurrent-per-key", type=int, default=None,
                        help="POST requests one API key (or, without keys, all clients) may have in flight, streams "
                             "until their last chunk; more are answered 429 with Retry-After (default: no limit)")
    access.add_argument("--max-warmup-documents", type=int, default=256,
                        help="most documents in one /warmup call (default: 256)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn log level (default: info)")
    return parser


def _tier_options(serve: argparse.ArgumentParser) -> None:
    tiers = serve.add_argument_group("cache tiers (below the public pool's memory; default: none)")
    tiers.add_argument("--host-cache-size", type=parse_size, default=None,
                       help="with --device cuda: host memory that keeps documents the GPU's public pool evicts (L2), "
                            "moved back to the GPU when reused, their copy started as the request arrives, e.g. "
                            "64G (default: off; refused on a CPU server, whose pool already is host memory)")
    tiers.add_argument("--cache-dir", metavar="DIR",
                       help="keep documents' cache entries as files in DIR (created if missing): a restarted server, "
                            "or another one with the same model, dtype and seam width on DIR, serves them as hits; "
                            "the private pool keeps its resume points there too (each request's end, each system "
                            "prompt's), so conversations resume after a restart; a damaged or foreign file is a "
                            "miss, deleted (default: off)")
    tiers.add_argument("--disk-cache-size", type=parse_size, default=parse_size("16G"),
                       help="byte budget of --cache-dir; over it the least recently used files are deleted, e.g. 2G, "
                            "none (default: 16G)")
    tiers.add_argument("--mooncake-master", metavar="HOST:PORT",
                       help="share documents' cache entries, and the private pool's resume points (so a "
                            "conversation continues on any server), with every server on this Mooncake Store master "
                            "(needs the mooncake-transfer-engine package; a master that is down is reported in "
                            "/get_server_info and retried, never fatal) (default: off)")
    tiers.add_argument("--mooncake-metadata-server", metavar="URL",
                       help="the Mooncake metadata server (default: http://HOST:8080/metadata, the master's own "
                            "when it runs with --enable_http_metadata_server)")
    tiers.add_argument("--eviction", choices=[e.value for e in Eviction], default="lru",
                       help="which document memory gives up first when the public pool is full: lru = the least "
                            "recently used; cost = the one whose rebuild work per byte held is lowest, aged by "
                            "disuse (GreedyDual; keeps long documents over short ones) (default: lru)")
    tiers.add_argument("--mooncake-segment-size", type=parse_size, default=parse_size("1G"),
                       help="memory this server lends the Mooncake store for everyone's entries (default: 1G)")
    tiers.add_argument("--prefetch-policy", choices=[p.value for p in PrefetchPolicy], default="timeout",
                       help="a request's documents start loading from disk/Mooncake when it arrives; the scheduler "
                            "holds the request back meanwhile (serving the others): best_effort = not at all (what "
                            "is not loaded yet is rebuilt); "
                            "wait_complete = until every load is done; timeout = up to 0.2 s plus 1 s per 200 MB "
                            "to load (default: timeout)")
    tiers.add_argument("--write-policy", choices=[p.value for p in WritePolicy], default="write_through",
                       help="when a document's entry, or a private-pool resume point, is written below memory, in "
                            "the background: write_through = when it is built (a request's end); "
                            "write_through_selective = when it is first reused; write_back = when memory evicts it "
                            "or the server stops gracefully (default: write_through)")


def _tiers(args: argparse.Namespace) -> TierOptions:
    host = getattr(args, "host_cache_size", None)
    if host is not None and not args.device.startswith("cuda"):
        raise HypicError("--host-cache-size keeps a GPU's evicted documents in host memory; on a CPU server the "
                         "public pool already is host memory: raise --public-pool-size instead")
    if args.mooncake_master is not None and not re.fullmatch(r"[^:\s]+:\d+", args.mooncake_master):
        raise HypicError(f"--mooncake-master must be HOST:PORT, got {as_written(args.mooncake_master)}")
    return TierOptions(args.cache_dir, args.disk_cache_size, args.mooncake_master, args.mooncake_metadata_server,
                       args.mooncake_segment_size or DEFAULT_SEGMENT_BYTES, WritePolicy(args.write_policy),
                       PrefetchPolicy(args.prefetch_policy), host)


def _model_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``Engine.from_pretrained``'s options from the model flags."""
    return {"device": args.device, "dtype": args.dtype, "seam_width": args.seam_width,
            "pic_separator": args.pic_separator, "state_cache_dtype": args.state_cache_dtype}


def _engine(args: argparse.Namespace, choice: ModelChoice, **options: Any) -> Engine:
    if args.threads:
        torch.set_num_threads(args.threads)
    return Engine.from_pretrained(choice.path, **_model_settings(args), **options)


@dataclass
class Instance:
    """One serving instance: its engine, the loop that drives it, what it says about itself, and
    the processes it started (tensor-parallel ranks, Ray workers)."""

    engine: Engine
    loop: Any
    info: Any
    choice: ModelChoice
    group: Any = None
    peers: Any = None

    def close(self) -> None:
        self.loop.stop()  # with ranks: the stop is broadcast to them
        self.engine.close()  # the lower tiers' pending writes (write_back: memory's entries) finish
        if self.group is not None:
            self.group.close()
        if self.peers is not None:
            self.peers.shutdown()


def check_serve_args(args: argparse.Namespace) -> None:
    """Refuse a bad ``hypic serve`` command line, naming the flag, before anything starts."""
    for name in ("max_running_requests", "max_segments", "chunked_prefill_size", "max_warmup_documents",
                 "max_prefill_batch"):
        if getattr(args, name) < 1:
            raise HypicError(f"--{name.replace('_', '-')} must be >= 1")
    if args.workers < 1:
        raise HypicError("--workers must be >= 1")
    if args.watchdog_timeout < 0:
        raise HypicError("--watchdog-timeout must be >= 0 (0: no watchdog)")
    if args.tp_size > 1 and args.workers > 1:
        raise HypicError("--tp-size above 1 with --workers above 1 is not served: each peer worker would need its "
                         "own group of tensor-parallel ranks, and the documents it builds would have to travel shard "
                         "by shard to the matching rank here; use one or the other")
    _check_cpus(args)
    _check_memory(args)
    if args.ingress_replicas > 1 and args.dp_size == 1:
        raise HypicError("--ingress-replicas above 1 needs --dp-size above 1: one instance is its own ingress")
    for name, value in (("--ttft-slo", args.ttft_slo), ("--tbt-slo", args.tbt_slo)):
        if value is not None and args.dp_size == 1:
            raise HypicError(f"{name} needs --dp-size above 1: it refuses a request when every replica is too busy")
    if args.dp_size > 1 and args.workers > 1:
        raise HypicError("--dp-size above 1 with --workers above 1 is not served: replicas already build each "
                         "other's documents; use --dp-size")
    check_device(args.device, args.tp_size)


def _check_cpus(args: argparse.Namespace) -> None:
    """Refuse replicas on this machine alone whose threads outnumber its CPUs (they would share
    cores and each run slower than one instance), unless asked to start anyway."""
    if args.dp_size == 1 or args.ray_address is not None or args.allow_cpu_oversubscription:
        return
    threads, cpus = args.dp_size * (args.threads or 1) * args.tp_size, len(allowed_cpus())
    if threads > cpus:
        raise HypicError(f"--dp-size {args.dp_size} x --threads {args.threads or 1} x --tp-size {args.tp_size} = "
                         f"{threads} threads on {cpus} CPU(s): lower one of them, join a Ray cluster "
                         "(--ray-address), or pass --allow-cpu-oversubscription")


def _check_memory(args: argparse.Namespace, machine: int | None = None) -> None:
    """With replicas on this machine alone, ``--max-state-memory auto`` is their share together (and
    no more than what their pools leave of the machine), each replica taking its part; budgets that
    together pass the machine's memory are refused (a replica would be killed for memory before its
    pools filled)."""
    here = args.dp_size if args.dp_size > 1 and args.ray_address is None else 1
    machine = physical_memory() if machine is None else machine
    pools = sum(b for b in (args.public_pool_size, args.private_pool_size) if b is not None)
    if isinstance(args.max_state_memory, MachineShare):
        share = min(int(STATE_MEMORY_SHARE * machine), machine - here * pools)
        args.max_state_memory = MachineShare(max(0, share) // here)
    total = here * (pools + (args.max_state_memory or 0))
    if here > 1 and (total > machine or args.max_state_memory == 0):
        raise HypicError(f"--dp-size {here} x (--public-pool-size {_size(args.public_pool_size)} + --private-pool-size "
                         f"{_size(args.private_pool_size)} + --max-state-memory {_size(args.max_state_memory)}) is "
                         f"more than this machine's {_size(machine)} of memory: lower them, or join a Ray cluster "
                         "(--ray-address)")


def _size(value: int | None) -> str:
    return "none" if value is None else f"{value / 2**30:.1f}G"


def check_device(device: str, tp_size: int) -> None:
    """Refuse a ``--device`` this machine lacks, or more CUDA ranks than it has GPUs (rank r runs on GPU r),
    before any model is loaded or rank started."""
    kind = device.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise HypicError(f"--device {device!r} is not served: use cpu or cuda")
    if kind == "cuda" and tp_size > torch.cuda.device_count():
        raise HypicError(f"--device cuda with --tp-size {tp_size} needs {tp_size} GPU(s), one per rank; this machine "
                         f"has {torch.cuda.device_count()}")


def start_instance(args: argparse.Namespace, on_fatal: Any = None) -> Instance:
    """The engine (with its ranks and workers) and its started loop, as ``hypic serve ARGS`` runs
    them: the whole server, or one replica of a ``--dp-size`` cluster. ``on_fatal``: told if the
    loop cannot go on (default: the process exits non-zero)."""
    from .scheduler.lockstep import leader_loop
    from .scheduler.fatal import exit_soon
    from .scheduler.loop import EngineLoop

    on_fatal = on_fatal or exit_soon
    if args.workers > 1 and not args.threads:
        args.threads = max(1, (os.cpu_count() or 1) // args.workers)
    choice = choose_model(args.model)
    if args.tp_size != 1:
        check_tp_size(choice.path, args.tp_size)  # a size the heads do not divide: refused before any rank starts
        args.threads = args.threads or 1
    serving = {"public_pool_bytes": args.public_pool_size, "private_pool_bytes": args.private_pool_size,
               "private_window_bytes": args.private_window_pool_size, "chunk_tokens": args.chunked_prefill_size,
               "snapshot_interval": args.snapshot_interval, "tiers": _tiers(args), "eviction": Eviction(args.eviction)}
    loop_options = {"mode": args.mode, "max_running": args.max_running_requests,
                    "max_queued": args.max_queued_requests, "max_state_bytes": args.max_state_memory,
                    "max_prefill_batch": args.max_prefill_batch, "watchdog_s": args.watchdog_timeout or None}
    group = _rank_group(args, choice, serving, loop_options, on_fatal) if args.tp_size > 1 else None
    try:
        engine = _engine(args, choice, **serving, **({"tp": group.tp} if group is not None else {}))
    except BaseException:
        if group is not None:
            group.kill()
        raise
    info = server_info(args, choice, engine.model.dtype, tuple(group.pids) if group is not None else ())
    peers = _peers(args, choice) if args.workers > 1 else None
    loop = (EngineLoop(engine, on_fatal=on_fatal, **loop_options) if group is None
            else leader_loop(engine, ranks=group, **loop_options))
    loop.start()
    return Instance(engine, loop, info, choice, group, peers)


def server_info(args: argparse.Namespace, choice: ModelChoice, dtype: Any, rank_pids: tuple[int, ...] = ()) -> Any:
    """What ``hypic serve ARGS`` says about itself (``/get_model_info``, ``/get_server_info``)."""
    from .server.app import ServerInfo
    from .server.chat import load_chat_template

    template, from_model = load_chat_template(choice.path)
    return ServerInfo(str(choice.path), args.served_model_name or choice.name, choice.description,
                      choice.random_weights, from_model, template, args.mode, args.seam_width, args.pic_separator,
                      args.max_segments, args.max_running_requests, args.public_pool_size, args.private_pool_size,
                      args.device, str(dtype).removeprefix("torch."), args.isolate_by_key, args.max_warmup_documents,
                      tp_size=args.tp_size, rank_pids=rank_pids)


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from .server.app import build_app
    from .scheduler.loop import default_prefill_batch
    from .heap import limit_arenas
    from .memory_trace import start_from_env

    limit_arenas()  # before the threads that would each take an arena, here and in Ray's workers
    start_from_env()
    if args.max_prefill_batch is None:
        args.max_prefill_batch = default_prefill_batch(args.device)
    check_serve_args(args)
    limits = _gate_limits(args)
    if args.dp_size > 1:
        return _serve_replicas(args, limits)
    instance = start_instance(args)
    _announce(args, instance)
    if instance.group is not None or instance.peers is not None:  # uvicorn re-raises SIGTERM after its graceful
        signal.signal(signal.SIGTERM, _stop_gracefully)  # stop: end here, the ranks or Ray stopped in turn
    try:
        uvicorn.run(build_app(instance.loop, instance.info, instance.peers, limits), host=args.host, port=args.port,
                    log_level=args.log_level)
    finally:
        instance.close()


def _serve_replicas(args: argparse.Namespace, limits: Any) -> None:
    """``--dp-size N``: N instances as one service on Ray Serve (``hypic.cluster``)."""
    from .cluster.launch import serve_cluster
    from .loading.loader import resolve_dtype

    choice = choose_model(args.model)
    if args.tp_size != 1:
        check_tp_size(choice.path, args.tp_size)
    serve_cluster(args, start_instance, limits, server_info(args, choice, resolve_dtype(args.dtype, choice.path,
                                                                                        args.device)))


def serve_application(options: dict[str, str]) -> Any:
    """The ``--dp-size`` service as a Ray Serve application, for those who deploy with Ray Serve
    themselves: ``serve run hypic.cli:serve_application args="--dp-size 2 --model DIR"`` (or the
    same import path and ``args`` in a Serve config file). ``args``: ``hypic serve``'s flags; the
    host and port are Ray Serve's."""
    from .cluster.launch import application
    from .loading.loader import resolve_dtype
    from .scheduler.loop import default_prefill_batch

    args = _parser().parse_args(["serve", *str(options.get("args", "")).split()])
    if args.max_prefill_batch is None:
        args.max_prefill_batch = default_prefill_batch(args.device)
    check_serve_args(args)
    args.threads = args.threads or 1
    choice = choose_model(args.model)
    return application(args, start_instance, _gate_limits(args),
                       server_info(args, choice, resolve_dtype(args.dtype, choice.path, args.device)))


def _announce(args: argparse.Namespace, instance: Instance) -> None:
    """What the server prints as it starts: the model, the mode, its ranks, its tiers."""
    info, group = instance.info, instance.group
    print(f"hypic: serving {info.served_model_name} ({instance.choice.description}) in {args.mode} mode "
          f"with {args.workers} worker(s) on http://{args.host}:{args.port}", flush=True)
    if group is not None:
        print(f"hypic: {args.tp_size} tensor-parallel ranks ({args.threads} thread(s) each); ranks 1..{args.tp_size - 1} "
              f"are pids {', '.join(map(str, group.pids))}", flush=True)
    status = instance.engine.cache.describe_tiers()
    if status is not None:
        names = ", ".join(f"{name} ({'ready' if tier['healthy'] else tier['error'] or tier['state']})"
                          for name, tier in status["tiers"].items())
        print(f"hypic: documents below memory: {names}; {status['write_policy']}, prefetch "
              f"{status['prefetch_policy']}", flush=True)


def _stop_gracefully(signum: int, _: Any) -> None:
    raise SystemExit(0)


def _rank_group(args: argparse.Namespace, choice: ModelChoice, serving: dict[str, Any],
                loop_options: dict[str, Any], on_failure: Any) -> Any:
    """Ranks 1..N-1 started, each loading its shard with this process's options; this process joins as rank 0.
    A rank that dies or hangs ends the server (non-zero exit status, the cause on stderr)."""
    from .scheduler.rank_group import start_ranks

    return start_ranks(args.tp_size, str(choice.path), args.threads, {**_model_settings(args), **serving},
                       loop_options, on_failure=on_failure)


def _gate_limits(args: argparse.Namespace) -> Any:
    """API keys and request limits from the command line, checked."""
    from .server.gate import GateLimits
    from .server.tenancy import ApiKeys, read_api_keys

    keys = ApiKeys.of(read_api_keys(args.api_key, args.api_key_file))
    if args.isolate_by_key and not keys.required:
        raise HypicError("--isolate-by-key needs API keys (--api-key, --api-key-file or $HYPIC_API_KEY)")
    if args.max_concurrent_per_key is not None and args.max_concurrent_per_key < 1:
        raise HypicError("--max-concurrent-per-key must be >= 1")
    if args.max_request_bytes is not None and args.max_request_bytes < 1024:
        raise HypicError("--max-request-bytes must be at least 1K")
    return GateLimits(keys, args.max_request_bytes, args.max_concurrent_per_key)


def peer_engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options of the Ray workers ``hypic serve ARGS`` starts: this process's pools and
    chunking (a worker chosen as a request's combine node keeps the head it combines early in its
    private pool, so it needs one; with none it never combined early)."""
    return {"device": args.device, "dtype": args.dtype, "pic_separator": args.pic_separator,
            "state_cache_dtype": args.state_cache_dtype, "public_pool_bytes": args.public_pool_size,
            "private_pool_bytes": args.private_pool_size, "private_window_bytes": args.private_window_pool_size,
            "chunk_tokens": args.chunked_prefill_size, "snapshot_interval": args.snapshot_interval}


def _peers(args: argparse.Namespace, choice: ModelChoice) -> Any:
    """Ray workers 1..N-1, each an engine like this process's (``hypic.router.PeerPrefill``)."""
    from .router import PeerPrefill

    options = peer_engine_options(args)
    if args.worker_timeout <= 0:
        raise HypicError("--worker-timeout must be > 0")
    try:
        return PeerPrefill(str(choice.path), args.workers, threads=args.threads, ray_address=args.ray_address,
                           seam_width=args.seam_width, timeout_s=args.worker_timeout,
                           engine_options=options, transfer=args.transfer)
    except Exception as err:  # Ray could not start or join, or a worker could not load the model
        raise HypicError(f"could not start {args.workers - 1} Ray worker(s): {type(err).__name__}: {err}") from err


WARM_UP_NAMESPACE = "hypic-generate-warm-up"  # the throwaway request's cache namespace, flushed after it


def _warm_up(engine: Engine, mode: Mode) -> float:
    """Run one throwaway request through ``mode``'s path (the first one pays one-time costs: weights
    paged in, kernels and allocators set up) and drop what it cached; returns its seconds."""
    start = time.perf_counter()
    sep = engine.pic_separator
    engine.generate(f"warm-up{sep} a document{sep} another{sep} ?", mode=mode, max_new_tokens=2,
                    namespace=WARM_UP_NAMESPACE)
    engine.flush(WARM_UP_NAMESPACE, frozenset({"memory", "disk", "mooncake"}))
    return time.perf_counter() - start


def _generate(args: argparse.Namespace) -> None:
    choice = choose_model(args.model)
    if args.threads is None:  # torch's own default counts hyper-threads and ignores the affinity mask
        args.threads = max(1, physical_cores() // max(args.tp_size, 1))
    if args.tp_size == 1:
        for line in _generate_lines(args, _engine(args, choice)):
            print(line)
        return
    check_tp_size(choice.path, args.tp_size)
    with contextlib.closing(_engine(args, choice, tp_size=args.tp_size, threads=args.threads, mode=args.mode)) as group:
        for line in _generate_lines(args, group):
            print(line)


def check_tp_size(path: Path, tp_size: int) -> None:
    """Refuse a tensor-parallel size the model's heads do not divide, naming the count, before any
    rank starts or anything is loaded."""
    from .loading.loader import read_config
    from .parallel import TensorParallel
    from .parallel.sharding import rank_config
    if tp_size < 1:
        raise HypicError("--tp-size must be >= 1")
    rank_config(read_config(path), TensorParallel(0, tp_size))


def _generate_lines(args: argparse.Namespace, engine: Engine) -> list[str]:
    """Each prompt's answer and counts (warm-up first, on stderr)."""
    warm_up_s = _warm_up(engine, args.mode)
    print(f"(warm-up: {warm_up_s:.1f} s, one time, not in the timings below)", file=sys.stderr)
    lines = []
    for prompt in args.prompt:
        result = engine.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, mode=args.mode)
        lines.append(f"{result.text!r}\n  mode={result.mode} prompt_tokens={result.prompt_tokens} "
                     f"cached={result.cached_tokens} recomputed={result.recomputed_tokens} segments hit/missed="
                     f"{result.segments_hit}/{result.segments_missed} ttft={result.ttft_s * 1000:.1f} ms "
                     f"finish={result.finish_reason}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "eval" and args.study == "scaling":
        args.options = rest  # the scaling sweeps parse their own options
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "eval":
        return eval_main(args)
    try:
        _serve(args) if args.command == "serve" else _generate(args)
    except HypicError as err:
        print(f"hypic: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
