"""Batched prefill in the engine loop: 8 requests at once against the same 8 one after another.

In process (``EngineLoop``, as ``hypic serve`` runs it), one torch thread, greedy, one output token
(so a request's time is its prefill). Three ways to serve the same 8 prompts: one after another
(each submitted when the previous one is done), all at once with one prefill pass per step
(``max_prefill_batch=1``, the loop before batching), all at once with the passes of several
requests in one pass through the model (the default, within ``--chunk`` tokens a step). The
private pool is emptied before each run; each way's tokens are compared with one after another's.

Workloads: ``cold``, 8 prompts of --cold-tokens random tokens (no separators); ``warm``, 8 PIC
requests over 6 cached documents of --doc-tokens tokens (each request: a leading part, 4 of the
documents in its own order, its own question), whose combine passes are short (seams and query).

    python eval/bench_batched_prefill.py [--model default|PATH] [--dtype float32] [--json OUT]
"""
import argparse
import json
import platform
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from hypic import DEFAULT_SEPARATOR, Engine
from hypic.sampling.params import SamplingParams
from hypic.scheduler.loop import DoneEvent, EngineLoop, ErrorEvent, Event
from hypic.server.protocol import GenerationRequest

REQUESTS = 8


def _ids(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(3, min(vocab, 256)) for _ in range(count)]


def _text(ids: list[int], engine: Engine) -> str:
    return engine.tokenizer.decode(ids)


def workloads(engine: Engine, args: argparse.Namespace, seed: int) -> dict[str, list[str | list[int]]]:
    """The prompts of each workload (token ids for cold ones, PIC texts for warm ones)."""
    rng, vocab = random.Random(seed), engine.model.config.vocab_size
    cold = [_ids(rng, args.cold_tokens, vocab) for _ in range(REQUESTS)]
    words = "the river city record studied born coat call dawn north south west east old new".split()
    documents = [f"Record {d}: " + " ".join(rng.choice(words) for _ in range(args.doc_tokens // 3))
                 for d in range(6)]
    warm = [DEFAULT_SEPARATOR.join(["Answer from the records.", *rng.sample(documents, 4),
                                    f"Question {i}: which record is oldest?"]) for i in range(REQUESTS)]
    return {"cold": cold, "warm": warm, "documents": documents}


def serve(loop: EngineLoop, prompts: list[str | list[int]], together: bool) -> tuple[float, list[list[int]]]:
    """Seconds until every prompt has its one greedy token, and those tokens."""
    done: dict[int, Event] = {}
    finished = threading.Condition()

    def emit_for(index: int):
        def emit(event: Event) -> None:
            if isinstance(event, (DoneEvent, ErrorEvent)):
                with finished:
                    done[index] = event
                    finished.notify_all()
        return emit

    def submit(index: int) -> None:
        params = SamplingParams(max_new_tokens=1, temperature=0)
        parts = loop.engine.parse(prompts[index])
        loop.submit(parts, GenerationRequest(prompts[index], params), loop.engine.sequences(params, parts.token_ids),
                    emit_for(index))

    def wait(count: int) -> None:
        with finished:
            assert finished.wait_for(lambda: len(done) >= count, 600)

    start = time.perf_counter()
    for index in range(len(prompts)):
        submit(index)
        if not together:
            wait(index + 1)
    wait(len(prompts))
    elapsed = time.perf_counter() - start
    assert all(isinstance(done[i], DoneEvent) for i in done), [done[i] for i in done if isinstance(done[i], ErrorEvent)]
    return elapsed, [done[i].completion.samples[0].output_ids for i in range(len(prompts))]


WAYS = {"one after another": (16, False), "together, one pass a step": (1, True), "together, batched": (16, True)}


def measure(engine: Engine, prompts: list[str | list[int]], repeats: int) -> dict[str, Any]:
    """Median seconds of each way over ``repeats`` runs (after a warm-up run of each)."""
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    outputs: dict[str, list[list[int]]] = {}
    for repeat in range(repeats + 1):
        for way, (batch, together) in WAYS.items():
            engine.cache.private.clear()
            loop = EngineLoop(engine, "hypic", max_prefill_batch=batch)
            loop.start()
            try:
                elapsed, outputs[way] = serve(loop, prompts, together)
            finally:
                loop.stop()
            if repeat:
                times[way].append(elapsed)
    medians = {way: statistics.median(t) for way, t in times.items()}
    same = {way: sum(a == b for a, b in zip(out, outputs["one after another"])) for way, out in outputs.items()}
    return {"median_s": medians, "all_s": times, "same_tokens_as_one_after_another": same,
            "batched_over_one_after_another": medians["together, batched"] / medians["one after another"],
            "batched_over_one_pass_a_step": medians["together, batched"] / medians["together, one pass a step"]}


def _model_path(name: str, folder: Path) -> str:
    if name != "tiny":
        return name
    from hypic.loading.checkpoints import write_random_checkpoint

    return str(write_random_checkpoint(folder / "tiny", "qwen3_5_text", 0))  # the tests' qwen3_5_text-ratio2


def make_engine(args: argparse.Namespace, folder: Path) -> Engine:
    """The engine under test: a checkpoint, or (``--preset``) random weights with a real model's
    layer shapes built on the device (``bench_real_shapes.py``'s models, ``--layers`` of them)."""
    if args.preset is None:
        return Engine.from_pretrained(_model_path(args.model, folder), device=args.device, dtype=args.dtype,
                                      chunk_tokens=args.chunk)
    from bench_real_shapes import PRESETS, random_model  # this script's folder is on sys.path

    from hypic.loading.checkpoints import byte_level_tokenizer
    from hypic.tokenizer import TextTokenizer

    fields = dict(PRESETS[args.preset], **({"num_hidden_layers": args.layers} if args.layers else {}))
    model = random_model(fields, args.device, getattr(torch, args.dtype), 0)
    return Engine(model, TextTokenizer(byte_level_tokenizer()), f"random-{args.preset}", chunk_tokens=args.chunk)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="checkpoint directory, 'default' (shipped) or 'tiny' "
                                                           "(the tests' random Qwen3.5)")
    parser.add_argument("--preset", default=None, help="instead of --model: random weights with a real model's "
                                                       "shapes (bench_real_shapes.py's presets, e.g. qwen3.5-35b-a3b)")
    parser.add_argument("--layers", type=int, default=None, help="with --preset: keep this many layers")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--chunk", type=int, default=4096, help="prefill tokens a step (--chunked-prefill-size)")
    parser.add_argument("--cold-tokens", type=int, default=512)
    parser.add_argument("--doc-tokens", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        engine = make_engine(args, Path(folder))
        prompts = workloads(engine, args, 0)
        engine.warmup(prompts.pop("documents"))
        result: dict[str, Any] = {"model": args.preset or args.model, "layers": args.layers, "dtype": args.dtype,
                                  "chunk": args.chunk, "threads": args.threads, "device": _device_name(args.device),
                                  "machine": platform.processor() or platform.machine(), "torch": torch.__version__}
        for name, batch in prompts.items():
            result[name] = measure(engine, batch, args.repeats)
            print(name, {way: round(s, 3) for way, s in result[name]["median_s"].items()},
                  "batched / one after another %.2f" % result[name]["batched_over_one_after_another"],
                  "batched / one pass a step %.2f" % result[name]["batched_over_one_pass_a_step"],
                  "same tokens", result[name]["same_tokens_as_one_after_another"], flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
