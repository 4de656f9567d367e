"""Which worker holds which prompt prefix in its private pool (the radix tree of its engine), as the
router believes: whole-request routing sends a prompt to the worker that can resume it.

Prefixes are recorded in blocks of ``block`` tokens, each named by a hash chained over every token
before it, so a block matches only behind the same prefix. The router records a prompt on the
worker that served it; an engine's evictions are not reported, so the index may claim a prefix the
worker has dropped: that costs that worker a recompute, never a wrong answer (the engine matches its
own tree). Each worker's record is bounded (least recently used blocks go first).
"""
import hashlib
from collections import OrderedDict, defaultdict

PREFIX_BLOCK = 64  # tokens per recorded block: prefixes shorter than this are not worth routing for
MAX_BLOCKS = 1 << 16  # per worker: 4M tokens of prefixes at 64 tokens per block


def block_hashes(token_ids: list[int] | tuple[int, ...], block: int = PREFIX_BLOCK, namespace: str = "") -> list[bytes]:
    """The chained hash of each whole block of ``token_ids`` in cache ``namespace`` (a tail shorter
    than a block is not named)."""
    hashes, previous = [], namespace.encode()
    for lo in range(0, len(token_ids) - block + 1, block):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(",".join(map(str, token_ids[lo : lo + block])).encode())
        previous = digest.digest()
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """Worker -> the prefix blocks it is believed to hold, most recently used last."""

    def __init__(self, block: int = PREFIX_BLOCK, max_blocks: int = MAX_BLOCKS) -> None:
        self.block, self.max_blocks = block, max_blocks
        self._blocks: dict[int, OrderedDict[bytes, None]] = defaultdict(OrderedDict)

    def record(self, worker: int, token_ids: list[int] | tuple[int, ...], namespace: str = "") -> None:
        """``worker`` served a prompt of ``token_ids`` in cache ``namespace``: it now holds its prefix blocks."""
        held = self._blocks[worker]
        for digest in block_hashes(token_ids, self.block, namespace):
            held[digest] = None
            held.move_to_end(digest)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def matched(self, token_ids: list[int] | tuple[int, ...], namespace: str = "") -> dict[int, int]:
        """Worker -> how many leading tokens of ``token_ids`` (in ``namespace``) it is believed to hold (whole blocks)."""
        hashes = block_hashes(token_ids, self.block, namespace)
        out = {}
        for worker, held in self._blocks.items():
            count = next((i for i, digest in enumerate(hashes) if digest not in held), len(hashes))
            if count:
                out[worker] = count * self.block
        return out

    def forget_worker(self, worker: int) -> None:
        self._blocks.pop(worker, None)

    def __len__(self) -> int:
        return sum(len(held) for held in self._blocks.values())
