"""What a resume point is made of in a storage tier: one head and the KV chunks it names.

A resume point at position p is the private pool's state after p tokens. Its full-attention KV is
cut into chunks of ``CHUNK_TOKENS`` positions at fixed offsets (0, C, 2C, ...; the last one ends at
p), each an object named by a digest (BLAKE2b-128) of the prompt up to the chunk's end: the next turn of a
conversation, or another request with the same system prompt, names the same full chunks, so a
tier holds each once and a turn writes only the KV of its new tokens (and its last, partial
chunk). The head holds everything else (each linear layer's state and conv window, each
sliding-window layer's last window), the tokens (ids with layout marks) and the names of its
chunks. Every object carries the model's identity and its tokens, compared before use, and a
checksum (``entry_file.pack``).
"""
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..prefix_cache import MARK_MASK, Snapshot
from ..segments import MARK_BITS
from ...state import AttentionLayerState, LayerState, LinearLayerState, RequestState, WindowLayerState
from .entry_file import BadEntryFile, EntryIdentity
from .hierarchy import BlobTier

HEAD_FORMAT = "hypic-resume-state/4"  # /4: XXH3-128 checksums; /3: chunks named by a digest of their whole prefix
CHUNK_FORMAT = "hypic-resume-kv/3"  # part of a chunk's name: a chunk of an older format is never taken as held
CHUNK_TOKENS = 256  # positions of KV per chunk object
Chunks = list[tuple[str, Callable[[], bytes]]]  # a resume point's chunk objects: name, and how to pack it


@dataclass
class WriteCounters:
    """Resume points written to one tier."""

    written: int = 0  # heads
    chunks_written: int = 0
    written_bytes: int = 0  # heads and chunks
    write_errors: int = 0


def put_resume_point(tier: BlobTier, address: str, head: bytes, chunks: Chunks, held: list[bool],
                     counters: WriteCounters) -> None:
    """Write the chunks ``tier`` does not hold (``held``, one flag per chunk), then the head that
    names them (a head is never there before its chunks)."""
    for (name, make), present in zip(chunks, held):
        if not present:
            data = make()
            tier.write(name, data)
            counters.chunks_written += 1
            counters.written_bytes += len(data)
    tier.write(address, head)
    counters.written += 1
    counters.written_bytes += len(head)


def head_address(directory: str, value: int) -> str:
    """Where the head of the resume point named by prefix hash ``value`` lives."""
    return f"{directory}/r{value:016x}"


def chunk_address(directory: str, digest: str) -> str:
    """Where the KV chunk whose prefix (up to its end) has ``digest`` (``prefix_digests``) lives."""
    return f"{directory}/k{digest}"


def prefix_digests(seed: str, keys: list[int], ends: list[int]) -> list[str]:
    """BLAKE2b-128 of ``seed`` and the tokens ``keys[:end]`` for each of the increasing ``ends``, as
    hex: a chunk's name. Unlike the 64-bit rolling hashes that find heads (whose own tokens are
    checked), a name no other prefix can be made to share: a chunk checks only its own tokens."""
    digest, done, names = hashlib.blake2b(seed.encode(), digest_size=16), 0, []
    for end in ends:
        digest.update(np.asarray(keys[done:end], dtype="<i8").tobytes())
        done = end
        names.append(digest.copy().hexdigest())
    return names


def chunk_spans(position: int) -> list[tuple[int, int]]:
    """The chunks of the first ``position`` positions: [0, C), [C, 2C), ..., [., position)."""
    return [(start, min(start + CHUNK_TOKENS, position)) for start in range(0, position, CHUNK_TOKENS)]


@dataclass
class ResumeParts:
    """A resume point's tensors: the head's (linear states, window tails) and each full-attention
    layer's KV [Hkv, p, D] (views of the request's state: positions before p never change)."""

    head: dict[str, torch.Tensor]
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    source: RequestState  # held while the views are read: a view of a pool page is valid while its page lives


