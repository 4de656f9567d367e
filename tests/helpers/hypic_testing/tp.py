"""What each rank of a tensor-parallel test runs (spawned processes import it by name)."""
from pathlib import Path

import torch

from hypic.engine import Engine
from hypic.parallel import TensorParallel

SEP = "<<PIC_SEP>>"
PROMPTS = (("The quick brown fox jumps over the lazy dog. " * 3, "full"),
           (SEP.join(["Read these.", "First record: the otter studied the river.",
                      "Second record: the heron was born at the mill.", "Who studied the river?"]), "hypic"))


def greedy_run(tp: TensorParallel, path: str, steps: int = 4) -> list[tuple[torch.Tensor, list[int]]]:
    """For each test prompt (the PIC one twice: a miss, then every document a hit): the logits of the
    prefill and of ``steps`` greedy decode steps [steps + 1, vocab], and the greedy tokens."""
    engine = Engine.from_pretrained(path, dtype="float32", tp=tp)
    runs = []
    for prompt, mode in (*PROMPTS, PROMPTS[1]):
        prefill = engine.prefill(engine.parse(prompt), mode)
        logits, state, tokens = [prefill.logits], prefill.state, []
        for _ in range(steps):
            tokens.append(int(logits[-1].argmax()))
            step_logits, state = engine.decode_step(state, tokens[-1])
            logits.append(step_logits)
        runs.append((torch.stack(logits), tokens))
    return runs


def greedy_runs(tp: TensorParallel, paths: dict[str, str]) -> dict[str, list[tuple[torch.Tensor, list[int]]]]:
    """``greedy_run`` of every named checkpoint, in one start of the ranks."""
    return {name: greedy_run(tp, path) for name, path in paths.items()}


def parameter_bytes(tp: TensorParallel, path: str) -> int:
    """Bytes of this rank's parameters, as loaded (loading talks to no other rank: any process may
    load any rank's share)."""
    from hypic.loading.loader import load_model
    return sum(p.numel() * p.element_size() for p in load_model(path, tp=tp).parameters())


def load_error(tp: TensorParallel, path: str) -> str:
    """The message loading ``path`` on this rank raises ('' if it loads)."""
    try:
        Engine.from_pretrained(Path(path), dtype="float32", tp=tp)
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"
    return ""


def dies_on_rank_one(tp: TensorParallel) -> None:
    """Rank 1 is killed (SIGKILL) while rank 0 waits for it in an all-reduce."""
    import os
    import signal

    from hypic.parallel import all_reduce
    if tp.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    all_reduce(torch.ones(4), tp)


def stops_on_rank_one(tp: TensorParallel) -> None:
    """Rank 1 stops itself (SIGSTOP: it hangs) while rank 0 waits for it in an all-reduce."""
    import os
    import signal

    from hypic.parallel import all_reduce
    if tp.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    all_reduce(torch.ones(4), tp)


def pic_through_disk(tp: TensorParallel, path: str, cache_dir: str) -> tuple[str, int, int]:
    """The PIC test prompt on an engine whose public pool writes to and reads from ``cache_dir``:
    (text, segments hit, segments missed); the engine is closed (its writes finished) before returning."""
    from hypic.cache.tiers.options import TierOptions
    engine = Engine.from_pretrained(path, dtype="float32", tp=tp, tiers=TierOptions(cache_dir=cache_dir))
    try:
        result = engine.generate(PROMPTS[1][0], max_new_tokens=4)
    finally:
        engine.close()
    return result.text, result.segments_hit, result.segments_missed


def unseeded_sample(tp: TensorParallel, path: str) -> list[int]:
    """A sampled (temperature 1, no seed) continuation, each rank's own random state made different first."""
    torch.manual_seed(1000 + tp.rank)
    engine = Engine.from_pretrained(path, dtype="float32", tp=tp)
    return engine.generate(PROMPTS[1][0], max_new_tokens=12, temperature=1.0).output_ids


def pool_bytes_after_warmup(tp: TensorParallel, path: str, document: str) -> int:
    """The public pool's bytes on this rank once ``document`` is cached."""
    engine = Engine.from_pretrained(path, dtype="float32", tp=tp)
    engine.warmup([document])
    return engine.cache.describe()["public_pool"]["bytes"]


def pic_after_rank_one_lost_its_shards(tp: TensorParallel, path: str, cache_root: str) -> tuple[str, int, int, int]:
    """The PIC test prompt run once (its documents and resume points written below memory, each rank
    in a directory of its own), then, on new engines, again after rank 1's directory was emptied:
    (text, segments hit, segments missed, cached tokens) of the second run. Rank 0 finds its shards
    on disk while rank 1 finds none."""
    import shutil
    from pathlib import Path
    from hypic.cache.tiers.options import TierOptions
    tiers = TierOptions(cache_dir=str(Path(cache_root) / f"rank{tp.rank}"))
    for run in range(2):
        if run == 1 and tp.rank == 1:
            shutil.rmtree(tiers.cache_dir)
        engine = Engine.from_pretrained(path, dtype="float32", tp=tp, tiers=tiers)
        try:
            result = engine.generate(PROMPTS[1][0], max_new_tokens=4)
        finally:
            engine.close()
    return result.text, result.segments_hit, result.segments_missed, result.cached_tokens


def fidelity_runs(tp: TensorParallel, paths: dict[str, str]) -> dict[str, dict[str, tuple]]:
    """For each checkpoint, the fidelity tests' three-document layout with its documents cold (built
    in the request) and warm (cached by a warm-up first): {"cold"|"warm": (greedy tokens, the logits
    each was chosen from, segments hit, segments missed)}, seam width 8."""
    from hypic_testing.fidelity import engine_generation, layout
    case, runs = layout(1, [70, 260, 41]), {}
    for name, path in paths.items():
        runs[name] = {}
        for kind in ("cold", "warm"):
            engine = Engine.from_pretrained(path, dtype="float32", seam_width=8, tp=tp)
            if kind == "warm":
                engine.warmup(list(case.documents))
            prefill = engine.prefill(engine.parse(case.text))
            generation = engine_generation(engine, prefill)
            runs[name][kind] = (generation.tokens, generation.logits, prefill.stats.segments_hit,
                                prefill.stats.segments_missed)
    return runs
