"""Protocol 1's ``ready`` (PROTOCOL.md, "ready"): what a session's first message says to its controller, and to
a viewer that joins it (its format, its viewer id; nothing of the controller's resume, share or rewind)."""

from __future__ import annotations

import logging

from .dialect import SessionPort, Started
from .outbox import QueuedText
from .protocol import dumps, ready_message
from .webrtc import webrtc_ice_servers

log = logging.getLogger("arstream.session")

ROLE_CONTROLLER = "controller"
ROLE_VIEWER = "viewer"


def send_ready(live: SessionPort, started: Started) -> None:
    """Queue ``ready`` for the socket's role: the viewer's when it watches, the controller's otherwise."""
    gate, settings, session, watch = live.gate, live.gate.settings, started.session, live.watch
    if watch is not None:
        (codec, quality), card = watch.format, gate.model_card
        message = ready_message(
            session_id=session.id, model_card=card, codec=codec, role=ROLE_VIEWER, viewer_id=watch.viewer_id,
            quality=quality, max_pending_ticks=settings.max_pending_ticks,
            max_message_bytes=settings.max_message_bytes, idle_timeout_s=settings.idle_timeout_s,
            ice_servers=webrtc_ice_servers(settings, session.id),
        )  # fmt: skip
        live.outbox.push(QueuedText(dumps(message), is_reply=True))
        log.info("session=%s viewer %s joined codec=%s", session.id, watch.viewer_id, codec)
        gate.shares.audience_changed(session, gate.controller(session.id))
        return
    message = ready_message(
        session_id=session.id,
        model_card=gate.model_card,
        codec=session.codec,
        max_pending_ticks=settings.max_pending_ticks,
        max_message_bytes=settings.max_message_bytes,
        idle_timeout_s=settings.idle_timeout_s,
        resume=started.ticket,
        resumed=started.resumed,
        max_start_image_bytes=settings.max_start_image_bytes if gate.start_image_names else None,
        share=gate.shares.token(session.id),
        rewind_points=gate.rewind_points,
        rewind_seconds=gate.rewind_seconds,
        branched_from=started.branched_from,
        record=None if settings.record_dir is None else session.record_to is not None,
        ice_servers=webrtc_ice_servers(settings, session.id),
    )
    live.outbox.push(QueuedText(dumps(message), is_reply=True))
    log.info("session=%s started codec=%s", session.id, session.codec)
