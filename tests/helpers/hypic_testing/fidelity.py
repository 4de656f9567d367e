"""The fidelity tests' machinery: a PIC layout of random texts, the reference's HYPIC generation for
it (``Oracle``: ``tests/reference``'s token loop and splice rule), the engine's greedy generation, and
the bound they must agree to. Shared by ``tests/hypic/test_fidelity.py`` and the quantized
checkpoints' fidelity tests."""
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from hypic import DEFAULT_SEPARATOR as SEP, Engine
from hypic.engine import Prefill
from hypic_reference import semantics as reference
from hypic_reference.model import ReferenceModel

TOLERANCE = 1e-4  # every logit of the first token and of each greedy decode step
STEPS = 16
ALPHABET = "abcdefghijklmnopqrstuvwxyz ,.;:!?0123456789"


@dataclass(frozen=True)
class Layout:
    """One request: leading part, documents, query (texts; the byte-level tokenizer makes a
    character one token)."""

    leading: str
    documents: tuple[str, ...]
    query: str

    @property
    def text(self) -> str:
        return SEP.join([self.leading, *self.documents, self.query])

    def request(self, tokenizer: Tokenizer) -> reference.PicRequest:
        ids = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False).ids)  # noqa: E731
        return reference.PicRequest(ids(self.leading), tuple(ids(d) for d in self.documents), ids(self.query))


def random_text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(length))


def layout(seed: int, lengths: list[int], leading: int = 20, query: int = 15) -> Layout:
    rng = random.Random(seed)
    return Layout(random_text(rng, leading), tuple(random_text(rng, n) for n in lengths), random_text(rng, query))


@dataclass
class Generation:
    """Greedy tokens and the logits [vocab] each was chosen from (first token, then every decode step)."""

    tokens: list[int]
    logits: list[torch.Tensor]


class Oracle:
    """The reference's HYPIC generation for one checkpoint and seam width."""

    def __init__(self, model: ReferenceModel, path: Path, seam_width: int) -> None:
        self.model, self.seam_width = model, seam_width
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))

    def generate(self, case: Layout, steps: int = STEPS) -> Generation:
        logits, state = reference.prefill(self.model, case.request(self.tokenizer), self.seam_width,
                                          self.model.config.conv_kernel)
        return Generation(*reference.greedy(self.model, state, logits, steps))

    def full(self, case: Layout) -> torch.Tensor:
        """The plain forward's last logits (full recompute of the same ids)."""
        return self.model.run(self.model.empty_state(), case.request(self.tokenizer).token_ids)[0][-1]


def engine_generation(engine: Engine, prefill: Prefill, steps: int = STEPS) -> Generation:
    """Greedy decode from a prefill, one request at a time."""
    logits, state, tokens, seen = prefill.logits, prefill.state, [], []
    for _ in range(steps):
        seen.append(logits)
        tokens.append(int(logits.argmax()))
        logits, state = engine.decode_step(state, tokens[-1])
    return Generation(tokens, seen)


def assert_same_generation(ours: Generation, expected: Generation, label: str = "") -> None:
    for step, (a, b) in enumerate(zip(ours.logits, expected.logits)):
        error = (a - b).abs().max().item()
        assert error <= TOLERANCE, f"{label} step {step}: max |logit difference| {error:.2e}"
    assert ours.tokens == expected.tokens, label
