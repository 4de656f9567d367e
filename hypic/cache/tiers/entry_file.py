"""A public-pool entry as a self-describing file: safetensors layout, identity and checksum in its header.

Layout (readable by any safetensors reader): 8-byte little-endian header length, a JSON header
(each tensor's dtype, shape and byte range, plus ``__metadata__``), then the tensors' bytes. The
metadata names the entry's content key, the model fingerprint, both dtypes, the seam rule, the
token ids, the decayed heads of each T_C (``kept_heads``: flags instead of matrices) and a
checksum (XXH3-128) of the header and the tensors, so a file from another model,
another dtype, another document or a damaged disk is refused (``BadEntryFile``), never spliced.

A load reads the file in one pass: each tensor is copied from the buffer (a memory map, a transfer
buffer) straight into the tensor it is returned as, a chunk at a time, and each chunk is hashed
right after its copy, while it is still in the core's cache. A load for the public pool copies each
linear layer's S_C|0 and T_C straight into a slot of the pool's arenas, taken before the copy, so
storing the entry copies nothing more; a refused file gives its slots back at once. The checksum guards against damage
(torn writes, bit rot, a truncated transfer), not against someone who can write the store: entries
are content-addressed per namespace, and whoever can write there can write a valid file.
"""
import hashlib
import json
import re
import struct
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from ..arena import Field, Slot, StateArenas
from ..composition import Family, Transition
from ...config import ModelConfig
from ..entry_check import EntryMismatch, check_entry
from ...errors import HypicError
from ...state import LinearShapes
from ..segments import Seams
from ..store import AttentionInterior, InteriorLayer, LinearInterior, Role, SegmentEntry

FORMAT = "hypic-segment-entry/3"  # /3: decayed heads of T_C flagged in "kept_heads"; /2: XXH3-128 (/1: SHA-256)
CHECKSUM = "xxh3-128"  # the checksum's algorithm, named in its value: "xxh3-128:<hex>"
COPY_CHUNK = 1 << 18  # bytes copied, then hashed, at a time: still in the core's L2 when hashed
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class BadEntryFile(HypicError):
    """A stored entry that cannot be used here: truncated, damaged, or made for another model,
    dtype, document or format."""


@dataclass(frozen=True)
class EntryIdentity:
    """What a stored entry must have been made with to be spliced by this engine (``linear``: its
    linear layers' shapes, ``families.linear_shapes(config)``)."""

    fingerprint: str
    model_dtype: torch.dtype
    state_dtype: torch.dtype
    config: ModelConfig
    linear: LinearShapes
    device: torch.device = torch.device("cpu")  # where decoded tensors go

    @property
    def shard_suffix(self) -> str:
        """'' without tensor parallelism; else the rank and size, so that stored shards are never read
        by another rank or TP size (and TP=1 names stay as they were)."""
        tp = self.config.tensor_parallel
        return f"|tp{tp.rank}of{tp.size}" if tp.enabled else ""

    def address(self, key: str, namespace: str) -> str:
        """The storage name of entry ``key`` of cache ``namespace``: ``namespace-dir/digest`` (the key
        already names model, seams, role, namespace and tokens; the dtypes are added here; the
        namespace leads so one namespace's entries can be flushed together). Under tensor parallelism
        each rank stores its own shard, named by rank and size: another TP size never reads it."""
        digest = hashlib.sha256(f"{key}|{self.model_dtype}|{self.state_dtype}{self.shard_suffix}".encode()).hexdigest()
        return f"{namespace_dir(namespace)}/{digest}"


def namespace_dir(namespace: str) -> str:
    """A path- and key-safe name of a cache namespace ("shared" for the shared one)."""
    if not namespace:
        return "shared"
    if re.fullmatch(r"[0-9a-zA-Z_-]{1,64}", namespace) and namespace != "shared":
        return f"ns-{namespace}"
    return "ns-" + hashlib.sha256(namespace.encode()).hexdigest()[:32]


def _layer_tensors(index: int, layer: InteriorLayer) -> dict[str, torch.Tensor]:
    if isinstance(layer, AttentionInterior):
        return {f"{index}.keys": layer.keys, f"{index}.values": layer.values}
    tensors = {f"{index}.state": layer.zero_start_state, f"{index}.conv_tail": layer.conv_tail}
    if layer.transition is not None:
        tensors[f"{index}.transition"] = layer.transition.value
    return tensors


def _layer_kind(layer: InteriorLayer) -> str:
    if isinstance(layer, AttentionInterior):
        return "attention"
    return "linear" if layer.transition is None else f"linear:{layer.transition.family.value}"


