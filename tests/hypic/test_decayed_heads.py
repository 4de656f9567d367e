"""Decayed heads of a dense T_C: a head whose T_C is exactly zero is stored as a flag, not a matrix,
and composes as zero.

Oracles: the definition S' = T_C S + S_C|0 with the full matrices (an engine whose flagging is
turned off builds the same documents), closed-form values (a subnormal entry times 2^126), and
the independent reference of HYPIC's semantics (``tests/reference``: a token loop that never
forms T_C) for whole requests, from memory and from the disk tier. The tiny checkpoints remember
long (no head decays); ``make_fast_decay`` gives chosen heads transformers' kind of fast gate.
"""
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from hypic import Engine
from hypic.cache.composition import Family, Transition, compose_states
from hypic.cache.store import LinearInterior, SegmentEntry, SegmentStore
from hypic.cache.tiers.entry_file import BadEntryFile, decode_entry, encode_entry
from hypic.cache.tiers.options import TierOptions
from hypic_reference import semantics as reference
from hypic_reference.model import ReferenceModel
from hypic_testing.checkpoints import make_fast_decay
from hypic_testing.entry_files import entry_identity, join_entry_file, split_entry_file
from tokenizers import Tokenizer

TOLERANCE = 1e-4  # the fidelity tests' bound on logits against the reference
STEPS = 8
SEAM = 3  # short seams: what a fast head carries across one still shows in the logits
EVEN_HEADS = slice(0, None, 2)
TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. "
LONG_DOCUMENT = (TEXT * 4)[:300]
MakeCheckpoint = Callable[[str, slice | None], Path]


@pytest.fixture
def checkpoint(checkpoint_factory: Callable[..., Path], tmp_path: Path) -> MakeCheckpoint:
    """``checkpoint(name, heads)`` -> a copy of the long-memory tiny checkpoint ``name`` whose linear
    heads ``heads`` decay fast (None: none do)."""

    def make(name: str, heads: slice | None) -> Path:
        path = Path(shutil.copytree(checkpoint_factory(name, long_memory=True), tmp_path / f"{name}-{heads}"))
        return path if heads is None else make_fast_decay(path, heads)

    return make


def linear_layers(entry: SegmentEntry) -> Iterator[LinearInterior]:
    for layer in entry.layers:
        if isinstance(layer, LinearInterior):
            assert layer.transition is not None
            yield layer


def build(engine: Engine, text: str) -> SegmentEntry:
    ids = tuple(engine.tokenizer.encode(text))
    return engine.segment_entry(ids, engine.policy("hypic"))[0]


def unflagged(path: Path, text: str, monkeypatch: pytest.MonkeyPatch) -> SegmentEntry:
    """The entry as it was before flags: every head's matrix stored."""
    with monkeypatch.context() as patched:
        patched.setattr(Transition, "without_decayed", lambda self: self)
        return build(Engine.from_pretrained(path, seam_width=SEAM), text)


def prefix_states(like: torch.Tensor, scale: float) -> torch.Tensor:
    """A prefix state of ``scale``-sized entries (any finite state may come before a document)."""
    generator = torch.Generator().manual_seed(7)
    return scale * torch.randn(like.shape, generator=generator)


def composed(layer: LinearInterior, prefix: torch.Tensor) -> torch.Tensor:
    return compose_states(prefix, [layer.for_compute()])


def by_definition(layer: LinearInterior, prefix: torch.Tensor) -> torch.Tensor:
    """S' = T_C S + S_C|0 with T_C a full [H, K, K] matrix."""
    assert layer.transition is not None and layer.transition.kept is None
    return layer.transition.value.float() @ prefix + layer.zero_start_state.float()


# ----- the rule, in closed form -------------------------------------------------------------------
def test_only_an_exactly_zero_head_is_flagged() -> None:
    """Four heads: zero, one subnormal entry (2^-149), entries of 1e-30, of 1. Only the zero head is
    flagged: against a prefix state of 2^126 the subnormal entry alone moves the state by 2^-23 and
    the 1e-30 head by ~1e8, so no nonzero head can be dropped for every prefix."""
    value = torch.zeros(4, 3, 3)
    value[1, 0, 2] = 2.0 ** -149
    value[2] = 1e-30 * torch.randn(3, 3, generator=torch.Generator().manual_seed(1))
    value[3] = torch.eye(3)
    flagged = Transition(Family.DENSE, value).without_decayed()
    assert flagged.kept == (False, True, True, True) and flagged.value.shape == (3, 3, 3)
    assert torch.equal(flagged.value, value[1:]) and flagged.shape == (4, 3, 3)
    prefix, zero_start = torch.full((4, 3, 2), 2.0 ** 126), torch.ones(4, 3, 2)
    expected = value @ prefix + zero_start
    assert torch.equal(compose_states(prefix, [(flagged, zero_start)]), expected)
    assert expected[1, 0, 0] == 1 + 2.0 ** -23 and torch.equal(expected[0], zero_start[0])


