"""Checks on a segment entry that crossed a process boundary, before the receiver splices it."""
from collections.abc import Callable
from dataclasses import dataclass

from hypic.config import ModelConfig
from hypic.engine import Engine
from hypic.errors import HypicError
from hypic.store import AttentionInterior, LinearInterior, Role, SegmentEntry, entry_key

from .channel import BulkChannel, ChannelError, Parcel


class TransferError(HypicError):
    """A received entry does not match what was asked for or what the model can splice."""


def check_entry(entry: SegmentEntry, fingerprint: str, role: Role, config: ModelConfig) -> None:
    """Raise ``TransferError`` unless ``entry`` is the interior of its own token ids for this model
    (its key is their content address) with every layer's tensors of the model's shapes."""
    if entry_key(fingerprint, entry.seams, role, entry.token_ids, entry.namespace) != entry.key:
        raise TransferError(f"entry {entry.key[:12]} does not address its token ids for this model")
    interior = entry.seams.interior(len(entry.token_ids))
    if interior is None or interior != (entry.local_start, entry.local_start + entry.length):
        raise TransferError(f"entry {entry.key[:12]} has interior {entry.local_start}+{entry.length}, "
                            f"its seams give {interior}")
    if len(entry.layers) != config.num_hidden_layers:
        raise TransferError(f"entry {entry.key[:12]} has {len(entry.layers)} layers, the model {config.num_hidden_layers}")
    for index, layer in enumerate(entry.layers):
        expected = _shapes(config, index, entry.length, role)
        if _layer_shapes(layer) != expected:
            raise TransferError(f"entry {entry.key[:12]} layer {index}: shapes {_layer_shapes(layer)}, expected {expected}")


def entries_of(batches: list[list[SegmentEntry]]) -> list[SegmentEntry]:
    """The entries of several shipments (each one peer's list), in order."""
    return [entry for batch in batches for entry in batch]


def install_entries(engine: Engine, entries: list[SegmentEntry], mode: str) -> tuple[list[str], int]:
    """Check and store received entries in ``engine``'s public pool; returns the keys kept and how
    many were refused (dropped: the combine pass recomputes them)."""
    policy, kept, refused = engine.policy(mode), [], 0
    for entry in entries:
        try:
            check_entry(entry, engine.fingerprint, policy.role, engine.model.config)
        except TransferError:
            refused += 1
            continue
        if engine.store.put(entry):
            kept.append(entry.key)
    return kept, refused


def entry_check(fingerprint: str, role: Role, config: ModelConfig) -> Callable[[SegmentEntry], None]:
    """``check_entry`` against one model and role."""
    return lambda entry: check_entry(entry, fingerprint, role, config)


@dataclass
class ReceiveCounts:
    """Entries a combine node received, by path, and parcels that did not arrive or were refused."""

    point_to_point: int = 0
    object_store: int = 0
    failed: int = 0

    def add(self, other: "ReceiveCounts") -> None:
        self.point_to_point += other.point_to_point
        self.object_store += other.object_store
        self.failed += other.failed


def receive_all(channel: BulkChannel | None, items: list[SegmentEntry | Parcel],
                check: Callable[[SegmentEntry], None]) -> tuple[list[SegmentEntry], ReceiveCounts]:
    """Entries as they are (they came through the object store), parcels received over ``channel``
    (their headers ``check``-ed first); returns the entries and the counts."""
    entries, counts = [], ReceiveCounts()
    for item in items:
        if not isinstance(item, Parcel):
            entries.append(item)
            counts.object_store += 1
            continue
        try:
            if channel is None:
                raise ChannelError("a parcel arrived but this process has no bulk-transfer group")
            entries.append(channel.receive(item, check))
            counts.point_to_point += 1
        except (ChannelError, TransferError):
            counts.failed += 1
    return entries, counts


def _shapes(config: ModelConfig, index: int, length: int, role: Role) -> tuple:
    if config.layer_types[index] != "linear_attention":  # a sliding-window layer keeps its last window tokens
        heads, window = config.kv_heads(index), config.window(index)
        kept = length if window is None else min(length, window)
        return ("attention", (heads, kept, config.head_dim), (heads, kept, config.attention_value_dim))
    heads, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    transition = None if role is Role.NAIVE_SEGMENT else config.linear_transition_shape
    conv_tail = (config.linear_conv_kernel_dim - 1, config.linear_conv_channels)
    return ("linear", transition, (heads, dk, dv), conv_tail)


def _layer_shapes(layer: object) -> tuple:
    if isinstance(layer, AttentionInterior):
        return ("attention", tuple(layer.keys.shape), tuple(layer.values.shape))
    if isinstance(layer, LinearInterior):
        transition = None if layer.transition is None else tuple(layer.transition.value.shape)
        return ("linear", transition, tuple(layer.zero_start_state.shape), tuple(layer.conv_tail.shape))
    return (type(layer).__name__,)
