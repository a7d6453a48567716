"""A moved session's snapshot from a hostile sender that has the cluster secret, and a sender guessing it
(issue 31, findings 5 and 12), against a real server on loopback.

Before: a deeply nested header was a 500, a 15 MiB header was parsed on the
event loop, the `session` section was taken as it came (codec `evil`, quality
10^9, negative counters) and a session id with a newline wrote forged log
lines; the secret could be guessed at any rate.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import threading
from typing import Any

import httpx
import pytest

from arstream.app import migration
from arstream.app.migration import CLUSTER_AUTH_BURST, IMPORT_PATH
from arstream.models.fake import FakeKVPipeline
from arstream.runner import snapshot
from arstream.runner.snapshot_stream import parse_snapshot, snapshot_bytes
from arstream.runner.snapshot_header import (
    MAX_HEADER_BYTES,
    MAX_HEADER_DEPTH,
    METADATA_KEY,
    SnapshotHeaderError,
    parse_header,
)
from servers import LiveServer, running_server, session_client
from test_migration import SECRET, _post_import, _snapshot_bytes, cluster_settings, drain, two_replicas


def raw_snapshot(header_text: str) -> bytes:
    """Safetensors bytes with no tensors whose ARStream metadata is ``header_text`` as given."""
    outer = json.dumps({"__metadata__": {METADATA_KEY: header_text}}).encode()
    return struct.pack("<Q", len(outer)) + outer


def with_session(**changes: Any) -> bytes:
    """A snapshot this replica would take, with its `session` section changed."""
    moved = parse_snapshot(_snapshot_bytes(FakeKVPipeline(window_frames=6)))
    moved.header["session"] = {**moved.header["session"], **changes}
    return snapshot_bytes(moved)


def at_baseline(server: LiveServer, free: int) -> bool:
    stats = server.stats()
    return bool(stats["kv"]["blocks_free"] == free and stats["sessions"]["detached"] == 0)


@pytest.mark.parametrize(
    ("why", "header"),
    [
        ("deep", '{"format_version": 1, "model": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        ("one level too deep", '{"format_version": 1, "x": ' + "[" * MAX_HEADER_DEPTH + "]" * MAX_HEADER_DEPTH + "}"),
        ("large", json.dumps({"format_version": 1, "model": "x" * (MAX_HEADER_BYTES + 1)})),
    ],
)
def test_a_header_past_its_bounds_is_a_clear_400(why: str, header: str) -> None:
    """Old code: the deep header was a 500 (RecursionError), the large one was parsed and then refused (409)."""
    with running_server(cluster_settings("r1")) as r1:
        free = r1.stats()["kv"]["blocks_free"]
        response = _post_import(r1, raw_snapshot(header))
        assert response.status_code == 400, response.text
        detail = response.json()["detail"]
        assert ("at most" in detail) if why == "large" else ("not a session snapshot" in detail), detail
        assert at_baseline(r1, free) and r1.get("/readyz").status_code == 200


def test_a_header_at_its_bounds_still_parses() -> None:
    """The bounds refuse only what is past them (negative control for the test above)."""
    deepest = '{"format_version": 1, "x": ' + "[" * (MAX_HEADER_DEPTH - 1) + "]" * (MAX_HEADER_DEPTH - 1) + "}"
    assert parse_header(raw_snapshot(deepest))["format_version"] == 1
    with pytest.raises(SnapshotHeaderError, match="nests deeper"):
        parse_header(raw_snapshot('{"x": ' + "[" * MAX_HEADER_DEPTH + "]" * MAX_HEADER_DEPTH + "}"))
    room = MAX_HEADER_BYTES - len(raw_snapshot(json.dumps({"format_version": 1, "model": ""}))) + 8
    assert len(raw_snapshot(json.dumps({"format_version": 1, "model": "x" * room}))) - 8 == MAX_HEADER_BYTES
    assert parse_header(raw_snapshot(json.dumps({"format_version": 1, "model": "x" * room})))["model"] == "x" * room


def test_the_header_is_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Old code: read_header ran on the event loop (a 15 MiB header stalled every session 237-381 ms)."""
    threads: list[str] = []
    real = snapshot.read_header

    def recording(data: bytes) -> dict[str, Any]:
        threads.append(threading.current_thread().name)
        return real(data)

    monkeypatch.setattr("arstream.runner.snapshot_stream.read_header", recording)
    with running_server(cluster_settings("r1")) as r1:
        assert r1.server is not None
        loop_thread = r1.thread.name if r1.thread is not None else ""
        assert _post_import(r1, _snapshot_bytes(FakeKVPipeline(window_frames=6))).status_code == 200
    assert threads and loop_thread not in threads, threads


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("codec", "evil"),
        ("quality", 10**9),
        ("quality", 0),
        ("last_tick_id", -5),
        ("event_floor", -1),
        ("pending_event_ids", [-1]),
        ("recent_event_ids", list(range(257))),
        ("seed", "7"),
        ("id", "s-1\nINFO arstream.hub: a forged line"),
        ("client_host", "10.0.0.1\nforged"),
        ("controls", ["not", "an", "object"]),
        ("codec", "fmp4/16\nforged"),  # the realtime dialect's codec is fmp4/<fps>, nothing else
        ("dialect_state", {"dialect": "/v1/realtime/video", "event_names": [[1, "x" * 200]]}),
        ("dialect_state", {"dialect": "/v1/elsewhere"}),
    ],
)
def test_a_session_section_a_replica_would_not_make_is_refused_naming_the_field(
    field: str, value: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Old code: each was taken (200), and the session failed later; the id's newline forged log lines."""
    with running_server(cluster_settings("r1")) as r1:
        free = r1.stats()["kv"]["blocks_free"]
        with caplog.at_level(logging.INFO, logger="arstream"):
            response = _post_import(r1, with_session(**{field: value}))
        assert response.status_code == 400, response.text
        assert field in response.json()["detail"] and "forged" not in response.json()["detail"]
        assert at_baseline(r1, free)
        # No log line carries what the sender wrote raw: a newline in it would start a line of its own.
        assert not [r for r in caplog.records if "\n" in r.getMessage()]
        # The same snapshot with the field as a replica makes it is taken (the refusal was that field's doing).
        assert _post_import(r1, with_session()).status_code == 200


FORGED_TRIES = 60
NO_REFILL_PER_S = 1e-6  # the tries' refill rate in these tests: none within a run, however slow


def post_with_secret(
    server: LiveServer, secret: str, source: str = "127.0.0.1", forwarded_for: str | None = None
) -> int:
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=10.0) as client:
        headers = {"authorization": f"Bearer {secret}"}
        if forwarded_for is not None:
            headers["x-forwarded-for"] = forwarded_for
        return client.post(server.base_url + IMPORT_PATH, content=b"x" * 64, headers=headers).status_code


