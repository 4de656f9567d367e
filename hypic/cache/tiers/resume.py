"""The private pool below memory: resume points kept in the disk tier and Mooncake Store, found
again after a restart or by another server.

Two kinds of resume point outlive the server: the end of every request (the next turn of its
conversation resumes there) and the end of a PIC prompt's leading part (a system prompt). Each is
one self-describing object: the KV of every position before it in each full-attention layer, each
linear layer's state and conv window, each sliding-window layer's last window, the tokens it
follows (ids with layout marks: a state assembled from spliced documents is resumed only under the
same segmentation) and the model's identity, with a checksum. On disk it is a file of the disk
tier (its budget, its recency, its namespace's directory); in Mooncake an object beside the public
pool's entries, found by markers (``shared_resume``). Its name is a 64-bit polynomial hash of the
private-pool tree and those tokens, so the hashes of all of a prompt's prefixes come from one
vectorised pass; the positions whose hash names a resume point are tried longest first (the disk's
before Mooncake's at one position), and an object's tokens are compared before it is used. A
damaged or foreign one is a miss, deleted.
"""
import contextlib
import hashlib
import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..prefix_cache import MARK_MASK, Snapshot, cache_key
from ..segments import MARK_BITS
from ...state import AttentionLayerState, LayerState, LinearLayerState, RequestState, WindowLayerState
from .disk import DiskTier
from .entry_file import BadEntryFile, EntryIdentity, namespace_dir, pack, unpack
from .hierarchy import BlobTier
from .shared_resume import SharedResumePoints, resume_address

log = logging.getLogger("hypic.tiers")
FORMAT = "hypic-resume-state/1"
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
    written: int = 0
    write_errors: int = 0
    hits: int = 0
    misses: int = 0
    bad_files: int = 0


