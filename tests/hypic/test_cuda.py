"""The engine on CUDA (FLA's kernels, GPU attention) against the same engine on CPU.

Runs only where a GPU is present; the CPU paths are the oracle, themselves checked against
transformers and the token-loop recurrence elsewhere.
"""
import random
from pathlib import Path

import pytest
import torch

from hypic import DEFAULT_SEPARATOR as SEP, Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm()).item()


def _prompt(seed: int) -> tuple[str, list[str]]:
    rng = random.Random(seed)
    text = lambda n: "".join(rng.choice("abcdefghijklmnop ,.") for _ in range(n))  # noqa: E731
    docs = [text(rng.randint(60, 200)) for _ in range(4)]
    return text(24) + SEP + SEP.join(docs) + SEP + text(20), docs


@pytest.fixture(scope="module")
def engines(tiny_checkpoint: Path) -> dict[str, Engine]:
    return {device: Engine.from_pretrained(tiny_checkpoint, device=device, seam_width=8)
            for device in ("cpu", "cuda")}


@pytest.mark.parametrize("mode", ["full", "hypic", "naive"])
def test_prefill_on_cuda_matches_cpu(engines: dict[str, Engine], mode: str) -> None:
    prompt, docs = _prompt(1)
    results = {}
    for device, engine in engines.items():
        engine.warmup(docs)
        results[device] = engine.prefill(engine.parse(prompt), mode)
    assert _rel(results["cuda"].logits, results["cpu"].logits) < 2e-3
    for cuda_layer, cpu_layer in zip(results["cuda"].state.layers, results["cpu"].state.layers):
        if hasattr(cpu_layer, "recurrent"):
            assert _rel(cuda_layer.recurrent, cpu_layer.recurrent) < 2e-3


def test_layer0_composition_is_exact_on_cuda(engines: dict[str, Engine]) -> None:
    engine = engines["cuda"]
    prompt, docs = _prompt(2)
    engine.warmup(docs)
    hypic = engine.prefill(engine.parse(prompt), "hypic")
    full = engine.prefill(engine.parse(prompt), "full")
    assert hypic.stats.segments_hit == 4
    first = engine.model.config.linear_layers()[0]
    assert _rel(hypic.state.layers[first].recurrent, full.state.layers[first].recurrent) < 1e-3


def test_greedy_generation_on_cuda_matches_cpu(engines: dict[str, Engine]) -> None:
    prompt, _ = _prompt(3)
    outputs = {device: engine.generate(prompt, max_new_tokens=12, mode="hypic").output_ids
               for device, engine in engines.items()}
    assert outputs["cuda"] == outputs["cpu"]


def test_grouped_experts_on_cuda_match_the_loop() -> None:
    """The MoE's two grouped matmuls (bfloat16 on Hopper) against its per-expert loop on the same GPU."""
    from hypic.models.mlp import expert_outputs, grouped_mm_runs
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(8, 128, 64, device="cuda", generator=gen).bfloat16()
    down = torch.randn(8, 64, 64, device="cuda", generator=gen).bfloat16()
    inputs = torch.randn(40, 64, device="cuda", generator=gen).bfloat16()
    counts = torch.tensor([5, 0, 12, 1, 0, 0, 20, 2], device="cuda")
    if not grouped_mm_runs(inputs):
        pytest.skip("torch._grouped_mm does not run bfloat16 on this GPU")
    grouped = expert_outputs(inputs, counts, gate_up, down, grouped=True)
    looped = expert_outputs(inputs, counts, gate_up, down, grouped=False)
    assert _rel(grouped, looped) < 1e-2


def test_moe_checkpoint_in_bfloat16_on_cuda_tracks_float32_on_cpu(checkpoint_factory) -> None:
    """A MoE hybrid in bfloat16 on the GPU (grouped experts, batched seam runs) against float32 on the CPU."""
    path = checkpoint_factory("qwen3_5_moe_text")
    prompt, docs = _prompt(4)
    logits = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16")):
        engine = Engine.from_pretrained(path, device=device, dtype=dtype, seam_width=8)
        engine.warmup(docs)
        prefill = engine.prefill(engine.parse(prompt), "hypic")
        assert prefill.stats.segments_hit == 4
        logits[device] = prefill.logits
    assert _rel(logits["cuda"], logits["cpu"]) < 3e-2


def test_requests_prefilled_together_on_cuda_match_each_alone(engines: dict[str, Engine],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Four requests (two PIC over cached documents, two cold) prefilled together as the engine loop
    batches them: each linear layer's runs of all four in FLA's varlen calls, each request from its
    own entering state; every request's logits equal its prefill alone on the CPU."""
    import hypic.assembler as assembler
    from hypic_testing.steps import drain_together

    widths: list[int] = []
    together = assembler.recurrences_together
    monkeypatch.setattr(assembler, "recurrences_together", lambda *a: widths.append(len(a[2])) or together(*a))
    prompts = [_prompt(seed)[0] for seed in (5, 6)] + [_prompt(seed)[0].replace(SEP, " ") for seed in (7, 8)]
    cuda, cpu = engines["cuda"], engines["cpu"]
    for engine in (cuda, cpu):
        engine.warmup([doc for seed in (5, 6) for doc in _prompt(seed)[1]])
        engine.prefix_cache.clear()
    batched = drain_together([cuda.prefill_steps(cuda.plan(cuda.parse(p))) for p in prompts])
    assert max(widths) == 4
    for prompt, result in zip(prompts, batched):
        alone = cpu.prefill(cpu.parse(prompt), "hypic")
        assert _rel(result.logits, alone.logits) < 2e-3


def test_host_memory_on_cuda_hands_back_evicted_documents(tiny_checkpoint: Path) -> None:
    """L2 on a GPU server: a device pool for one document above pinned host memory for all; a request
    over three documents takes two from host memory (copies started when it was planned) and its
    logits equal the CPU engine's over the same documents."""
    from hypic.cache.tiers.options import TierOptions

    prompt, docs = _prompt(9)
    probe = Engine.from_pretrained(tiny_checkpoint, device="cuda", seam_width=8)
    sizes = [probe.entry_bytes(len(probe.tokenizer.encode(d))) for d in docs]
    engine = Engine.from_pretrained(tiny_checkpoint, device="cuda", seam_width=8, public_pool_bytes=max(sizes),
                                    tiers=TierOptions(host_bytes=sum(sizes)))
    engine.warmup(docs)
    host = engine.store.lower
    assert len(host.entries) == len(docs) - 1
    assert all(t.is_pinned() for entry in host.entries.values() for t in _tensors(entry))
    engine.prefetch(engine.plan(engine.parse(prompt)))
    assert len(host.staged) >= 2
    result = engine.prefill(engine.parse(prompt), "hypic")
    assert result.stats.cached_tokens_by_tier["host"] > 0 and result.stats.segments_hit == len(docs)
    cpu = Engine.from_pretrained(tiny_checkpoint, device="cpu", seam_width=8)
    cpu.warmup(docs)
    assert _rel(result.logits, cpu.prefill(cpu.parse(prompt), "hypic").logits) < 2e-3


def _tensors(entry) -> list[torch.Tensor]:
    from hypic.cache.store import entry_tensors
    return entry_tensors(entry)
