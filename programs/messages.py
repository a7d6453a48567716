"""The JSON messages a client sends (docs/PROTOCOL.md), and the session URL for what a user typed.

The client's side of the wire, for the programs here and for tests; the server validates what comes with
:mod:`arstream.app.protocol`, and the binary frame format both sides read is :mod:`arstream.app.wire`.
"""

from __future__ import annotations

import base64
import json
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..app.codecs import CODEC_NAMES
from ..app.wire import ID_LIMIT, SESSIONS_PATH


def _present(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields that have a value (an absent field and a null one mean the same to the server)."""
    return {k: v for k, v in fields.items() if v is not None}


def _message(fields: dict[str, Any]) -> str:
    # allow_nan=False: the server refuses NaN/Infinity, so fail here with a Python error instead.
    return json.dumps(_present(fields), allow_nan=False)


def takes_keys(card: dict[str, Any]) -> bool:
    """Whether a model card's controls take held keys: its schema names ``keys`` or leaves room for unnamed fields.

    A model steered by its prompt alone (LongLive) refuses every ``input`` that carries keys.
    """
    schema = card.get("controls")
    if not isinstance(schema, dict):
        return True  # no schema: nothing says keys are refused
    return "keys" in (schema.get("properties") or {}) or schema.get("additionalProperties") is not False


def _check_id(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < ID_LIMIT:
        raise ValueError(f"{name} must be an integer in [0, 2^32), got {value!r}")


def start_message(
    *,
    codec: str = "jpeg",
    seed: int | None = None,
    prompt: str | None = None,
    quality: int | None = None,
    resume: str | None = None,
    image: dict[str, str] | None = None,
    watch: str | None = None,
    branch: tuple[str, int | None] | None = None,
) -> str:
    """``start``; with ``resume`` (a ticket's token) it resumes that session instead of starting one.

    ``image`` is ``start.image`` (:func:`start_image_field`). ``watch`` (a share token) starts a viewer of
    that session; ``branch`` (share token, chunk boundary) a new session from that boundary of the shared one
    (boundary None: its latest, where it is when the branch is made).
    """
    if codec not in CODEC_NAMES:
        raise ValueError(f"codec must be one of {list(CODEC_NAMES)}, got {codec!r}")
    return _message(
        {
            "type": "start", "codec": codec, "seed": seed, "prompt": prompt, "quality": quality, "resume": resume,
            "image": image, "watch": watch,
            "branch": _present({"share": branch[0], "chunk": branch[1]}) if branch is not None else None,
        }
    )


def start_image_field(*, name: str | None = None, data: bytes | None = None) -> dict[str, str]:
    """``start.image``: one the model offers by ``name`` (``ready.model.start_images``), or an image file's
    bytes (PNG, JPEG or WebP) as ``data``, sent base64."""
    if name is not None and data is None:
        return {"name": name}
    if data is not None and name is None:
        return {"data": base64.b64encode(data).decode("ascii")}
    raise ValueError("a start image is a name or a file's bytes: give exactly one")


def tick_message(
    tick_id: int,
    *,
    controls: dict[str, Any] | None = None,
    prompt: str | None = None,
    reset: bool = False,
    close: bool = False,
    rewind_to: int | None = None,
) -> str:
    """Ask for one chunk; ``controls``/``prompt`` (optional) update the session first, ``rewind_to`` first
    takes it back to that chunk boundary."""
    _check_id("tick_id", tick_id)
    fields: dict[str, Any] = {
        "type": "tick", "tick_id": tick_id, "controls": controls, "prompt": prompt, "rewind_to": rewind_to
    }
    if reset:
        fields["reset"] = True
    if close:
        fields["close"] = True
    return _message(fields)


def input_message(event_id: int, *, controls: dict[str, Any] | None = None, prompt: str | None = None) -> str:
    """Update controls and/or prompt without asking for a chunk; applied at the next chunk that starts."""
    _check_id("event_id", event_id)
    return _message({"type": "input", "event_id": event_id, "controls": controls, "prompt": prompt})


def close_message() -> str:
    return _message({"type": "close"})


def pass_control_message(viewer_id: str) -> str:
    """Hand the session's controls to one of its viewers (an id from the controller's ``viewers`` message)."""
    return _message({"type": "pass_control", "to": viewer_id})


def session_url(url: str, *, token: str | None = None, resume: str | None = None, share: str | None = None) -> str:
    """The ``ws(s)://host:port/v1/sessions`` URL for what a user typed.

    Accepts a full WebSocket URL, or an ``http(s)://host:port`` base URL (its
    scheme is swapped and, when it has no path, ``/v1/sessions`` is added). A
    token becomes the ``?token=`` query parameter, a resume ticket's token
    ``?resume=`` and a share token ``?share=`` (so a load balancer can route it to the replica that holds
    the session).
    """
    parts = urlsplit(url if "://" in url else f"ws://{url}")
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None:
        raise ValueError(f"URL scheme must be ws, wss, http or https, got {parts.scheme!r} in {url!r}")
    if not parts.netloc:
        raise ValueError(f"URL has no host: {url!r}")
    path = parts.path if parts.path not in ("", "/") else SESSIONS_PATH
    query = parse_qsl(parts.query)
    for name, value in (("token", token), ("resume", resume), ("share", share)):
        if value is not None:
            query = [(k, v) for k, v in query if k != name] + [(name, value)]
    return urlunsplit((scheme, parts.netloc, path, urlencode(query), ""))


def http_base_url(url: str) -> str:
    """``http(s)://host:port`` of the server behind a session URL (for /v1/stats and friends)."""
    parts = urlsplit(session_url(url))
    return urlunsplit(({"ws": "http", "wss": "https"}[parts.scheme], parts.netloc, "", "", ""))
