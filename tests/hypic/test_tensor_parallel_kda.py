"""Tensor parallelism of the Kimi Delta Attention families (Kimi-Linear, Bailing-hybrid) over two gloo
ranks against one process (TP=1): KDA cut by heads, latent attention cut by heads with its kv latent
replicated; same greedy tokens and logits within fp32 round-off, for PIC misses and hits alike."""
import pytest

from hypic.parallel import TensorParallel
from hypic.parallel.launch import run_ranks
from hypic_testing import tp as rank_code

LOGIT_BOUND = 1e-4  # fp32: the ranks sum partial products in another order than one process does
SHARE_BOUND = 0.55  # a rank's parameter bytes over TP=1's: half, plus the small replicated parts
VARIANTS = ["kimi_linear", "kimi_linear-dense-q-lora", "bailing_hybrid", "bailing_hybrid-dense-softplus"]


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
def test_each_rank_holds_about_half(checkpoint_factory, name: str) -> None:
    """Vocabulary 320 is cut over the ranks; what stays replicated (norms, the kv and q latents' down
    projections, KDA's low-rank f_a, g_a, the routers) is a few percent of the tiny models."""
    path = str(checkpoint_factory(name))
    whole = rank_code.parameter_bytes(TensorParallel(), path)
    for share in run_ranks(rank_code.parameter_bytes, 2, path):
        assert share <= SHARE_BOUND * whole, f"a rank holds {share / whole:.3f} of the model"
