"""What the loader reads from the checkpoint file: a tensor-parallel rank reads its own rows of a
matrix, not the whole matrix. The oracle is the kernel's page cache: the file is dropped from it
first, the rank's model is loaded, and ``mincore`` says which pages of the file were read."""
import ctypes
import mmap
import os
import re
from pathlib import Path

import pytest
import torch

from hypic.loading.checkpoints import write_random_checkpoint
from hypic.errors import CheckpointError
from hypic.loading.loader import load_model
from hypic.parallel import TensorParallel
from hypic.loading.safetensors_reader import TensorReader, read_header

EMBEDDING = "model.embed_tokens.weight"


def _resident(file: Path, begin: int, end: int) -> float:
    """The fraction of the file's pages in [begin, end) that the page cache holds."""
    page = mmap.PAGESIZE
    first, last = begin // page, (end - 1) // page
    with file.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        anchor = ctypes.c_char.from_buffer(mapped)
        pages = (ctypes.c_ubyte * (last - first + 1))()
        libc = ctypes.CDLL(None, use_errno=True)
        result = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor) + first * page),
                              ctypes.c_size_t((last - first + 1) * page), pages)
        del anchor
    assert result == 0, os.strerror(ctypes.get_errno())
    return sum(p & 1 for p in pages) / len(pages)


def _drop_from_page_cache(file: Path) -> None:
    with file.open("rb") as handle:
        os.fsync(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _readahead_bytes(folder: Path) -> int:
    """The kernel's read-ahead window for the disk holding ``folder`` (8 MiB if it cannot be read)."""
    device = os.stat(folder).st_dev
    queue = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
    for candidate in (queue / "queue/read_ahead_kb", queue / "../queue/read_ahead_kb"):
        if candidate.is_file():
            return int(candidate.read_text()) * 1024
    return 8 << 20


def test_a_rank_reads_only_its_rows_of_the_embedding(tmp_path: Path) -> None:
    """Rank 1 of 2 keeps the second half of the vocabulary's rows of a float32 embedding 16 times the
    kernel's read-ahead window: the first half's pages stay unread, but for what read-ahead brings in
    around the reads (at most a window from the tensor before it and half of one behind the seam);
    the second half's are read."""
    window = _readahead_bytes(tmp_path)
    hidden, vocab = 64, max(65536, 16 * window // (64 * 4))
    if vocab * hidden * 4 > 512 << 20:
        pytest.skip(f"read-ahead of {window >> 20} MiB would need an embedding over 512 MiB to show it")
    path = write_random_checkpoint(tmp_path / "model", "qwen3_5_text", vocab_size=vocab, hidden_size=hidden,
                                   dtype="float32", tie_word_embeddings=True)
    (file,) = path.glob("*.safetensors")
    info = read_header(file)[EMBEDDING]
    middle = info.begin + (info.end - info.begin) // 2
    _drop_from_page_cache(file)
    if _resident(file, info.begin, info.end) > 0.05:
        pytest.skip(f"the page cache of {file.parent} cannot be dropped here (a tmpfs?)")
    model = load_model(path, tp=TensorParallel(1, 2))
    assert model.config.vocab_size == vocab
    assert _resident(file, info.begin, middle) < 0.25  # rank 0's rows: read-ahead at most 3/16
    assert _resident(file, middle, info.end) > 0.9  # its own


def test_a_tensor_read_is_its_bytes_and_a_truncated_file_is_named(tmp_path: Path) -> None:
    """The reader hands out each tensor as saved (misaligned and empty ones included); writing to one
    never reaches the file; a file cut inside a tensor is a CheckpointError naming it."""
    from safetensors.torch import save_file
    tensors = {"a": torch.arange(3, dtype=torch.uint8), "b": torch.randn(5, 7), "c": torch.zeros(0, 4),
               "d": torch.randn(9, dtype=torch.float64)}
    file = tmp_path / "t.safetensors"
    save_file(tensors, str(file))
    reader = TensorReader([file])
    for name, tensor in tensors.items():
        assert torch.equal(reader.read(name), tensor), name
    reader.read("b").fill_(0)
    assert torch.equal(TensorReader([file]).read("b"), tensors["b"])
    last = max(read_header(file).items(), key=lambda item: item[1].end)[0]
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(file.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=f"ends inside tensor {re.escape(last)} "):
        TensorReader([cut]).read(last)
