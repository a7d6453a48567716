"""A snapshot's JSON header, read within bounds before anything is parsed (docs/public.md, "Moved sessions").

A snapshot comes from a peer over the network, so its header is checked the
way a client's message is: its length first (``MAX_HEADER_BYTES``, read from
the safetensors prefix before a byte of JSON is touched), then its nesting
(``MAX_HEADER_DEPTH``, in linear time, so deep nesting is a clear refusal and
never a RecursionError), then it is parsed strictly (arstream/strict_json.py).
Both layers are bounded: the safetensors header and the ARStream header inside
its metadata. ``json.loads`` holds the GIL for the whole parse, so moving it
off the event loop alone would not stop a stall: the length bound is what
keeps one parse short.
"""

from __future__ import annotations

import struct
from typing import Any

from ..strict_json import MAX_JSON_DEPTH, loads_strict

# A real header is a few KiB to a few hundred KiB: counters, the model's JSON state, the session's
# protocol state (two prompts of at most a message each, escaped twice) and the tensors' index.
MAX_HEADER_BYTES = 1024 * 1024
# A client's controls nest at most MAX_JSON_DEPTH levels within a message; the header holds them a few
# levels down (header > model_state > session > controls).
MAX_HEADER_DEPTH = MAX_JSON_DEPTH + 8
METADATA_KEY = "arstream_session"


class SnapshotHeaderError(ValueError):
    """The bytes do not start with a header this server reads (too long, too deep, not JSON, no ARStream part)."""


def parse_header(data: bytes) -> Any:
    """The ARStream JSON value in ``data``'s safetensors metadata; :class:`SnapshotHeaderError` past a bound."""
    if len(data) < 8:
        raise SnapshotHeaderError("not a session snapshot: shorter than a safetensors header")
    (length,) = struct.unpack("<Q", data[:8])
    if length > min(MAX_HEADER_BYTES, len(data) - 8):
        raise SnapshotHeaderError(
            f"not a session snapshot: header length {length} does not fit "
            f"(the bytes after it: {len(data) - 8}; a header here is at most {MAX_HEADER_BYTES} bytes)"
        )
    try:
        outer = loads_strict(data[8 : 8 + length].decode("utf-8"), MAX_HEADER_DEPTH)
        inner = outer["__metadata__"][METADATA_KEY]
        if not isinstance(inner, str):
            raise TypeError("the ARStream metadata is not a string")
        return loads_strict(inner, MAX_HEADER_DEPTH)
    except (ValueError, KeyError, TypeError) as exc:
        # The reason, never the bytes: they came from the network.
        reason = str(exc) if isinstance(exc, ValueError) and "nests deeper" in str(exc) else type(exc).__name__
        raise SnapshotHeaderError(
            f"not a session snapshot: no ARStream header in the safetensors metadata ({reason})"
        ) from None
