"""Draining a replica (app/migration.py) between two real servers on loopback, with real WebSocket clients.

A session streaming on r0 is moved to r1 by a drain: the client gets
``moved`` with a token for r1, resumes there, and every chunk after the move
equals the chunk an uninterrupted session (same seed, same controls) gets.
Refusals (wrong secret, another model, no room) leave both pools at their
baselines. The balancer in front (HAProxy routing the token's prefix) is
tests/cluster/test_cluster.py's; here the client reconnects to r1 directly.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import AsyncExitStack, ExitStack, contextmanager
from typing import Any

import httpx
import numpy as np
import pytest

from arstream.app.wire import DRAIN_PATH
from arstream.app.migration import IMPORT_PATH
from arstream.models.fake import FakeKVPipeline
from arstream.runner.runner import runner_for_sessions
from arstream.runner.snapshot import export_session
from arstream.runner.snapshot_stream import snapshot_bytes
from arstream.runner.types import TickRequest
from servers import LiveServer, fake_settings, running_server, server_process, session_client

SECRET = "a-cluster-secret-for-tests"
SEED = 7
KEYS = [["d"], ["d"], ["w"], [], ["a", "s"], ["d"], ["w", "d"], ["s"]]
MOVE_AT = 3


def cluster_settings(replica: str, model: str = "fake-kv", **overrides: Any) -> Any:
    values: dict[str, Any] = {
        "replica_id": replica,
        "resume_grace_s": 30.0,
        "cluster_secret": SECRET,
        "model": model,
        "max_batch_sessions": 1,
    }
    if model == "fake-kv":
        values["model_options"] = {"window_frames": 6}  # short: the move happens after the window slid
    if model == "matrix-game-2":
        values["model_options"] = {"config": "tiny", "random_init": True}
    values.update(overrides)
    return fake_settings(**values)


@contextmanager
def two_replicas(
    model: str = "fake-kv", both: dict[str, Any] | None = None, **r1_overrides: Any
) -> Iterator[tuple[LiveServer, LiveServer]]:
    with ExitStack() as stack:
        r0 = stack.enter_context(running_server(cluster_settings("r0", model, **(both or {}))))
        r1 = stack.enter_context(running_server(cluster_settings("r1", model, **(both or {}), **r1_overrides)))
        yield r0, r1


def own_start_image() -> dict[str, str]:
    """A client's own start image (PNG, base64), as `start.image` carries it."""
    import base64
    import io

    from PIL import Image

    picture = Image.new("RGB", (90, 60), (200, 40, 40))
    picture.paste((20, 160, 60), (0, 30, 90, 60))
    encoded = io.BytesIO()
    picture.save(encoded, format="PNG")
    return {"data": base64.b64encode(encoded.getvalue()).decode()}


TOKEN = "tenant-token-for-the-move-test"
# A matrix-game-2 session with its own start image, on replicas that require an auth token: the image
# (and what the model derived from it) and the session's owner travel with it.
OWN_IMAGE_WITH_AUTH = {
    "start": {"image": own_start_image()},
    "both": {"auth_token": TOKEN},
    "headers": [("authorization", f"Bearer {TOKEN}")],
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "fake-kv": ("fake-kv", {}),
    "tiny-world": ("tiny-world", {}),
    "matrix-game-2": ("matrix-game-2", {}),
    "matrix-game-2-own-image-auth": ("matrix-game-2", OWN_IMAGE_WITH_AUTH),
}


def drain(server: LiveServer, peers: list[str], *, secret: str = SECRET) -> httpx.Response:
    return httpx.post(
        server.base_url + DRAIN_PATH,
        json={"peers": peers, "exit": False},
        headers={"authorization": f"Bearer {secret}"},
        timeout=60.0,
    )


async def frames_of(client: Any) -> tuple[dict[str, Any], np.ndarray]:
    chunk, frames = await client.recv_chunk()
    return chunk, np.stack([pixels for _header, pixels in frames])


async def reference(
    server: LiveServer, start: dict[str, Any] | None = None, headers: list[tuple[str, str]] | None = None
) -> list[np.ndarray]:
    """An uninterrupted session with the test's seed and controls."""
    out = []
    start = {"codec": "raw", "seed": SEED, **(start or {})}
    async with session_client(server.ws_url, start=start, headers=headers) as client:
        for tick_id, keys in enumerate(KEYS):
            await client.send(type="tick", tick_id=tick_id, controls={"keys": keys})
            out.append((await frames_of(client))[1])
        await client.send(type="close")
        await client.closed_by_server()
    return out


def baseline(server: LiveServer) -> int:
    return server.stats()["kv"]["blocks_total"]


