"""The private pool below memory: resume points kept in the disk tier and Mooncake Store, found
again after a restart or by another server.

Two kinds of resume point outlive the server: the end of every request (the next turn of its
conversation resumes there) and the end of a PIC prompt's leading part (a system prompt). Each is
a head and the KV chunks it names (``resume_objects``), self-describing objects with the model's
identity, their tokens (ids with layout marks: a state assembled from spliced documents is resumed
only under the same segmentation) and a checksum. On disk they are files of the disk tier (its
budget, its recency, its namespace's directory); in Mooncake objects beside the public pool's
entries, heads found by markers (``shared_resume``). A head's name is a 64-bit polynomial hash of
the private-pool tree and its tokens, so the hashes of all of a prompt's prefixes come from one
vectorised pass; the positions whose hash names a head are tried longest first (the disk's before
Mooncake's at one position), and every object's tokens are compared before it is used. A damaged
one, another model's or an incomplete one (a chunk evicted) is a miss, its head deleted; another
prompt's head under a colliding name is a miss left in place.
"""
import contextlib
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from ..prefix_cache import Snapshot, cache_key
from ...state import RequestState
from .disk import DiskTier
from .entry_file import BadEntryFile, EntryIdentity, namespace_dir, pack, unpack
from ..store import Event, Load
from .hierarchy import BlobTier, WritePolicy
from .resume_objects import (CHUNK_FORMAT, HEAD_FORMAT, Chunks, ForeignPrefix, ResumeParts, WriteCounters, check,
                             chunk_meta, chunk_names, chunk_spans, chunk_tensors, head_address, identity_meta,
                             put_resume_point, resume_parts, state_from)
from .shared_resume import SharedResumePoints

log = logging.getLogger("hypic.tiers")
MAX_PREFETCHES = 16  # lookups started and not taken yet, at most (each may hold a whole state)
LOOKUP_WAIT_S = 2.0  # a request is held back this long at most for its resume point's read
DRAIN_S = 30.0  # a flush waits this long at most for the resume-point writes under way
MULTIPLIER = 0x100000001B3  # odd: invertible modulo 2^64


def prefix_hashes(seed: int, keys: list[int]) -> np.ndarray:
    """h_0 .. h_n [n + 1] uint64 of ``keys``: h_0 = seed, h_p = h_{p-1} * M + keys[p-1] + 1 (mod 2^64),
    all at once: h_p = M^p (seed + sum_{i<p} (keys[i] + 1) M^-(i+1))."""
    count = len(keys)
    inverse = pow(MULTIPLIER, -1, 1 << 64)
    with np.errstate(over="ignore"):  # unsigned arithmetic wraps modulo 2^64, as meant
        powers = np.concatenate([np.ones(1, dtype=np.uint64), np.cumprod(np.full(count, MULTIPLIER, dtype=np.uint64))])
        inverses = np.cumprod(np.full(count, inverse, dtype=np.uint64))
        terms = (np.asarray(keys, dtype=np.uint64) + np.uint64(1)) * inverses
        sums = np.concatenate([np.zeros(1, dtype=np.uint64), np.cumsum(terms, dtype=np.uint64)])
        return powers * (np.uint64(seed) + sums)


@dataclass
class ResumeFound:
    """A resume point brought back: the state after its tokens, its snapshot, and its tier's name."""

    state: RequestState
    snapshot: Snapshot
    tier: str


@dataclass
class ResumeCounters:
    """Lookups below memory (every tier)."""

    hits: int = 0
    misses: int = 0
    bad_files: int = 0  # damaged, another model's or incomplete heads (deleted)


