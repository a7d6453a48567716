"""A moved session's upload that ends early leaves nothing on the peer (issue 33), against a real server on loopback.

The peer writes a snapshot's pieces straight into the session's pool blocks as
they arrive (app/migration.py, runner/snapshot_import.py), so it holds blocks
from the header on: each test first sees them taken mid-stream (the import is
under way), then ends the upload the way it can end (the connection dropped,
the sender killed, the sender stalled, a piece corrupt, the header or the
length lying) and waits for the pool to be back at its baseline with no
detached session and nothing being imported. The same snapshot sent whole
afterwards is taken (the refusal was the cut's doing, and nothing of the
first try is in its way). A raw socket plays the sender where httpx would not
send a body that stops in the middle.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from arstream.app import migration
from arstream.models.fake import FakeKVPipeline
from arstream.runner.snapshot import SessionSnapshot
from arstream.runner.snapshot_stream import DIGEST_BYTES, PIECE_BYTES, parse_snapshot
from arstream.runner.snapshot_stream import snapshot_bytes as wire_bytes
from servers import LiveServer, running_server
from test_migration import SECRET, _post_import, _snapshot_bytes, cluster_settings

# 10 MiB of KV (5 frames of 2 MiB): the upload is several pieces, so it can be cut after the first has landed.
HEAD_SIZE = 65536
OPTIONS: dict[str, Any] = {"window_frames": 6, "head_size": HEAD_SIZE}


@pytest.fixture(scope="module")
def peer() -> Iterator[LiveServer]:
    # A short grace: a session taken whole (the negative controls) is let go by its own timer before the next test.
    with running_server(cluster_settings("r1", model_options=OPTIONS, resume_grace_s=1.0)) as server:
        yield server


@pytest.fixture(scope="module")
def snapshot_bytes() -> bytes:
    data = _snapshot_bytes(FakeKVPipeline(**OPTIONS))
    assert len(data) > 2 * PIECE_BYTES
    return data


def upload_head(data: bytes, length: int | None = None) -> bytes:
    return (
        f"POST {migration.IMPORT_PATH} HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {SECRET}\r\n"
        f"content-type: application/octet-stream\r\ncontent-length: {len(data) if length is None else length}\r\n\r\n"
    ).encode()


def free_blocks(server: LiveServer) -> int:
    return int(server.stats()["kv"]["blocks_free"])


def importing(server: LiveServer) -> set[str]:
    assert server.server is not None and server.server.migration is not None
    return set(server.server.migration.importing)


def at_baseline(server: LiveServer, free: int) -> None:
    """Blocks back, no session detached or resident, nothing being imported (polled: the release is a worker step)."""
    server.wait_for_stats(
        lambda s: s["kv"]["blocks_free"] == free and s["sessions"]["detached"] == 0 and not importing(server)
    )
    assert server.stats()["kv"]["sessions_resident"] == 0


def blocks_taken_mid_stream(server: LiveServer, free: int) -> None:
    """The import is under way: its blocks are taken while the upload is still open."""
    server.wait_for_stats(lambda s: s["kv"]["blocks_free"] < free)
    assert importing(server)


def taken_whole_then_released(server: LiveServer, data: bytes, free: int) -> None:
    """Negative control: the same snapshot sent whole is taken (resident, detached); its grace then ends it, so
    the next test starts clean."""
    response = _post_import(server, data)
    assert response.status_code == 200, response.text
    stats = server.stats()
    assert stats["sessions"]["detached"] == 1 and stats["kv"]["blocks_free"] < free
    at_baseline(server, free)


def test_the_connection_dropping_mid_stream_leaves_nothing(peer: LiveServer, snapshot_bytes: bytes) -> None:
    """Old code, had it written into the pool: nothing returned the blocks of an upload cut off mid-way."""
    free = free_blocks(peer)
    with socket.create_connection(("127.0.0.1", peer.port)) as sender:
        sender.sendall(upload_head(snapshot_bytes) + snapshot_bytes[: len(snapshot_bytes) * 2 // 3])
        blocks_taken_mid_stream(peer, free)
    at_baseline(peer, free)
    taken_whole_then_released(peer, snapshot_bytes, free)


def test_the_sender_killed_mid_stream_leaves_nothing(
    peer: LiveServer, snapshot_bytes: bytes, tmp_path: Any
) -> None:
    """A sending process that dies (kill -9) mid-upload: the kernel closes its socket, the peer lets go."""
    free = free_blocks(peer)
    body = tmp_path / "upload.bin"
    body.write_bytes(upload_head(snapshot_bytes) + snapshot_bytes[: len(snapshot_bytes) // 2])
    script = textwrap.dedent(
        f"""
        import socket, sys, time
        sender = socket.create_connection(("127.0.0.1", {peer.port}))
        sender.sendall(open({str(body)!r}, "rb").read())
        print("sent", flush=True)
        time.sleep(120)
        """
    )
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None and process.stdout.readline().strip() == "sent"
            blocks_taken_mid_stream(peer, free)
            os.kill(process.pid, signal.SIGKILL)
        finally:
            process.kill()
            process.wait(timeout=30)
    at_baseline(peer, free)
    taken_whole_then_released(peer, snapshot_bytes, free)


def test_a_sender_that_stalls_mid_stream_is_let_go(
    peer: LiveServer, snapshot_bytes: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alive but silent (a hung sender): past import_piece_timeout_s the peer answers 408 and returns the blocks."""
    assert peer.server is not None
    monkeypatch.setattr(peer.server.hub.settings, "import_piece_timeout_s", 1.0)
    free = free_blocks(peer)
    with socket.create_connection(("127.0.0.1", peer.port)) as sender:
        sender.sendall(upload_head(snapshot_bytes) + snapshot_bytes[: len(snapshot_bytes) // 2])
        blocks_taken_mid_stream(peer, free)
        sender.settimeout(30)
        answer = sender.recv(65536).decode(errors="replace")
        assert answer.startswith("HTTP/1.1 408"), answer
        at_baseline(peer, free)  # while the sender still holds its connection open
    taken_whole_then_released(peer, snapshot_bytes, free)


def test_a_corrupt_piece_is_a_400_and_leaves_nothing(peer: LiveServer, snapshot_bytes: bytes) -> None:
    """One bit of the KV flipped on the way: the digest refuses it. Old code took it (200) and the session went
    on from wrong KV."""
    free = free_blocks(peer)
    corrupt = bytearray(snapshot_bytes)
    corrupt[-DIGEST_BYTES - 1000] ^= 0x10
    response = _post_import(peer, bytes(corrupt))
    assert response.status_code == 400 and "corrupt" in response.json()["detail"], response.text
    at_baseline(peer, free)
    taken_whole_then_released(peer, snapshot_bytes, free)


def test_a_body_shorter_than_its_table_is_a_400_and_leaves_nothing(peer: LiveServer, snapshot_bytes: bytes) -> None:
    """The table promises more bytes than the body brings (the request itself ends cleanly)."""
    free = free_blocks(peer)
    response = _post_import(peer, snapshot_bytes[: len(snapshot_bytes) * 3 // 4])
    assert response.status_code == 400 and "ended early" in response.json()["detail"], response.text
    at_baseline(peer, free)


def resealed(data: bytes, change: Any) -> bytes:
    """The snapshot with ``change`` applied and its digest made again: a sender that has the secret and lies."""
    snapshot = parse_snapshot(data)
    change(snapshot)
    return wire_bytes(snapshot)


def more_frames(snapshot: SessionSnapshot) -> None:
    kv = snapshot.tensors["kv/main"]
    snapshot.tensors["kv/main"] = torch.cat([kv, kv], dim=2)  # 10 frames for a window of 6 (+1 sink)


@pytest.mark.parametrize(
    ("why", "change", "match"),
    [
        ("more frames than the spec holds", more_frames, "does not fit this spec"),
        ("more sink frames than frames", lambda s: s.header["kv"]["sink_frames"].update(main=99), "does not fit"),
        ("a negative counter", lambda s: s.header["kv"].update(chunks_committed=-1), "not a count"),
        ("a tensor this replica does not know", lambda s: s.tensors.update({"junk/x": torch.zeros(8)}), "not know"),
    ],
)
def test_a_header_that_lies_is_a_400_and_leaves_nothing(
    peer: LiveServer, snapshot_bytes: bytes, why: str, change: Any, match: str
) -> None:
    free = free_blocks(peer)
    response = _post_import(peer, resealed(snapshot_bytes, change))
    assert response.status_code == 400 and match in response.json()["detail"], (why, response.text)
    at_baseline(peer, free)


def test_a_content_length_that_lies_then_a_dropped_connection_leaves_nothing(
    peer: LiveServer, snapshot_bytes: bytes
) -> None:
    """Content-Length says more than the sender will ever send; it sends everything it has, then goes."""
    free = free_blocks(peer)
    with socket.create_connection(("127.0.0.1", peer.port)) as sender:
        sender.sendall(upload_head(snapshot_bytes, length=len(snapshot_bytes) + 4096) + snapshot_bytes)
        sender.shutdown(socket.SHUT_WR)
        sender.settimeout(30)
        answer = sender.recv(65536).decode(errors="replace")
    # Whatever the server could say before the connection went (or nothing): no session was taken from it.
    assert "200 OK" not in answer, answer
    at_baseline(peer, free)
