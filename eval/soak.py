"""Steady mixed load against ``hypic serve`` for minutes, sampling the server's resident memory.

What a server sees in production, compressed: PIC prompts over a pool of 60 documents, plain
completions, chat streams the client drops after a few chunks, bad requests, ``/warmup`` and
``/flush_cache``, from ``--clients`` threads, with both pools capped small (``--pool-size``) so
they evict all the time. Every ``--sample-s`` seconds the server's RSS (``/proc/PID/status``) and
the request counts are recorded; the summary gives the RSS slope over the run's second half
(least squares, MB per minute: a bounded server is ~0) and the 5xx count (must be 0).

    python eval/soak.py --minutes 10 --json eval/results/soak.json
    python eval/soak.py --repo /tmp/old_checkout ...   # the server of another tree (before/after)
"""
import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hypic import DEFAULT_SEPARATOR as SEP
from hypic.server.launch import free_port

WORDS = "cat dog river stone heron mill valley reed frog weather lake born studied coat call dawn record".split()
BAD_BODIES = [b"{bad", b'{"text": 5}', b'{"text": "a", "lora_path": "x"}',
              b'{"text": "a", "sampling_params": {"max_new_tokens": 99999}}']
KINDS = {"pic": 0.45, "plain": 0.20, "dropped_stream": 0.10, "bad": 0.10, "warmup": 0.10, "flush": 0.05}


@dataclass
class Tally:
    """Outcomes by class, shared by the client threads."""

    counts: dict[str, int] = field(default_factory=lambda: {"ok": 0, "4xx": 0, "5xx": 0, "dropped": 0, "error": 0})
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, outcome: str) -> None:
        with self.lock:
            self.counts[outcome] += 1

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counts)


def documents(count: int = 60, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 160))) + f" Record {i}." for i in range(count)]


def pick(rng: random.Random) -> str:
    draw, total = rng.random(), 0.0
    for kind, share in KINDS.items():
        total += share
        if draw < total:
            return kind
    return "pic"


def one_request(client: httpx.Client, rng: random.Random, docs: list[str]) -> str:
    """One request of a random kind; its outcome class."""
    kind = pick(rng)
    if kind == "dropped_stream":
        body = {"messages": [{"role": "user", "content": SEP.join(["sys", *rng.sample(docs, 3), "q"])}],
                "max_tokens": 40, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            for index, _ in enumerate(stream.iter_lines()):
                if index > 3:
                    break  # the client goes away mid-stream
        return "dropped"
    if kind == "pic":
        text = SEP.join(["Answer from the records.", *rng.sample(docs, rng.randint(2, 6)), f"Question {rng.randint(0, 999)}?"])
        response = client.post("/generate", json={"text": text, "sampling_params": {
            "max_new_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0.7])}})
    elif kind == "plain":
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 300)))
        response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": rng.randint(1, 16)})
    elif kind == "bad":
        response = client.post("/generate", content=rng.choice(BAD_BODIES))
    elif kind == "warmup":
        response = client.post("/warmup", json={"documents": rng.sample(docs, 2)})
    else:
        response = client.post("/flush_cache")
    return "ok" if response.status_code < 400 else "4xx" if response.status_code < 500 else "5xx"


def drive(url: str, seed: int, until: float, tally: Tally, docs: list[str]) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=300) as client:
        while time.monotonic() < until:
            try:
                tally.note(one_request(client, rng, docs))
            except httpx.HTTPError:
                tally.note("error")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def slope_mb_per_min(samples: list[dict[str, Any]]) -> float:
    """Least-squares slope of RSS over the second half of the samples (the first holds warm-up)."""
    half = samples[len(samples) // 2:]
    xs, ys = [s["t_s"] / 60 for s in half], [s["rss_mb"] for s in half]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread if spread else 0.0


def start(args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    """``hypic serve`` of ``--repo``'s tree on one thread, pools capped; returns once healthy."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"PYTHONPATH": str(args.repo)} if args.repo else {})}
    command = [sys.executable, "-m", "hypic.cli", "serve", "--port", str(port), "--threads", "1",
               "--public-pool-size", args.pool_size, "--private-pool-size", args.pool_size, "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                               cwd=args.repo or None)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError("the server did not become healthy in 180 s")


def run(args: argparse.Namespace) -> dict[str, Any]:
    port, log = free_port(), Path(args.log)
    process = start(args, port, log)
    url, tally, docs = f"http://127.0.0.1:{port}", Tally(), documents()
    begin = time.monotonic()
    until = begin + args.minutes * 60
    threads = [threading.Thread(target=drive, args=(url, seed, until, tally, docs), daemon=True)
               for seed in range(args.clients)]
    samples: list[dict[str, Any]] = []
    try:
        for thread in threads:
            thread.start()
        while time.monotonic() < until:
            samples.append({"t_s": round(time.monotonic() - begin, 1), "rss_mb": round(rss_mb(process.pid), 1),
                            **tally.snapshot()})
            print(json.dumps(samples[-1]), flush=True)
            time.sleep(args.sample_s)
        for thread in threads:
            thread.join()
        samples.append({"t_s": round(time.monotonic() - begin, 1), "rss_mb": round(rss_mb(process.pid), 1),
                        **tally.snapshot()})
    finally:
        process.terminate()
        process.wait(timeout=30)
    return {"repo": str(args.repo or "installed hypic"), "minutes": args.minutes, "clients": args.clients,
            "pool_size": args.pool_size, "mix": KINDS, "samples": samples, "final": tally.snapshot(),
            "rss_first_mb": samples[0]["rss_mb"], "rss_last_mb": samples[-1]["rss_mb"],
            "rss_max_mb": max(s["rss_mb"] for s in samples), "rss_slope_mb_per_min": round(slope_mb_per_min(samples), 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the load")
    parser.add_argument("--clients", type=int, default=6, help="client threads, each one request at a time")
    parser.add_argument("--pool-size", default="24M", help="--public-pool-size and --private-pool-size of the server")
    parser.add_argument("--sample-s", type=float, default=20.0, help="seconds between RSS samples")
    parser.add_argument("--repo", type=Path, default=None, help="serve this source tree instead of the installed hypic")
    parser.add_argument("--log", default="/tmp/hypic-soak-server.log", help="the server's log")
    parser.add_argument("--json", type=Path, default=None, help="write the samples and the summary here")
    args = parser.parse_args(argv)
    result = run(args)
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["final"]["5xx"] == 0 and result["final"]["error"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
