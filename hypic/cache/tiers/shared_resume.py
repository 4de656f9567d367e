"""The private pool's resume points in Mooncake Store, found by other servers without a listing.

The disk tier lists its files at start, so a request's prefixes are matched against a set of
names. Mooncake cannot list objects, and probing every prefix of an 8k-token prompt would be 8k
existence checks. So each resume point at position p is put with a small marker named by the hash
of its prompt up to ``p - p % BLOCK``: a request probes one marker per ``BLOCK`` tokens of its
prompt in one batched call, then the positions of the longest marked blocks in a second one. A
resume point's KV chunks are put only where the store lacks them (one batched check). Every kind
of object is immutable (a put of a name that exists keeps the first value), so servers
writing the same conversation at once never conflict; a marker whose resume point the master
evicted only costs a probe.
"""
import logging
from typing import Protocol

import numpy as np

from .hierarchy import BlobTier, StorageTiers
from .resume_objects import Chunks, WriteCounters, head_address, put_resume_point

log = logging.getLogger("hypic.tiers")
BLOCK = 64  # tokens a marker covers: a prompt of n tokens costs n / BLOCK probes, then up to BLOCK
BLOCKS_TRIED = 2  # marked blocks whose positions are probed, longest first
MARKER = b"\x01"  # Mooncake refuses empty objects


class SharedTier(BlobTier, Protocol):
    """A store that cannot list its objects but checks many names at once (``MooncakeTier``)."""

    def contains_all(self, addresses: list[str]) -> list[bool]: ...


def marker_address(directory: str, value: int) -> str:
    return f"{directory}/m{value:016x}"


class SharedResumePoints:
    """Resume points in ``tier`` (health as ``storage`` judges it: a master that is down is skipped,
    and retried as the public pool's entries are)."""

    def __init__(self, tier: SharedTier, storage: StorageTiers) -> None:
        self.tier, self.storage = tier, storage
        self.counters = WriteCounters()
        self.probes = 0  # batched existence checks

    def usable(self) -> bool:
        return self.storage.usable(self.tier)

    def wanted(self, directory: str, value: int) -> bool:
        """Whether a resume point named ``value`` is worth putting (not put or seen here before)."""
        return not self.tier.indexed(head_address(directory, value))

    def write(self, directory: str, hashes: np.ndarray, head: bytes, chunks: Chunks) -> None:
        """Put the resume point at position ``len(hashes) - 1`` (``hashes``: its prompt's prefix hashes
        h_0..h_p): the chunks the store lacks (one batched check), its head, then its block's marker."""
        position = len(hashes) - 1
        if not self.usable():
            return
        try:
            held = self.tier.contains_all([name for name, _ in chunks]) if chunks else []
            put_resume_point(self.tier, head_address(directory, int(hashes[position])), head, chunks, held,
                             self.counters)
            self.tier.write(marker_address(directory, int(hashes[position - position % BLOCK])), MARKER)
        except Exception as err:  # too large for the store, or the master gone: not kept there
            self.counters.write_errors += 1
            self.storage.fail(self.tier, err)

    def positions(self, directory: str, hashes: np.ndarray, after: int) -> list[int]:
        """Positions p > ``after`` of a prompt (``hashes``: h_0..h_limit) whose resume point the store
        holds, longest first (two batched probes; none if the store cannot be asked now)."""
        limit = len(hashes) - 1
        blocks = [b for b in range(0, limit + 1, BLOCK) if b + BLOCK > after + 1]
        if not blocks or not self.usable():
            return []
        try:
            marked = self._present([marker_address(directory, int(hashes[b])) for b in blocks])
            spans = [range(max(b, after + 1), min(b + BLOCK, limit + 1))
                     for b, hit in reversed(list(zip(blocks, marked))) if hit][:BLOCKS_TRIED]
            candidates = [p for span in spans for p in reversed(span)]
            if not candidates:
                return []
            held = self._present([head_address(directory, int(hashes[p])) for p in candidates])
        except Exception as err:
            self.storage.fail(self.tier, err)
            return []
        return [p for p, hit in zip(candidates, held) if hit]

    def _present(self, addresses: list[str]) -> list[bool]:
        self.probes += 1
        return self.tier.contains_all(addresses)

    def describe(self) -> dict:
        return {**vars(self.counters), "probes": self.probes}
