"""Batched decode against the combine pass run one request and one token at a time."""
import random
from pathlib import Path

import torch

from hypic import Engine
from hypic.assembler import combine
from hypic.decode import decode_batch, delta_rule_step
from hypic.kernels.gated_delta import naive_gated_delta_rule
from hypic.segments import Run
from hypic.state import RequestState


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
    empty = RequestState.empty(model.config, "cpu", torch.float32)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 40, 17)]
    states = [combine(model, ids, [Run(0, len(ids))], empty).state for ids in prompts]
    references = list(states)
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
            for x, y in zip(vars(a).values(), vars(b).values()):
                assert torch.allclose(x, y, atol=1e-5)
