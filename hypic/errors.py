"""Exceptions with messages that say what is wrong; the server maps them to 4xx."""


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
