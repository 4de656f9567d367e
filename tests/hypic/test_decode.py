"""Batched decode against the combine pass run one request and one token at a time."""
import random
from pathlib import Path

import pytest
import torch

from hypic import Engine
from hypic.assembler import combine
from hypic.decode import decode_batch
from hypic.kernels.gated_delta import gated_delta_step as delta_rule_step
from hypic.kernels.gated_delta import naive_gated_delta_rule
from hypic.models.mlp import SparseMoE
from hypic.cache.segments import Run
from hypic.state import RequestState
from hypic.models.families import empty_state


def test_delta_rule_step_matches_token_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    b, h, k, v = 3, 2, 8, 4
    q, key = (torch.nn.functional.normalize(torch.randn(b, h, k, generator=gen), dim=-1) for _ in range(2))
    values, g, beta = torch.randn(b, h, v, generator=gen), -torch.rand(b, h, generator=gen), torch.rand(b, h, generator=gen)
    state = torch.randn(b, h, k, v, generator=gen)
    out, new = delta_rule_step(state, q, key, values, g, beta)
    for i in range(b):
        ref_out, ref_state = naive_gated_delta_rule(q[i : i + 1], key[i : i + 1], values[i : i + 1], g[i : i + 1],
                                                    beta[i : i + 1], state[i])
        assert torch.allclose(out[i], ref_out[0], atol=1e-6) and torch.allclose(new[i], ref_state, atol=1e-6)


def test_batched_decode_matches_one_request_at_a_time(tiny_checkpoint: Path) -> None:
    engine = Engine.from_pretrained(tiny_checkpoint)
    model, rng = engine.model, random.Random(0)
    def empty() -> RequestState:
        return empty_state(model.config, "cpu", torch.float32)

    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 40, 17)]
    states = [combine(model, ids, [Run(0, len(ids))], empty()).state for ids in prompts]
    references = [s.fork() for s in states]  # decode grows ``states`` in place
    for _ in range(4):
        tokens = [rng.randrange(256) for _ in prompts]
        logits, states = decode_batch(model, states, tokens)
        for b, token in enumerate(tokens):
            ids = references[b].token_ids + [token]
            step = combine(model, ids, [Run(references[b].length, 1)], references[b])
            references[b] = step.state
            assert (logits[b] - step.logits).abs().max().item() < 1e-4
    for ours, ref in zip(states, references):
        assert ours.length == ref.length and ours.token_ids == ref.token_ids
        for a, b in zip(ours.layers, ref.layers):
            for x, y in zip(a.tensors(), b.tensors()):
                assert torch.allclose(x, y, atol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_grouped_moe_equals_the_per_token_reference(top_k: int) -> None:
    """Every token through its own top-k experts, one at a time, plus the gated shared expert."""
    torch.manual_seed(top_k)
    experts, hidden, size = 8, 16, 12
    moe = SparseMoE(hidden, experts, top_k, size, 10, norm_topk=True)
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(23, hidden)
    expected = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(moe.router.weight @ x[t], dim=-1)
        top, chosen = probs.topk(top_k)
        for weight, e in zip(top / top.sum(), chosen.tolist()):
            gate, up = (moe.gate_up_proj[e] @ x[t]).chunk(2)
            expected[t] += weight * (moe.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
        shared = moe.shared_expert.down_proj.weight @ (torch.nn.functional.silu(moe.shared_expert.gate_proj.weight @ x[t])
                                                       * (moe.shared_expert.up_proj.weight @ x[t]))
        expected[t] += torch.sigmoid(moe.shared_expert_gate.weight @ x[t]) * shared
    with torch.no_grad():
        assert (moe(x) - expected).abs().max().item() <= 1e-5


def _decode_step_allocations(engine: Engine, context: int) -> int:
    """Bytes the PyTorch allocator hands out during one decode step after ``context`` tokens."""
    ids = [random.Random(context).randrange(256) for _ in range(context)]
    state = engine.prefill(engine.parse(ids), "full").state
    state.reserve(context + 4)
    engine.decode_step(state, 5)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.decode_step(state, 6)
    return sum(event.self_cpu_memory_usage for event in prof.events() if event.self_cpu_memory_usage > 0)


def test_decode_step_copies_nothing_the_request_holds(tiny_checkpoint: Path) -> None:
    """From 256 to 4000 tokens of context the allocations of a decode step stay flat: the new key and
    value go into the reserved buffer and attention reads views (the KV held grows 16x)."""
    engine = Engine.from_pretrained(tiny_checkpoint)
    short, long = _decode_step_allocations(engine, 256), _decode_step_allocations(engine, 4000)
    config = engine.model.config
    kv_bytes = 4000 * 2 * config.num_key_value_heads * config.head_dim * 4 * len(config.attention_layers())
    print(f"allocated per step: {short} B at 256 tokens, {long} B at 4000 (KV held: {kv_bytes} B)")
    assert long - short < 0.05 * kv_bytes
