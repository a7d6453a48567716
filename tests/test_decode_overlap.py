"""Decode overlapped with the next forward (--decode-overlap): a real server, real websocket clients.

The same sessions and ticks are served with the decode stage on and off: the
frames are bit-identical, a failed decode mid-overlap ends only its session
(every block back) and the other session's frames do not change, and
/v1/stats shows the phases.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from servers import LiveServer, fake_settings, running_server, session_client

# forward and decode both sleep (no GIL held), so with the stage on they overlap
FAKE = {"compute_delay_s": 0.02, "decode_delay_s": 0.02, "session_capacity": 8}
TINY_TAEHV = {"config": "tiny", "random_init": True, "decoder": "taehv"}
TICKS = 4


def _controls(session: int, tick_id: int) -> dict[str, Any]:
    return {"keys": [("w", "a", "s", "d")[(session + tick_id) % 4]]}


async def _serve(server: LiveServer, sessions: int, fail_decode: tuple[int, int] | None = None) -> list[list[Any]]:
    """Each session sends all its ticks at once (credits allow 4) and reads every reply; per session its replies."""
    seen: list[list[Any]] = []

    async def one(index: int) -> None:
        replies: list[Any] = []
        seen.append(replies)
        async with session_client(server.ws_url, start={"codec": "raw", "seed": 7 + index}) as client:
            for tick_id in range(TICKS):
                controls = _controls(index, tick_id)
                if fail_decode == (index, tick_id):
                    controls["fail_decode"] = True
                await client.send(type="tick", tick_id=tick_id, controls=controls)
            for _ in range(TICKS):
                message = await client.recv_json()
                if message["type"] == "chunk":
                    frames = [await client.recv() for _ in range(message["frames"])]
                    replies.append(("chunk", message["tick_id"], message["chunk_index"], frames))
                else:
                    replies.append((message["type"], message.get("code"), message.get("tick_id")))

    await asyncio.gather(*(one(i) for i in range(sessions)))
    return seen


def _run(
    model: str, options: dict[str, Any], overlap: bool, sessions: int, batch: int = 1, **kw: Any
) -> tuple[list[list[Any]], dict[str, Any]]:
    settings = fake_settings(
        model=model, model_options=options, decode_overlap=overlap, rewind_seconds=1.0, max_batch_sessions=batch
    )
    with running_server(settings) as server:
        free = server.stats()["kv"]["blocks_free"]
        seen = asyncio.run(_serve(server, sessions, **kw))
        stats = server.settled(free)  # every session gone, every block back
        stats["metrics"] = _samples(server.get("/metrics").text)
    return seen, stats


def _samples(exposition: str) -> dict[str, float]:
    samples = {}
    for line in exposition.splitlines():
        if line.startswith("arstream_round"):  # the phase counters (comment lines start with #)
            name, _, value = line.partition(" ")
            samples[name] = float(value)
    return samples


@pytest.mark.parametrize(
    ("model", "options", "batch"),
    [("fake-kv", FAKE, 1), ("fake-kv", FAKE, 2), ("matrix-game-2", TINY_TAEHV, 1), ("matrix-game-2", TINY_TAEHV, 2)],
    ids=["fake-kv", "fake-kv-batched", "matrix-game-2-taehv", "matrix-game-2-taehv-batched"],
)
def test_frames_with_overlap_are_bit_identical_to_serial(model: str, options: dict[str, Any], batch: int) -> None:
    """Batched too: both sessions' rows share one forward and one decode when their histories line up."""
    serial, serial_stats = _run(model, options, overlap=False, sessions=2, batch=batch)
    overlapped, stats = _run(model, options, overlap=True, sessions=2, batch=batch)
    assert stats["phases"]["decode_overlap"] is True and serial_stats["phases"]["decode_overlap"] is False
    for a, b in zip(sorted(serial, key=str), sorted(overlapped, key=str)):
        assert [r[:3] for r in a] == [r[:3] for r in b] == [("chunk", t, t) for t in range(TICKS)]
        for ra, rb in zip(a, b):
            assert ra[3] == rb[3]  # every frame message, byte for byte


def test_a_failed_decode_mid_overlap_ends_only_its_session_and_returns_every_block() -> None:
    healthy_alone, _ = _run("fake-kv", FAKE, overlap=True, sessions=2)
    seen, stats = _run("fake-kv", FAKE, overlap=True, sessions=2, fail_decode=(1, 1))
    by_first_key = {_controls(0, 0)["keys"][0]: 0, _controls(1, 0)["keys"][0]: 1}
    assert len(by_first_key) == 2
    healthy = next(r for r in seen if r[0][0] == "chunk" and r[-1][0] == "chunk")
    doomed = next(r for r in seen if r is not healthy)
    # chunk 0, then the failed decode's session_failed; its next tick (forwarded meanwhile, or queued) fails too
    assert doomed[0][:3] == ("chunk", 0, 0)
    assert doomed[1:] == [("error", "session_failed", 1), ("error", "session_failed", 2), ("error", "session_failed", 3)]
    # the other session's frames are the ones it gets with no failure beside it
    reference = next(r for r in healthy_alone if r[0][3] == healthy[0][3])
    assert [r[3] for r in healthy] == [r[3] for r in reference]
    assert stats["sessions"]["failures_total"] == 1


def test_stats_show_dit_decode_and_overlap_per_round() -> None:
    _, serial = _run("fake-kv", FAKE, overlap=False, sessions=1)
    _, overlapped = _run("fake-kv", FAKE, overlap=True, sessions=1)
    assert serial["phases"]["decode_ms_mean"] == 0 and serial["phases"]["overlap_ms_mean"] == 0
    assert serial["phases"]["dit_ms_mean"] > 0
    phases = overlapped["phases"]
    assert phases["rounds_total"] >= TICKS and phases["decode_ms_mean"] > 0 and phases["dit_ms_mean"] > 0
    # one session's ticks queued ahead: its chunk n+1's forward ran beside chunk n's decode
    assert phases["overlap_ms_mean"] > 0
    metrics = overlapped["metrics"]
    assert metrics["arstream_rounds_total"] == phases["rounds_total"]
    for name in ("dit", "decode", "overlap"):
        assert metrics[f"arstream_round_{name}_seconds_total"] == pytest.approx(
            phases[f"{name}_ms_mean"] * phases["rounds_total"] / 1e3, rel=1e-2
        )
    assert serial["metrics"]["arstream_round_decode_seconds_total"] == 0


def test_a_model_without_the_split_serves_as_before_with_the_overlap_asked_for() -> None:
    """tiny-world has no SupportsSplitDecode: --decode-overlap changes nothing, and the stats say so."""
    settings = fake_settings(model="tiny-world", decode_overlap=True)
    with running_server(settings) as server:
        free = server.stats()["kv"]["blocks_free"]

        async def one() -> dict[str, Any]:
            async with session_client(server.ws_url, start={"codec": "raw"}) as client:
                await client.send(type="tick", tick_id=0)
                chunk, _ = await client.recv_chunk()
                return chunk

        assert asyncio.run(one())["chunk_index"] == 0
        stats = server.settled(free)
    assert stats["phases"]["decode_overlap"] is False and stats["phases"]["decode_ms_mean"] == 0
