"""The private pool: a radix tree over token ids holding assembled request states.

Full-attention KV can be cut at any token, but a linear layer's state exists only where it was
snapshotted (document boundaries, request ends). So each node stores the KV of its edge's tokens,
and some nodes also carry a snapshot of every linear layer's state at their end; a hit is the
longest matched prefix that ends at such a node. Trees are kept per reuse mode (a HYPIC-assembled
state is an approximation that an exact mode must not reuse) and cache namespace
(``ModePolicy.tree``: a tenant's states are never resumed by another's request). Within a tree the
key of a token is its id with its layout marks (``segments.PartMark``): a state
assembled from spliced segments is resumed only by a request with the same segmentation up to
the resume point, and never by a plain prompt of the same ids.

A hit copies nothing: a node keeps its edge's KV in pages of ``page_tokens`` positions (cut at
multiples of it), slots of the pool's preallocated arenas (``arena.py``), and the resumed request
reads those pages where they lie (``AttentionLayerState.shared``). Its ``PrefixLease`` pins the
path's nodes (``RadixNode.users``) until the last state holding it is gone: eviction passes them by,
so the pool's bytes stay the bytes in memory; a page leaves its slot only when nothing holds it. A
split copies at most the one page it cuts through. The budget counts whole slots (a page that uses
part of its slot holds all of it). Snapshots' linear states and window rings sit in slots too
(``state_arenas``, one slot per layer state), held by the state objects that view them.
"""
import heapq
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import count, pairwise

import torch

from .arena import Copies, Page, PageArenas, StateArenas
from .segments import MARK_BITS
from ..state import AttentionLayerState, LayerState, LinearLayerState, RequestState, WindowLayerState

MARK_MASK = (1 << MARK_BITS) - 1
PAGE_TOKENS = 128  # positions per KV page by default: a split copies at most one page

# layer index -> its state at a position: a linear layer's recurrent state and conv window, a
# sliding-window layer's last ``window`` keys and values (the only SWA KV the tree keeps)
Snapshot = dict[int, LinearLayerState | WindowLayerState]


def _window_bytes(node: "RadixNode") -> int:
    """Bytes of the sliding-window layers' tails in ``node``'s snapshot."""
    snapshot = node.snapshot or {}
    return sum(s.nbytes for s in snapshot.values() if isinstance(s, WindowLayerState))


def _kept(arenas: StateArenas, state: LinearLayerState | WindowLayerState,
          copies: Copies) -> LinearLayerState | WindowLayerState:
    """A copy the tree owns, in a slot of ``arenas`` (held by the copy: a reader of it keeps the slot);
    a linear state's tensors are copied when ``copies`` runs."""
    if isinstance(state, WindowLayerState):
        slot = arenas.copy(*state.rings())
        return state.placed(*slot.views(), owner=slot)
    slot = arenas.copy(state.recurrent, state.conv, copies=copies)
    return LinearLayerState(*slot.views(), owner=slot)


