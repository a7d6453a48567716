"""A socket before its session starts: the upgrade checks, refusals and the start image.

A :class:`~arstream.app.live_session.LiveSession` opens with an :class:`Opening`, and its dialect's start talks
to it (the :class:`~arstream.app.dialect.OpeningPort`): accept the upgrade (auth, origin, the cap on sockets
waiting to start), read the start within the message limit, decode a start image off the loop, or refuse with
the dialect's error and a close bounded by ``close_timeout_s``. Until its session is registered, the opening
is who admission and the registry of sockets waiting to start count.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from . import auth
from .dialect import Dialect, Gate
from .guard import limit_messages, transport_control
from .limits import TokenBucket
from .protocol import ERROR_CLOSE_CODES, ErrorCode, dumps
from .start_image import ClientGone, StartImageBusy, StartImageRefused
from ..runner.types import StartImage

log = logging.getLogger("arstream.session")


class Opening:
    """One socket from its upgrade to its session's start (or its refusal)."""

    def __init__(self, websocket: WebSocket, gate: Gate, dialect: Dialect, budget: TokenBucket) -> None:
        self.ws = websocket
        self.gate = gate
        self.dialect = dialect
        self.budget = budget
        self.session_id = dialect.session_id
        self.client_host = websocket.client.host if websocket.client else ""
        self.token_key = auth.token_key(auth.offered_token(websocket.headers, websocket.query_params))
        self.transport = transport_control(websocket.scope)
        self.disconnected = False  # the client went away (before or after its session started)

    async def accept(self) -> bool:
        """Run the upgrade checks (auth, origin, the cap on sockets waiting to start) and accept the socket;
        False after refusing. An accepted socket counts as waiting to start until its session is registered."""
        settings = self.gate.settings
        refusal, missing_token = auth.upgrade_refusal(self.ws, settings)
        if refusal is not None and settings.refuse_before_upgrade:
            headers = {"WWW-Authenticate": "Bearer"} if missing_token else None
            status = 401 if missing_token else 403
            await self._deny_upgrade(ErrorCode.UNAUTHORIZED, refusal, status=status, headers=headers)
            return False
        if refusal is None:
            # Waiting to start is capped (app/unstarted.py); past the cap, a 503 that closes the connection at once.
            busy = self.gate.unstarted.refusal(self.client_host)
            if busy is not None:
                await self._deny_upgrade(ErrorCode.OVER_CAPACITY, busy, status=503, headers={"Retry-After": "1"})
                return False
            self.gate.unstarted.add(self, self.client_host)
        await self.ws.accept()
        if refusal is not None:
            log.info("session=%s refused: %s", self.session_id, refusal)
            await self.refuse(ErrorCode.UNAUTHORIZED, refusal)
            return False
        # Only the start message may carry a picture.
        self.limit_messages(self.gate.start_message_bytes)
        return True

    def limit_messages(self, max_bytes: int) -> None:
        """The largest message the transport reads from now on."""
        limit_messages(self.ws, self.gate.settings.ws_message_limit(max_bytes))

    async def _deny_upgrade(
        self, code: ErrorCode, refusal: str, *, status: int, headers: dict[str, str] | None = None
    ) -> None:
        """Refuse with HTTP ``status`` before the upgrade; the body is the dialect's error object."""
        log.info("session=%s refused before the upgrade: %s", self.session_id, refusal)
        self.gate.metrics.errors.labels(code=str(code)).inc()
        body = self.dialect.error(code, refusal)
        await self.ws.send_denial_response(JSONResponse(body, status_code=status, headers=headers))

    async def refuse(self, code: ErrorCode, message: str) -> None:
        """Error then close, for a socket whose session never started (bounded by ``close_timeout_s``)."""
        self.gate.metrics.errors.labels(code=str(code)).inc()
        await self.send_then_close([dumps(self.dialect.error(code, message))], ERROR_CLOSE_CODES.get(code, 1008))

    async def send_then_close(self, texts: list[str], close_code: int) -> None:
        """Send ``texts`` then the close frame, bounded by ``close_timeout_s``; nothing it sends later is read.

        A peer that does not read its refusal is left to the transport, which drops it (app/guard.py)."""

        async def send_refusal() -> None:
            for text in texts:
                await self.ws.send_text(text)
            await self.ws.close(close_code)

        timeout_s = self.gate.settings.close_timeout_s
        try:
            await asyncio.wait_for(send_refusal(), timeout_s)
            if self.transport is not None:
                self.transport.stop_reading()  # refused: nothing it sends now is parsed
        except TimeoutError:
            log.debug("session=%s did not take its refusal within %s s", self.session_id, timeout_s)
        except Exception:  # noqa: BLE001 - the client may already be gone
            log.debug("session=%s gone before its refusal was sent", self.session_id)

    async def start_image(self, name: str | None, data: str | None) -> StartImage | None:
        """The start image a start asks for (decoded off the loop), or None after refusing (or if the client left)."""
        try:
            return await self.gate.start_images.resolve(
                name=name,
                data=data,
                offered=self.gate.start_image_names,
                gone=None if self.transport is None else self.transport.lost,
            )
        except ClientGone:
            self.disconnected = True  # no longer waiting to start: the live session's finish stops counting it
        except StartImageBusy as exc:
            await self.refuse(ErrorCode.OVER_CAPACITY, str(exc))
        except StartImageRefused as exc:
            log.info("session=%s start image refused: %s", self.session_id, exc)
            await self.refuse(ErrorCode.INVALID_IMAGE, str(exc))
        return None