@pytest.mark.parametrize("case", list(CASES))
def test_a_drained_session_continues_on_the_peer_bit_identically(case: str) -> None:
    model, extra = CASES[case]
    headers = extra.get("headers")
    with two_replicas(model, extra.get("both")) as (r0, r1):

        async def scenario() -> None:
            want = await reference(r1, extra.get("start"), headers)
            start = {"codec": "raw", "seed": SEED, **extra.get("start", {})}
            async with session_client(r0.ws_url, start=start, headers=headers) as client:
                assert client.ready is not None
                session_id = client.ready["session_id"]
                for tick_id in range(MOVE_AT):
                    await client.send(type="tick", tick_id=tick_id, controls={"keys": KEYS[tick_id]})
                    _chunk, got = await frames_of(client)
                    assert np.array_equal(got, want[tick_id])
                response = await asyncio.to_thread(drain, r0, [r1.base_url])
                assert response.status_code == 200, response.text
                report = response.json()
                assert report["moved"] == 1 and report["ended"] == 0, report
                assert report["sessions"][0]["snapshot_bytes"] > 0
                closed = await client.closed_by_server()
                moved, last = closed.messages[-2], closed.messages[-1]
                assert last == {"type": "closed", "reason": "moved"}
                assert moved["type"] == "moved" and moved["resume"].startswith("r1.")
                assert moved["next_chunk_index"] == MOVE_AT
            token = moved["resume"]
            async with session_client(
                f"{r1.ws_url}?resume={token}", start={"resume": token, "codec": "raw"}, headers=headers
            ) as client:
                ready = client.ready
                assert ready is not None and ready["resumed"] is True and ready["session_id"] == session_id
                assert ready["resume"]["next_chunk_index"] == MOVE_AT
                for tick_id in range(MOVE_AT, len(KEYS)):
                    await client.send(type="tick", tick_id=tick_id, controls={"keys": KEYS[tick_id]})
                    chunk, got = await frames_of(client)
                    assert chunk["chunk_index"] == tick_id and chunk["restarted"] is None, chunk
                    assert np.array_equal(got, want[tick_id]), f"chunk {tick_id} differs after the move"
                await client.send(type="close")
                await client.closed_by_server()

        asyncio.run(scenario())
        assert r0.get("/readyz").status_code == 503  # a drained replica admits nothing
        r0.settled(r0.stats()["kv"]["blocks_total"])
        r1.settled(r1.stats()["kv"]["blocks_total"])


def test_controls_held_by_an_input_event_travel_with_the_session() -> None:
    with two_replicas() as (r0, r1):

        async def scenario() -> None:
            async with session_client(r0.ws_url, start={"codec": "raw", "seed": SEED}) as client:
                await client.send(type="tick", tick_id=0)
                await frames_of(client)
                await client.send(type="input", event_id=9, controls={"keys": ["d"]})
                assert (await client.recv_json())["type"] == "ack"
                await asyncio.to_thread(drain, r0, [r1.base_url])
                moved = (await client.closed_by_server()).messages[-2]
            token = moved["resume"]
            async with session_client(f"{r1.ws_url}?resume={token}", start={"resume": token, "codec": "raw"}) as c:
                await c.send(type="tick", tick_id=1)  # no controls: the event's held "d" applies
                chunk, frames = await frames_of(c)
                assert chunk["applied_event_ids"] == [9], chunk
                assert int(frames[0, 0, 0, 2]) == 8  # fake-kv's blue channel is the controls code: "d" is bit 3
                await c.send(type="input", event_id=9)
                assert (await c.recv_json()) == {"type": "ack", "event_id": 9, "status": "duplicate"}

        asyncio.run(scenario())


def test_wrong_secret_is_refused_and_nothing_moves() -> None:
    with two_replicas() as (r0, r1):
        free0, free1 = r0.stats()["kv"]["blocks_free"], r1.stats()["kv"]["blocks_free"]
        assert drain(r0, [r1.base_url], secret="not-the-secret-at-all").status_code == 401
        response = httpx.post(r1.base_url + IMPORT_PATH, content=b"x" * 64, timeout=10.0)
        assert response.status_code == 401
        assert r0.get("/readyz").status_code == 200  # still admitting
        assert r0.stats()["kv"]["blocks_free"] == free0 and r1.stats()["kv"]["blocks_free"] == free1


def test_cluster_routes_are_off_without_a_secret() -> None:
    with running_server(cluster_settings("r0", cluster_secret=None)) as r0:
        assert drain(r0, []).status_code == 404


def _snapshot_bytes(pipeline: FakeKVPipeline) -> bytes:
    runner = runner_for_sessions(pipeline, 1)
    for i in range(3):
        runner.execute_tick(TickRequest(session_id="s-0123456789abcdef", request_id=i))
    snapshot = export_session(runner, "s-0123456789abcdef", protocol_version=1)
    snapshot.header["session"] = {
        "id": "s-0123456789abcdef", "codec": "raw", "quality": 80, "seed": None, "controls": {}, "prompt": None,
        "staged_controls": None, "staged_prompt": None, "pending_event_ids": [], "last_tick_id": 2,
        "last_reset_tick_id": None, "event_floor": None, "recent_event_ids": [],
    }
    return snapshot_bytes(snapshot)


