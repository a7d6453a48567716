"""A snapshot in pieces (runner/snapshot_stream.py): the same file, never whole, read back exactly.

The planned export's bytes, read part by part, equal :meth:`SessionSnapshot.to_bytes`
of the whole export byte for byte (so either side of a move may be old);
the reader rebuilds the same tensors from pieces cut at any boundary, and
refuses a stream that is too large, cut short, or padded, by name. fake-kv's
runner (CPU, exact block ids), no server.
"""

from __future__ import annotations

import pytest
import torch

from arstream.models.fake import FakeKVPipeline
from arstream.runner.runner import runner_for_sessions
from arstream.runner.snapshot import SessionSnapshot, SnapshotError, export_session, tensors_digest
from arstream.runner.snapshot_stream import PIECE_BYTES, SnapshotReader, SnapshotTooLarge, piece_bytes, plan_export
from arstream.runner.types import TickRequest

SESSION = "s-00000000000000aa"


def runner_with_history(head_size: int = 4, chunks: int = 5) -> object:
    runner = runner_for_sessions(FakeKVPipeline(window_frames=4, head_size=head_size), 2)
    for i in range(chunks):  # past the window: the session's blocks are no longer 0..n in order
        runner.execute_tick(TickRequest(session_id="s-other", request_id=i))
        runner.execute_tick(TickRequest(session_id=SESSION, request_id=i))
    return runner


def streamed(runner: object) -> bytes:
    plan = plan_export(runner, SESSION, protocol_version=1)  # type: ignore[arg-type]
    return plan.head() + b"".join(piece_bytes(part()) for tensor in plan.tensors for part in tensor.parts)


@pytest.mark.parametrize("head_size", [4, PIECE_BYTES // 16])  # a few bytes a block, and a block a piece
def test_the_streamed_file_is_the_whole_file_byte_for_byte(head_size: int) -> None:
    runner = runner_with_history(head_size, chunks=3 if head_size > 4 else 5)
    whole = export_session(runner, SESSION, protocol_version=1)  # type: ignore[arg-type]
    data = streamed(runner)
    assert data == whole.to_bytes()
    assert SessionSnapshot.from_bytes(data).header == whole.header


@pytest.mark.parametrize("cut", [1, 7, 8, 9, 100, 4096])
def test_the_reader_rebuilds_the_tensors_from_pieces_cut_anywhere(cut: int) -> None:
    runner = runner_with_history()
    whole = export_session(runner, SESSION, protocol_version=1)  # type: ignore[arg-type]
    data = whole.to_bytes()
    reader = SnapshotReader(max_bytes=len(data))
    for start in range(0, len(data), cut):
        reader.feed(data[start : start + cut])
    got = reader.snapshot()
    assert got.header == whole.header
    assert tensors_digest(got.tensors) == tensors_digest({k: t.contiguous() for k, t in whole.tensors.items()})
    assert all(torch.equal(got.tensors[k], whole.tensors[k]) for k in whole.tensors)


def test_the_reader_refuses_what_is_not_one_whole_snapshot() -> None:
    data = export_session(runner_with_history(), SESSION, protocol_version=1).to_bytes()  # type: ignore[arg-type]
    with pytest.raises(SnapshotTooLarge, match=f"at most {len(data) - 1} bytes"):
        SnapshotReader(max_bytes=len(data) - 1).feed(data)
    short = SnapshotReader(max_bytes=len(data))
    short.feed(data[:-3])
    with pytest.raises(SnapshotError, match="ended early"):
        short.snapshot()
    with pytest.raises(SnapshotError, match="bytes after its last tensor"):
        SnapshotReader(max_bytes=len(data) + 4).feed(data + b"more")
    with pytest.raises(SnapshotError, match="header length"):
        SnapshotReader(max_bytes=1024).feed(b"not a snapshot at all")


def test_small_blocks_travel_together_in_pieces_of_bounded_size() -> None:
    plan = plan_export(runner_with_history(head_size=4096), SESSION, protocol_version=1)  # type: ignore[arg-type]
    pieces = plan.pieces()
    block = plan.tensors[0].nbytes // len(plan.tensors[0].parts)
    assert block < PIECE_BYTES // 4  # several blocks fit one piece ...
    assert [part for piece in pieces for part in piece] == [p for t in plan.tensors for p in t.parts]  # in order
    for piece in pieces:  # ... and none is over the bound
        assert len(b"".join(piece_bytes(part()) for part in piece)) <= PIECE_BYTES
    assert len(pieces) < len(plan.tensors[0].parts)


def test_a_header_the_receiver_refuses_stops_the_read_before_any_tensor_is_allocated() -> None:
    data = export_session(runner_with_history(), SESSION, protocol_version=1).to_bytes()  # type: ignore[arg-type]
    seen: list[dict[str, object]] = []

    def refuse(header: dict[str, object]) -> None:
        seen.append(header)
        raise RuntimeError("no room")

    reader = SnapshotReader(max_bytes=len(data), check=refuse)
    with pytest.raises(RuntimeError, match="no room"):
        reader.feed(data)
    assert seen and seen[0]["model"] == "fake-kv"
    assert reader.header is None  # nothing taken: no tensor buffers were made
