"""The private pool below memory: resume points kept in the disk tier and found again after a restart.

Two kinds of resume point outlive the server: the end of every request (the next turn of its
conversation resumes there) and the end of a PIC prompt's leading part (a system prompt). Each is
one file of the disk tier (its budget, its recency, its namespace's directory): the KV of every
position before it in each full-attention layer, each linear layer's state and conv window, each
sliding-window layer's last window, the tokens it follows (ids with layout marks: a state
assembled from spliced documents is resumed only under the same segmentation) and the model's
identity, with a checksum. Its name is a 64-bit polynomial hash of the private-pool tree and those
tokens, so the hashes of all of a prompt's prefixes come from one vectorised pass; the positions
whose hash names a file are tried longest first, and a file's tokens are compared before it is
used. A damaged or foreign file is a miss, deleted.
"""
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
class ResumeCounters:
    written: int = 0
    write_errors: int = 0
    hits: int = 0
    misses: int = 0
    bad_files: int = 0


class ResumeStore:
    """Resume points of the private pool as files of ``disk``. ``offer`` writes in the background;
    ``find`` runs on the engine loop."""

    def __init__(self, disk: DiskTier, identity: EntryIdentity) -> None:
        self.disk, self.identity = disk, identity
        self.known: dict[str, set[int]] = {}  # namespace directory -> hashes its files are named by
        self.counters = ResumeCounters()
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hypic-resume-writer")
        self.pending: list[Future] = []  # writes not known to be done
        self.closed = False
        for address in disk.addresses():
            directory, _, name = address.partition("/")
            if name.startswith("r") and len(name) == 17:
                self.known.setdefault(directory, set()).add(int(name[1:], 16))

    def _seed(self, tree: str) -> int:
        text = f"{self.identity.fingerprint}|{self.identity.model_dtype}|{self.identity.state_dtype}|{tree}"
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")

    @staticmethod
    def _address(directory: str, value: int) -> str:
        return f"{directory}/r{value:016x}"

    # ----- writes --------------------------------------------------------------------------
    def offer(self, tree: str, namespace: str, state: RequestState, position: int, snapshot: Snapshot) -> None:
        """Keep ``state``'s first ``position`` tokens as a resume point of ``tree`` (``snapshot``: its
        linear and sliding-window layers' states there), unless one is kept already; written in the
        background (the KV read is immutable by then: positions before ``position`` never change)."""
        if self.closed:  # after a graceful stop nothing more is written (as the storage tiers do)
            return
        keys = cache_key(state.token_ids[:position], state.marks)
        directory = namespace_dir(namespace)
        value = int(prefix_hashes(self._seed(tree), keys)[-1])
        if value in self.known.get(directory, ()):
            return
        tensors: dict[str, torch.Tensor] = {}
        for index, layer in enumerate(state.layers):
            if isinstance(layer, AttentionLayerState):
                tensors[f"{index}.keys"], tensors[f"{index}.values"] = layer.kv(0, position)
            elif isinstance(snapshot.get(index), LinearLayerState):
                tensors[f"{index}.state"], tensors[f"{index}.conv"] = snapshot[index].tensors()
            elif isinstance(snapshot.get(index), WindowLayerState):
                tensors[f"{index}.keys"], tensors[f"{index}.values"] = snapshot[index].held()[:2]
            else:
                return  # a layer without its state there: no resume point
        meta = {"format": FORMAT, "fingerprint": self.identity.fingerprint, "model_dtype": str(self.identity.model_dtype),
                "state_dtype": str(self.identity.state_dtype), "tree": tree, "length": str(position),
                "keys": json.dumps(keys)}
        self.known.setdefault(directory, set()).add(value)
        self.pending.append(self.writer.submit(self._write, self._address(directory, value), meta, tensors))
        self.pending = [f for f in self.pending if not f.done()]

    def _write(self, address: str, meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> None:
        try:
            self.disk.write(address, pack(meta, tensors))
            self.counters.written += 1
        except Exception as err:  # a full disk or a removed directory: the resume point is just not kept
            log.warning("resume point %s not written (%s: %s)", address, type(err).__name__, err)
            self.counters.write_errors += 1

    # ----- reads ---------------------------------------------------------------------------
    def find(self, tree: str, namespace: str, key: list[int], after: int, limit: int,
             template: RequestState) -> tuple[RequestState, Snapshot] | None:
        """The longest kept resume point of ``tree`` on ``key`` (a request's private-pool key) that ends
        past ``after`` and within ``limit`` tokens, as a state and its snapshot; None if there is none.
        ``template``: an empty state of the model (layer kinds, device, dtype)."""
        directory = namespace_dir(namespace)
        known = self.known.get(directory)
        if not known or limit <= after:
            return None
        hashes = prefix_hashes(self._seed(tree), key[:limit])
        found = np.isin(hashes, np.fromiter(known, dtype=np.uint64, count=len(known)))
        for position in np.flatnonzero(found)[::-1]:
            if position <= after:
                break
            loaded = self._load(self._address(directory, int(hashes[position])), key[:position], template)
            if loaded is not None:
                self.counters.hits += 1
                return loaded
        self.counters.misses += 1
        return None

    def _load(self, address: str, keys: list[int], template: RequestState) -> tuple[RequestState, Snapshot] | None:
        try:
            with self.disk.reading(address) as buffer:
                if buffer is None:
                    self._forget(address)
                    return None
                meta, tensors = unpack(buffer)
                self._check(meta, keys)
                return self._state(tensors, keys, template)
        except (BadEntryFile, KeyError, ValueError) as err:
            log.warning("resume point %s unusable (%s); deleted", address, err)
            self.counters.bad_files += 1
            self.disk.remove(address)
            self._forget(address)
        except OSError as err:
            log.warning("resume point %s unreadable (%s)", address, err)
        return None

    def _forget(self, address: str) -> None:
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
        return {"resume_points": sum(len(v) for v in self.known.values()), **vars(self.counters)}


def _check_shape(recurrent: torch.Tensor, expected: torch.Tensor, conv: torch.Tensor, expected_conv: torch.Tensor) -> None:
    if recurrent.shape != expected.shape or conv.shape != expected_conv.shape:
        raise ValueError(f"a linear state of shape {tuple(recurrent.shape)} / {tuple(conv.shape)} where the model "
                         f"has {tuple(expected.shape)} / {tuple(expected_conv.shape)}")