def _post_import(server: LiveServer, data: bytes) -> httpx.Response:
    return httpx.post(
        server.base_url + IMPORT_PATH, content=data, headers={"authorization": f"Bearer {SECRET}"}, timeout=10.0
    )


class WhereFingerprinted(FakeKVPipeline):
    """fake-kv noting the thread that takes its transfer fingerprint (a real model's hashes every weight)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.threads: list[str] = []

    def transfer_fingerprint(self) -> dict[str, Any]:
        self.threads.append(threading.current_thread().name)
        return super().transfer_fingerprint()


def test_the_first_incoming_move_hashes_the_weights_on_the_worker_thread() -> None:
    """A replica that has exported nothing yet hashes its weights for the first move it takes: on the model
    worker's thread (which owns the runtime), never on the event loop or its thread pool."""
    pipeline = WhereFingerprinted(window_frames=6)
    with running_server(cluster_settings("r1"), pipeline) as r1:
        assert pipeline.threads == []  # nothing moved yet: never hashed
        taken = _post_import(r1, _snapshot_bytes(FakeKVPipeline(window_frames=6)))
        assert taken.status_code == 200, taken.text
    assert pipeline.threads and set(pipeline.threads) == {"arstream-model-worker"}, pipeline.threads


def test_a_snapshot_of_another_config_is_refused_and_the_pool_stays_at_baseline() -> None:
    with running_server(cluster_settings("r1")) as r1:
        free = r1.stats()["kv"]["blocks_free"]
        response = _post_import(r1, _snapshot_bytes(FakeKVPipeline(window_frames=8)))
        assert response.status_code == 409 and "another model config" in response.json()["detail"], response.text
        assert _post_import(r1, b"not a snapshot").status_code == 400
        assert r1.stats()["kv"]["blocks_free"] == free and r1.stats()["sessions"]["detached"] == 0
        # the same snapshot from the same config is taken (so the refusal above was the config's doing)
        taken = _post_import(r1, _snapshot_bytes(FakeKVPipeline(window_frames=6)))
        assert taken.status_code == 200 and taken.json()["resume"].startswith("r1."), taken.text
        assert r1.stats()["sessions"]["detached"] == 1


def test_a_snapshot_of_another_model_is_refused() -> None:
    with running_server(cluster_settings("r1", "tiny-world")) as r1:
        free = r1.stats()["kv"]["blocks_free"]
        response = _post_import(r1, _snapshot_bytes(FakeKVPipeline(window_frames=6)))
        assert response.status_code == 409 and "another model" in response.json()["detail"], response.text
        assert r1.stats()["kv"]["blocks_free"] == free


def test_no_room_on_the_peer_ends_the_session_as_on_shutdown() -> None:
    with two_replicas(model_options={"window_frames": 6, "session_capacity": 1}) as (r0, r1):

        async def scenario() -> None:
            async with session_client(r1.ws_url, start={"codec": "raw"}) as holder:
                await holder.send(type="tick", tick_id=0)
                await frames_of(holder)
                free1 = await asyncio.to_thread(lambda: r1.stats()["kv"]["blocks_free"])
                async with session_client(r0.ws_url, start={"codec": "raw"}) as client:
                    await client.send(type="tick", tick_id=0)
                    await frames_of(client)
                    report = (await asyncio.to_thread(drain, r0, [r1.base_url])).json()
                    assert report["moved"] == 0 and report["ended"] == 1
                    assert "no room" in report["sessions"][0]["reason"], report
                    closed = await client.closed_by_server()
                    assert closed.messages[-1] == {"type": "closed", "reason": "server_shutdown"}
                assert await asyncio.to_thread(lambda: r1.stats()["kv"]["blocks_free"]) == free1
                await holder.send(type="close")
                await holder.closed_by_server()

        asyncio.run(scenario())
        r0.settled(r0.stats()["kv"]["blocks_total"])
        r1.settled(r1.stats()["kv"]["blocks_total"])


