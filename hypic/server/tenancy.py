"""Who may call the server, and which cache namespace a request lives in.

API keys are held as SHA-256 digests and a presented key is compared with every one of them in
constant time, so neither the response time nor the logs say anything about the keys. A request's
namespace is a digest of what names it: its ``cache_salt`` / ``extra_key`` and, under
``--isolate-by-key``, its API key; a request that names nothing shares the common namespace "".
"""
import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import HypicError

API_KEY_ENV = "HYPIC_API_KEY"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class ApiKeys:
    """The keys a server accepts, as digests; empty: no authentication."""

    digests: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, keys: list[str]) -> "ApiKeys":
        bad = [index for index, key in enumerate(keys) if not key or key != key.strip() or any(c.isspace() for c in key)]
        if bad:
            raise HypicError(f"API key {bad[0] + 1} is empty or holds whitespace")
        return cls(tuple(dict.fromkeys(_digest(key) for key in keys)))

    @property
    def required(self) -> bool:
        return bool(self.digests)

    def identify(self, authorization: str | None) -> str | None:
        """The id of the key in an ``Authorization: Bearer KEY`` header (a digest prefix, never the
        key), or None when it names no accepted key. Every stored digest is compared, in constant time."""
        scheme, _, token = (authorization or "").partition(" ")
        presented = _digest(token.strip() if scheme.lower() == "bearer" else "\0")
        found = None
        for digest in self.digests:
            if hmac.compare_digest(digest, presented):
                found = digest
        return None if found is None else found.hex()[:16]


def read_api_keys(given: list[str], files: list[str]) -> list[str]:
    """The keys from ``--api-key``, each ``--api-key-file`` (one per line; blank lines and ``#``
    comments skipped) and the ``HYPIC_API_KEY`` environment variable."""
    keys = list(given)
    for name in files:
        try:
            lines = Path(name).read_text().splitlines()
        except OSError as err:
            raise HypicError(f"cannot read --api-key-file {name}: {err.strerror}") from err
        keys += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if os.environ.get(API_KEY_ENV):
        keys.append(os.environ[API_KEY_ENV])
    return keys


def namespace_of(salt: tuple[str, ...], caller: str | None, isolate: bool) -> str:
    """The cache namespace of a request that named ``salt`` (its tagged cache_salt / extra_key),
    sent with API key id ``caller``: "" (shared) when nothing names one."""
    names = ([f"key={caller}"] if isolate and caller is not None else []) + list(salt)
    return hashlib.sha256(json.dumps(names).encode()).hexdigest()[:32] if names else ""