class ResumeStore:
    """Resume points of the private pool as files of ``disk`` and objects of ``shared`` (either may be
    None). ``offer`` writes in the background; ``take`` runs on the engine loop, through the lookup
    ``prefetch`` started on a thread of its own as the request arrived (or itself, without one)."""

    def __init__(self, disk: DiskTier | None, identity: EntryIdentity, shared: SharedResumePoints | None = None,
                 write_policy: WritePolicy = WritePolicy.WRITE_THROUGH) -> None:
        self.disk, self.identity, self.shared, self.write_policy = disk, identity, shared, write_policy
        self.known: dict[str, set[int]] = {}  # namespace directory -> hashes the disk's files are named by
        self.lock = threading.Lock()  # for ``known``: lookups run on prefetch threads too
        self.counters = ResumeCounters()
        self.prefetcher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hypic-resume-prefetch")
        self.prefetches: OrderedDict[tuple, Future] = OrderedDict()  # lookups started as requests arrived
        self.disk_writes = WriteCounters()
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hypic-resume-writer")
        self.pending: list[Future] = []  # writes not known to be done
        self.closed = False
        for address in disk.addresses() if disk is not None else ():
            directory, _, name = address.partition("/")
            if name.startswith("r") and len(name) == 17:
                self.known.setdefault(directory, set()).add(int(name[1:], 16))

    def _seed_text(self, tree: str) -> str:
        return f"{self.identity.fingerprint}|{self.identity.model_dtype}|{self.identity.state_dtype}|{tree}" + \
            self.identity.shard_suffix

    def _seed(self, tree: str) -> int:
        return int.from_bytes(hashlib.sha256(self._seed_text(tree).encode()).digest()[:8], "little")

    # ----- writes --------------------------------------------------------------------------
    def wanted(self, event: Event) -> bool:
        """Whether the write policy keeps a resume point on ``event``, as it keeps documents:
        ``write_through`` when it is made (a request's end, a system prompt's), ``write_through_selective``
        when memory resumes from it (first time), ``write_back`` when it leaves memory or the server stops."""
        if event is Event.EVICTED or event is Event.CLOSING:
            return self.write_policy is WritePolicy.WRITE_BACK
        if event is Event.MADE:
            return self.write_policy is WritePolicy.WRITE_THROUGH
        return self.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE

    def offer(self, tree: str, namespace: str, state: RequestState, position: int, snapshot: Snapshot,
              event: Event = Event.MADE) -> None:
        """Keep ``state``'s first ``position`` tokens as a resume point of ``tree`` (``snapshot``: its
        linear and sliding-window layers' states there) in each tier that lacks it, if the write policy
        wants it on ``event``; written in the background (the KV read is immutable by then: positions
        before ``position`` never change)."""
        if self.closed or not self.wanted(event):  # after a graceful stop nothing more is written
            return
        keys = cache_key(state.token_ids[:position], state.marks)
        directory = namespace_dir(namespace)
        hashes = prefix_hashes(self._seed(tree), keys)
        value = int(hashes[-1])
        with self.lock:
            to_disk = self.disk is not None and value not in self.known.get(directory, ())
        to_shared = self.shared is not None and self.shared.wanted(directory, value)
        parts = resume_parts(state, position, snapshot) if to_disk or to_shared else None
        if parts is None:
            return
        if to_disk:
            with self.lock:
                self.known.setdefault(directory, set()).add(value)
        self.pending.append(self.writer.submit(self._write, tree, directory, keys, hashes, parts, to_disk, to_shared))
        self.pending = [f for f in self.pending if not f.done()]

    def _write(self, tree: str, directory: str, keys: list[int], hashes: np.ndarray, parts: ResumeParts,
               to_disk: bool, to_shared: bool) -> None:
        """The head and the chunks a tier does not hold yet (each packed once for both tiers)."""
        names, packed = chunk_names(self._seed_text(tree), keys, directory), {}

        def packer(name: str, start: int, end: int) -> Callable[[], bytes]:
            def make() -> bytes:
                if name not in packed:
                    packed[name] = pack(chunk_meta(self.identity, keys, start, end), chunk_tensors(parts, start, end))
                return packed[name]
            return make

        chunks = [(name, packer(name, *span)) for name, span in zip(names, chunk_spans(len(keys)))] if parts.kv else []
        meta = {**identity_meta(self.identity, HEAD_FORMAT), "tree": tree, "length": str(len(keys)),
                "keys": json.dumps(keys), "chunks": json.dumps([name for name, _ in chunks])}
        head = pack(meta, parts.head)
        if to_disk:
            self._write_disk(head_address(directory, int(hashes[-1])), head, chunks)
        if to_shared:
            assert self.shared is not None
            self.shared.write(directory, hashes, head, chunks)

    def _write_disk(self, address: str, head: bytes, chunks: Chunks) -> None:
        assert self.disk is not None
        try:
            held = [self.disk.touch(name) for name, _ in chunks]  # held ones become as recent as this head
            put_resume_point(self.disk, address, head, chunks, held, self.disk_writes)
        except Exception as err:  # a full disk or a removed directory: the resume point is just not kept
            log.warning("resume point %s not written (%s: %s)", address, type(err).__name__, err)
            self.disk_writes.write_errors += 1

    # ----- reads ---------------------------------------------------------------------------
    def prefetch(self, tree: str, namespace: str, key: list[int], after: int, limit: int,
                 template: RequestState) -> Load | None:
        """Start ``take``'s lookup in the background (a request that may resume below memory just
        arrived): its reads overlap the request's wait instead of holding up the engine loop later.
        Returns the lookup and until when (``time.monotonic``) its request is held back for it."""
        ident = _identity(tree, namespace, key)
        if self.closed or limit <= after or not self._anywhere(namespace):
            return None
        if ident not in self.prefetches:
            self.prefetches[ident] = self.prefetcher.submit(self._find, tree, namespace, key, after, limit, template)
            while len(self.prefetches) > MAX_PREFETCHES:  # requests that went away
                self.prefetches.popitem(last=False)
        started = self.prefetches.get(ident)
        return (started, time.monotonic() + LOOKUP_WAIT_S) if started is not None else None

    def discard(self, tree: str, namespace: str, key: list[int]) -> None:
        """Forget the lookup ``prefetch`` started for this key (its request went away): a state read
        for nobody must not be held."""
        started = self.prefetches.pop(_identity(tree, namespace, key), None)
        if started is not None:
            started.cancel()

    def take(self, tree: str, namespace: str, key: list[int], after: int, limit: int,
             template: RequestState) -> ResumeFound | None:
        """The longest kept resume point of ``tree`` on ``key`` (a request's private-pool key) that ends
        past ``after`` and within ``limit`` tokens, through the lookup ``prefetch`` started for it (waited
        for) if there is one; None if there is none. ``template``: an empty state of the model."""
        started = self.prefetches.pop(_identity(tree, namespace, key), None)
        try:
            found = started.result() if started is not None else self._find(tree, namespace, key, after, limit, template)
        except Exception as err:  # noqa: BLE001 - a broken lookup costs only the resume
            log.warning("resume point lookup failed (%s: %s)", type(err).__name__, err)
            found = None
        if found is None or not after < found.state.length <= limit:  # memory may hold a longer one by now
            self.counters.misses += 1
            return None
        self.counters.hits += 1
        return found

    def _anywhere(self, namespace: str) -> bool:
        with self.lock:
            return self.shared is not None or bool(self.known.get(namespace_dir(namespace)))

    def _find(self, tree: str, namespace: str, key: list[int], after: int, limit: int,
              template: RequestState) -> ResumeFound | None:
        directory = namespace_dir(namespace)
        with self.lock:
            known = np.fromiter(self.known.get(directory, ()), dtype=np.uint64)
        if limit <= after or not (len(known) or self.shared is not None):
            return None
        hashes = prefix_hashes(self._seed(tree), key[:limit])
        candidates = []  # (position, the disk first at one position, tier)
        if len(known):
            found = np.isin(hashes, known)
            candidates += [(int(p), 1, self.disk) for p in np.flatnonzero(found) if p > after]
        if self.shared is not None:
            candidates += [(p, 0, self.shared.tier) for p in self.shared.positions(directory, hashes, after)]
        for position, _, tier in sorted(candidates, key=lambda c: c[:2], reverse=True):
            loaded = self._load(tier, head_address(directory, int(hashes[position])), key[:position], template)
            if loaded is not None:
                return ResumeFound(*loaded, tier.name)
        return None

    def _load(self, tier: BlobTier, address: str, keys: list[int],
              template: RequestState) -> tuple[RequestState, Snapshot] | None:
        """The resume point whose head is ``address`` in ``tier``; None (a miss) if it is gone, another
        prompt's, or damaged, another model's or incomplete (then its head is deleted)."""
        try:
            head = self._read(tier, address)
            if head is None:
                self._forget(tier, address)
                return None
            meta, tensors = head
            try:
                check(meta, self.identity, HEAD_FORMAT, keys)
            except ForeignPrefix:  # another prompt's, under a colliding name: a miss, not ours to delete
                return None
            kv = self._read_chunks(tier, json.loads(meta["chunks"]), keys)
            return state_from(tensors, kv, keys, template, self.identity.device)
        except (BadEntryFile, KeyError, ValueError) as err:
            log.warning("resume point %s in the %s tier unusable (%s); deleted", address, tier.name, err)
            self.counters.bad_files += 1
            with contextlib.suppress(Exception):  # a store that cannot delete now keeps a miss
                tier.remove(address)
            self._forget(tier, address)
        except OSError as err:  # an unreadable file, a store gone mid-read: a miss
            log.warning("resume point %s in the %s tier unreadable (%s: %s)", address, tier.name, type(err).__name__, err)
            if self.shared is not None and tier is self.shared.tier:
                self.shared.storage.fail(tier, err)
        return None

    @staticmethod
    def _read(tier: BlobTier, address: str) -> tuple[dict, dict[str, torch.Tensor]] | None:
        with tier.reading(address) as buffer:
            return None if buffer is None else unpack(buffer)

    def _read_chunks(self, tier: BlobTier, names: list[str], keys: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Each full-attention layer's KV of every position of ``keys``, from its chunks in order."""
        spans = chunk_spans(len(keys)) if names else []
        if len(names) != len(spans):
            raise BadEntryFile(f"{len(names)} chunks named for {len(keys)} positions")
        pieces: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for name, (start, end) in zip(names, spans):
            chunk = self._read(tier, name)
            if chunk is None:
                raise BadEntryFile(f"its chunk {name} is gone")
            meta, tensors = chunk
            check(meta, self.identity, CHUNK_FORMAT, keys[start:end], start)
            for tensor_name, tensor in tensors.items():
                index, _, kind = tensor_name.partition(".")
                pair = pieces.setdefault(int(index), [])
                if kind == "keys":
                    pair.append((tensor, tensors[f"{index}.values"]))
        return {index: (torch.cat([k for k, _ in pair], dim=1), torch.cat([v for _, v in pair], dim=1))
                for index, pair in pieces.items()}

    def _forget(self, tier: BlobTier, address: str) -> None:
        if tier is not self.disk:
            return  # the shared tier's index forgets by itself
        directory, _, name = address.partition("/")
        with self.lock:
            self.known.get(directory, set()).discard(int(name[1:], 16))

    def drain(self, timeout_s: float = DRAIN_S) -> None:
        """Wait for the writes under way (a flush of the disk must see their files), ``timeout_s`` at
        most for all of them: a write still hung then is left to finish on its own (and logged)."""
        pending, self.pending = self.pending, []
        done, hung = wait(pending, timeout=timeout_s)
        for future in done:
            future.result()
        if hung:
            log.warning("%d resume-point write(s) still under way after %.0f s; the flush goes on", len(hung), timeout_s)

    def forget(self, namespace: str | None) -> None:
        """The disk's files of ``namespace`` (None: all) were flushed: nothing is kept for it."""
        with self.lock:
            if namespace is None:
                self.known.clear()
            else:
                self.known.pop(namespace_dir(namespace), None)

    def close(self) -> None:
        """Finish the writes under way; later offers are ignored."""
        self.closed = True
        self.prefetcher.shutdown(wait=True, cancel_futures=True)
        self.writer.shutdown(wait=True)

    def describe(self) -> dict:
        """Lookups, the write policy and queue, and writes per tier (``tiers``)."""
        with self.lock:
            held = sum(len(v) for v in self.known.values())
        tiers = {"disk": {"resume_points": held, **vars(self.disk_writes)}} if self.disk is not None else {}
        if self.shared is not None:
            tiers["mooncake"] = self.shared.describe()
        return {"write_policy": self.write_policy.value, "write_queue": sum(1 for f in self.pending if not f.done()),
                **vars(self.counters), "tiers": tiers}


def _identity(tree: str, namespace: str, key: list[int]) -> tuple:
    """What a prefetched lookup is filed under: the request's tree, namespace and whole key (a hash
    of the key alone could hand one request another's lookup)."""
    return tree, namespace, tuple(key)
