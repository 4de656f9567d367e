"""Exceptions with messages that say what is wrong; the server maps them to 4xx. Messages show
values as their users write them (``as_written``), not as Python's repr."""
import json
from enum import Enum
from typing import Any


class HypicError(Exception):
    """Base class of every error HYPIC raises on purpose."""


class InvalidRequest(HypicError, ValueError):
    """The prompt or the sampling parameters cannot be served as given; ``param``: the request field
    at fault, when there is one (OpenAI's error object names it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnsupportedModel(HypicError, ValueError):
    """The checkpoint's architecture is not one HYPIC can run."""


class CheckpointError(HypicError, ValueError):
    """The checkpoint directory is incomplete or its tensors do not match the config."""


def as_written(value: Any, limit: int = 60) -> str:
    """``value`` for a message, as its user writes it in JSON or on a command line: a string bare
    (quoted as JSON when bare it would read as something else: empty, spaces at an end, a number,
    true/false/null), booleans true/false, None null, lists and objects as JSON, an enum by its
    value; cut to ``limit`` characters."""
    if isinstance(value, Enum):
        value = value.value
    text = value if isinstance(value, str) and _reads_bare(value) else _as_json(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _reads_bare(text: str) -> bool:
    """Whether ``text`` without quotes still reads as that string."""
    if not text or text != text.strip() or not text.isprintable():
        return False
    try:
        json.loads(text)
    except ValueError:
        return True
    return False  # it would read as a number, true, false, null...


def _as_json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    except (TypeError, ValueError):
        return str(value)