@dataclass(frozen=True)
class _Span:
    """One tensor of a file: its name, dtype, shape and byte range in the buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _raw(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy where it is contiguous."""
    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _dumps(header: dict) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


def _header_digest(header: dict) -> "xxhash.xxh3_128":
    """A running checksum started on the header as written less the checksum itself; the tensors'
    bytes follow in file order. (The header is re-serialised: a damaged one that still parses hashes
    differently.)"""
    meta = {name: value for name, value in header.get("__metadata__", {}).items() if name != "checksum"}
    return xxhash.xxh3_128(_dumps({**header, "__metadata__": meta}))


def _checksum_value(digest: "xxhash.xxh3_128") -> str:
    return f"{CHECKSUM}:{digest.hexdigest()}"


def encode_entry(entry: SegmentEntry, identity: EntryIdentity) -> bytes:
    """The file bytes of ``entry`` (tensors on the CPU, in their stored dtypes)."""
    tensors = {name: t for index, layer in enumerate(entry.layers) for name, t in _layer_tensors(index, layer).items()}
    naive = any(isinstance(layer, LinearInterior) and layer.transition is None for layer in entry.layers)
    role = Role.NAIVE_SEGMENT if naive else Role.SEGMENT  # the naive baseline keeps no T_C
    metadata = {"format": FORMAT, "key": entry.key, "fingerprint": identity.fingerprint,
                "model_dtype": str(identity.model_dtype), "state_dtype": str(identity.state_dtype),
                "seams": f"{entry.seams.head},{entry.seams.tail}", "role": role.value, "namespace": entry.namespace,
                "local_start": str(entry.local_start), "length": str(entry.length),
                "token_ids": json.dumps(list(entry.token_ids)),
                "layers": json.dumps([_layer_kind(layer) for layer in entry.layers]),
                "kept_heads": json.dumps(_kept_heads(entry))}
    return pack(metadata, tensors)


def _kept_heads(entry: SegmentEntry) -> dict[str, str]:
    """Layer index -> one character per head of its T_C, "1" stored, "0" decayed (a flag, no matrix);
    layers with every head stored are left out."""
    return {str(index): "".join("1" if kept else "0" for kept in layer.transition.kept)
            for index, layer in enumerate(entry.layers)
            if isinstance(layer, LinearInterior) and layer.transition is not None and layer.transition.kept is not None}


def _kept_of(flags: dict, index: int) -> tuple[bool, ...] | None:
    """The ``kept`` flags of layer ``index`` as ``_kept_heads`` wrote them (None: every head stored)."""
    written = flags.get(str(index))
    if written is None:
        return None
    if not isinstance(written, str) or set(written) - {"0", "1"}:
        raise ValueError(f"layer {index}: kept heads {written!r} are not a string of 0 and 1")
    return tuple(flag == "1" for flag in written)


def pack(metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> bytes:
    """A safetensors file of ``tensors`` (copied to the CPU) with ``metadata`` and the checksum of
    the header and the tensors (``checksum``) in its header."""
    names = sorted(tensors)
    data = {name: _raw(tensors[name].detach().to("cpu")) for name in names}
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    for name in names:
        header[name] = {"dtype": _NAMES[tensors[name].dtype], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + data[name].nbytes]}
        offset += data[name].nbytes
    digest = _header_digest(header)
    for name in names:
        digest.update(data[name])
    header["__metadata__"]["checksum"] = _checksum_value(digest)
    encoded = _dumps(header)
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data section to 8 bytes
    return b"".join([struct.pack("<Q", len(encoded)), encoded, *data.values()])  # one copy of the tensors


def unpack(buffer: bytes | memoryview) -> tuple[dict, dict[str, torch.Tensor]]:
    """The metadata and the tensors (copies) of a file ``pack`` wrote; raises ``BadEntryFile`` if it is
    truncated, unreadable or damaged (checksum)."""
    header, start = _header(buffer)
    spans = _spans(header, start, len(buffer))
    return header.get("__metadata__", {}), _verified(buffer, header, spans, {}, torch.device("cpu"))


def _header(buffer: bytes | memoryview) -> tuple[dict, int]:
    if len(buffer) < 8:
        raise BadEntryFile(f"truncated: {len(buffer)} bytes")
    (size,) = struct.unpack("<Q", bytes(buffer[:8]))
    if size > len(buffer) - 8:
        raise BadEntryFile(f"truncated: a header of {size} bytes in a file of {len(buffer)}")
    try:
        header = json.loads(bytes(buffer[8:8 + size]))
    except ValueError as err:
        raise BadEntryFile(f"unreadable header: {err}") from err
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__", {}), dict):
        raise BadEntryFile("unreadable header: not an object with an object of metadata")
    return header, 8 + size