def test_scalar_and_diagonal_transitions_are_never_flagged() -> None:
    """Their T_C is a number or a vector a head: a flag would save nothing."""
    for family, shape in ((Family.SCALAR, (4,)), (Family.DIAGONAL, (4, 3))):
        transition = Transition(family, torch.zeros(shape)).without_decayed()
        assert transition.kept is None and transition.value.shape == shape


# ----- entries built by the engine ----------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen3_5_text-ratio2", "kimi_linear"])
def test_fast_heads_are_flagged_and_compose_as_the_full_matrices_do(checkpoint: MakeCheckpoint, name: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Even heads decay fast, odd ones remember: on a 300-token document every layer flags exactly
    the even heads (whose full T_C is exactly zero), stores the odd heads' matrices as they were,
    and composes bit for bit as the full matrices do, behind a prefix state of entries ~1e30."""
    path = checkpoint(name, EVEN_HEADS)
    entry, full = build(Engine.from_pretrained(path, seam_width=SEAM), LONG_DOCUMENT), unflagged(path, LONG_DOCUMENT,
                                                                                                   monkeypatch)
    for layer, whole in zip(linear_layers(entry), linear_layers(full), strict=True):
        heads = whole.transition.value.shape[0]
        assert layer.transition.kept == tuple(h % 2 == 1 for h in range(heads))
        assert not whole.transition.value[0::2].any() and whole.transition.value[1::2].abs().amax((1, 2)).min() > 0
        assert torch.equal(layer.transition.value, whole.transition.value[1::2])
        prefix = prefix_states(layer.zero_start_state, 1e30)
        assert torch.equal(composed(layer, prefix), by_definition(whole, prefix))
    saved = sum(whole.transition.nbytes // 2 for whole in linear_layers(full))
    assert entry.nbytes == full.nbytes - saved


def test_every_head_decays_and_the_entry_holds_no_transition(checkpoint: MakeCheckpoint,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every head fast: no layer stores a matrix (the public pool's slot holds S_C|0 alone), and the
    composed state is S_C|0 itself, as the full (zero) matrices give, whatever the prefix."""
    path = checkpoint("qwen3_5_text-ratio2", slice(None))
    entry, full = build(Engine.from_pretrained(path, seam_width=SEAM), LONG_DOCUMENT), unflagged(path, LONG_DOCUMENT,
                                                                                                   monkeypatch)
    for layer, whole in zip(linear_layers(entry), linear_layers(full), strict=True):
        assert not any(layer.transition.kept) and layer.transition.value.numel() == 0 and layer.owner is not None
        prefix = prefix_states(layer.zero_start_state, 1e30)
        assert torch.equal(composed(layer, prefix), by_definition(whole, prefix))
        assert torch.equal(composed(layer, prefix), layer.zero_start_state)
    assert entry.nbytes == full.nbytes - sum(whole.transition.nbytes for whole in linear_layers(full))


def test_no_head_decays_and_every_matrix_is_stored(checkpoint: MakeCheckpoint) -> None:
    """The long-memory model: no T_C has a zero head, so none is flagged and every matrix is kept."""
    engine = Engine.from_pretrained(checkpoint("qwen3_5_text-ratio2", None), seam_width=SEAM)
    entry = build(engine, LONG_DOCUMENT)
    config = engine.model.config
    for layer in linear_layers(entry):
        assert layer.transition.kept is None
        assert layer.transition.value.shape == (config.linear_num_value_heads, config.linear_key_head_dim,
                                                config.linear_key_head_dim)


# ----- whole requests against the reference ------------------------------------------------------
def reference_generation(path: Path, leading: str, documents: list[str], query: str) -> tuple[list[int], list[torch.Tensor]]:
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False).ids)  # noqa: E731
    model = ReferenceModel(path)
    request = reference.PicRequest(ids(leading), tuple(ids(d) for d in documents), ids(query))
    logits, state = reference.prefill(model, request, SEAM, model.config.conv_kernel)
    return reference.greedy(model, state, logits, STEPS)


def engine_generation(engine: Engine, text: str) -> tuple[list[int], list[torch.Tensor], int]:
    prefill = engine.prefill(engine.parse(text))
    logits, state, tokens, seen = prefill.logits, prefill.state, [], []
    for _ in range(STEPS):
        seen.append(logits)
        tokens.append(int(logits.argmax()))
        logits, state = engine.decode_step(state, tokens[-1])
    return tokens, seen, prefill.stats.segments_hit


DOCUMENTS = [LONG_DOCUMENT, TEXT[:60], (TEXT * 3)[30:170]]
LEADING, QUERY = "a system prompt of some length", " so which jug was in the box?"


