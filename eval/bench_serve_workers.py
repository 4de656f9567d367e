"""Cold PIC requests through the server's engine loop alone and with one Ray peer, as ``hypic serve``
and ``hypic serve --workers 2`` run them: time to the first token (the request's arrival to its
prefill done, ``Completion.ttft_s``), medians over ``--repeats`` requests, each of fresh documents.

    PYTHONPATH=$PWD python eval/bench_serve_workers.py --docs 6 --doc-tokens 1000 --repeats 3
"""
import argparse
import json
import random
import statistics
import threading
from typing import Any

from hypic import Engine
from hypic.evaluation.scaling import build_prompt, make_document
from hypic.router import PeerPrefill
from hypic.sampling.params import SamplingParams

try:  # the loop's home before and after the scheduler got a package of its own
    from hypic.scheduler.loop import DoneEvent, EngineLoop, ErrorEvent, Event
except ImportError:
    from hypic.server.loop import DoneEvent, EngineLoop, ErrorEvent, Event  # type: ignore[no-redef]
from hypic.server.protocol import GenerationRequest


def ttft(loop: EngineLoop, prompt: str, peers: PeerPrefill | None) -> float:
    """One request's TTFT through ``loop`` (with ``peers``: their work started as the server starts it)."""
    engine, done, outcome = loop.engine, threading.Event(), {}
    parts = engine.parse(prompt)
    request = GenerationRequest(prompt, SamplingParams(max_new_tokens=1, temperature=0))

    def emit(event: Event) -> None:
        if isinstance(event, (DoneEvent, ErrorEvent)):
            outcome["event"] = event
            done.set()

    peer_work = (lambda plan: peers.prefill_for(loop, plan)) if peers is not None else None
    loop.submit(parts, request, engine.sequences(request.params, parts.token_ids), emit, peer_work=peer_work)
    done.wait()
    event = outcome["event"]
    if isinstance(event, ErrorEvent):
        raise RuntimeError(event.message)
    return event.completion.ttft_s


def measure(workers: int, args: argparse.Namespace) -> list[float]:
    engine = Engine.from_pretrained("default", chunk_tokens=args.chunk_tokens)
    peers = PeerPrefill("default", workers, threads=args.threads,
                        engine_options={"chunk_tokens": args.chunk_tokens}) if workers > 1 else None
    loop = EngineLoop(engine, "hypic", max_prefill_batch=1)
    loop.start()
    try:
        warm = [make_document(engine.tokenizer, 64, random.Random(f"warm-{i}")) for i in range(2)]
        ttft(loop, build_prompt(warm), peers)  # first-call costs paid outside the numbers
        times = []
        for repeat in range(args.repeats):
            documents = [make_document(engine.tokenizer, args.doc_tokens, random.Random(f"w{workers}-{repeat}-{i}"))
                         for i in range(args.docs)]
            times.append(ttft(loop, build_prompt(documents), peers))
        return times
    finally:
        loop.stop()
        if peers is not None:
            peers.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    args = parser.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    one, two = measure(1, args), measure(2, args)
    report: dict[str, Any] = {"one_process_s": one, "two_workers_s": two,
                              "speedup": statistics.median(one) / statistics.median(two)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
