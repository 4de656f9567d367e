"""A public-pool entry as a self-describing file: safetensors layout, identity and checksum in its header.

Layout (readable by any safetensors reader): 8-byte little-endian header length, a JSON header
(each tensor's dtype, shape and byte range, plus ``__metadata__``), then the tensors' bytes. The
metadata names the entry's content key, the model fingerprint, both dtypes, the seam rule, the
token ids and a SHA-256 of the tensors, so a file from another model, another dtype, another
document or a damaged disk is refused (``BadEntryFile``), never spliced.
"""
import hashlib
import json
import re
import struct
from dataclasses import dataclass

import torch

from ..composition import Family, Transition
from ...config import ModelConfig
from ..entry_check import EntryMismatch, check_entry
from ...errors import HypicError
from ..segments import Seams
from ..store import AttentionInterior, InteriorLayer, LinearInterior, Role, SegmentEntry

FORMAT = "hypic-segment-entry/1"
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class BadEntryFile(HypicError):
    """A stored entry that cannot be used here: truncated, damaged, or made for another model,
    dtype, document or format."""


@dataclass(frozen=True)
class EntryIdentity:
    """What a stored entry must have been made with to be spliced by this engine."""

    fingerprint: str
    model_dtype: torch.dtype
    state_dtype: torch.dtype
    config: ModelConfig
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


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(_raw(tensors[name]))  # hashed in place, not copied
    return digest.hexdigest()


def _raw(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy where it is contiguous."""
    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


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
                "layers": json.dumps([_layer_kind(layer) for layer in entry.layers])}
    return pack(metadata, tensors)


def pack(metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> bytes:
    """A safetensors file of ``tensors`` (copied to the CPU) with ``metadata`` and their SHA-256
    (``checksum``) in its header."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    header: dict = {"__metadata__": {**metadata, "checksum": _checksum(tensors)}}
    offset, chunks = 0, []
    for name in sorted(tensors):
        data = _raw(tensors[name])
        header[name] = {"dtype": _NAMES[tensors[name].dtype], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + data.nbytes]}
        chunks.append(data)
        offset += data.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data section to 8 bytes
    return b"".join([struct.pack("<Q", len(encoded)), encoded, *chunks])  # one copy of the tensors


def unpack(buffer: bytes | memoryview) -> tuple[dict, dict[str, torch.Tensor]]:
    """The metadata and the tensors (copies) of a file ``pack`` wrote; raises ``BadEntryFile`` if it is
    truncated, unreadable or damaged (checksum)."""
    header, start = _header(buffer)
    meta = header.get("__metadata__", {})
    tensors = _tensors(buffer, header, start)
    if _checksum(tensors) != meta.get("checksum"):
        raise BadEntryFile("checksum mismatch: the file is damaged")
    return meta, tensors


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
    if not isinstance(header, dict):
        raise BadEntryFile("unreadable header: not an object")
    return header, 8 + size


def decode_entry(buffer: bytes | memoryview, identity: EntryIdentity, key: str, token_ids: tuple[int, ...]) -> SegmentEntry:
    """The entry stored in ``buffer`` if it is ``key``'s, for ``token_ids``, made by ``identity`` and
    intact; its tensors are copies (the buffer may be a memory map). Raises ``BadEntryFile``."""
    header, start = _header(buffer)
    meta = header.get("__metadata__", {})
    _check_identity(meta, identity, key, token_ids)
    tensors = _tensors(buffer, header, start)
    if _checksum(tensors) != meta.get("checksum"):
        raise BadEntryFile("checksum mismatch: the file is damaged")
    tensors = {name: t.to(identity.device) for name, t in tensors.items()}
    try:
        entry = _entry(meta, tensors, token_ids)
        check_entry(entry, identity.fingerprint, Role(meta["role"]), identity.config)
    except (EntryMismatch, KeyError, ValueError) as err:
        raise BadEntryFile(f"not an entry this model can splice: {err}") from err
    return entry


def _check_identity(meta: dict, identity: EntryIdentity, key: str, token_ids: tuple[int, ...]) -> None:
    expected = {"format": FORMAT, "key": key, "fingerprint": identity.fingerprint,
                "model_dtype": str(identity.model_dtype), "state_dtype": str(identity.state_dtype)}
    for name, value in expected.items():
        if meta.get(name) != value:
            raise BadEntryFile(f"{name} is {meta.get(name)!r}, expected {value!r}")
    if meta.get("token_ids") != json.dumps(list(token_ids)):
        raise BadEntryFile("the file holds another document's tokens")


def _tensors(buffer: bytes | memoryview, header: dict, start: int) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (start + int(o) for o in spec["data_offsets"])
            dtype, shape = _DTYPES[spec["dtype"]], [int(s) for s in spec["shape"]]
        except (KeyError, TypeError, ValueError) as err:
            raise BadEntryFile(f"tensor {name}: unreadable spec") from err
        if end > len(buffer) or begin > end:
            raise BadEntryFile(f"truncated: tensor {name} ends at byte {end} of {len(buffer)}")
        data = bytearray(buffer[begin:end])
        flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        if flat.numel() != dtype.itemsize * torch.Size(shape).numel():
            raise BadEntryFile(f"tensor {name}: {flat.numel()} bytes for shape {shape}")
        tensors[name] = flat.view(dtype).reshape(shape)
    return tensors


def _entry(meta: dict, tensors: dict[str, torch.Tensor], token_ids: tuple[int, ...]) -> SegmentEntry:
    head, tail = (int(x) for x in meta["seams"].split(","))
    layers: list[InteriorLayer] = []
    for index, kind in enumerate(json.loads(meta["layers"])):
        if kind == "attention":
            layers.append(AttentionInterior(tensors[f"{index}.keys"], tensors[f"{index}.values"]))
            continue
        family = kind.partition(":")[2]
        transition = Transition(Family(family), tensors[f"{index}.transition"]) if family else None
        layers.append(LinearInterior(transition, tensors[f"{index}.state"], tensors[f"{index}.conv_tail"]))
    return SegmentEntry(meta["key"], token_ids, Seams(head, tail), int(meta["local_start"]), int(meta["length"]),
                        layers, meta["namespace"])
