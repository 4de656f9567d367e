"""Tensor parallelism over two gloo ranks against one process (TP=1), the oracle: same logits within
fp32 round-off, same greedy tokens, for PIC misses and hits alike."""
import pytest
import torch

from hypic.parallel import TensorParallel
from hypic.parallel.launch import run_ranks
from hypic_testing import tp as rank_code

LOGIT_BOUND = 1e-4  # fp32: the ranks sum partial products in another order than one process does


@pytest.mark.parametrize("name", ["qwen3_5_text-ratio2", "qwen3_next-moe", "qwen3_5_moe_text"])
def test_two_ranks_match_one(checkpoint_factory, name: str) -> None:
    path = str(checkpoint_factory(name))
    expected = rank_code.greedy_run(TensorParallel(), path)
    ranks = run_ranks(rank_code.greedy_run, 2, path)
    for got in ranks:  # every rank sees the whole vocabulary's logits
        for (logits, tokens), (want_logits, want_tokens) in zip(got, expected):
            assert tokens == want_tokens
            assert (logits - want_logits).abs().max().item() < LOGIT_BOUND
