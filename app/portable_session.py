"""The ``session`` section of a moved session's snapshot, checked field by field before it is used.

The section is the protocol state one replica hands another (app/migration.py,
:meth:`Session.portable_state` plus whose session it is). It comes over the
network behind the cluster secret, and a secret can leak: so it is held to what
a client could have made through the protocol itself (a known codec, a quality
of 1-100, wire ids, event lists no longer than the session keeps, a session id
of the server's own alphabet), and an off value is a 400 naming the field,
never a session that fails later or a forged log line.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .codecs import CodecName
from .protocol import WireId, describe_errors
from .session import MAX_PENDING_EVENTS, RECENT_EVENT_IDS

# The server's own session ids ("s-" and hex, "v-" and a token) fit in this; nothing that can break a log line does.
SESSION_ID = r"^[A-Za-z0-9_.-]{1,128}$"
# The realtime video dialect's codec, fMP4 at its frame rate (fmp4.fmp4_codec: a fraction, denominator <= 1001).
FMP4_CODEC = r"^fmp4/[1-9][0-9]{0,5}(/[1-9][0-9]{0,3})?$"
TOKEN_KEY = r"^[0-9a-f]{1,64}$"


class PortableSessionError(ValueError):
    """A session section that is not one a replica makes; the message names the fields, not their values."""


class PortableSession(BaseModel):
    """What :meth:`Session.from_portable` reads, with the protocol's own bounds."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    id: Annotated[str, Field(pattern=SESSION_ID)]
    codec: CodecName | Annotated[str, Field(pattern=FMP4_CODEC)]
    quality: Annotated[int, Field(ge=1, le=100)]
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None
    controls: dict[str, Any]
    prompt: str | None
    staged_controls: dict[str, Any] | None
    staged_prompt: str | None
    pending_event_ids: Annotated[list[WireId], Field(max_length=MAX_PENDING_EVENTS)]
    last_tick_id: WireId | None
    last_reset_tick_id: WireId | None
    event_floor: WireId | None
    recent_event_ids: Annotated[list[WireId], Field(max_length=RECENT_EVENT_IDS)]
    owner: Annotated[str, Field(pattern=TOKEN_KEY)] | None = None
    # A realtime video session's own state (realtime_video.VideoStreamState.portable); None for protocol 1.
    dialect_state: dict[str, Any] | None = None
    client_host: str = ""
    record: bool = False  # recorded where it was: it goes on recording where recording is on (app/recorder.py)

    @field_validator("dialect_state")
    @classmethod
    def _a_dialects_state(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        from .realtime_video import VideoStreamState  # the one dialect with a state of its own

        if value is not None:
            try:
                VideoStreamState.from_portable(value)
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"not a realtime video session's state ({type(exc).__name__})") from None
        return value

    @field_validator("client_host")
    @classmethod
    def _an_address(cls, value: str) -> str:
        try:
            return str(ipaddress.ip_address(value)) if value else value
        except ValueError:
            raise ValueError("not an IP address (a client's host is one, or empty)") from None


def validated_session(section: Any) -> dict[str, Any]:
    """``section`` checked as a :class:`PortableSession`, as the dict ``Session.from_portable`` takes."""
    try:
        return PortableSession.model_validate(section).model_dump()
    except ValidationError as exc:
        raise PortableSessionError(f"the snapshot's session section is not valid: {describe_errors(exc)}") from None
