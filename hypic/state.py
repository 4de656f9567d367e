"""Per-request running state: what decode continues from (the private pool's unit).

A request's state grows in place: the combine pass and decode append to its own full-attention KV
buffers (capacity doubling, or reserved up front), so a decode step copies nothing the request
already holds. KV it resumed from (the private pool's pages) or shares with its sibling samples
(``fork``) is read where it lies, never copied into the request; a state handed to ``combine`` or
``decode_batch`` is consumed by it.
"""
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .config import ModelConfig


@dataclass
class LinearLayerState:
    """Recurrent state [Hv, K, V] fp32 and conv window [k-1, C] of one Gated DeltaNet layer
    (replaced, never written in place: sharing one between requests is safe). ``owner``: what holds
    the memory the tensors view (a private-pool slot), kept alive with them."""

    recurrent: torch.Tensor
    conv: torch.Tensor
    owner: object = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        """Pickled as copies when the tensors view a pool slot (a view would carry its whole slab)."""
        if self.owner is None:
            return self.__dict__
        return {"recurrent": self.recurrent.clone(), "conv": self.conv.clone(), "owner": None}

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.recurrent, self.conv

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.recurrent, self.conv)


KVBlock = tuple[torch.Tensor, torch.Tensor]  # keys [Hkv, n, Dk] and values [Hkv, n, Dv] of n consecutive positions


class Lease(Protocol):
    """A hold on shared KV blocks' owner (``prefix_cache.PrefixLease``)."""

    def release(self) -> None: ...


