"""The ticks both Waypoint test files play (Waypoint-1's tiny config and Waypoint-1.5's): two sessions, each with
its own seed, whose controls change every chunk (keys, mouse deltas and the wheel)."""

from __future__ import annotations

from typing import Any

from arstream.runner.types import TickRequest

SEEDS = {"a": 1, "b": 2}


def controls_for(session: str, chunk: int) -> dict[str, Any]:
    keys = [[87], [65, 87], [], [68], [83, 32], [1]][(chunk + (session == "b")) % 6]
    return {"buttons": keys, "mouse": [0.4 * ((chunk % 3) - 1), 0.2 * (session == "a")], "scroll": chunk % 3 - 1}


def tick(session: str, chunk: int, controls: dict[str, Any] | None = None) -> TickRequest:
    return TickRequest(
        session_id=session, request_id=chunk, controls=controls_for(session, chunk) if controls is None else controls,
        seed=SEEDS[session],
    )
