"""Documents for the router tests: short records the default model answers from."""
from collections.abc import Callable

import pytest

from hypic import DEFAULT_SEPARATOR

ANIMALS = ["otter", "heron", "badger", "lynx", "marten", "ibis", "stoat", "crane", "vole", "egret"]
PLACES = ["Tarsk", "Welby", "Oxmoor", "Quill", "Dunmere", "Pellow", "Ravia", "Scoll", "Hithe", "Brant"]
DOCS = [f"Record {i}: the {a} of {p} was born in {1900 + 7 * i} and studied {a}s near the river of {p}. "
        f"It was known for a red coat and a loud call at dawn."
        for i, (a, p) in enumerate(zip(ANIMALS, PLACES))]


def make_prompt(indices: list[int], question: str) -> str:
    return DEFAULT_SEPARATOR.join(["Answer from the records.", *(DOCS[i] for i in indices), f"Question: {question}\nAnswer:"])


@pytest.fixture(scope="session")
def docs() -> list[str]:
    return DOCS


@pytest.fixture(scope="session")
def pic_prompt() -> Callable[[list[int], str], str]:
    """The PIC prompt of records ``indices`` and a question."""
    return make_prompt