def assert_matches_reference(path: Path, engine: Engine) -> None:
    from hypic import DEFAULT_SEPARATOR as SEP

    expected_tokens, expected_logits = reference_generation(path, LEADING, DOCUMENTS, QUERY)
    tokens, logits, hits = engine_generation(engine, SEP.join([LEADING, *DOCUMENTS, QUERY]))
    assert hits == len(DOCUMENTS)
    for step, (ours, theirs) in enumerate(zip(logits, expected_logits, strict=True)):
        assert (ours - theirs).abs().max().item() <= TOLERANCE, f"step {step}"
    assert tokens == expected_tokens


@pytest.mark.parametrize("name", ["qwen3_5_text-ratio2", "kimi_linear"])
def test_warm_documents_with_flagged_heads_match_reference(checkpoint: MakeCheckpoint, name: str) -> None:
    """Documents warmed into the public pool with their fast heads flagged are spliced as the
    reference splices them (logits to 1e-4, the same greedy tokens)."""
    path = checkpoint(name, EVEN_HEADS)
    engine = Engine.from_pretrained(path, seam_width=SEAM)
    engine.warmup(DOCUMENTS)
    flagged = [layer.transition.decayed_heads for e in engine.cache.public.entries.values() for layer in linear_layers(e)]
    assert sum(flagged) > 0
    assert_matches_reference(path, engine)


# ----- the disk tier -------------------------------------------------------------------------------
def test_flagged_entries_round_trip_through_the_disk_tier(checkpoint: MakeCheckpoint, tmp_path: Path) -> None:
    """A file keeps the flags in its header (covered by the checksum) and only the kept heads'
    matrices; decoded, the entry equals the one written; a restarted engine splices it as the
    reference does. A flag flipped in the header, or the previous format's name, is refused."""
    path = checkpoint("qwen3_5_text-ratio2", EVEN_HEADS)
    tiers = TierOptions(str(tmp_path / "cache"))
    first = Engine.from_pretrained(path, seam_width=SEAM, tiers=tiers)
    entry = build(first, LONG_DOCUMENT)
    first.warmup(DOCUMENTS)
    first.close()
    ident = entry_identity(first)
    data = encode_entry(entry, ident)
    header, body = split_entry_file(data)
    heads = first.model.config.linear_num_value_heads
    kept = json.loads(header["__metadata__"]["kept_heads"])
    assert kept and all(flags == "01" * (heads // 2) for flags in kept.values())
    assert all(header[f"{index}.transition"]["shape"][0] == heads // 2 for index in kept)
    decoded = decode_entry(data, ident, entry.key, entry.token_ids)
    pool = SegmentStore()
    into_slots = decode_entry(data, ident, entry.key, entry.token_ids, pool.arenas)  # a load for the pool
    for ours, slotted, theirs in zip(linear_layers(decoded), linear_layers(into_slots), linear_layers(entry), strict=True):
        assert ours.transition.kept == slotted.transition.kept == theirs.transition.kept
        assert torch.equal(ours.transition.value, theirs.transition.value)
        assert torch.equal(ours.zero_start_state, theirs.zero_start_state)
        assert torch.equal(slotted.transition.value, theirs.transition.value)
        assert torch.equal(slotted.zero_start_state, theirs.zero_start_state)
        assert slotted.owner.arena.fields == theirs.owner.arena.fields  # the kept heads' slot, as the pool's own
    assert pool.put(into_slots) and pool.arenas.used_slots == len(list(linear_layers(entry)))  # stored in them, no copy
    restarted = Engine.from_pretrained(path, seam_width=SEAM, tiers=tiers)
    assert_matches_reference(path, restarted)
    restarted.close()
    index = next(iter(kept))
    flipped = dict(kept, **{index: "11" + kept[index][2:]})
    header["__metadata__"]["kept_heads"] = json.dumps(flipped)
    with pytest.raises(BadEntryFile):
        decode_entry(join_entry_file(header, body), ident, entry.key, entry.token_ids)
    header["__metadata__"]["kept_heads"] = json.dumps(kept)
    header["__metadata__"]["format"] = "hypic-segment-entry/2"
    with pytest.raises(BadEntryFile, match="format"):
        decode_entry(join_entry_file(header, body), ident, entry.key, entry.token_ids)


def test_tensor_parallel_ranks_hold_entries_of_the_same_bytes(checkpoint: MakeCheckpoint) -> None:
    """Under tensor parallelism the ranks' pools decide alike only if an entry takes the same bytes on
    each: with the fast heads all on rank 0 (the first half of the heads), neither rank flags any."""
    from hypic.parallel.launch import run_ranks
    from hypic_testing import tp
    path = checkpoint("qwen3_5_text-ratio2", slice(0, 2))
    first, second = run_ranks(tp.pool_bytes_after_warmup, 2, str(path), LONG_DOCUMENT)
    assert first == second > 0