def _paged(arenas: PageArenas, keys: torch.Tensor, values: torch.Tensor, lo: int, copies: Copies) -> list[Page]:
    """Pages holding copies of the KV [Hkv, n, D] of positions lo..lo+n-1, cut at multiples of the
    page size (copied when ``copies`` runs)."""
    hi, size = lo + keys.shape[1], arenas.page_tokens
    cuts = [lo, *range((lo // size + 1) * size, hi, size), hi]
    sizes = [b - a for a, b in pairwise(cuts)]
    parts = zip(keys.split(sizes, dim=1), values.split(sizes, dim=1)) if len(sizes) > 1 else [(keys, values)]
    return [arenas.page(k, v, copies) for k, v in parts]


def _path(node: "RadixNode") -> list["RadixNode"]:
    """The nodes from the root's child down to ``node``."""
    path: list[RadixNode] = []
    walk: RadixNode | None = node
    while walk is not None and walk.parent is not None:
        path.append(walk)
        walk = walk.parent
    return path[::-1]


def _cut_pages(arenas: PageArenas, pages: list[Page], at: int) -> tuple[list[Page], list[Page]]:
    """Pages holding n positions split into the first ``at`` positions' and the rest's; a page cut
    through is copied into two pages (a reader of the old one keeps it until it lets go)."""
    offset = 0
    for index, (keys, values) in enumerate(pages):
        if offset + keys.shape[1] > at:
            cut = at - offset
            if cut == 0:
                return pages[:index], pages[index:]
            upper, lower = arenas.page(keys[:, :cut], values[:, :cut]), arenas.page(keys[:, cut:], values[:, cut:])
            return [*pages[:index], upper], [lower, *pages[index + 1 :]]
        offset += keys.shape[1]
    return pages, []


@dataclass(eq=False)
class RadixNode:
    """Tokens ``edge`` (their keys: ids with marks) after the parent's end; ``pages`` of those tokens'
    KV per attention layer ([Hkv, n, D] blocks in position order, in the pool's arena slots)."""

    edge: tuple[int, ...]
    parent: "RadixNode | None"
    pages: dict[int, list[Page]]
    depth: int  # tokens from the root to this node's end
    children: dict[int, "RadixNode"] = field(default_factory=dict)
    snapshot: Snapshot | None = None
    last_used: int = 0  # a request passed through or ended here
    snapshot_used: int = 0  # its snapshot was taken or resumed from
    users: int = 0  # requests reading this node's pages (see ``PrefixLease``): never evicted while > 0

    @property
    def nbytes(self) -> int:
        total = sum(page.nbytes for pages in self.pages.values() for page in pages)
        if self.snapshot is not None:
            total += sum(s.nbytes for s in self.snapshot.values())
        return total


class PrefixLease:
    """The nodes of a hit's path, pinned while a request reads their pages: released by ``release``
    or, at the latest, when the last state holding the lease is gone (whichever thread drops it:
    hence the lock)."""

    def __init__(self, nodes: list[RadixNode], lock: threading.Lock) -> None:
        self.nodes, self._lock = nodes, lock
        with lock:
            for node in nodes:
                node.users += 1

    def release(self) -> None:
        with self._lock:
            nodes, self.nodes = self.nodes, []
            for node in nodes:
                node.users -= 1

    def __del__(self) -> None:
        self.release()


@dataclass
class PrefixHit:
    """A private-pool hit: the request's state after its first ``length`` tokens, and the snapshot
    it resumed from (the node's own: the request's rings are copies it writes into)."""

    length: int
    state: RequestState
    snapshot: Snapshot = field(default_factory=dict)


def resume_snapshot(state: RequestState) -> Snapshot:
    """The snapshot a private pool keeps with a resume point at ``state``'s end: its linear layers'
    states and sliding-window rings."""
    return {i: layer for i, layer in enumerate(state.layers) if not isinstance(layer, AttentionLayerState)}


def cache_key(token_ids: list[int], marks: Mapping[int, int]) -> list[int]:
    """The radix-tree key of a token sequence: each id with its layout marks in the low bits
    (vectorised: a 26k-token prompt's key costs ~5 ms instead of ~20)."""
    keys = torch.tensor(token_ids, dtype=torch.int64) << MARK_BITS
    placed = [(position, mark) for position, mark in marks.items() if position < len(keys)]
    if placed:
        positions, values = zip(*placed)
        keys[list(positions)] |= torch.tensor(values, dtype=torch.int64)
    return keys.tolist()


def _common_length(a: tuple[int, ...], b: list[int], offset: int) -> int:
    """How many leading keys of ``a`` equal ``b``'s from ``offset`` on (slices compared in halves:
    C-speed compares, ~log n Python steps)."""
    lo, hi = 0, min(len(a), len(b) - offset)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == tuple(b[offset + lo:offset + mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixCache:
    """Radix trees of request states under one byte budget, evicting least recently used leaves and
    inner snapshots (``_evict``).
    Sliding-window layers keep no KV along the edges, only their last ``window`` tokens in each
    snapshot (the SWA pool, O(window) per resume point); ``window_budget_bytes`` bounds those
    apart from the full-attention KV: over it, the least recently used snapshots lose their
    window tails, and with them their standing as resume points (a hit needs the window whole)."""

    def __init__(self, budget_bytes: int | None = None, window_budget_bytes: int | None = None,
                 page_tokens: int = PAGE_TOKENS) -> None:
        for name, value in (("budget_bytes", budget_bytes), ("window_budget_bytes", window_budget_bytes)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        self.budget_bytes, self.window_budget_bytes = budget_bytes, window_budget_bytes
        self.arenas = PageArenas(page_tokens)  # the KV pages' slots (L1: allocated once, reused)
        self.state_arenas = StateArenas()  # the snapshots' linear states and window rings
        self.roots: dict[str, RadixNode] = {}
        self.nbytes = self.window_nbytes = 0
        self.hits = self.misses = self.evictions = self.window_evictions = self.snapshot_evictions = 0
        self._clock = count(1)
        self._leaves: dict[RadixNode, None] = {}  # nodes without children, oldest first (the eviction candidates)
        self._snapshots: dict[RadixNode, None] = {}  # nodes with a snapshot (inner ones: candidates to drop it)
        self._lock = threading.Lock()  # for ``RadixNode.users``, which a dropped lease lowers on any thread
        # told of every resume point that leaves memory (its tree and node, before it goes): write_back's moment
        self.on_drop: Callable[[str, RadixNode], None] | None = None

    # ----- lookup -------------------------------------------------------------------------
    def match(self, tree: str, key: list[int], limit: int, template: RequestState) -> PrefixHit | None:
        """Longest snapshotted prefix of ``key`` (see ``cache_key``) no longer than ``limit`` tokens.
        ``template``: an empty state giving the layer kinds (and the device) of the model."""
        best = self._deepest(tree, key, limit)
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        assert best.snapshot is not None
        state = self._assemble(best, key, template)
        best.snapshot_used = best.last_used
        return PrefixHit(best.depth, state, best.snapshot)

    def peek(self, tree: str, key: list[int], limit: int) -> int:
        """The length ``match`` would resume from, without assembling it or counting it."""
        best = self._deepest(tree, key, limit)
        return best.depth if best is not None else 0

    def _deepest(self, tree: str, key: list[int], limit: int) -> RadixNode | None:
        """The deepest snapshotted node on ``key``'s path that ends within ``limit`` tokens."""
        node, best, offset = self.roots.get(tree), None, 0
        while node is not None:
            if node.snapshot is not None and 0 < node.depth <= limit:
                best = node
            child = node.children.get(key[offset]) if offset < len(key) else None
            if child is None or _common_length(child.edge, key, offset) < len(child.edge):
                break
            node, offset = child, offset + len(child.edge)
        return best

    def _assemble(self, node: RadixNode, key: list[int], template: RequestState) -> RequestState:
        """The state at ``node``'s end, reading the path's pages in place (nothing copied but the
        sliding-window rings, which the request writes into)."""
        path, tick = _path(node), next(self._clock)
        for walk in path:
            walk.last_used = tick
        return self._state(path, key, template, PrefixLease(path, self._lock))

    @staticmethod
    def _state(path: list[RadixNode], key: list[int], template: RequestState, lease: PrefixLease | None) -> RequestState:
        """The state at the end of ``path`` (root's child to a snapshotted node), its KV the path's pages."""
        node = path[-1]
        assert node.snapshot is not None
        layers: list[LayerState] = []
        for index, empty in enumerate(template.layers):
            if isinstance(empty, LinearLayerState):
                layers.append(node.snapshot[index])
            elif isinstance(empty, WindowLayerState):
                window = node.snapshot[index]
                assert isinstance(window, WindowLayerState)
                layers.append(window.fork())
            else:
                pages = tuple(page for n in path for page in n.pages[index])
                layers.append(AttentionLayerState(empty.keys, empty.values, shared=pages, lease=lease))
        prefix = key[: node.depth]
        marks = {position: k & MARK_MASK for position, k in enumerate(prefix) if k & MARK_MASK}
        return RequestState(layers, node.depth, [k >> MARK_BITS for k in prefix], marks)

    def state_at(self, node: RadixNode, template: RequestState) -> RequestState:
        """The state at a snapshotted ``node``'s end, nothing pinned or made recent (to write it below
        memory as it leaves, or at a stop)."""
        path = _path(node)
        return self._state(path, [k for n in path for k in n.edge], template, None)

    def copy_at(self, tree: str, key: list[int], limit: int, template: RequestState) -> RequestState | None:
        """The state ``match`` would resume ``key`` from, to send to another process, or None; not
        counted as a hit, nothing made recent. It holds its pages and slots until it is dropped (a
        flush or an eviction meanwhile frees them then), and pickles as copies of them."""
        node = self._deepest(tree, key, limit)
        return None if node is None else self.state_at(node, template)

    def resume_points(self) -> Iterator[tuple[str, RadixNode]]:
        """Every snapshotted node and its tree's name."""
        for node in list(self._snapshots):
            yield self._tree_of(node), node

    def _tree_of(self, node: RadixNode) -> str:
        top = node
        while top.parent is not None:
            top = top.parent
        return next(name for name, root in self.roots.items() if root is top)

    def _dropping(self, node: RadixNode) -> None:
        """``node``'s resume point leaves memory: tell ``on_drop``."""
        if self.on_drop is not None and node.snapshot is not None:
            self.on_drop(self._tree_of(node), node)

    # ----- insertion ----------------------------------------------------------------------
    def insert(self, tree: str, state: RequestState, snapshots: dict[int, Snapshot]) -> None:
        """Add ``state``'s tokens (keyed with its marks) up to its last snapshot position, with the
        snapshots (position -> linear layer states) at their nodes. Existing nodes are kept as they are."""
        needed = set(resume_snapshot(state))
        positions = sorted(p for p in snapshots if 0 < p <= state.length and needed <= set(snapshots[p]))
        if not positions or self.budget_bytes == 0:  # a position missing a layer's state is no resume point
            return
        node = self.roots.setdefault(tree, RadixNode((), None, {}, 0))
        key, tick, copies = cache_key(state.token_ids, state.marks), next(self._clock), Copies()
        for position in positions:
            node = self._extend(node, state, key, position, tick, copies)
            node.snapshot_used = tick
            if node.snapshot is None:
                node.snapshot = {i: _kept(self.state_arenas, s, copies) for i, s in snapshots[position].items()
                                 if i in needed}
                self._snapshots[node] = None
                self.nbytes += sum(s.nbytes for s in node.snapshot.values())
                self.window_nbytes += _window_bytes(node)
        copies.run()  # every page and state of the new nodes in one copy, before anything is evicted
        self._evict_windows()
        self._evict()

    def _extend(self, node: RadixNode, state: RequestState, key: list[int], end: int, tick: int,
                copies: Copies) -> RadixNode:
        """Walk (splitting or creating nodes) from ``node`` down to a node ending exactly at ``end``."""
        while node.depth < end:
            node.last_used = tick
            child = node.children.get(key[node.depth])
            if child is None:
                child = self._new_node(node, state, key, node.depth, end, copies)
            else:
                common = min(_common_length(child.edge, key, node.depth), end - node.depth)
                if common < len(child.edge):
                    child = self._split(child, common)
            node = child
        node.last_used = tick
        return node

    def _new_node(self, parent: RadixNode, state: RequestState, key: list[int], lo: int, hi: int,
                  copies: Copies) -> RadixNode:
        pages = {i: _paged(self.arenas, *layer.kv(lo, hi), lo, copies)
                 for i, layer in enumerate(state.layers) if isinstance(layer, AttentionLayerState)}
        node = RadixNode(tuple(key[lo:hi]), parent, pages, hi)
        parent.children[node.edge[0]] = node
        self._leaves.pop(parent, None)
        self._leaves[node] = None
        self.nbytes += node.nbytes
        return node

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut ``node``'s edge after ``at`` tokens; returns the new upper node. ``node`` stays the lower
        one (a lease pinning it keeps it pinned; its new parent is never a leaf while it lives)."""
        assert node.parent is not None
        held = node.nbytes
        cut = {i: _cut_pages(self.arenas, pages, at) for i, pages in node.pages.items()}
        upper = RadixNode(node.edge[:at], node.parent, {i: halves[0] for i, halves in cut.items()},
                          node.depth - len(node.edge) + at, last_used=node.last_used)
        node.parent.children[upper.edge[0]] = upper
        node.pages = {i: halves[1] for i, halves in cut.items()}
        node.edge, node.parent = node.edge[at:], upper
        upper.children[node.edge[0]] = node
        self.nbytes += upper.nbytes + node.nbytes - held  # a page cut through now takes two slots
        return upper

    # ----- eviction -----------------------------------------------------------------------
    def _nodes(self, roots: list[RadixNode] | None = None) -> list[RadixNode]:
        stack, nodes = list(self.roots.values()) if roots is None else list(roots), []
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def _evict(self) -> None:
        """Over the budget, in least recently used order (pinned nodes passed by: a request reads their
        pages): a leaf goes whole, by when a request last ended or passed there; an inner node gives
        up its snapshot (its linear states; its KV serves the deeper nodes) by when that snapshot was
        last taken or resumed from, so the snapshots a long prompt leaves on its way, never resumed
        from, go before the ends that conversations resume at. A parent becomes a leaf candidate once
        its last child is gone, and goes at once if it holds no snapshot (KV nothing resumes from)."""
        if self.budget_bytes is None or self.nbytes <= self.budget_bytes:
            return
        order = count()
        candidates = [(n.last_used, 0, next(order), n) for n in self._leaves if n.users == 0]
        candidates += [(n.snapshot_used, 1, next(order), n) for n in self._snapshots if n.children and n.users == 0]
        heapq.heapify(candidates)
        while candidates and (self.nbytes > self.budget_bytes or candidates[0][0] < 0):
            node = heapq.heappop(candidates)[3]
            if node.children:
                if node.snapshot is not None:
                    self._dropping(node)
                    self._drop_snapshot(node)
                    self.snapshot_evictions += 1
                continue
            if node.parent is None or node.parent.children.get(node.edge[0]) is not node:
                continue  # gone already (a former inner node, queued twice)
            parent = node.parent
            self._dropping(node)
            self._remove(node)
            self.evictions += 1
            if parent.parent is not None and not parent.children and parent.users == 0:
                dead = parent.snapshot is None
                heapq.heappush(candidates, (-1 if dead else parent.last_used, 0, next(order), parent))

    def _evict_windows(self) -> None:
        """Over the window budget: the least recently used snapshots holding windows are dropped,
        the full-attention KV of their edges kept (deeper snapshots still need it)."""
        if self.window_budget_bytes is None or self.window_nbytes <= self.window_budget_bytes:
            return
        holders = sorted((n for n in self._snapshots if _window_bytes(n)), key=lambda n: n.last_used)
        for node in holders:  # dropping a snapshot makes no new holder: one sorted walk
            if self.window_nbytes <= self.window_budget_bytes:
                break
            self._dropping(node)
            self._drop_snapshot(node)
            self.window_evictions += 1

    def _drop_snapshot(self, node: RadixNode) -> None:
        """``node`` is no resume point any more (a window without its tail, or a state, never half of one)."""
        assert node.snapshot is not None
        self.window_nbytes -= _window_bytes(node)
        self.nbytes -= sum(s.nbytes for s in node.snapshot.values())
        node.snapshot = None
        self._snapshots.pop(node, None)

    def _remove(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None
        self.nbytes -= node.nbytes
        self.window_nbytes -= _window_bytes(node)
        del parent.children[node.edge[0]]
        self._leaves.pop(node, None)
        self._snapshots.pop(node, None)
        if parent.parent is not None and not parent.children:
            self._leaves[parent] = None

    def clear(self, trees: Callable[[str], bool] | None = None) -> int:
        """Drop every tree (``trees``: those whose name it accepts); returns how many nodes were
        dropped. Nodes are unlinked first: a parent and its children reference each other, so a
        dropped tree would wait, tensors and all, for the interpreter's next full garbage collection
        (under load with flushes, hundreds of MB)."""
        names = [name for name in self.roots if trees is None or trees(name)]
        nodes = self._nodes([self.roots.pop(name) for name in names])
        for node in nodes:
            self.nbytes -= node.nbytes
            self.window_nbytes -= _window_bytes(node)
            self._leaves.pop(node, None)
            self._snapshots.pop(node, None)
            node.parent, node.children = None, {}
        return len(nodes) - len(names)

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the arenas' slabs (KV pages and snapshot states; slots used and free)."""
        return self.arenas.reserved_bytes + self.state_arenas.reserved_bytes

    def __len__(self) -> int:
        return sum(1 for n in self._nodes() if n.parent is not None)
