"""Tensor parallelism of the Mamba2 families (Granite-4.0-H, Nemotron-H) over gloo ranks against one
process (TP=1), the oracle: same logits within fp32 round-off, same greedy tokens, for PIC misses
and hits alike; groups cut over the ranks (2 groups) and one group shared by them (B and C
replicated, the gated norm's mean square summed over the ranks)."""
import pytest
import torch

from hypic.parallel import TensorParallel
from hypic.parallel.launch import run_ranks
from hypic_testing import tp as rank_code

LOGIT_BOUND = 1e-4  # fp32: the ranks sum partial products in another order than one process does
BYTES_BOUND = 0.55  # a rank's parameters against the whole model's (vocabulary 320: embedding and head cut too)

VARIANTS = ["granitemoehybrid", "granitemoehybrid-dense-nope", "granitemoehybrid-tp2", "nemotron_h",
            "nemotron_h-latent-moe", "nemotron_h-dense", "nemotron_h-dense-tp2"]


def _assert_ranks_match(path: str, size: int) -> None:
    expected = rank_code.greedy_run(TensorParallel(), path)
    for got in run_ranks(rank_code.greedy_run, size, path):  # every rank sees the whole vocabulary's logits
        for (logits, tokens), (want_logits, want_tokens) in zip(got, expected):
            assert tokens == want_tokens
            assert (logits - want_logits).abs().max().item() < LOGIT_BOUND


@pytest.mark.parametrize("name", VARIANTS)
def test_two_ranks_match_one(checkpoint_factory, name: str) -> None:
    _assert_ranks_match(str(checkpoint_factory(name)), 2)


def test_four_ranks_share_two_groups(checkpoint_factory) -> None:
    """Two groups over four ranks: each group's norm spans two ranks, the second group ranks 2 and 3."""
    _assert_ranks_match(str(checkpoint_factory("granitemoehybrid")), 4)


@pytest.mark.parametrize("name", ["granitemoehybrid", "granitemoehybrid-tp2", "nemotron_h-latent-moe"])
def test_rank_holds_half(checkpoint_factory, name: str) -> None:
    path = str(checkpoint_factory(name))
    whole = rank_code.parameter_bytes(TensorParallel(), path)
    for share in run_ranks(rank_code.parameter_bytes, 2, path):
        assert share <= BYTES_BOUND * whole
