"""Which worker holds which prompt prefix in its private pool (the radix tree of its engine), as the
router believes: whole-request routing sends a prompt to the worker that can resume it. A worker is
any hashable id (an int worker of ``hypic.router``, a str replica of ``hypic.cluster``).

Prefixes are recorded in blocks of ``block`` tokens, each named by a hash chained over every token
before it, so a block matches only behind the same prefix. The router records a prompt on the
worker that served it; an engine's evictions are not reported, so the index may claim a prefix the
worker has dropped: that costs that worker a recompute, never a wrong answer (the engine matches its
own tree). Each worker's record is bounded (least recently used blocks go first).
"""
import hashlib
from array import array
from collections import OrderedDict, defaultdict
from collections.abc import Hashable, Iterator

PREFIX_BLOCK = 64  # tokens per recorded block: prefixes shorter than this are not worth routing for
MAX_BLOCKS = 1 << 16  # per worker: 4M tokens of prefixes at 64 tokens per block


def block_hashes(token_ids: list[int] | tuple[int, ...], block: int = PREFIX_BLOCK, namespace: str = "") -> list[bytes]:
    """The chained hash of each whole block of ``token_ids`` in cache ``namespace`` (a tail shorter
    than a block is not named)."""
    return list(iter_block_hashes(token_ids, block, namespace))


def iter_block_hashes(token_ids: list[int] | tuple[int, ...], block: int = PREFIX_BLOCK,
                      namespace: str = "") -> Iterator[bytes]:
    """``block_hashes`` one block at a time, each computed only when asked for."""
    previous = namespace.encode()
    for lo in range(0, len(token_ids) - block + 1, block):
        previous = hashlib.blake2b(previous + array("q", token_ids[lo : lo + block]).tobytes(), digest_size=16).digest()
        yield previous


class PrefixIndex:
    """Worker -> the prefix blocks it is believed to hold, most recently used last."""

    def __init__(self, block: int = PREFIX_BLOCK, max_blocks: int = MAX_BLOCKS) -> None:
        self.block, self.max_blocks = block, max_blocks
        self._blocks: dict[Hashable, OrderedDict[bytes, None]] = defaultdict(OrderedDict)

    def record(self, worker: Hashable, token_ids: list[int] | tuple[int, ...], namespace: str = "") -> None:
        """``worker`` served a prompt of ``token_ids`` in cache ``namespace``: it now holds its prefix blocks."""
        held = self._blocks[worker]
        for digest in block_hashes(token_ids, self.block, namespace):
            held[digest] = None
            held.move_to_end(digest)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def matched(self, token_ids: list[int] | tuple[int, ...], namespace: str = "") -> dict[Hashable, int]:
        """Worker -> how many leading tokens of ``token_ids`` (in ``namespace``) it is believed to hold
        (whole blocks). Blocks are hashed only while some worker still matches."""
        out: dict[Hashable, int] = {}
        matching = [worker for worker, held in self._blocks.items() if held]
        for depth, digest in enumerate(iter_block_hashes(token_ids, self.block, namespace), start=1):
            matching = [worker for worker in matching if digest in self._blocks[worker]]
            if not matching:
                break
            out.update(dict.fromkeys(matching, depth * self.block))
        return out

    def workers(self) -> list[Hashable]:
        """Workers with a recorded prefix."""
        return [worker for worker, held in self._blocks.items() if held]

    def forget_worker(self, worker: Hashable) -> None:
        self._blocks.pop(worker, None)

    def __len__(self) -> int:
        return sum(len(held) for held in self._blocks.values())
