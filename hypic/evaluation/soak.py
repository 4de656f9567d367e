"""``hypic eval soak``: a shared server under steady mixed load, with faults, for a bounded time.

``--clients`` threads send the mix of ``soak_workload`` (PIC prompts over a Zipf pool of
``--documents`` documents, larger than the pools; plain, two-turn chat, structured and ``n > 1``
requests; dropped streams, bad bodies, warm-ups and one namespace's flushes; two cache namespaces
and the shared one) to a ``hypic serve`` started here with small pools (``--pool-size``), while
faults are injected every ``--fault-every`` seconds: the server killed with SIGKILL and restarted on
its port, or, with ``--workers 2``, a Ray worker killed, or, with ``--dp-size 2``, a replica killed (Ray
Serve starts another). Every ``--sample-s`` seconds the server's RSS, its Ray worker actors' RSS
(the replicas and the ingress with ``--dp-size``; each by pid) and the pool bytes are read. At the end every
``--replay-every``-th greedy answer is sent again to a quiet server of the same mode and model
(started here, or ``--reference-url``): under load, eviction and faults the answer must not
change (a PIC answer is compared with HYPIC's own quiet answer, not with full recompute: how far
those differ is the accuracy studies' subject).

Writes ``OUT/soak.jsonl`` (one record per request, sample, fault and replay), ``OUT/soak_summary.json``,
``OUT/soak.png`` and the servers' logs in ``OUT/soak_logs/`` (RSS, TTFT p50/p99 and outcomes over time, faults marked). A rerun with the
same options only re-reads the JSONL and reports it. With ``--url`` the server there is loaded and
nothing is injected (it is not ours to kill) and its RSS is not read.

Passes when: no wrong answer, no 5xx, every fault recovered from, RSS within ``--max-rss-growth``
of its value after warm-up in every server life and every Ray worker's life, pool bytes within
their budgets.
"""
import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from .data import DataError
from .soak_report import draw_soak, format_soak, summarize_soak
from .soak_workload import Client, Workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The soak study's options."""
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the load")
    parser.add_argument("--clients", type=int, default=6, help="client threads, each one request at a time")
    parser.add_argument("--documents", type=int, default=80, help="documents in the Zipf pool")
    parser.add_argument("--pool-size", default="24M", help="the started server's --public-pool-size and --private-pool-size")
    parser.add_argument("--workers", type=int, default=1, help="the started server's --workers (2: Ray worker faults)")
    parser.add_argument("--dp-size", type=int, default=1,
                        help="the started server's --dp-size (2: replica faults; each replica one thread)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="the started server's --cache-dir, kept across its restarts (documents come back from "
                             "disk after each SIGKILL, writes killed midway included); default: no disk tier")
    parser.add_argument("--fault-every", type=float, default=120.0, help="seconds between faults (0: none)")
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS and pool samples")
    parser.add_argument("--warmup-fraction", type=float, default=0.2,
                        help="of each server life, the part before RSS is judged (caches and allocator fill)")
    parser.add_argument("--max-rss-growth", type=float, default=0.10, help="RSS growth allowed after warm-up")
    parser.add_argument("--replay-every", type=int, default=5, help="replay every N-th greedy answer on a quiet server")
    parser.add_argument("--model", default="default", help="checkpoint directory, or default (the shipped model)")
    parser.add_argument("--mode", default="hypic", help="the servers' --mode")
    parser.add_argument("--dtype", default="float32",
                        help="the servers' --dtype. float32 by default because replays compare greedy answers "
                             "exactly: in bfloat16 two tokens' logits often round to the same value, and which "
                             "one wins then depends on the batch a request decodes in, not on the cache")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each started server")
    parser.add_argument("--url", default=None, help="soak the server at URL instead (no faults, no RSS)")
    parser.add_argument("--reference-url", default=None, help="the quiet server for replays (default: one started here)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("eval/runs"), help="folder of the JSONL, summary and figure")
    parser.add_argument("--no-progress", action="store_true")


class SoakedServer:
    """The server under test: started here (killable and restartable on its port), or at ``--url``."""

    def __init__(self, args: argparse.Namespace, logs: Path) -> None:
        self.args, self.logs, self.lives = args, logs, 0
        self.server: Any = None
        self.url = args.url
        if args.url is None:
            from hypic.server.launch import free_port
            self.port = free_port()
            self.start()

    def options(self) -> list[str]:
        args = self.args
        model = [] if args.model == "default" else ["--model", str(args.model)]
        tiers = [] if args.cache_dir is None else ["--cache-dir", str(args.cache_dir)]
        return [*model, "--mode", args.mode, "--dtype", args.dtype, "--public-pool-size", args.pool_size, "--private-pool-size", args.pool_size,
                "--workers", str(args.workers), "--dp-size", str(args.dp_size), "--log-level", "warning", *tiers]

    def start(self) -> None:
        from hypic.server.launch import start_server
        self.lives += 1
        on_ray = self.args.workers > 1 or self.args.dp_size > 1  # each Ray process its own --threads
        threads = None if on_ray else self.args.threads
        extra = ["--threads", str(self.args.threads)] if on_ray else []
        self.server = start_server([*self.options(), *extra], self.logs / f"server-{self.lives}.log", threads=threads,
                                   port=self.port, timeout_s=300)
        self.url = self.server.url

    @property
    def pid(self) -> int | None:
        return None if self.server is None else self.server.process.pid

    def kill_and_restart(self) -> None:
        """SIGKILL, as an out-of-memory kill or a crash would, then a new server on the same port."""
        self.server.process.send_signal(signal.SIGKILL)
        self.server.process.wait()
        self.start()

    def kill_worker(self, kind: bytes = b"ray::Worker") -> bool:
        """SIGKILL one of this server's Ray actor processes whose command line starts with ``kind``
        (a worker; a replica: ``ray::ServeReplica:hypic:HypicReplica``); False if none is left."""
        for pid in _ray_worker_pids(self.pid, kind):
            os.kill(pid, signal.SIGKILL)
            return True
        return False

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


ACTORS = (b"ray::Worker", b"ray::ServeReplica")  # --workers' actors; --dp-size's replicas and ingress


def _ray_worker_pids(server: int | None, kind: bytes | tuple[bytes, ...] = ACTORS) -> list[int]:
    """The Ray actors descending from process ``server`` (its raylet's children) whose command line
    starts with ``kind``."""
    parents, workers = {}, []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if (entry / "cmdline").read_bytes().startswith(kind):
                    workers.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return [pid for pid in workers if server in _ancestors(pid, parents)]


def _ancestors(pid: int, parents: dict[int, int]) -> set[int]:
    found = set()
    while pid in parents and pid not in found and pid > 1:
        found.add(pid)
        pid = parents[pid]
    return found


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


HEAP_FIELDS = ("heap_trims", "heap_trim_seconds", "heap_trimmed_bytes")  # the server's (hypic.heap)


def workers_rss_mb(server: int | None) -> dict[str, float]:
    """RSS of each of the server's Ray worker actors, by pid (JSON keys are strings)."""
    found = {str(pid): rss_mb(pid) for pid in _ray_worker_pids(server)} if server is not None else {}
    return {pid: mb for pid, mb in found.items() if mb is not None}


class Recorder:
    """Every record of the run, appended to the JSONL as it is made (threads share it)."""

    def __init__(self, path: Path, begin: float) -> None:
        self.path, self.begin, self.records, self.lock = path, begin, [], threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def clock(self) -> float:
        return time.monotonic() - self.begin

    def add(self, record: dict[str, Any]) -> None:
        with self.lock:
            self.records.append(record)
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")


def _drive(server: SoakedServer, workload: Workload, seed: int, until: float, recorder: Recorder,
           faulting: threading.Event) -> None:
    rng, client, url = random.Random(seed), None, None
    try:
        while recorder.clock() < until:
            if url != server.url or client is None:
                client, url = Client(server.url, workload, rng, recorder.clock), server.url
            for outcome in client.send(workload.pick(rng)):
                recorder.add({"type": "request", **asdict(outcome), "outcome": outcome.outcome, "client": seed,
                              "during_fault": faulting.is_set()})
            if outcome.status is None:
                time.sleep(0.2)  # the server is down: do not spin
    finally:
        if client is not None:
            client.close()


def _sample(server: SoakedServer, recorder: Recorder) -> None:
    info = None
    try:
        info = httpx.get(f"{server.url}/get_server_info", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        pass
    pools = {name: {k: info[name][k] for k in ("bytes", "budget_bytes")} for name in ("public_pool", "private_pool")} \
        if info else None
    recorder.add({"type": "sample", "t_s": recorder.clock(), "life": server.lives, "rss_mb": rss_mb(server.pid),
                  "workers_rss_mb": workers_rss_mb(server.pid), "pools": pools,
                  "heap": {k: info.get(k) for k in HEAP_FIELDS} if info else None})


def _faults(server: SoakedServer, args: argparse.Namespace) -> list[Callable[[], str]]:
    if args.url is not None or args.fault_every <= 0:
        return []
    if args.workers > 1:
        return [lambda: "kill_worker" if server.kill_worker() else "kill_worker_none_found"]
    if args.dp_size > 1:
        replica = b"ray::ServeReplica:hypic:HypicReplica"
        return [lambda: "kill_replica" if server.kill_worker(replica) else "kill_replica_none_found"]
    return [lambda: (server.kill_and_restart(), "kill_server")[1]]


def run_load(server: SoakedServer, args: argparse.Namespace, recorder: Recorder, progress: Any) -> None:
    """The clients, the sampler and the fault schedule for ``--minutes``."""
    until, workload, faulting = args.minutes * 60, Workload(args.documents, seed=args.seed), threading.Event()
    clients = [threading.Thread(target=_drive, args=(server, workload, args.seed * 1000 + i, until, recorder, faulting),
                                daemon=True) for i in range(args.clients)]
    for thread in clients:
        thread.start()
    faults, next_fault, next_sample, fault_index = _faults(server, args), args.fault_every, 0.0, 0
    while (now := recorder.clock()) < until:
        if now >= next_sample:
            _sample(server, recorder)
            next_sample += args.sample_s
        if faults and now >= next_fault and now < until - 15:  # room left to see the recovery
            faulting.set()
            kind = faults[fault_index % len(faults)]()
            faulting.clear()
            recorder.add({"type": "fault", "t_s": now, "kind": kind, "back_s": recorder.clock()})
            fault_index, next_fault = fault_index + 1, next_fault + args.fault_every
        progress.n = min(int(now), int(until))
        progress.refresh()
        time.sleep(0.5)
    for thread in clients:
        thread.join()
    _sample(server, recorder)


def replay(records: list[dict[str, Any]], args: argparse.Namespace, url: str, recorder: Recorder) -> None:
    """Every ``--replay-every``-th greedy answer sent again to the quiet server at ``url``."""
    answered = [r for r in records if r["type"] == "request" and r.get("replay")]
    with httpx.Client(base_url=url, timeout=300) as client:
        for record in answered[:: max(args.replay_every, 1)]:
            call = record["replay"]
            response = client.post(call["path"], json=call["body"])
            text = _text(call["path"], response.json()) if response.status_code == 200 else None
            recorder.add({"type": "replay", "kind": record["kind"], "start_s": record["start_s"],
                          "status": response.status_code, "same": text == call["text"], "expected": call["text"],
                          "got": text})


def _text(path: str, body: dict[str, Any]) -> str:
    if path == "/generate":
        return body["text"]
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _reference(args: argparse.Namespace, logs: Path) -> tuple[str, Callable[[], None]]:
    if args.reference_url is not None:
        return args.reference_url, lambda: None
    from hypic.server.launch import start_server
    model = [] if args.model == "default" else ["--model", str(args.model)]
    quiet = start_server([*model, "--mode", args.mode, "--dtype", args.dtype, "--log-level", "warning"], logs / "reference.log",
                         threads=args.threads, timeout_s=300)
    return quiet.url, quiet.stop


def _check(args: argparse.Namespace) -> None:
    if args.minutes <= 0 or args.clients < 1 or args.documents < 5 or args.sample_s <= 0 or args.replay_every < 1:
        raise DataError("--minutes and --sample-s must be > 0, --clients and --replay-every >= 1, --documents >= 5")
    if not 0 <= args.warmup_fraction < 1 or args.max_rss_growth <= 0 or args.workers < 1 or args.dp_size < 1:
        raise DataError("--warmup-fraction must be in [0, 1), --max-rss-growth > 0, --workers and --dp-size >= 1")
    if args.workers > 1 and args.dp_size > 1:
        raise DataError("--workers and --dp-size above 1 together: the server serves one or the other")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            if k not in ("out", "no_progress", "command", "study")}


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    """The soak of ``args`` (or the report of an earlier run with the same options): records,
    summary and where they were written."""
    _check(args)
    path = args.out / "soak.jsonl"
    records = _earlier(path, _options(args))
    if records is None:
        print(f"hypic eval soak: {args.minutes:g} min, {args.clients} clients, pools {args.pool_size}, "
              f"{args.workers} worker(s), {args.dp_size} replica(s), a fault every {args.fault_every:g} s, into {path}", file=sys.stderr)
        records = _run(args, path)
    summary = summarize_soak(records, args)
    (args.out / "soak_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    draw_soak(records, summary["windows"], args.out / "soak.png")
    print(format_soak(summary))
    return {"records": records, "summary": summary, "figure": args.out / "soak.png"}


def _earlier(path: Path, options: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The records of a finished run with the same options in ``path``, if there is one."""
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    done = [r for r in records if r["type"] == "done"]
    return records if done and done[-1]["options"] == options else None


def _run(args: argparse.Namespace, path: Path) -> list[dict[str, Any]]:
    from tqdm import tqdm
    logs = args.out / "soak_logs"  # kept: each server life's log and the reference's, for what the records show
    logs.mkdir(parents=True, exist_ok=True)
    server = SoakedServer(args, logs)
    recorder = Recorder(path, time.monotonic())
    recorder.add({"type": "start", "options": _options(args), "url": server.url})
    try:
        with tqdm(total=int(args.minutes * 60), desc="soak", unit="s", disable=args.no_progress,
                  file=sys.stderr) as progress:
            run_load(server, args, recorder, progress)
    finally:
        server.stop()
    url, stop = _reference(args, logs)
    try:
        replay(list(recorder.records), args, url, recorder)
    finally:
        stop()
    recorder.add({"type": "done", "options": _options(args)})
    return list(recorder.records)
