"""The byte-level BPE tokenizer of the synthetic QA corpus."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from hypic_data.synthetic_qa import EOS_TOKEN, PAD_TOKEN, build_training_text, prompt_parts
from hypic_data.tokenizer import (
    TokenizerConfig,
    corpus_texts,
    encode_parts,
    load_tokenizer,
    main,
    special_token_ids,
    train_tokenizer,
)


def corpus(splits: dict[str, list[dict]]) -> list[str]:
    """Every prompt part, answer and training text of the fixture dataset."""
    texts = []
    for examples in splits.values():
        for example in examples:
            texts.extend(prompt_parts(example))
            texts.append(build_training_text(example))
    return texts


def test_round_trips_the_corpus_exactly(splits: dict[str, list[dict]],
                                        tokenizer_file: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_file)
    for text in corpus(splits):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_round_trips_unseen_bytes(tokenizer_file: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_file)
    for text in ("naïve café — 東京 ☃", "\t tabs\r\n and  double  spaces ", "x" * 300, ""):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_and_no_automatic_additions(tokenizer_file: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_file)
    assert special_token_ids(tokenizer) == (0, 1)
    assert tokenizer.token_to_id(EOS_TOKEN) == 0 and tokenizer.token_to_id(PAD_TOKEN) == 1
    for add in (True, False):
        ids = tokenizer.encode("The city lies in Vostra.", add_special_tokens=add).ids
        assert 0 not in ids and 1 not in ids
    assert tokenizer.encode(f"done{EOS_TOKEN}").ids[-1] == 0  # eos is never split


def test_parts_encode_like_the_concatenated_text(splits: dict[str, list[dict]],
                                                 tokenizer_file: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_file)
    for example in splits["test"]:
        parts = prompt_parts(example) + [" " + example["answer"]]
        whole = tokenizer.encode("".join(parts), add_special_tokens=False).ids
        assert encode_parts(tokenizer, parts) == whole


def test_training_is_deterministic(splits: dict[str, list[dict]]) -> None:
    texts = list(corpus_texts(splits["train"][:30]))
    first = train_tokenizer(texts, TokenizerConfig(vocab_size=1000))
    second = train_tokenizer(texts, TokenizerConfig(vocab_size=1000))
    assert first.to_str() == second.to_str()
    assert first.get_vocab_size() == 1000


def test_cli_writes_tokenizer_json(dataset_dir: Path, tmp_path: Path) -> None:
    main(["--data", str(dataset_dir), "--out", str(tmp_path / "tok"), "--vocab-size", "600"])
    tokenizer = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 600
