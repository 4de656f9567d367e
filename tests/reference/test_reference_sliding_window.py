"""HYPIC's splice rule on the sliding-window hybrids (gpt-oss, MiMo-V2-Flash), as the reference states it.

Without an interior, ``semantics.prefill`` is the plain forward. With one, an absorbed token reaches a
later query only through the windows: in a model whose layers all slide (window W, ``layers`` of them)
the last token's logits depend on the last ``layers * (W - 1)`` positions alone, and an interior token's
isolated inputs differ from its in-context ones only if its isolated prefill missed context, i.e. within
``(layers - 1) * (W - 1)`` tokens of its segment's start. So the splice shows in the logits when the
interior is within a window or so of the query, and not when its context-starved head is out of reach.
"""
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hypic.loading.checkpoints import FAMILY_CONFIGS, write_random_checkpoint
from hypic_testing.checkpoints import make_long_memory
from hypic_reference.model import AttentionMemory, ReferenceModel
from hypic_reference.semantics import PicRequest, interiors, prefill

SLIDING_WINDOW_TYPES = ("gpt_oss", "mimo_v2_flash")
SAME = 1e-5  # fp32 noise between runs of different lengths
CHANGED = 1e-4  # the tiny gpt-oss moves its logits by about 1e-3 at most (long memory), MiMo by about 0.1
SEAM = 2  # conv kernel 1: the head seam is the seam width


def _tokens(generator: torch.Generator, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 256, (n,), generator=generator).tolist())


def _plain(model: ReferenceModel, ids: list[int]) -> torch.Tensor:
    """The last token's logits [vocab] of the plain forward."""
    return model.run(model.empty_state(), ids)[0][-1]


@pytest.mark.parametrize("name", SLIDING_WINDOW_TYPES)
def test_prefill_without_interiors_is_the_plain_forward(checkpoint_factory: Callable[..., Path],
                                                        reference_factory: Callable[[Path], ReferenceModel],
                                                        name: str) -> None:
    """Segments no longer than twice the seam have no interior: logits and every layer's memory (window
    layers keep every key) are those of the plain forward, here fed in two runs."""
    model = reference_factory(checkpoint_factory(name, long_memory=True))
    generator = torch.Generator().manual_seed(1)
    request = PicRequest(_tokens(generator, 5), (_tokens(generator, 20), _tokens(generator, 32)), _tokens(generator, 6))
    assert interiors(request, 16, model.config.conv_kernel) == []
    logits, state = prefill(model, request, 16, model.config.conv_kernel)
    ids, plain = request.token_ids, model.empty_state()
    expected = torch.cat([model.run(plain, ids[:40])[0], model.run(plain, ids[40:])[0]])[-1]
    assert (logits - expected).abs().max().item() <= SAME
    assert state.length == plain.length == len(ids)
    for ours, theirs in zip(state.layers, plain.layers):
        assert isinstance(ours, AttentionMemory) and isinstance(theirs, AttentionMemory)
        assert (ours.keys - theirs.keys).abs().max().item() <= SAME
        assert (ours.values - theirs.values).abs().max().item() <= SAME


@pytest.fixture(scope="module", params=SLIDING_WINDOW_TYPES)
def all_sliding(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ReferenceModel:
    """The tiny long-memory checkpoint of a model type with every layer a sliding-window one (window 8)."""
    layers = FAMILY_CONFIGS[request.param]["num_hidden_layers"]
    path = tmp_path_factory.mktemp(f"{request.param}-all-sliding")
    write_random_checkpoint(path, request.param, layer_types=["sliding_attention"] * layers)
    return ReferenceModel(make_long_memory(path))


def test_the_window_bounds_what_the_splice_changes(all_sliding: ReferenceModel) -> None:
    """One document, seam 2, a one-token query. Short document: the whole interior is within reach and
    its head lacks the leading context, so the logits differ from the plain forward. Long document: the
    head is out of reach and the absorbed tokens in reach equal their in-context selves (isolated keys
    rotated at their global positions), so the logits equal the plain forward although they depend on
    those tokens, and replacing the interior's head changes nothing."""
    model, generator = all_sliding, torch.Generator().manual_seed(3)
    c = model.config
    reach = len(c.layer_types) * (c.window - 1)
    leading = _tokens(generator, 5)

    short = PicRequest(leading, (_tokens(generator, c.window + 2),), _tokens(generator, 1))
    assert len(interiors(short, SEAM, c.conv_kernel)) == 1
    near = prefill(model, short, SEAM, c.conv_kernel)[0]
    assert (near - _plain(model, short.token_ids)).abs().max().item() >= CHANGED

    document = _tokens(generator, 3 * reach)
    long = PicRequest(leading, (document,), _tokens(generator, 1))
    (interior,) = interiors(long, SEAM, c.conv_kernel)
    assert len(long.token_ids) - 1 - reach > interior.lo + reach  # the interior's first `reach` tokens are out of reach
    expected = _plain(model, long.token_ids)
    assert (prefill(model, long, SEAM, c.conv_kernel)[0] - expected).abs().max().item() <= SAME

    late = list(long.token_ids)  # a token late in the interior: the plain logits depend on it
    late[interior.hi - 5] = (late[interior.hi - 5] + 1) % 256
    assert (_plain(model, late) - expected).abs().max().item() >= CHANGED

    head = interior.lo - interior.start  # the interior's first `window` tokens replaced
    renewed = tuple(t if not head <= i < head + c.window else (t + 1) % 256 for i, t in enumerate(document))
    replaced = PicRequest(leading, (renewed,), long.trailing)
    assert (prefill(model, replaced, SEAM, c.conv_kernel)[0] - expected).abs().max().item() <= SAME
