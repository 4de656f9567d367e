"""Exceptions with messages that say what is wrong; the server maps them to 4xx."""


class HypicError(Exception):
    """Base class of every error HYPIC raises on purpose."""


class InvalidRequest(HypicError, ValueError):
    """The prompt or the sampling parameters cannot be served as given."""


class UnsupportedModel(HypicError, ValueError):
    """The checkpoint's architecture is not one HYPIC can run."""


class CheckpointError(HypicError, ValueError):
    """The checkpoint directory is incomplete or its tensors do not match the config."""
