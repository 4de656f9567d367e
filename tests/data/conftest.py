"""Shared fixtures of the data tests: a small generated dataset, its tokenizer, a micro run."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from hypic_data.synthetic_qa import GeneratorConfig, generate_split, read_jsonl, write_split
from hypic_data.tokenizer import TokenizerConfig, corpus_texts, save_tokenizer, train_tokenizer

SPLIT_SIZES = {"train": 80, "validation": 10, "test": 40}
TEST_SEED = 20240601
MICRO_STEPS = 10


@pytest.fixture(scope="session")
def qa_config() -> GeneratorConfig:
    """Generator settings of the fixture dataset."""
    return GeneratorConfig(seed=TEST_SEED)


@pytest.fixture(scope="session")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory, qa_config: GeneratorConfig) -> Path:
    """A small dataset written the way the command line writes it."""
    out = tmp_path_factory.mktemp("synthetic_qa")
    for split, count in SPLIT_SIZES.items():
        write_split(out / f"{split}.jsonl", generate_split(qa_config, split, count))
    return out


@pytest.fixture(scope="session")
def splits(dataset_dir: Path) -> dict[str, list[dict]]:
    """The fixture dataset, split name -> examples."""
    return {split: read_jsonl(dataset_dir / f"{split}.jsonl") for split in SPLIT_SIZES}


@pytest.fixture(scope="session")
def tokenizer_file(dataset_dir: Path, splits: dict[str, list[dict]]) -> Path:
    """A tokenizer trained on the fixture train split, saved beside the data."""
    tokenizer = train_tokenizer(corpus_texts(splits["train"]), TokenizerConfig(vocab_size=4096))
    return save_tokenizer(tokenizer, dataset_dir / "tokenizer")


@pytest.fixture(scope="session")
def micro_run(tmp_path_factory: pytest.TempPathFactory, dataset_dir: Path,
              tokenizer_file: Path):
    """A few training steps of a micro hybrid model (3 linear + 1 full layer) on CPU."""
    from hypic_data.train import ModelConfig, TrainConfig, train

    model = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
    config = TrainConfig(data=dataset_dir, tokenizer=tokenizer_file,
                         out=tmp_path_factory.mktemp("micro_run"), steps=MICRO_STEPS,
                         batch_size=2, seq_len=512, lr=3e-3, warmup_steps=2, max_examples=8,
                         save_every=4, keep_checkpoints=1, device="cpu", progress=False,
                         model=model)
    with torch_threads(1):
        return config, train(config)


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run torch on ``count`` threads, then restore the previous setting.

    On a 2-core machine shared with other processes, two torch threads spin-wait on
    each other and a micro step can take 10 s instead of 0.3 s; one thread is steady.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture()
def one_torch_thread() -> Iterator[None]:
    """Function-scoped ``torch_threads(1)``."""
    with torch_threads(1):
        yield
