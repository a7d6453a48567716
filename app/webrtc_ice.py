"""The ICE servers a session's client is told to use (`ready.webrtc.ice_servers`, PROTOCOL.md "WebRTC video").

They are ``--webrtc-ice-servers`` as configured, except that a TURN entry without a username gets credentials of its
own for each `ready` from ``--webrtc-turn-secret``: coturn's time-limited "TURN REST API" credentials (its
``use-auth-secret`` with ``static-auth-secret``), a username ``<expiry unix time>:<session id>`` and the password
``base64(HMAC-SHA1(secret, username))``. The relay checks them without asking the server, and the shared secret
never reaches a client.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from typing import TYPE_CHECKING, Any

from .settings import ice_server_urls

if TYPE_CHECKING:
    from .settings import Settings


def turn_rest_credentials(secret: str, user: str, expires_at: int) -> tuple[str, str]:
    """coturn's REST API credentials: (username, credential) good until ``expires_at`` (unix seconds)."""
    username = f"{expires_at}:{user}"
    digest = hmac.new(secret.encode(), username.encode(), hashlib.sha1).digest()
    return username, base64.b64encode(digest).decode()


def ice_servers_for(settings: Settings, session_id: str, now: float | None = None) -> list[dict[str, Any]]:
    """The ICE servers for a `ready` of ``session_id``: TURN entries without a username get fresh credentials."""
    servers = []
    for server in settings.webrtc_ice_servers:
        entry = dict(server)
        turn = any(url.startswith(("turn:", "turns:")) for url in ice_server_urls(server))
        if turn and "username" not in entry and settings.webrtc_turn_secret is not None:
            expires_at = int((time.time() if now is None else now) + settings.webrtc_turn_credential_ttl_s)
            entry["username"], entry["credential"] = turn_rest_credentials(
                settings.webrtc_turn_secret, session_id, expires_at
            )
        servers.append(entry)
    return servers
