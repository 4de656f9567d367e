"""The combine pass end to end against the independent reference of HYPIC's semantics.

The oracle is ``tests/reference``: its own token-loop forward (proven equal to ``transformers``)
and the splice rule stated in one place. Every layout is also run on the long-memory copy of its
model, where HYPIC's approximation above layer 0 is O(1), so that full recompute (or any
other wrong combine pass) cannot pass for HYPIC. The first token's logits and every greedy
decode step must agree to 1e-4, and the 16 greedy tokens must be identical.
"""
import random
from collections.abc import Callable
from itertools import product
from dataclasses import replace
from pathlib import Path

import pytest

from hypic import Engine
from hypic.decode import decode_batch
from hypic.engine import Prefill
from hypic.prefill_stats import BuiltForRequest
from hypic_reference.model import ReferenceModel
from hypic_testing.fidelity import (STEPS, TOLERANCE, Layout, Oracle, assert_same_generation, engine_generation,
                                    layout, random_text)

MODELS = ["qwen3_5_text-ratio1", "qwen3_5_text-ratio2", "qwen3_5_text-ratio3", "qwen3_5_text-full-rotary",
          "qwen3_next-moe", "qwen3_next-dense", "qwen3_next-ratio3", "qwen3_5_moe_text", "qwen3_5-wrapper", "minimax",
          "minimax-residual-scales", "granitemoehybrid", "granitemoehybrid-dense-nope", "hypic_gla", "hypic_scalar_rope",
          "kimi_linear", "kimi_linear-dense-q-lora", "nemotron_h", "nemotron_h-dense", "gpt_oss", "mimo_v2_flash",
          "bailing_hybrid", "bailing_hybrid-dense-softplus", "bailing_moe_linear"]


Setup = Callable[..., tuple[Engine, Oracle]]


@pytest.fixture
def setup(checkpoint_factory: Callable[..., Path], reference_factory: Callable[[Path], ReferenceModel]) -> Setup:
    """``setup(model, long_memory, seam_width, **engine_options)`` -> (a fresh engine, its oracle)."""

    def make(name: str, long_memory: bool, seam_width: int, **options) -> tuple[Engine, Oracle]:
        path = checkpoint_factory(name, long_memory=long_memory)
        engine = Engine.from_pretrained(path, seam_width=seam_width, **options)
        return engine, Oracle(reference_factory(path), path, seam_width)

    return make


def _spliced(prefill: Prefill) -> int:
    return prefill.stats.segments_hit + prefill.stats.segments_missed


# ----- documents cold in the request vs warmed before -------------------------------------------
@pytest.mark.parametrize("name, long_memory, seam_width", list(product(MODELS, [False, True], [3, 4, 8, 16])))
def test_cold_and_warm_documents_match_reference(setup: Setup, name: str, long_memory: bool, seam_width: int) -> None:
    case = layout(1, [70, 260, 41])
    cold, oracle = setup(name, long_memory, seam_width)
    warm, _ = setup(name, long_memory, seam_width)
    warm.warmup(list(case.documents))
    expected = oracle.generate(case)
    cold_prefill, warm_prefill = cold.prefill(cold.parse(case.text)), warm.prefill(warm.parse(case.text))
    assert cold_prefill.stats.segments_missed == 3 and warm_prefill.stats.segments_hit == 3
    assert_same_generation(engine_generation(cold, cold_prefill), expected, "cold")
    assert_same_generation(engine_generation(warm, warm_prefill), expected, "warm")


@pytest.mark.parametrize("name, long_memory", list(product(MODELS, [False, True])))
def test_reordered_documents_behind_another_leading_part(setup: Setup, name: str, long_memory: bool) -> None:
    first = layout(2, [120, 60, 200])
    second = Layout("another leading part", tuple(first.documents[i] for i in (2, 0, 1)), "and a new query?")
    engine, oracle = setup(name, long_memory, 8)
    engine.prefill(engine.parse(first.text))
    prefill = engine.prefill(engine.parse(second.text))
    assert prefill.stats.segments_hit == 3 and prefill.stats.prefix_hit_tokens == 0
    assert_same_generation(engine_generation(engine, prefill), oracle.generate(second))