class ResumeStore:
    """Resume points of the private pool as files of ``disk`` and objects of ``shared`` (either may be
    None). ``offer`` writes in the background; ``find`` runs on the engine loop."""

    def __init__(self, disk: DiskTier | None, identity: EntryIdentity, shared: SharedResumePoints | None = None) -> None:
        self.disk, self.identity, self.shared = disk, identity, shared
        self.known: dict[str, set[int]] = {}  # namespace directory -> hashes the disk's files are named by
        self.counters = ResumeCounters()
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hypic-resume-writer")
        self.pending: list[Future] = []  # writes not known to be done
        self.closed = False
        for address in disk.addresses() if disk is not None else ():
            directory, _, name = address.partition("/")
            if name.startswith("r") and len(name) == 17:
                self.known.setdefault(directory, set()).add(int(name[1:], 16))

    def _seed(self, tree: str) -> int:
        text = f"{self.identity.fingerprint}|{self.identity.model_dtype}|{self.identity.state_dtype}|{tree}"
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")

    # ----- writes --------------------------------------------------------------------------
    def offer(self, tree: str, namespace: str, state: RequestState, position: int, snapshot: Snapshot) -> None:
        """Keep ``state``'s first ``position`` tokens as a resume point of ``tree`` (``snapshot``: its
        linear and sliding-window layers' states there) in each tier that lacks it; written in the
        background (the KV read is immutable by then: positions before ``position`` never change)."""
        if self.closed:  # after a graceful stop nothing more is written (as the storage tiers do)
            return
        keys = cache_key(state.token_ids[:position], state.marks)
        directory = namespace_dir(namespace)
        hashes = prefix_hashes(self._seed(tree), keys)
        value = int(hashes[-1])
        to_disk = self.disk is not None and value not in self.known.get(directory, ())
        to_shared = self.shared is not None and self.shared.wanted(directory, value)
        tensors = _tensors(state, position, snapshot) if to_disk or to_shared else None
        if tensors is None:
            return
        meta = {"format": FORMAT, "fingerprint": self.identity.fingerprint, "model_dtype": str(self.identity.model_dtype),
                "state_dtype": str(self.identity.state_dtype), "tree": tree, "length": str(position),
                "keys": json.dumps(keys)}
        if to_disk:
            self.known.setdefault(directory, set()).add(value)
        self.pending.append(self.writer.submit(self._write, directory, hashes, meta, tensors, to_disk, to_shared))
        self.pending = [f for f in self.pending if not f.done()]

    def _write(self, directory: str, hashes: np.ndarray, meta: dict[str, str], tensors: dict[str, torch.Tensor],
               to_disk: bool, to_shared: bool) -> None:
        address, data = resume_address(directory, int(hashes[-1])), pack(meta, tensors)
        if to_disk:
            assert self.disk is not None
            try:
                self.disk.write(address, data)
                self.counters.written += 1
            except Exception as err:  # a full disk or a removed directory: the resume point is just not kept
                log.warning("resume point %s not written (%s: %s)", address, type(err).__name__, err)
                self.counters.write_errors += 1
        if to_shared:
            assert self.shared is not None
            self.shared.write(directory, hashes, data)

    # ----- reads ---------------------------------------------------------------------------
    def find(self, tree: str, namespace: str, key: list[int], after: int, limit: int,
             template: RequestState) -> ResumeFound | None:
        """The longest kept resume point of ``tree`` on ``key`` (a request's private-pool key) that ends
        past ``after`` and within ``limit`` tokens; None if there is none. ``template``: an empty
        state of the model (layer kinds, device, dtype)."""
        directory = namespace_dir(namespace)
        known = self.known.get(directory)
        if limit <= after or not (known or self.shared is not None):
            return None
        hashes = prefix_hashes(self._seed(tree), key[:limit])
        candidates = []  # (position, the disk first at one position, tier)
        if known:
            found = np.isin(hashes, np.fromiter(known, dtype=np.uint64, count=len(known)))
            candidates += [(int(p), 1, self.disk) for p in np.flatnonzero(found) if p > after]
        if self.shared is not None:
            candidates += [(p, 0, self.shared.tier) for p in self.shared.positions(directory, hashes, after)]
        for position, _, tier in sorted(candidates, key=lambda c: c[:2], reverse=True):
            loaded = self._load(tier, resume_address(directory, int(hashes[position])), key[:position], template)
            if loaded is not None:
                self.counters.hits += 1
                return ResumeFound(*loaded, tier.name)
        self.counters.misses += 1
        return None

    def _load(self, tier: BlobTier, address: str, keys: list[int],
              template: RequestState) -> tuple[RequestState, Snapshot] | None:
        try:
            with tier.reading(address) as buffer:
                if buffer is None:
                    self._forget(tier, address)
                    return None
                meta, tensors = unpack(buffer)
                self._check(meta, keys)
                return self._state(tensors, keys, template)
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

    def _forget(self, tier: BlobTier, address: str) -> None:
        if tier is not self.disk:
            return  # the shared tier's index forgets by itself
        directory, _, name = address.partition("/")
        self.known.get(directory, set()).discard(int(name[1:], 16))

    def _check(self, meta: dict, keys: list[int]) -> None:
        expected = {"format": FORMAT, "fingerprint": self.identity.fingerprint,
                    "model_dtype": str(self.identity.model_dtype), "state_dtype": str(self.identity.state_dtype)}
        for name, value in expected.items():
            if meta.get(name) != value:
                raise BadEntryFile(f"{name} is {meta.get(name)!r}, expected {value!r}")
        if meta.get("keys") != json.dumps(keys):
            raise BadEntryFile("the file holds another prefix's tokens")

    def _state(self, tensors: dict[str, torch.Tensor], keys: list[int],
               template: RequestState) -> tuple[RequestState, Snapshot]:
        """The resume point's state (its KV the request's own) and its snapshot, on the engine's device."""
        device, position = self.identity.device, len(keys)
        layers: list[LayerState] = []
        snapshot: Snapshot = {}
        for index, empty in enumerate(template.layers):
            if isinstance(empty, LinearLayerState):
                recurrent, conv = tensors[f"{index}.state"].to(device), tensors[f"{index}.conv"].to(device)
                _check_shape(recurrent, empty.recurrent, conv, empty.conv)
                snapshot[index] = layer = LinearLayerState(recurrent, conv)
            elif isinstance(empty, WindowLayerState):
                keys_, values = tensors[f"{index}.keys"].to(device), tensors[f"{index}.values"].to(device)
                snapshot[index] = WindowLayerState(keys_, values, empty.window, position)
                layer = snapshot[index].fork()
            else:
                keys_, values = tensors[f"{index}.keys"].to(device), tensors[f"{index}.values"].to(device)
                if keys_.shape[1] != position or keys_.shape[0] != empty.keys.shape[0]:
                    raise ValueError(f"layer {index}: keys of shape {tuple(keys_.shape)} for {position} positions")
                layer = AttentionLayerState(keys_, values)
            layers.append(layer)
        marks = {p: k & MARK_MASK for p, k in enumerate(keys) if k & MARK_MASK}
        return RequestState(layers, position, [k >> MARK_BITS for k in keys], marks), snapshot

    def drain(self) -> None:
        """Wait for the writes under way (a flush of the disk must see their files)."""
        for future in self.pending:
            future.result()
        self.pending = []

    def forget(self, namespace: str | None) -> None:
        """The disk's files of ``namespace`` (None: all) were flushed: nothing is kept for it."""
        if namespace is None:
            self.known.clear()
        else:
            self.known.pop(namespace_dir(namespace), None)

    def close(self) -> None:
        """Finish the writes under way; later offers are ignored."""
        self.closed = True
        self.writer.shutdown(wait=True)

    def describe(self) -> dict:
        shared = {"mooncake": self.shared.describe()} if self.shared is not None else {}
        return {"resume_points": sum(len(v) for v in self.known.values()), **vars(self.counters), **shared}


def _tensors(state: RequestState, position: int, snapshot: Snapshot) -> dict[str, torch.Tensor] | None:
    """What a resume point at ``position`` holds, by name; None if a layer has no state there."""
    tensors: dict[str, torch.Tensor] = {}
    for index, layer in enumerate(state.layers):
        if isinstance(layer, AttentionLayerState):
            tensors[f"{index}.keys"], tensors[f"{index}.values"] = layer.kv(0, position)
        elif isinstance(snapshot.get(index), LinearLayerState):
            tensors[f"{index}.state"], tensors[f"{index}.conv"] = snapshot[index].tensors()
        elif isinstance(snapshot.get(index), WindowLayerState):
            tensors[f"{index}.keys"], tensors[f"{index}.values"] = snapshot[index].held()[:2]
        else:
            return None
    return tensors


def _check_shape(recurrent: torch.Tensor, expected: torch.Tensor, conv: torch.Tensor, expected_conv: torch.Tensor) -> None:
    if recurrent.shape != expected.shape or conv.shape != expected_conv.shape:
        raise ValueError(f"a linear state of shape {tuple(recurrent.shape)} / {tuple(conv.shape)} where the model "
                         f"has {tuple(expected.shape)} / {tuple(expected_conv.shape)}")