class AttentionLayerState:
    """Keys (rotated at their global positions) [Hkv, T, Dk] and values [Hkv, T, Dv] of one full-attention
    layer. The first ``shared_length`` positions may sit in read-only ``shared`` blocks that others hold
    too (the private pool's pages after a hit, a prompt's KV shared by its samples: neither is
    copied); the rest is the request's own, in buffers of some capacity that grow in place.
    ``lease``: whatever keeps the shared blocks' owners from dropping them while this state lives."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int = 0,
                 shared: tuple[KVBlock, ...] = (), lease: Lease | None = None) -> None:
        """``keys`` / ``values``: the own positions after the shared ones (copied into a buffer of
        ``capacity`` tokens or more)."""
        length, room = keys.shape[1], max(capacity, keys.shape[1])
        self.shared, self.lease = shared, lease
        self.shared_length = sum(block[0].shape[1] for block in shared)
        self._keys = keys.new_empty(keys.shape[0], room, keys.shape[2])
        self._values = values.new_empty(values.shape[0], room, values.shape[2])  # narrower under latent attention
        self._keys[:, :length], self._values[:, :length] = keys, values
        self._own = length

    @property
    def length(self) -> int:
        """Positions held (shared and own)."""
        return self.shared_length + self._own

    @length.setter
    def length(self, length: int) -> None:
        if length < self.shared_length:
            raise ValueError(f"cannot cut a state to {length} positions inside its {self.shared_length} shared ones")
        self._own = length - self.shared_length

    @property
    def keys(self) -> torch.Tensor:
        """All keys [Hkv, T, Dk]: a view of the own buffer, or, behind shared blocks, a gathered copy
        (transient: what attention reads)."""
        return self._gather(0)

    @property
    def values(self) -> torch.Tensor:
        return self._gather(1)

    def _gather(self, which: int) -> torch.Tensor:
        own = (self._keys, self._values)[which][:, : self._own]
        if not self.shared:
            return own
        return torch.cat([block[which] for block in self.shared] + [own], dim=1)

    def kv(self, lo: int, hi: int) -> KVBlock:
        """Keys and values of positions lo..hi-1 (views when they lie in one block or in the own buffer)."""
        pieces, offset = [], 0
        for keys, values, length in (*((k, v, k.shape[1]) for k, v in self.shared), (self._keys, self._values, self._own)):
            a, b = max(lo, offset), min(hi, offset + length)
            if a < b:
                pieces.append((keys[:, a - offset : b - offset], values[:, a - offset : b - offset]))
            offset += length
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat([k for k, _ in pieces], dim=1), torch.cat([v for _, v in pieces], dim=1)

    @property
    def capacity(self) -> int:
        """Positions this state can hold without reallocating its own buffer."""
        return self.shared_length + self._keys.shape[1]

    def reserve(self, total: int) -> None:
        """Room for ``total`` tokens without reallocating (copies what is owned once, if it must grow)."""
        room = total - self.shared_length
        if room > self._keys.shape[1]:
            keys, values = self._keys.new_empty(self._keys.shape[0], room, self._keys.shape[2]), self._values.new_empty(
                self._values.shape[0], room, self._values.shape[2])
            keys[:, : self._own], values[:, : self._own] = self._keys[:, : self._own], self._values[:, : self._own]
            self._keys, self._values = keys, values

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add n tokens' keys and values [Hkv, n, D] after the ones held (capacity doubles when full)."""
        end = self.length + keys.shape[1]
        if end > self.capacity:
            self.reserve(max(end, self.shared_length + 2 * self._keys.shape[1]))
        lo, hi = self._own, self._own + keys.shape[1]
        self._keys[:, lo:hi], self._values[:, lo:hi] = keys, values
        self._own = hi

    def place(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keys and values [Hkv, n, D] written at own-buffer slots [n] (positions less ``shared_length``),
        in one copy each; the caller has reserved the room and sets ``length`` after."""
        self._keys.index_copy_(1, slots, keys)
        self._values.index_copy_(1, slots, values)

    def fork(self) -> "AttentionLayerState":
        """Another state of the same positions that shares them (nothing copied): what this state owns
        becomes a shared block of both, and each appends into a buffer of its own from here on."""
        if self._own:
            self.shared += ((self._keys[:, : self._own], self._values[:, : self._own]),)
            self.shared_length += self._own
            self._keys, self._values, self._own = self._keys[:, :0], self._values[:, :0], 0
        return AttentionLayerState(self._keys, self._values, 0, self.shared, self.lease)

    def __getstate__(self) -> dict[str, torch.Tensor]:
        """Pickled (sent to another process) as the tokens held, not the spare capacity."""
        return {"keys": self.keys.clone(), "values": self.values.clone()}

    def __setstate__(self, held: dict[str, torch.Tensor]) -> None:
        self.__init__(held["keys"], held["values"])  # type: ignore[misc]

    @property
    def nbytes(self) -> int:
        """Bytes of the own buffers at their capacity (shared blocks are their holders' to count)."""
        return tensor_bytes(self._keys, self._values)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.keys, self.values


class WindowLayerState:
    """Keys (rotated at their global positions) [Hkv, ., Dk] and values [Hkv, ., Dv] of a sliding-window
    layer's last ``window`` positions: a ring of ``window`` slots (position p in slot p % window), so
    a request's SWA KV never exceeds ``window`` tokens however long its context grows."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, window: int, length: int = 0) -> None:
        """keys [Hkv, n <= window, Dk] and values of positions length - n .. length - 1."""
        self._keys = keys.new_zeros(keys.shape[0], window, keys.shape[2])
        self._values = values.new_zeros(values.shape[0], window, values.shape[2])
        self.window, self.length = window, 0
        if keys.shape[1]:
            self.write(keys, values, length - keys.shape[1])
        self.length = length

    @property
    def start(self) -> int:
        """The first position held."""
        return max(0, self.length - self.window)

    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.length, device=self._keys.device)

    def held(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values and positions [T] of the held tokens, in position order (a copy)."""
        positions = self.positions()
        slots = positions % self.window
        return self._keys[:, slots], self._values[:, slots], positions

    def slots(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Keys, values and positions (host integers) of the held tokens in slot order (views when the
        ring is full)."""
        held = min(self.length, self.window)
        positions = [slot + ((self.length - 1 - slot) // self.window) * self.window for slot in range(held)]
        return self._keys[:, :held], self._values[:, :held], positions

    def write(self, keys: torch.Tensor, values: torch.Tensor, first: int) -> None:
        """Keys and values [Hkv, n, D] of positions first .. first + n - 1, the newest. A gap after the
        held positions is allowed only where the window no longer reaches (n >= window)."""
        count = keys.shape[1]
        if first > self.length and count < self.window:
            raise ValueError(f"positions {self.length}..{first - 1} would be missing from the window")
        keep = min(count, self.window)
        slots = torch.arange(first + count - keep, first + count, device=self._keys.device) % self.window
        self._keys[:, slots], self._values[:, slots] = keys[:, count - keep:], values[:, count - keep:]
        self.length = first + count

    def fork(self) -> "WindowLayerState":
        state = WindowLayerState(self._keys[:, :0], self._values[:, :0], self.window)
        state._keys.copy_(self._keys)
        state._values.copy_(self._values)
        state.length = self.length
        return state

    def rings(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value rings [Hkv, window, D] (to copy them elsewhere: ``placed``)."""
        return self._keys, self._values

    def placed(self, keys: torch.Tensor, values: torch.Tensor, owner: object) -> "WindowLayerState":
        """A copy whose rings are ``keys`` and ``values`` (same shapes: a pool slot's views, which
        ``owner`` holds; kept alive with the copy)."""
        keys.copy_(self._keys)
        values.copy_(self._values)
        state = WindowLayerState.__new__(WindowLayerState)
        state._keys, state._values, state.window, state.length, state.owner = keys, values, self.window, self.length, owner
        return state

    def __getstate__(self) -> dict:
        """Pickled with copies of the rings when they view a pool slot."""
        held = dict(self.__dict__)
        if held.pop("owner", None) is not None:
            held["_keys"], held["_values"] = self._keys.clone(), self._values.clone()
        return held

    def mark(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        """What the next one-token write overwrites (to undo a decode step)."""
        slot = self.length % self.window
        return self.length, self._keys[:, slot].clone(), self._values[:, slot].clone()

    def restore(self, mark: tuple[int, torch.Tensor, torch.Tensor]) -> None:
        length, keys, values = mark
        if self.length > length:
            slot = length % self.window
            self._keys[:, slot], self._values[:, slot] = keys, values
        self.length = length

    @property
    def nbytes(self) -> int:
        """Bytes of the ring (``window`` tokens, whatever the context length)."""
        return tensor_bytes(self._keys, self._values)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.held()[:2]


LayerState = LinearLayerState | AttentionLayerState | WindowLayerState


def tensor_bytes(*tensors: torch.Tensor) -> int:
    """Exact bytes of the tensors' elements (what every pool's accounting counts)."""
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class LinearShapes:
    """What a model's linear layers hold, which their family decides (``LinearFamily.shapes``): the
    recurrent state's shape and dtype, and a cached T_C's shape."""

    state: tuple[int, ...]
    state_dtype: torch.dtype
    transition: tuple[int, ...]


@dataclass(frozen=True)
class StateMark:
    """A ``RequestState``'s length, layer objects and KV lengths at one moment."""

    length: int
    layers: list[LayerState]
    kv_lengths: list[int]
    windows: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class RequestState:
    """State of every layer after ``length`` tokens at positions 0..length-1. ``marks``: the PIC
    layout it was assembled under (position -> ``segments.PartMark`` bits; empty when exact)."""

    layers: list[LayerState]
    length: int = 0
    token_ids: list[int] = field(default_factory=list)
    marks: dict[int, int] = field(default_factory=dict)

    @classmethod
    def empty(cls, config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
              linear: LinearShapes) -> "RequestState":
        """The zero state before any token; ``linear``: its linear layers' shapes (``families.empty_state``
        reads them from the model's family)."""
        layers: list[LayerState] = []
        for kind in config.layer_types:
            if kind == "linear_attention":
                recurrent = torch.zeros(linear.state, dtype=linear.state_dtype, device=device)
                conv = torch.zeros(config.linear_conv_kernel_dim - 1, config.linear_conv_channels, device=device,
                                   dtype=dtype)
                layers.append(LinearLayerState(recurrent, conv))
            else:
                index = len(layers)
                keys = torch.zeros(config.kv_heads(index), 0, config.head_dim, device=device, dtype=dtype)
                values = torch.zeros(config.kv_heads(index), 0, config.attention_value_dim, device=device, dtype=dtype)
                window = config.window(index)
                layers.append(AttentionLayerState(keys, values) if window is None else WindowLayerState(keys, values, window))
        return cls(layers)

    def reserve(self, total: int) -> None:
        """Room for ``total`` tokens in every KV buffer (prompt + the most tokens decode may add)."""
        for layer in self.layers:
            if isinstance(layer, AttentionLayerState):
                layer.reserve(total)

    def mark(self) -> "StateMark":
        """Where this state stands, to ``rollback`` a decode step that failed part way."""
        lengths = [layer.length if isinstance(layer, AttentionLayerState) else 0 for layer in self.layers]
        windows = {i: layer.mark() for i, layer in enumerate(self.layers) if isinstance(layer, WindowLayerState)}
        return StateMark(self.length, list(self.layers), lengths, windows)

    def rollback(self, mark: "StateMark") -> None:
        """Back to ``mark``: linear states put back, KV buffers cut to their marked length."""
        self.layers[:] = mark.layers
        for layer, length in zip(self.layers, mark.kv_lengths):
            if isinstance(layer, AttentionLayerState):
                layer.length = length
        for index, window in mark.windows.items():
            layer = self.layers[index]
            assert isinstance(layer, WindowLayerState)
            layer.restore(window)
        del self.token_ids[mark.length:]
        self.length = mark.length

    def fork(self) -> "RequestState":
        """Another state of the same tokens that decode may grow apart from this one: full-attention KV
        held so far is shared by both (``AttentionLayerState.fork``), sliding-window rings copied,
        linear states shared (they are never written in place)."""
        layers = [layer if isinstance(layer, LinearLayerState) else layer.fork() for layer in self.layers]
        return RequestState(layers, self.length, list(self.token_ids), dict(self.marks))

    @property
    def window_nbytes(self) -> int:
        """The part of ``nbytes`` in sliding-window rings (the SWA pool; the rest grows with the context)."""
        return sum(layer.nbytes for layer in self.layers if isinstance(layer, WindowLayerState))

    @property
    def nbytes(self) -> int:
        """Exact tensor bytes this state holds of its own (KV buffers at their capacity, rings,
        linear states); KV blocks it shares with the private pool or its sibling samples are not counted."""
        return sum(layer.nbytes for layer in self.layers)

    def release(self) -> None:
        """Let go of the holds on shared blocks' owners (the private pool may evict them again; this
        state stays readable while referenced). Dropping the state does the same."""
        for layer in self.layers:
            if isinstance(layer, AttentionLayerState) and layer.lease is not None:
                layer.lease.release()

    def shared_blocks(self) -> list[KVBlock]:
        """The KV blocks this state reads but does not own (see ``AttentionLayerState.shared``)."""
        return [block for layer in self.layers if isinstance(layer, AttentionLayerState) for block in layer.shared]