def resume_parts(state: RequestState, position: int, snapshot: Snapshot) -> ResumeParts | None:
    """``state``'s resume point at ``position``; None if a layer has no state there."""
    head: dict[str, torch.Tensor] = {}
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for index, layer in enumerate(state.layers):
        if isinstance(layer, AttentionLayerState):
            kv[index] = layer.kv(0, position)
        elif isinstance(snapshot.get(index), LinearLayerState):
            head[f"{index}.state"], head[f"{index}.conv"] = snapshot[index].tensors()
        elif isinstance(snapshot.get(index), WindowLayerState):
            head[f"{index}.keys"], head[f"{index}.values"] = snapshot[index].held()[:2]
        else:
            return None
    return ResumeParts(head, kv, state)


def identity_meta(identity: EntryIdentity, form: str) -> dict[str, str]:
    return {"format": form, "fingerprint": identity.fingerprint, "model_dtype": str(identity.model_dtype),
            "state_dtype": str(identity.state_dtype)}


def chunk_tensors(parts: ResumeParts, start: int, end: int) -> dict[str, torch.Tensor]:
    return {f"{index}.{name}": tensor[:, start:end]
            for index, pair in parts.kv.items() for name, tensor in zip(("keys", "values"), pair)}


def chunk_meta(identity: EntryIdentity, keys: list[int], start: int, end: int) -> dict[str, str]:
    return {**identity_meta(identity, CHUNK_FORMAT), "start": str(start), "keys": json.dumps(keys[start:end])}


class ForeignPrefix(BadEntryFile):
    """A sound object of another prompt (a head found under a colliding 64-bit name)."""


def check(meta: dict, identity: EntryIdentity, form: str, keys: list[int], start: int = 0) -> None:
    """Raise ``BadEntryFile`` unless ``meta`` is an object of ``form`` made by this model for ``keys``
    (the tokens from ``start`` on)."""
    for name, value in identity_meta(identity, form).items():
        if meta.get(name) != value:
            raise BadEntryFile(f"{name} is {meta.get(name)!r}, expected {value!r}")
    if meta.get("keys") != json.dumps(keys) or meta.get("start", "0") != str(start):
        raise ForeignPrefix("the object holds another prefix's tokens")


def chunk_names(seed: str, keys: list[int], directory: str) -> list[str]:
    """The chunk objects of the resume point after ``keys``."""
    ends = [end for _, end in chunk_spans(len(keys))]
    return [chunk_address(directory, digest) for digest in prefix_digests(f"{CHUNK_FORMAT}|{seed}", keys, ends)]


def state_from(head: dict[str, torch.Tensor], kv: dict[int, tuple[torch.Tensor, torch.Tensor]], keys: list[int],
               template: RequestState, device: torch.device) -> tuple[RequestState, Snapshot]:
    """The resume point's state (its KV the request's own) and its snapshot, on ``device``
    (``template``: an empty state of the model); raises ValueError on shapes the model does not have."""
    position = len(keys)
    layers: list[LayerState] = []
    snapshot: Snapshot = {}
    for index, empty in enumerate(template.layers):
        if isinstance(empty, LinearLayerState):
            recurrent, conv = head[f"{index}.state"].to(device), head[f"{index}.conv"].to(device)
            if recurrent.shape != empty.recurrent.shape or conv.shape != empty.conv.shape:
                raise ValueError(f"a linear state of shape {tuple(recurrent.shape)} / {tuple(conv.shape)} where the "
                                 f"model has {tuple(empty.recurrent.shape)} / {tuple(empty.conv.shape)}")
            snapshot[index] = layer = LinearLayerState(recurrent, conv)
        elif isinstance(empty, WindowLayerState):
            keys_, values = head[f"{index}.keys"].to(device), head[f"{index}.values"].to(device)
            snapshot[index] = WindowLayerState(keys_, values, empty.window, position)
            layer = snapshot[index].fork()
        else:
            keys_, values = kv[index][0].to(device), kv[index][1].to(device)
            if keys_.shape[1] != position or keys_.shape[0] != empty.keys.shape[0]:
                raise ValueError(f"layer {index}: keys of shape {tuple(keys_.shape)} for {position} positions")
            layer = AttentionLayerState(keys_, values)
        layers.append(layer)
    marks = {p: k & MARK_MASK for p, k in enumerate(keys) if k & MARK_MASK}
    return RequestState(layers, position, [k >> MARK_BITS for k in keys], marks), snapshot