@pytest.mark.parametrize("name, long_memory, seam_width", list(product(MODELS[:5], [False, True], [3, 8])))
def test_short_document_without_interior_between_long_ones(setup: Setup, name: str, long_memory: bool,
                                                           seam_width: int) -> None:
    case = layout(3, [230, 2 * seam_width - 1, 180])
    engine, oracle = setup(name, long_memory, seam_width)
    prefill = engine.prefill(engine.parse(case.text))
    assert _spliced(prefill) == 2
    assert_same_generation(engine_generation(engine, prefill), oracle.generate(case))


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 6])
def test_one_to_six_documents_of_20_to_400_tokens(setup: Setup, count: int) -> None:
    rng = random.Random(count)
    case = layout(10 + count, [rng.randint(20, 400) for _ in range(count)], leading=rng.randint(0, 30))
    engine, oracle = setup(MODELS[count % len(MODELS)], count % 2 == 0, [3, 4, 8, 16][count % 4])
    prefill = engine.prefill(engine.parse(case.text))
    assert _spliced(prefill) == count
    assert_same_generation(engine_generation(engine, prefill), oracle.generate(case))


# ----- serving paths: chunked prefill, private-pool hits, batched decode -------------------------
@pytest.mark.parametrize("chunk", [1, 9, 64])
def test_chunked_prefill_matches_reference(setup: Setup, chunk: int) -> None:
    case = layout(4, [90, 150], leading=12)
    engine, oracle = setup("qwen3_5_text-ratio2", True, 4, chunk_tokens=chunk)
    prefill = engine.prefill(engine.parse(case.text))
    assert _spliced(prefill) == 2
    assert_same_generation(engine_generation(engine, prefill), oracle.generate(case))


@pytest.mark.parametrize("name", ["qwen3_5_text-ratio2", "qwen3_next-moe"])
def test_private_pool_hit_then_pic_segments(setup: Setup, name: str) -> None:
    """The second request resumes at the end of the shared first document, then splices two more."""
    first = layout(5, [150, 80])
    rng = random.Random(55)
    second = Layout(first.leading, (first.documents[0], random_text(rng, 120), random_text(rng, 64)), "next?")
    engine, oracle = setup(name, True, 8)
    engine.prefill(engine.parse(first.text))
    prefill = engine.prefill(engine.parse(second.text))
    assert prefill.stats.prefix_hit_tokens == len(first.leading) + len(first.documents[0])
    assert prefill.stats.segments_missed == 2
    assert_same_generation(engine_generation(engine, prefill), oracle.generate(second))


@pytest.mark.parametrize("name", ["qwen3_5_text-ratio2", "qwen3_next-moe", "gpt_oss", "mimo_v2_flash"])
def test_precombined_head_then_the_rest(setup: Setup, name: str) -> None:
    """A combine node holding the first two of three documents combines that head early
    (``Engine.precombine``); once the third arrives, the request resumes at the head's end, and its
    stats count the head's own reuse (its first document a hit), not a private-pool hit of the head."""
    case = layout(9, [140, 2 * 8 - 1, 90, 120])  # the short second document has no interior: never waited for
    engine, oracle = setup(name, True, 8)
    engine.warmup([case.documents[0], case.documents[2]])
    parts = engine.parse(case.text)
    head = len(parts.leading) + sum(map(len, parts.segments[:3]))
    early = engine.precombine(parts)
    assert early is not None and early.prompt_tokens == head and early.segments_hit == 2  # the second: no interior
    assert engine.precombine(parts) is None  # its head is already combined
    engine.warmup([case.documents[3]])
    assert engine.cache.held_head(engine.plan(parts)) is None  # every document is held: the request runs whole
    prefill = engine.prefill(parts, built=BuiltForRequest(heads=(early,)))
    alone, _ = setup(name, True, 8)  # the same documents held, nothing combined early
    alone.warmup([case.documents[0], case.documents[2], case.documents[3]])
    assert prefill.stats.combined_early_tokens == head  # resumed at the head's end ...
    assert replace(prefill.stats, combined_early_tokens=0) == alone.prefill(parts).stats  # ... counted as its reuse
    assert_same_generation(engine_generation(engine, prefill), oracle.generate(case))