def test_guessing_the_cluster_secret_is_throttled_per_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """Old code: every wrong guess got its 401 at once, at any rate."""
    monkeypatch.setattr(migration, "CLUSTER_AUTH_RATE_PER_S", NO_REFILL_PER_S)
    with running_server(cluster_settings("r1")) as r1:
        assert [post_with_secret(r1, f"guess-{i}") for i in range(CLUSTER_AUTH_BURST)] == [401] * CLUSTER_AUTH_BURST
        assert post_with_secret(r1, "guess-next") == 429
        # The right secret is compared before the throttle: a peer sharing the guesser's address (every replica
        # of scripts/local-cluster.sh is 127.0.0.1) still hands sessions over; the body is refused as malformed.
        assert post_with_secret(r1, SECRET) == 400
        assert post_with_secret(r1, "guess-after") == 429
        # Another address is not held back either.
        assert post_with_secret(r1, "guess-elsewhere", source="127.0.0.2") == 401


def test_wrong_secrets_from_a_trusted_proxy_are_throttled_whatever_address_each_claims(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Old code: the throttle counted the forwarded address, which a trusted proxy (in Kubernetes, any pod of
    the private ranges the manifests trusted) sets as it likes: 60 of 60 wrong secrets, each claiming a fresh
    address, got 401 and none 429."""
    monkeypatch.setattr(migration, "CLUSTER_AUTH_RATE_PER_S", NO_REFILL_PER_S)  # a slow run refills no try
    with running_server(cluster_settings("r1", forwarded_allow_ips="127.0.0.0/8")) as r1:
        statuses = [
            post_with_secret(r1, f"guess-{i}", source="127.0.0.2", forwarded_for=f"198.51.100.{i}")
            for i in range(FORGED_TRIES)
        ]
        counts = {status: statuses.count(status) for status in set(statuses)}
        assert counts == {401: CLUSTER_AUTH_BURST, 429: FORGED_TRIES - CLUSTER_AUTH_BURST}, counts


def test_wrong_secrets_claiming_a_peers_address_do_not_keep_that_peer_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Old code: 6 wrong secrets from another socket claiming the draining replica's address (127.0.0.1, from
    which r0 calls r1) spent that address's tries: r0's drain got 429 and ended its session instead of moving it."""
    monkeypatch.setattr(migration, "CLUSTER_AUTH_RATE_PER_S", NO_REFILL_PER_S)
    with two_replicas(forwarded_allow_ips="127.0.0.0/8") as (r0, r1):
        forged = [
            post_with_secret(r1, f"guess-{i}", source="127.0.0.2", forwarded_for="127.0.0.1")
            for i in range(CLUSTER_AUTH_BURST + 1)
        ]
        assert forged[-1] == 429  # the forger itself is throttled

        async def scenario() -> dict[str, Any]:
            async with session_client(r0.ws_url, start={"codec": "raw"}) as client:
                await client.send(type="tick", tick_id=0)
                await client.recv_chunk()
                report: dict[str, Any] = (await asyncio.to_thread(drain, r0, [r1.base_url])).json()
                closed = await client.closed_by_server()
                report["last"] = closed.messages[-1]
                return report

        report = asyncio.run(scenario())
        assert (report["moved"], report["ended"]) == (1, 0), report
        assert report["last"] == {"type": "closed", "reason": "moved"}
