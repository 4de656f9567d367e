"""Tensor parallelism over two gloo ranks against one process (TP=1) for Lightning attention (MiniMax,
with and without its scaled post-norm residuals), GLA and scalar decay with RoPE: same greedy tokens,
logits within fp32 round-off, for PIC misses and hits alike; each rank holds about half the weights."""
import pytest

from hypic.parallel import TensorParallel
from hypic.parallel.launch import run_ranks
from hypic_testing import tp as rank_code

LOGIT_BOUND = 1e-4  # fp32: the ranks sum partial products in another order than one process does
SHARE_BOUND = 0.55  # every tiny variant here has vocabulary 320, so even the embedding and LM head are cut
VARIANTS = ["minimax", "minimax-residual-scales", "hypic_gla", "hypic_scalar_rope"]


@pytest.mark.parametrize("name", VARIANTS)
def test_two_ranks_match_one(checkpoint_factory, name: str) -> None:
    path = str(checkpoint_factory(name))
    expected = rank_code.greedy_run(TensorParallel(), path)
    ranks = run_ranks(rank_code.greedy_run, 2, path)
    for got in ranks:  # every rank sees the whole vocabulary's logits
        for (logits, tokens), (want_logits, want_tokens) in zip(got, expected):
            assert tokens == want_tokens
            assert (logits - want_logits).abs().max().item() < LOGIT_BOUND


@pytest.mark.parametrize("name", VARIANTS)
def test_each_rank_holds_its_share(checkpoint_factory, name: str) -> None:
    path = str(checkpoint_factory(name))
    whole = rank_code.parameter_bytes(TensorParallel(), path)
    for share in run_ranks(rank_code.parameter_bytes, 2, path):
        assert share <= SHARE_BOUND * whole