def named_entry(head: bytes, identity: EntryIdentity, address: str) -> tuple[str, str, int] | None:
    """(key, namespace, tokens) of the entry whose file begins with ``head`` (its length and header)
    if it is one ``identity`` stores at ``address``; None for anything else (another model's, a
    resume point, a damaged header). The tensors are not read: what a start-up scan lists."""
    try:
        meta = _header(head)[0].get("__metadata__", {})
        key, namespace, tokens = meta["key"], meta["namespace"], len(json.loads(meta["token_ids"]))
    except (BadEntryFile, KeyError, TypeError, ValueError):
        return None
    if meta.get("fingerprint") != identity.fingerprint or identity.address(key, namespace) != address:
        return None  # the address names the dtypes and the shard: another one's file is not ours
    return key, namespace, tokens


def decode_entry(buffer: bytes | memoryview, identity: EntryIdentity, key: str, token_ids: tuple[int, ...],
                 arenas: StateArenas | None = None) -> SegmentEntry:
    """The entry stored in ``buffer`` if it is ``key``'s, for ``token_ids``, made by ``identity`` and
    intact; its tensors are copies (the buffer may be a memory map). ``arenas``: the public pool's
    slots; each linear layer's S_C|0 and T_C are then copied straight into a slot taken from them
    (the layer's ``owner``: the pool stores it without another copy), and a file refused gives its
    slots back before this returns. Raises ``BadEntryFile``."""
    header, start = _header(buffer)
    meta = header.get("__metadata__", {})
    _check_identity(meta, identity, key, token_ids)
    spans = _spans(header, start, len(buffer))
    linear = _linear_spans(spans) if arenas is not None else {}
    slots = _slots(linear, arenas, identity.device) if arenas is not None else {}
    try:
        tensors = _verified(buffer, header, spans, _targets(linear, slots), identity.device)
        return _checked(meta, tensors, token_ids, slots, identity)
    except BaseException:
        for slot in slots.values():
            slot.release()  # now, not when the exception's frames go (a logged error keeps them)
        raise


def _checked(meta: dict, tensors: dict[str, torch.Tensor], token_ids: tuple[int, ...], slots: dict[int, Slot],
             identity: EntryIdentity) -> SegmentEntry:
    """The entry of a file's verified tensors, if this model can splice it; raises ``BadEntryFile``."""
    try:
        entry = _entry(meta, tensors, token_ids, slots)
        check_entry(entry, identity.fingerprint, Role(meta["role"]), identity.config, identity.linear)
    except (EntryMismatch, KeyError, ValueError, AttributeError) as err:
        raise BadEntryFile(f"not an entry this model can splice: {err}") from err
    return entry


def _linear_spans(spans: list[_Span]) -> dict[int, tuple[_Span, ...]]:
    """Layer index -> its S_C|0's span and its T_C's (if it has one), in the order of a slot's fields
    (``LinearInterior.placed``'s: the slot shapes the pool's own copies take)."""
    named = {span.name: span for span in spans}
    found = {}
    for name, span in named.items():
        layer, _, tensor = name.partition(".")
        if tensor == "state" and layer.isdigit():
            transition = named.get(f"{layer}.transition")
            found[int(layer)] = (span,) if transition is None else (span, transition)
    return found


def _slots(linear: dict[int, tuple[_Span, ...]], arenas: StateArenas, device: torch.device) -> dict[int, Slot]:
    """A slot of ``arenas`` for each linear layer's S_C|0 and T_C (``_linear_spans``), taken before
    anything is copied."""
    return {index: arenas.take(tuple(Field(span.shape, span.dtype) for span in fields), device)
            for index, fields in linear.items()}


def _targets(linear: dict[int, tuple[_Span, ...]], slots: dict[int, Slot]) -> dict[str, torch.Tensor]:
    """Tensor name -> the slot's view it is decoded into."""
    return {span.name: view for index, slot in slots.items() for span, view in zip(linear[index], slot.views())}


def _check_identity(meta: dict, identity: EntryIdentity, key: str, token_ids: tuple[int, ...]) -> None:
    expected = {"format": FORMAT, "key": key, "fingerprint": identity.fingerprint,
                "model_dtype": str(identity.model_dtype), "state_dtype": str(identity.state_dtype)}
    for name, value in expected.items():
        if meta.get(name) != value:
            raise BadEntryFile(f"{name} is {meta.get(name)!r}, expected {value!r}")
    if meta.get("token_ids") != json.dumps(list(token_ids)):
        raise BadEntryFile("the file holds another document's tokens")