def test_batched_decode_of_several_pic_requests(setup: Setup) -> None:
    engine, oracle = setup("qwen3_5_text-ratio2", True, 8)
    requests = [layout(6, [100, 40]), layout(7, [33, 180, 61]), layout(8, [250])]
    expected = [oracle.generate(case) for case in requests]
    prefills = [engine.prefill(engine.parse(case.text)) for case in requests]
    states, logits = [p.state for p in prefills], [p.logits for p in prefills]
    for step in range(STEPS):
        tokens = []
        for b, generation in enumerate(expected):
            error = (logits[b] - generation.logits[step]).abs().max().item()
            assert error <= TOLERANCE, f"request {b} step {step}: {error:.2e}"
            tokens.append(int(logits[b].argmax()))
            assert tokens[-1] == generation.tokens[step]
        batch_logits, states = decode_batch(engine.model, states, tokens)
        logits = list(batch_logits)


# ----- the oracle can tell HYPIC from full recompute ---------------------------------------------
@pytest.mark.parametrize("name", ["qwen3_5_text-ratio2", "qwen3_next-moe", "bailing_moe_linear"])
def test_long_memory_copy_makes_hypic_differ_from_full_recompute(setup: Setup, name: str) -> None:
    """Guards the guard: on the long-memory copy the reference's HYPIC logits are far from full
    recompute's, so a combine pass that silently recomputed everything would fail the tests above."""
    case = layout(1, [70, 260, 41])
    _, oracle = setup(name, True, 8)
    hypic, full = oracle.generate(case, steps=1).logits[0], oracle.full(case)
    assert (hypic - full).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("seam_width", [0, 1, 2])
def test_seam_width_below_the_conv_window(setup: Setup, seam_width: int) -> None:
    """w < k - 1: the head seam still covers the conv warm-up (max(w, k - 1) tokens)."""
    case = layout(9, [80, 45, 120])
    engine, oracle = setup("qwen3_5_text-ratio2", True, seam_width)
    prefill = engine.prefill(engine.parse(case.text))
    assert _spliced(prefill) == 3
    assert_same_generation(engine_generation(engine, prefill), oracle.generate(case))


# ----- the CUDA strategy for many runs, forced on the CPU ------------------------------------------
@pytest.mark.parametrize("name, long_memory, seam_width",
                         list(product(["qwen3_5_text-ratio1", "qwen3_5_text-ratio3", "qwen3_next-moe"], [False, True],
                                      [3, 8])))
def test_runs_batched_into_varlen_calls_match_reference(setup: Setup, monkeypatch: pytest.MonkeyPatch, name: str,
                                                        long_memory: bool, seam_width: int) -> None:
    """Every run of a linear layer from the state chained to it through the runs' transitions
    (``runs_batched``, on by default on CUDA only); then a request resuming from the private-pool
    snapshots that pass recorded at document ends."""
    import hypic.runs_together as runs_together
    calls = []
    together = runs_together.varlen_recurrence
    monkeypatch.setattr(runs_together, "runs_batched", lambda device: True)
    monkeypatch.setattr(runs_together, "varlen_recurrence", lambda *a: calls.append(1) or together(*a))
    case = layout(21, [70, 260, 2 * seam_width - 1, 41, 90])
    engine, oracle = setup(name, long_memory, seam_width)
    engine.warmup(list(case.documents))
    prefill = engine.prefill(engine.parse(case.text))
    assert prefill.stats.segments_hit == 4 and calls
    assert_same_generation(engine_generation(engine, prefill), oracle.generate(case))
    again = Layout(case.leading, case.documents[:2] + (random_text(random.Random(22), 150),), "another query")
    resumed = engine.prefill(engine.parse(again.text))
    assert resumed.stats.prefix_hit_tokens == len(case.leading) + 70 + 260
    assert_same_generation(engine_generation(engine, resumed), oracle.generate(again))


