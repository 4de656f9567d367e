"""Cold PIC requests end to end through ``hypic serve`` and ``hypic serve --workers 2``: the client's
time for a one-token answer over HTTP (``/generate``, ``max_new_tokens`` 1), medians over
``--repeats`` requests of fresh documents, after one warm-up request per server. The two servers run
one after the other with the same threads per process, so each process has the box to itself.

    python eval/bench_serve_http.py --docs 6 --doc-tokens 1000 --repeats 3 --runs 3 --json OUT.jsonl
"""
import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

from hypic import Engine
from hypic.evaluation.scaling import build_prompt, make_document
from hypic.server.launch import start_server


def client_ttft(server, prompt: str) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    answer = server.post("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    elapsed = time.perf_counter() - start
    assert answer["meta_info"]["segments_hit"] == 0, answer["meta_info"]  # every document cold
    return elapsed


def measure(workers: int, run: int, args: argparse.Namespace, tokenizer) -> list[float]:  # type: ignore[no-untyped-def]
    log = Path(tempfile.mkdtemp()) / f"serve-{workers}.log"
    extra = ["--workers", str(workers)] if workers > 1 else []
    server = start_server([*extra, "--log-level", "warning"], log, threads=args.threads, timeout_s=300)
    try:
        warm = [make_document(tokenizer, 64, random.Random(f"warm-{run}-{i}")) for i in range(2)]
        client_ttft(server, build_prompt(warm))  # first-call costs paid outside the numbers
        times = []
        for repeat in range(args.repeats):
            documents = [make_document(tokenizer, args.doc_tokens, random.Random(f"w{workers}-{run}-{repeat}-{i}"))
                         for i in range(args.docs)]
            times.append(client_ttft(server, build_prompt(documents)))
        return times
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help="requests per server and run")
    parser.add_argument("--runs", type=int, default=3, help="alternating pairs of servers")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per process")
    parser.add_argument("--json", type=Path, help="append one JSON line per run")
    args = parser.parse_args()
    tokenizer = Engine.from_pretrained("default").tokenizer
    for run in range(args.runs):
        one, two = measure(1, run, args, tokenizer), measure(2, run, args, tokenizer)
        row = {"run": run, "docs": args.docs, "doc_tokens": args.doc_tokens, "threads": args.threads,
               "one_process_s": one, "workers_2_s": two, "speedup": statistics.median(one) / statistics.median(two),
               "machine": platform.processor() or platform.machine()}
        print(f"run {run}: one process {statistics.median(one):.3f} s, --workers 2 {statistics.median(two):.3f} s, "
              f"{row['speedup']:.2f}x")
        if args.json:
            with args.json.open("a") as out:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
