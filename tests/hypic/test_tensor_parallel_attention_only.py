"""Tensor parallelism of the attention-only families (gpt-oss, MiMo-V2-Flash: no linear layers) over
two gloo ranks against one process: same logits within fp32 round-off, same greedy tokens, misses and
hits; sinks, q/k/v biases, expert biases and per-layer-kind KV heads (replicated where fewer than the
ranks) included."""
import pytest

from hypic.parallel import TensorParallel
from hypic.parallel.launch import run_ranks
from hypic_testing import tp as rank_code

LOGIT_BOUND = 1e-4  # fp32: the ranks sum partial products in another order than one process does
SHARE_BOUND = 0.55  # a rank's parameter bytes / the whole model's: replicated norms, routers, sinks are small

# gpt_oss: 4 query / 2 KV heads in every layer; mimo_v2_flash: 4 query heads, 1 KV head in the full
# layers (replicated on both ranks), 2 in the sliding ones; gpt_oss-kv1: 1 KV head in every layer.
MODELS = ["gpt_oss", "gpt_oss-clamped", "gpt_oss-kv1", "mimo_v2_flash"]


@pytest.mark.parametrize("name", MODELS)
def test_two_ranks_match_one(checkpoint_factory, name: str) -> None:
    path = str(checkpoint_factory(name))
    expected = rank_code.greedy_run(TensorParallel(), path)
    ranks = run_ranks(rank_code.greedy_run, 2, path)
    for got in ranks:  # every rank sees the whole vocabulary's logits
        for (logits, tokens), (want_logits, want_tokens) in zip(got, expected):
            assert tokens == want_tokens
            assert (logits - want_logits).abs().max().item() < LOGIT_BOUND


@pytest.mark.parametrize("name", ["gpt_oss", "gpt_oss-kv1", "mimo_v2_flash"])
def test_each_rank_holds_about_half(checkpoint_factory, name: str) -> None:
    """Loading talks to no other rank: each rank's share is loaded in this process."""
    path = str(checkpoint_factory(name))
    whole = rank_code.parameter_bytes(TensorParallel(), path)
    for rank in range(2):
        assert rank_code.parameter_bytes(TensorParallel(rank, 2), path) <= SHARE_BOUND * whole