def _verified(buffer: bytes | memoryview, header: dict, spans: list[_Span], targets: dict[str, torch.Tensor],
              device: torch.device) -> dict[str, torch.Tensor]:
    """The file's tensors on ``device``, copied out of ``buffer`` in one pass (into ``targets``' tensors
    where it names them, else into new ones) that also checks them and the header against the
    checksum; raises ``BadEntryFile``."""
    digest = _header_digest(header)
    tensors = _copied_out(buffer, spans, digest, targets)
    if _checksum_value(digest) != header.get("__metadata__", {}).get("checksum"):
        raise BadEntryFile("checksum mismatch: the file is damaged")
    return {name: tensor.to(device) for name, tensor in tensors.items()}


def _spans(header: dict, start: int, size: int) -> list[_Span]:
    """The tensors in the order of their bytes, checked to tile the data section exactly, each one's
    bytes matching its shape (so nothing is allocated for a damaged header's sizes)."""
    spans = sorted((_span(name, spec, start) for name, spec in header.items() if name != "__metadata__"),
                   key=lambda span: span.begin)
    cursor = start
    for span in spans:
        if span.end > size:
            raise BadEntryFile(f"truncated: tensor {span.name} ends at byte {span.end} of {size}")
        if span.begin != cursor:
            raise BadEntryFile(f"tensor {span.name} starts at byte {span.begin}, expected {cursor}")
        cursor = span.end
    if cursor != size:
        raise BadEntryFile(f"{size - cursor} bytes after the last tensor")
    return spans


def _span(name: str, spec: dict, start: int) -> _Span:
    try:
        begin, end = (start + int(o) for o in spec["data_offsets"])
        dtype, shape = _DTYPES[spec["dtype"]], tuple(int(s) for s in spec["shape"])
    except (KeyError, TypeError, ValueError) as err:
        raise BadEntryFile(f"tensor {name}: unreadable spec") from err
    if min(shape, default=0) < 0 or end - begin != dtype.itemsize * torch.Size(shape).numel():
        raise BadEntryFile(f"tensor {name}: {end - begin} bytes for shape {list(shape)} of {spec['dtype']}")
    return _Span(name, dtype, shape, begin, end)


def _copied_out(buffer: bytes | memoryview, spans: list[_Span], digest: "xxhash.xxh3_128",
                targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each span's tensor, copied from ``buffer`` straight into its target (or its own new memory) and
    hashed into ``digest``. Raises nothing on a checked ``spans``: no view of the buffer outlives the
    call, so a memory map can be closed right after, whatever the checksum says."""
    source = np.frombuffer(buffer, dtype=np.uint8)
    return {span.name: _copy_hashed(source[span.begin:span.end], span, digest, targets.get(span.name))
            for span in spans}


def _copy_hashed(source: np.ndarray, span: _Span, digest: "xxhash.xxh3_128",
                 target: torch.Tensor | None = None) -> torch.Tensor:
    """``target`` (a contiguous tensor of ``span``'s shape; None: a new one) holding ``source``'s
    bytes; each chunk is hashed from the copy just made (still in cache), so the source is read once.
    A target off the CPU (a slot on a GPU) gets one transfer from a host copy."""
    on_host = target is not None and target.device.type == "cpu"
    tensor = target if on_host else torch.empty(span.shape, dtype=span.dtype)
    if tensor.numel():
        copy = tensor.view(-1).view(torch.uint8).numpy()
        for offset in range(0, len(source), COPY_CHUNK):
            chunk = copy[offset:offset + COPY_CHUNK]
            np.copyto(chunk, source[offset:offset + COPY_CHUNK])
            digest.update(chunk)
    return tensor if target is None or on_host else target.copy_(tensor)


def _entry(meta: dict, tensors: dict[str, torch.Tensor], token_ids: tuple[int, ...],
           slots: dict[int, Slot] | None = None) -> SegmentEntry:
    """The entry of a file's checked tensors; a linear layer decoded into one of ``slots`` owns it."""
    head, tail = (int(x) for x in meta["seams"].split(","))
    flags = json.loads(meta["kept_heads"])
    layers: list[InteriorLayer] = []
    for index, kind in enumerate(json.loads(meta["layers"])):
        if kind == "attention":
            layers.append(AttentionInterior(tensors[f"{index}.keys"], tensors[f"{index}.values"]))
            continue
        family = kind.partition(":")[2]
        transition = Transition(Family(family), tensors[f"{index}.transition"], _kept_of(flags, index)) if family else None
        owner = (slots or {}).get(index)
        layers.append(LinearInterior(transition, tensors[f"{index}.state"], tensors[f"{index}.conv_tail"], owner))
    return SegmentEntry(meta["key"], token_ids, Seams(head, tail), int(meta["local_start"]), int(meta["length"]),
                        layers, meta["namespace"])