@pytest.mark.parametrize("name", ["qwen3_5_text-ratio2", "qwen3_next-moe"])
def test_snapshots_of_requests_run_together_match_reference_states(setup: Setup, monkeypatch: pytest.MonkeyPatch,
                                                                   name: str) -> None:
    """Two prompts' passes in one ``combine_batch`` with the CUDA strategy forced (one varlen call
    for both): each state they record, inside a run (chained through the runs' maps) and at a pass's
    end (the varlen call's own final state), is the reference model's state after as many tokens."""
    import hypic.runs_together as runs_together
    from hypic.assembler import CombineWork, combine_batch
    from hypic.cache.segments import Run
    from hypic.models.families import empty_state

    monkeypatch.setattr(runs_together, "runs_batched", lambda device: True)
    engine, oracle = setup(name, True, 8)
    rng = random.Random(31)
    prompts = [engine.parse(random_text(rng, n)).token_ids for n in (90, 57)]
    cuts = [[30, 61, len(prompts[0])], [11, len(prompts[1])]]
    empty = lambda: empty_state(engine.model.config, engine.model.device, engine.model.dtype)  # noqa: E731
    results = combine_batch([CombineWork(engine.model, ids, [Run(0, len(ids))], empty(), snapshot_at=at)
                             for ids, at in zip(prompts, cuts)])
    for ids, at, result in zip(prompts, cuts, results):
        for position in at:
            expected = oracle.model.empty_state()
            oracle.model.run(expected, ids[:position])
            for index in engine.model.config.linear_layers():
                ours, theirs = result.snapshots[position][index].recurrent, expected.layers[index].state
                assert (ours - theirs).abs().max().item() <= TOLERANCE * max(1.0, theirs.abs().max().item())


# ----- documents loaded from the disk tier (a restarted server) ------------------------------------
@pytest.mark.parametrize("name, state_dtype", [(m, "float32") for m in MODELS] + [("qwen3_5_text-ratio2", "bfloat16"),
                                                                                  ("minimax", "bfloat16")])
def test_documents_loaded_from_disk_match_reference(setup: Setup, tmp_path: Path, name: str, state_dtype: str) -> None:
    """An engine warms three documents into --cache-dir; a fresh engine on the same directory (a
    restarted server: its memory empty) loads all three from disk and generates what the reference
    generates (and what the first engine generates)."""
    from hypic.cache.tiers.options import TierOptions

    case = layout(21, [90, 170, 45])
    tiers = TierOptions(str(tmp_path / "cache"))
    first, oracle = setup(name, True, 8, tiers=tiers, state_cache_dtype=state_dtype)
    first.warmup(list(case.documents))
    first.close()
    restarted, _ = setup(name, True, 8, tiers=tiers, state_cache_dtype=state_dtype)
    prefill = restarted.prefill(restarted.parse(case.text))
    assert prefill.stats.segments_hit == 3 and prefill.stats.disk_cached_tokens == prefill.stats.cached_tokens > 0
    ours = engine_generation(restarted, prefill)
    if state_dtype == "float32":
        assert_same_generation(ours, oracle.generate(case), "from disk")
    assert_same_generation(ours, engine_generation(first, first.prefill(first.parse(case.text))), "as first")


# ----- several requests' passes in one batch (the serving loop's batched prefill) ------------------
@pytest.mark.parametrize("name, varlen", [(name, False) for name in MODELS]
                         + [("qwen3_5_text-ratio2", True), ("qwen3_next-moe", True)])
