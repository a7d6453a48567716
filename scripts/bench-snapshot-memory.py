#!/usr/bin/env python3
"""What a move costs in memory: peak RSS above the session's own, streamed snapshot vs whole, on each side.

    .venv/bin/python scripts/bench-snapshot-memory.py --mib 256

A fake-kv session made large with ``head_size`` (about MIB MiB of KV) is moved
from one runner to another in this process, twice, each step measured as the
peak resident set above the level before it (Linux: VmHWM, reset through
/proc/self/clear_refs), once the way a drain did before (the whole file:
export copied to the CPU, ``to_bytes``; on the peer the request body, its
bytes and ``from_bytes``) and once streamed (runner/snapshot_stream.py: the
worker's plan read part by part; the peer's SnapshotReader), side by side in
one run. The import into the peer's pool, the same either way, is left out.
Prints one line per side and way, the ratios, and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from arstream.models.fake import FakeKVPipeline
from arstream.runner.runner import runner_for_sessions
from arstream.runner.snapshot import SessionSnapshot, export_session
from arstream.runner.snapshot_stream import SnapshotReader, piece_bytes, plan_export
from arstream.runner.types import TickRequest

SESSION = "s-0000000000000big"
STATUS = Path("/proc/self/status")


def kib(field: str) -> int:
    line = next(line for line in STATUS.read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def peak_above(step: Callable[[], object]) -> tuple[float, object]:
    """MiB of resident memory at the step's peak above the level before it, and what the step returned."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = kib("VmRSS")
    result = step()
    return (kib("VmHWM") - before) / 1024, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="the session's KV, about (MiB)")
    args = parser.parse_args()
    resident_frames = 7  # fake-kv: 1 sink + 6 window frames
    head_size = args.mib * 2**20 // (resident_frames * 2 * 2 * 2 * 4)  # layers x K/V x tokens x float32
    runner = runner_for_sessions(FakeKVPipeline(head_size=head_size), 1)
    for i in range(resident_frames // 2 + 1):
        runner.execute_tick(TickRequest(session_id=SESSION, request_id=i))

    def whole_source() -> bytes:
        snapshot = export_session(runner, SESSION, protocol_version=1)
        snapshot.tensors = {name: t.to("cpu", copy=True) for name, t in snapshot.tensors.items()}  # as the worker did
        return snapshot.to_bytes()

    def streamed_source() -> list[bytes]:
        plan = plan_export(runner, SESSION, protocol_version=1)
        sent = [plan.head()]
        for tensor in plan.tensors:
            for part in tensor.parts:
                piece = piece_bytes(part())  # sent, then dropped
                sent.append(piece[:0])
        return sent

    source_whole_mib, data = peak_above(whole_source)
    assert isinstance(data, bytes)
    size_mib = len(data) / 2**20
    source_streamed_mib, _ = peak_above(streamed_source)
    pieces = [data[i : i + 2**20] for i in range(0, len(data), 2**20)]  # what arrives: 1 MiB reads

    def whole_peer() -> SessionSnapshot:
        body = bytearray()
        for piece in pieces:
            body += piece
        return SessionSnapshot.from_bytes(bytes(body))

    def streamed_peer() -> SessionSnapshot:
        reader = SnapshotReader(max_bytes=len(data))
        for piece in pieces:
            reader.feed(piece)
        return reader.snapshot()

    peer_whole_mib, whole = peak_above(whole_peer)
    del whole
    peer_streamed_mib, _ = peak_above(streamed_peer)
    result = {
        "snapshot_mib": round(size_mib, 1),
        "source_whole_mib": round(source_whole_mib, 1),
        "source_streamed_mib": round(source_streamed_mib, 1),
        "peer_whole_mib": round(peer_whole_mib, 1),
        "peer_streamed_mib": round(peer_streamed_mib, 1),
        "source_ratio_whole_over_streamed": round(source_whole_mib / max(source_streamed_mib, 0.1), 1),
        "peer_ratio_whole_over_streamed": round(peer_whole_mib / max(peer_streamed_mib, 0.1), 2),
    }
    print(f"snapshot {size_mib:.1f} MiB; peak RSS above the session's own:")
    print(f"  sending:   whole {source_whole_mib:.1f} MiB, streamed {source_streamed_mib:.1f} MiB")
    print(f"  receiving: whole {peer_whole_mib:.1f} MiB, streamed {peer_streamed_mib:.1f} MiB (before the pool import)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