def test_a_rolling_restart_of_both_replicas_under_six_sessions_loses_none() -> None:
    """r0 drains to r1 and is replaced by a new r0, then r1 drains to it: six sessions live through both moves.

    The test routes a reconnect by the token's prefix, as the balancer does (tests/cluster/test_cluster_drain.py runs HAProxy).
    """
    sessions = 6
    with ExitStack() as stack:
        r0 = stack.enter_context(running_server(cluster_settings("r0")))
        r1 = stack.enter_context(running_server(cluster_settings("r1")))
        routes = {"r0": r0, "r1": r1}

        async def chunks(clients: list[Any], ticks: range, want: list[np.ndarray]) -> None:
            for client in clients:
                for tick_id in ticks:
                    await client.send(type="tick", tick_id=tick_id, controls={"keys": KEYS[tick_id]})
                    chunk, got = await frames_of(client)
                    assert chunk["chunk_index"] == tick_id and np.array_equal(got, want[tick_id]), tick_id

        async def follow(stack_async: Any, client: Any) -> Any:
            moved = (await client.closed_by_server()).messages[-2]
            assert moved["type"] == "moved", moved
            token = moved["resume"]
            target = routes[token.split(".", 1)[0]]
            return await stack_async.enter_async_context(
                session_client(f"{target.ws_url}?resume={token}", start={"resume": token, "codec": "raw"})
            )

        async def scenario() -> None:
            want = await reference(r1)
            async with AsyncExitStack() as clients_stack:
                clients = [
                    await clients_stack.enter_async_context(
                        session_client((r0 if i % 2 == 0 else r1).ws_url, start={"codec": "raw", "seed": SEED})
                    )
                    for i in range(sessions)
                ]
                await chunks(clients, range(0, 3), want)
                # Roll r0: its three sessions move to r1, and a new r0 takes its place.
                report = (await asyncio.to_thread(drain, r0, [r1.base_url])).json()
                assert report["moved"] == 3 and report["ended"] == 0, report
                clients = [await follow(clients_stack, c) if i % 2 == 0 else c for i, c in enumerate(clients)]
                await chunks(clients, range(3, 5), want)
                new_r0 = stack.enter_context(running_server(cluster_settings("r0")))
                routes["r0"] = new_r0
                # Roll r1: all six sessions move to the new r0.
                report = (await asyncio.to_thread(drain, r1, [new_r0.base_url])).json()
                assert report["moved"] == sessions and report["ended"] == 0, report
                clients = [await follow(clients_stack, c) for c in clients]
                await chunks(clients, range(5, len(KEYS)), want)
                assert (await asyncio.to_thread(new_r0.stats))["sessions"]["connected"] == sessions
                for client in clients:
                    await client.send(type="close")
                    await client.closed_by_server()

        asyncio.run(scenario())
        for server in (r0, r1, routes["r0"]):
            server.settled(server.stats()["kv"]["blocks_total"])


def test_a_session_drains_from_a_replica_over_two_devices_to_one_on_a_single_device() -> None:
    """``--devices cpu,cpu`` (a subprocess: its ranks join a process group of their own) drains to a plain replica:
    the snapshot gathers both ranks' heads into the one-device format, and the session continues there with the
    chunks of an uninterrupted one-device session, within one step of uint8 rounding (sharded attention sums in
    another order)."""
    model = ["--model", "matrix-game-2", "--model-options", json.dumps({"config": "tiny", "random_init": True})]
    cluster = ["--replica-id", "r0", "--cluster-secret", SECRET, "--resume-grace-s", "30", "--max-batch-sessions", "1"]
    with server_process([*model, *cluster, "--devices", "cpu,cpu"]) as r0, running_server(
        cluster_settings("r1", "matrix-game-2")
    ) as r1:

        async def scenario() -> None:
            want = await reference(r1)
            async with session_client(r0.ws_url, start={"codec": "raw", "seed": SEED}) as client:
                for tick_id in range(MOVE_AT):
                    await client.send(type="tick", tick_id=tick_id, controls={"keys": KEYS[tick_id]})
                    _chunk, got = await frames_of(client)
                    assert _near(got, want[tick_id])
                response = await asyncio.to_thread(drain, r0, [r1.base_url])
                assert response.status_code == 200, response.text
                assert response.json()["moved"] == 1, response.json()
                closed = await client.closed_by_server()
                moved = closed.messages[-2]
                assert moved["type"] == "moved" and moved["next_chunk_index"] == MOVE_AT, closed.messages
            token = moved["resume"]
            async with session_client(f"{r1.ws_url}?resume={token}", start={"resume": token, "codec": "raw"}) as client:
                assert client.ready is not None and client.ready["resumed"] is True
                for tick_id in range(MOVE_AT, len(KEYS)):
                    await client.send(type="tick", tick_id=tick_id, controls={"keys": KEYS[tick_id]})
                    chunk, got = await frames_of(client)
                    assert chunk["chunk_index"] == tick_id and chunk["restarted"] is None, chunk
                    assert _near(got, want[tick_id]), f"chunk {tick_id} differs after the move"
                await client.send(type="close")
                await client.closed_by_server()

        asyncio.run(scenario())
        r1.settled(r1.stats()["kv"]["blocks_total"])


def _near(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and int(np.abs(got.astype(np.int16) - want.astype(np.int16)).max()) <= 1
