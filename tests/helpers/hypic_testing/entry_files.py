"""Entry files taken apart and put back together, for tests that damage or rewrite a header: an
8-byte little-endian header length, the JSON header (padded with spaces to 8 bytes), the tensors;
and the identity an engine's entry files carry."""
import json
import struct

from hypic import Engine
from hypic.cache.tiers.entry_file import EntryIdentity
from hypic.models.families import linear_shapes


def entry_identity(engine: Engine) -> EntryIdentity:
    """What ``engine``'s entry files are made with (what encodes and decodes them)."""
    config = engine.model.config
    return EntryIdentity(engine.fingerprint, engine.model.dtype, engine.state_cache_dtype, config, linear_shapes(config))


def split_entry_file(data: bytes) -> tuple[dict, bytes]:
    """(the header, the bytes after it)."""
    size = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + size]), data[8 + size:]


def join_entry_file(header: dict, body: bytes) -> bytes:
    """A file of ``header`` (compact JSON, padded) and ``body``."""
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + body