def test_requests_prefilled_together_match_reference(setup: Setup, monkeypatch: pytest.MonkeyPatch, name: str,
                                                     varlen: bool) -> None:
    """Three requests' prefills driven together, every round's combine passes in one
    ``combine_batch`` (as the engine loop runs them): a PIC layout with one warm and two cold
    documents (built in the same batches as the others' passes), its documents reordered behind
    another leading part, and a prompt with no documents. Each equals the reference: first logits
    and 16 greedy steps; so does a longer prompt resuming where the first ended. ``varlen``: with
    the CUDA strategy forced on the CPU, every request's runs of a linear layer in one varlen call
    (``varlen_recurrence``), several requests in one (a document being built runs apart)."""
    import hypic.runs_together as runs_together
    from hypic_testing.steps import drain_together

    widths: list[int] = []
    if varlen:
        together = runs_together.varlen_recurrence
        monkeypatch.setattr(runs_together, "runs_batched", lambda device: True)
        monkeypatch.setattr(runs_together, "varlen_recurrence", lambda *a: widths.append(len(a[2])) or together(*a))

    first = layout(23, [90, 150, 40])
    cases = [first, Layout("another leading part", tuple(first.documents[i] for i in (2, 0, 1)), "the query?"),
             Layout(random_text(random.Random(24), 130), (), "a plain question")]
    engine, oracle = setup(name, True, 8, chunk_tokens=64)
    engine.warmup([first.documents[1]])
    prefills = drain_together([engine.prefiller.prefill_steps(engine.plan(engine.parse(case.text))) for case in cases])
    assert sum(p.stats.segments_missed for p in prefills) >= 2  # the cold documents were built among the batches
    assert not varlen or max(widths) >= 2
    for case, prefill in zip(cases, prefills):
        assert_same_generation(engine_generation(engine, prefill), oracle.generate(case), case.leading[:10])
    longer = Layout(first.leading, first.documents, first.query + " and one more thing")  # resumes at the first's end
    resumed = engine.prefill(engine.parse(longer.text))
    assert resumed.stats.prefix_hit_tokens >= len(engine.parse(first.text).token_ids) - 1  # its last token's logits
    assert_same_generation(engine_generation(engine, resumed), oracle.generate(longer), "resumed")


# ----- a conversation resumed from the disk after a restart -----------------------------------------
@pytest.mark.parametrize("name", ["qwen3_5_text-ratio2", "qwen3_next-moe", "minimax", "granitemoehybrid", "kimi_linear",
                                  "hypic_scalar_rope", "nemotron_h", "gpt_oss", "mimo_v2_flash", "bailing_hybrid",
                                  "bailing_moe_linear"])
def test_a_conversation_resumed_from_disk_matches_reference(setup: Setup, tmp_path: Path, name: str) -> None:
    """Turn 1 ends on an engine with --cache-dir; a restarted engine resumes turn 2 from the state
    kept on disk (linear states, KV, sliding windows) and its first logits are the reference's full
    forward over turn 2's ids."""
    from hypic.cache.tiers.options import TierOptions

    tiers = TierOptions(str(tmp_path / "cache"))
    first, oracle = setup(name, True, 8, tiers=tiers)
    ids = first.parse(random_text(random.Random(25), 220)).token_ids
    reply = first.generate(ids, max_new_tokens=6, ignore_eos=True)
    turn2 = ids + reply.output_ids + first.parse(random_text(random.Random(26), 30)).token_ids
    first.close()
    restarted, _ = setup(name, True, 8, tiers=tiers)
    prefill = restarted.prefill(restarted.parse(turn2))
    assert prefill.stats.prefix_hit_tokens == prefill.stats.disk_cached_tokens == len(ids) + 5
    expected = oracle.model.run(oracle.model.empty_state(), turn2)[0][-1]
    assert (prefill.logits - expected).abs().max().item() <= TOLERANCE
