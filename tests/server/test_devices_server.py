"""``arstream serve --devices cpu,cpu``: one replica over two gloo ranks through the real served path.

The server (rank 0) starts its second rank, serves a session's chunks from both, and when that rank is killed
while idle, or stopped (it then neither exits nor answers) while a tick waits on it, the session gets
`session_failed` naming the lost rank and the server exits with code 1 for its supervisor, leaving no rank
process behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

from servers import server_process, session_client, wait_until

MODEL = ["--model", "matrix-game-2", "--model-options", json.dumps({"config": "tiny", "random_init": True})]


def _ranks(pid: int) -> list[int]:
    """The server's spawned rank processes (multiprocessing's resource tracker is a child too)."""
    # every thread's: the model worker's thread starts them
    children = [int(p) for task in Path(f"/proc/{pid}/task").iterdir() for p in (task / "children").read_text().split()]
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def _serve_then_lose_rank_1(extra: list[str], signal_number: int, reason: str, *, tick_after: bool) -> None:
    """Two chunks from both ranks, then ``signal_number`` to rank 1: the session fails naming ``reason`` (its next
    tick's answer, or unasked: ``tick_after``), the server exits 1 and rank 1 is gone."""
    with server_process([*MODEL, "--devices", "cpu,cpu", *extra]) as server:
        assert server.stats()["kv"]["session_capacity"] >= 1
        assert server.process is not None
        (rank1,) = _ranks(server.process.pid)

        async def scenario() -> None:
            async with session_client(server.ws_url, start={}) as client:
                for tick_id in (1, 2):
                    await client.send(type="tick", tick_id=tick_id)
                    chunk, frames = await client.recv_chunk()
                    assert chunk["tick_id"] == tick_id and frames
                os.kill(rank1, signal_number)
                if tick_after:
                    await client.send(type="tick", tick_id=3)
                failed = await client.recv_json()
                assert failed["code"] == "session_failed" and reason in failed["message"], failed

        asyncio.run(scenario())
        process = server.process
        wait_until(lambda: process.poll() is not None, attempts=2400)
        assert process.returncode == 1
        assert any("the server stops (exit code 1)" in line for line in server.output)
        leaked = Path(f"/proc/{rank1}").exists()  # a rank the server did not reap outlives it (stopped, or a zombie)
        if leaked:
            os.kill(rank1, signal.SIGKILL)
        assert not leaked


def test_a_replica_over_two_devices_serves_and_exits_1_when_a_rank_dies() -> None:
    """Killed while the replica is idle: the watchdog notices, and the session hears without asking."""
    _serve_then_lose_rank_1([], signal.SIGKILL, "rank 1 exited with code -9", tick_after=False)


def test_a_stopped_rank_is_killed_at_the_deadline_and_the_server_exits_1() -> None:
    """A SIGSTOPped rank neither exits nor answers (the forward's collective waits on it): past the collective
    deadline the watchdog kills it and the replica fails closed, with no hang. Rank 0 decodes beside the forward
    here (--decode-overlap), the other rank not at all."""
    _serve_then_lose_rank_1(["--collective-timeout-s", "5", "--decode-overlap"], signal.SIGSTOP, "rank 1 stopped answering", tick_after=True)
