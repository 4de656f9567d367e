"""What a peer or a replica builds for another's request (``document_build_steps``): each entry is the
one the requester's own warm-up would store (compared layer by layer with a second engine's), and the
builder keeps it in its pool (a ``--workers`` peer) or only ships it (a ``--dp-size`` replica, whose
pool is for its own requests' documents)."""
import pytest
import torch

from hypic import Engine
from hypic.assembler import drain
from hypic.cache.modes import Mode
from hypic.cache.store import AttentionInterior, InteriorLayer
from hypic.router.plan import SegmentJob
from hypic.router.worker import document_build_steps

DOCUMENTS = [f"Record {i}: the heron of Welby was born in {1900 + i} and fished the river at dawn." for i in range(2)]


def _same_interior(mine: InteriorLayer, theirs: InteriorLayer) -> bool:
    """Equal K and V; or equal S_C|0, conv tail, and T_C applied to a random state (a pool may store T_C
    with its decayed heads flagged, so the forms differ while the map is the same)."""
    if isinstance(mine, AttentionInterior):
        return torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    (t_mine, s_mine), (t_theirs, s_theirs) = mine.for_compute(), theirs.for_compute()
    probe = torch.randn(s_mine.shape, generator=torch.Generator().manual_seed(0))
    return (torch.equal(s_mine, s_theirs) and torch.equal(mine.conv_tail, theirs.conv_tail)
            and torch.equal(t_mine.apply(probe), t_theirs.apply(probe)))


@pytest.mark.parametrize("keep", [True, False])
def test_built_entries_equal_the_requesters_own_and_are_kept_only_when_asked(keep: bool) -> None:
    builder, requester = (Engine.from_pretrained("default", dtype="float32") for _ in range(2))
    policy = builder.policy(Mode.HYPIC)
    jobs = [SegmentJob(builder.cache.document_key(ids, policy), ids) for ids in builder.check_documents(DOCUMENTS)]
    built = drain(document_build_steps(builder, jobs, Mode.HYPIC, keep=keep))
    requester.warmup(DOCUMENTS)
    for job, entry in zip(jobs, built):
        own = requester.cache.held_documents([job.key])[0]
        assert entry.key == job.key and entry.token_ids == own.token_ids
        assert len(entry.layers) == len(own.layers)
        for mine, theirs in zip(entry.layers, own.layers):
            assert _same_interior(mine, theirs)
    assert (builder.cache.document_keys() == {job.key for job in jobs}) is keep
    assert keep or not builder.cache.document_keys()
