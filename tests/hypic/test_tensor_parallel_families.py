"""Tensor parallelism of every family over two gloo ranks against one process (TP=1), the oracle: the
same greedy tokens and logits within fp32 round-off, for a plain prompt and a PIC prompt's misses and
hits; each rank holds about half of the weights. All variants run in one start of the two ranks."""
import pytest

from hypic.parallel import TensorParallel
from hypic.parallel.launch import run_ranks
from hypic_testing import tp as rank_code
from hypic_testing.fidelity import Generation, Oracle, assert_same_generation, layout

LOGIT_BOUND = 1e-4  # fp32: the ranks sum partial products in another order than one process does
SHARE_BOUND = 0.55  # a rank's parameter bytes / the whole model's: vocabulary 320 is cut too; norms,
#                     routers, sinks and latent down projections stay replicated, a few percent here

VARIANTS = [
    # Gated DeltaNet + gated attention; MoE tensor parallel within experts (Qwen3-Next packs q/k/v/z per key head)
    "qwen3_5_text-ratio2", "qwen3_next-moe", "qwen3_5_moe_text",
    # Kimi Delta Attention + latent attention (kv latent replicated, kv_b cut per head)
    "kimi_linear", "kimi_linear-dense-q-lora", "bailing_hybrid", "bailing_hybrid-dense-softplus",
    # Lightning (a norm over all heads: mean square summed over the ranks; slopes by global head), GLA, scalar_rope
    "minimax", "minimax-residual-scales", "hypic_gla", "hypic_scalar_rope",
    # scalar_rope in Ring-linear's form: [Q | K | V] blocks cut by head, one output-norm group per rank; GQA softmax
    "bailing_moe_linear",
    # Mamba2: two groups cut over the ranks, or one group (-tp2: B and C replicated, its norm summed over ranks)
    "granitemoehybrid", "granitemoehybrid-dense-nope", "granitemoehybrid-tp2", "nemotron_h",
    "nemotron_h-latent-moe", "nemotron_h-dense", "nemotron_h-dense-tp2",
    # attention only: sinks, q/k/v and expert biases, KV heads per layer kind (one KV head: replicated)
    "gpt_oss", "gpt_oss-clamped", "gpt_oss-kv1", "mimo_v2_flash",
]


@pytest.fixture(scope="module")
def two_ranks(checkpoint_factory) -> dict[str, list]:
    """{variant: each rank's greedy runs}, from one start of two ranks."""
    paths = {name: str(checkpoint_factory(name)) for name in VARIANTS}
    ranks = run_ranks(rank_code.greedy_runs, 2, paths)
    return {name: [rank[name] for rank in ranks] for name in VARIANTS}


def _assert_matches(got: list, expected: list) -> None:
    for (logits, tokens), (want_logits, want_tokens) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        assert (logits - want_logits).abs().max().item() < LOGIT_BOUND


@pytest.mark.parametrize("name", VARIANTS)
def test_two_ranks_match_one(two_ranks: dict[str, list], checkpoint_factory, name: str) -> None:
    expected = rank_code.greedy_run(TensorParallel(), str(checkpoint_factory(name)))
    for got in two_ranks[name]:  # every rank sees the whole vocabulary's logits
        _assert_matches(got, expected)


def test_four_ranks_share_two_mamba_groups(checkpoint_factory) -> None:
    """Two groups over four ranks: each group's norm spans two ranks, the second group ranks 2 and 3."""
    path = str(checkpoint_factory("granitemoehybrid"))
    expected = rank_code.greedy_run(TensorParallel(), path)
    for got in run_ranks(rank_code.greedy_run, 4, path):
        _assert_matches(got, expected)


@pytest.mark.parametrize("name", VARIANTS)
def test_each_rank_holds_about_half(checkpoint_factory, name: str) -> None:
    path = str(checkpoint_factory(name))
    whole = rank_code.parameter_bytes(TensorParallel(), path)
    shares = [rank_code.parameter_bytes(TensorParallel(rank, 2), path) for rank in range(2)]
    assert all(share <= SHARE_BOUND * whole for share in shares), (shares, whole)
    assert sum(shares) >= whole  # nothing dropped: replicated parts are counted on both ranks


FIDELITY_VARIANTS = VARIANTS


@pytest.fixture(scope="module")
def two_ranks_fidelity(checkpoint_factory) -> dict[str, list]:
    """{variant: each rank's cold and warm generations of the fidelity layout}, long-memory copies (where
    HYPIC's splice differs from full recompute), from one start of two ranks."""
    paths = {name: str(checkpoint_factory(name, long_memory=True)) for name in FIDELITY_VARIANTS}
    ranks = run_ranks(rank_code.fidelity_runs, 2, paths)
    return {name: [rank[name] for rank in ranks] for name in FIDELITY_VARIANTS}


@pytest.mark.parametrize("name", FIDELITY_VARIANTS)
def test_fidelity_layout_at_two_ranks_matches_the_reference(two_ranks_fidelity: dict[str, list], checkpoint_factory,
                                                            reference_factory, name: str) -> None:
    """The independent reference's HYPIC generation (tests/reference: token loop and splice rule) of the
    fidelity tests' layout, against both ranks' cold and warm runs, to the fidelity tests' bound."""
    path = checkpoint_factory(name, long_memory=True)
    expected = Oracle(reference_factory(path), path, 8).generate(layout(1, [70, 260, 41]))
    for rank in two_ranks_fidelity[name]:
        for kind, (tokens, logits, hit, missed) in rank.items():
            assert (hit, missed) == ((3, 0) if kind == "warm" else (0, 3)), kind
            assert_same_generation(Generation(tokens, logits), expected, f"{name} {kind}")
