#!/usr/bin/env python3
"""What a move costs in memory: peak RSS above the session's own, streamed snapshot vs whole, on each side.

    .venv/bin/python scripts/bench-snapshot-memory.py --mib 256

A fake-kv session made large by its window (about MIB MiB of KV, in blocks of
BLOCK_MIB per layer's K or V) is moved
from one runner to another in this process, twice, each step measured as the
peak resident set above the level before it (Linux: VmHWM, reset through
/proc/self/clear_refs), once the way a drain did before streaming (the whole
file: export copied to the CPU, ``snapshot_bytes``; on the peer the request body,
``from_bytes`` and ``import_session``) and once streamed as a server does now
(the sender's plan read piece by piece and sealed with its digest; on the peer
the reader and :class:`SessionImport` writing each 4 MiB piece straight into
the pool blocks), side by side in one run. Both peers' pools are allocated and
touched before they are measured (a serving replica's pool is), so what is
left is what a move adds. Prints one line per side and way, the ratios, and a
JSON line.
"""

from __future__ import annotations

import argparse
import functools
import ctypes
import gc
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from arstream.models.fake import FakeKVPipeline
from arstream.runner.runner import ARRunner, runner_for_sessions
from arstream.runner.snapshot import export_session
from arstream.runner.snapshot_import import import_session
from arstream.runner.snapshot_stream import PIECE_BYTES, import_pieces, parse_snapshot, plan_export, snapshot_bytes
from arstream.runner.types import TickRequest

SESSION = "s-0000000000000big"
STATUS = Path("/proc/self/status")


def kib(field: str) -> int:
    line = next(line for line in STATUS.read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def peak_above(step: Callable[[], object]) -> tuple[float, object]:
    """MiB of resident memory at the step's peak above the level before it, and what the step returned.

    Memory an earlier step freed is handed back to the system first (glibc's malloc_trim): else a step could
    reuse pages that are still resident and look free of cost."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = kib("VmRSS")
    result = step()
    return (kib("VmHWM") - before) / 1024, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="the session's KV, about (MiB)")
    parser.add_argument(
        "--block-mib", type=float, default=1.0,
        help="one frame's K (or V) of one layer, MiB: the sender reads one such block at a time (default 1)",
    )
    args = parser.parse_args()
    # fake-kv: 2 layers x K/V, 2 tokens x 1 head of float32 a frame: a block of one layer's K is 8 x head_size bytes.
    head_size = int(args.block_mib * 2**20) // 8
    resident_frames = max(2, round(args.mib * 2**20 / (2 * 2 * 8 * head_size)))  # made large by its window
    options = {"window_frames": resident_frames - 1, "frames_per_chunk": 8, "head_size": head_size}
    runner = runner_for_sessions(FakeKVPipeline(**options), 1)
    for i in range(resident_frames // 8 + 2):  # past the window: every resident frame is held
        runner.execute_tick(TickRequest(session_id=SESSION, request_id=i))

    def whole_source() -> bytes:
        snapshot = export_session(runner, SESSION, protocol_version=1)
        snapshot.tensors = {name: t.to("cpu", copy=True) for name, t in snapshot.tensors.items()}  # as the worker did
        return snapshot_bytes(snapshot)

    def streamed_source() -> int:
        plan = plan_export(runner, SESSION, protocol_version=1)
        sent = 0
        for data in plan.chunks():  # each piece read, sealed, sent, then dropped
            sent += len(data)
        return sent

    source_whole_mib, data = peak_above(whole_source)
    assert isinstance(data, bytes)
    size_mib = len(data) / 2**20
    source_streamed_mib, sent = peak_above(streamed_source)
    assert sent == len(data)
    reads = [data[i : i + 2**16] for i in range(0, len(data), 2**16)]  # what arrives: 64 KiB reads

    def peer_runner() -> ARRunner:
        peer = runner_for_sessions(FakeKVPipeline(**options), 1)
        peer.pool.kv.fill_(0.5)  # touched, as a serving replica's pool is: its pages are not the move's
        return peer

    def whole_peer(peer: ARRunner) -> None:
        body = bytearray()
        for read in reads:
            body += read
        import_session(peer, SESSION, parse_snapshot(bytes(body)), protocol_version=1)

    def streamed_peer(peer: ARRunner) -> None:
        def pieces() -> Iterator[bytearray]:  # the reads gathered into pieces, as the server does
            piece = bytearray()
            for read in reads:
                piece += read
                if len(piece) >= PIECE_BYTES:
                    yield piece
                    piece = bytearray()
            yield piece

        import_pieces(peer, SESSION, pieces(), max_bytes=len(data), protocol_version=1)

    first = peer_runner()
    peer_whole_mib, _ = peak_above(functools.partial(whole_peer, first))
    del first  # its pool is freed before the streamed peer's is made
    second = peer_runner()
    peer_streamed_mib, _ = peak_above(lambda: streamed_peer(second))
    assert second.is_resident(SESSION)
    result = {
        "snapshot_mib": round(size_mib, 1),
        "source_whole_mib": round(source_whole_mib, 1),
        "source_streamed_mib": round(source_streamed_mib, 1),
        "peer_whole_mib": round(peer_whole_mib, 1),
        "peer_streamed_mib": round(peer_streamed_mib, 1),
        "source_whole_over_snapshot": round(source_whole_mib / size_mib, 2),
        "source_streamed_over_snapshot": round(source_streamed_mib / size_mib, 3),
        "peer_whole_over_snapshot": round(peer_whole_mib / size_mib, 2),
        "peer_streamed_over_snapshot": round(peer_streamed_mib / size_mib, 3),
        "source_ratio_whole_over_streamed": round(source_whole_mib / max(source_streamed_mib, 0.1), 1),
        "peer_ratio_whole_over_streamed": round(peer_whole_mib / max(peer_streamed_mib, 0.1), 1),
    }
    print(f"snapshot {size_mib:.1f} MiB; peak RSS above the session's own (pools allocated and touched before):")
    print(f"  sending:   whole {source_whole_mib:.1f} MiB, streamed {source_streamed_mib:.1f} MiB")
    print(f"  receiving: whole {peer_whole_mib:.1f} MiB, streamed {peer_streamed_mib:.1f} MiB (import into the pool included)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
