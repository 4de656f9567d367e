"""The private pool: a radix tree over token ids holding assembled request states (DESIGN §6).

Full-attention KV can be cut at any token, but a linear layer's state exists only where it was
snapshotted (document boundaries, request ends). So each node stores the KV of its edge's tokens,
and some nodes also carry a snapshot of every linear layer's state at their end; a hit is the
longest matched prefix that ends at such a node. Trees are kept per namespace (the reuse mode),
because a HYPIC-assembled state is an approximation that an exact mode must not reuse.
"""
from dataclasses import dataclass, field
from itertools import count

import torch

from .state import AttentionLayerState, LayerState, LinearLayerState, RequestState

Snapshot = dict[int, LinearLayerState]  # linear layer index -> its state at a position


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(eq=False)
class RadixNode:
    """Tokens ``edge`` after the parent's end; ``kv`` of those tokens per attention layer [Hkv, len, D]."""

    edge: tuple[int, ...]
    parent: "RadixNode | None"
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    depth: int  # tokens from the root to this node's end
    children: dict[int, "RadixNode"] = field(default_factory=dict)
    snapshot: Snapshot | None = None
    last_used: int = 0

    @property
    def nbytes(self) -> int:
        total = sum(_nbytes(k, v) for k, v in self.kv.values())
        if self.snapshot is not None:
            total += sum(_nbytes(s.recurrent, s.conv) for s in self.snapshot.values())
        return total


@dataclass
class PrefixHit:
    """A private-pool hit: the request's state after its first ``length`` tokens."""

    length: int
    state: RequestState


def _common_length(a: tuple[int, ...], b: list[int], offset: int) -> int:
    n = 0
    limit = min(len(a), len(b) - offset)
    while n < limit and a[n] == b[offset + n]:
        n += 1
    return n


class PrefixCache:
    """Radix trees of request states under one byte budget, evicting least recently used leaves."""

    def __init__(self, budget_bytes: int | None = None) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.roots: dict[str, RadixNode] = {}
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0
        self._clock = count(1)

    # ----- lookup -------------------------------------------------------------------------
    def match(self, namespace: str, token_ids: list[int], limit: int, template: RequestState) -> PrefixHit | None:
        """Longest snapshotted prefix of ``token_ids`` no longer than ``limit`` tokens.
        ``template``: an empty state giving the layer kinds (and the device) of the model."""
        node, best, offset = self.roots.get(namespace), None, 0
        while node is not None:
            if node.snapshot is not None and 0 < node.depth <= limit:
                best = node
            child = node.children.get(token_ids[offset]) if offset < len(token_ids) else None
            if child is None or _common_length(child.edge, token_ids, offset) < len(child.edge):
                break
            node, offset = child, offset + len(child.edge)
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        return PrefixHit(best.depth, self._assemble(best, token_ids, template))

    def _assemble(self, node: RadixNode, token_ids: list[int], template: RequestState) -> RequestState:
        path, tick = [], next(self._clock)
        walk: RadixNode | None = node
        while walk is not None and walk.parent is not None:
            path.append(walk)
            walk.last_used = tick
            walk = walk.parent
        path.reverse()
        assert node.snapshot is not None
        layers: list[LayerState] = []
        for index, empty in enumerate(template.layers):
            if isinstance(empty, LinearLayerState):
                layers.append(node.snapshot[index])
            else:
                keys = torch.cat([empty.keys] + [n.kv[index][0] for n in path], dim=1)
                values = torch.cat([empty.values] + [n.kv[index][1] for n in path], dim=1)
                layers.append(AttentionLayerState(keys, values))
        return RequestState(layers, node.depth, list(token_ids[: node.depth]))

    # ----- insertion ----------------------------------------------------------------------
    def insert(self, namespace: str, state: RequestState, snapshots: dict[int, Snapshot]) -> None:
        """Add ``state``'s tokens up to its last snapshot position, with the snapshots
        (position -> linear layer states) at their nodes. Existing nodes are kept as they are."""
        positions = sorted(p for p in snapshots if 0 < p <= state.length)
        if not positions or self.budget_bytes == 0:
            return
        node = self.roots.setdefault(namespace, RadixNode((), None, {}, 0))
        tick = next(self._clock)
        for position in positions:
            node = self._extend(node, state, position, tick)
            if node.snapshot is None:  # clones: a view would keep a larger tensor alive, uncounted
                node.snapshot = {i: LinearLayerState(s.recurrent.clone(), s.conv.clone())
                                 for i, s in snapshots[position].items()}
                self.nbytes += sum(_nbytes(s.recurrent, s.conv) for s in node.snapshot.values())
        self._evict()

    def _extend(self, node: RadixNode, state: RequestState, end: int, tick: int) -> RadixNode:
        """Walk (splitting or creating nodes) from ``node`` down to a node ending exactly at ``end``."""
        ids = state.token_ids
        while node.depth < end:
            node.last_used = tick
            child = node.children.get(ids[node.depth])
            if child is None:
                child = self._new_node(node, state, node.depth, end)
            else:
                common = min(_common_length(child.edge, ids, node.depth), end - node.depth)
                if common < len(child.edge):
                    child = self._split(child, common)
            node = child
        node.last_used = tick
        return node

    def _new_node(self, parent: RadixNode, state: RequestState, lo: int, hi: int) -> RadixNode:
        kv = {i: (layer.keys[:, lo:hi].clone(), layer.values[:, lo:hi].clone())
              for i, layer in enumerate(state.layers) if isinstance(layer, AttentionLayerState)}
        node = RadixNode(tuple(state.token_ids[lo:hi]), parent, kv, hi)
        parent.children[node.edge[0]] = node
        self.nbytes += node.nbytes
        return node

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut ``node``'s edge after ``at`` tokens; returns the new upper node (clones keep sizes exact)."""
        assert node.parent is not None
        upper_kv = {i: (k[:, :at].clone(), v[:, :at].clone()) for i, (k, v) in node.kv.items()}
        upper = RadixNode(node.edge[:at], node.parent, upper_kv, node.depth - len(node.edge) + at,
                          last_used=node.last_used)
        node.parent.children[upper.edge[0]] = upper
        node.kv = {i: (k[:, at:].clone(), v[:, at:].clone()) for i, (k, v) in node.kv.items()}
        node.edge, node.parent = node.edge[at:], upper
        upper.children[node.edge[0]] = node
        return upper

    # ----- eviction -----------------------------------------------------------------------
    def _nodes(self) -> list[RadixNode]:
        stack, nodes = list(self.roots.values()), []
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def _evict(self) -> None:
        """Drop least recently used leaves until the tree fits its budget. Nothing is in use here:
        a hit hands the request a copy, and the engine loop is the only thread touching the tree."""
        if self.budget_bytes is None:
            return
        while self.nbytes > self.budget_bytes:
            leaves = [n for n in self._nodes() if not n.children and n.parent is not None]
            self._remove(min(leaves, key=lambda n: n.last_used))
            self.evictions += 1

    def _remove(self, node: RadixNode) -> None:
        assert node.parent is not None
        self.nbytes -= node.nbytes
        del node.parent.children[node.edge[0]]

    def clear(self) -> int:
        """Drop every tree; returns how many nodes were dropped."""
        dropped = sum(1 for n in self._nodes() if n.parent is not None)
        self.roots.clear()
        self.nbytes = 0
        return dropped

    def __len__(self) -> int:
        return sum(1 for n in self._nodes() if n.parent is not None)
