"""A snapshot in pieces (runner/snapshot_stream.py, runner/snapshot_import.py): never whole, read back exactly.

The planned export's bytes, read part by part, equal :func:`snapshot_bytes`
of the whole export byte for byte, and are a safetensors file the library
itself reads; the reader rebuilds the same tensors from pieces cut at any
boundary, and refuses a stream that is too large, cut short, padded or
corrupt (its digest), by name. Streamed into a second runner, each piece lands
in the session's pool blocks as it arrives, and an import that ends early at
any point, or whose header lies, leaves that pool as it was. fake-kv's
runner (CPU, exact block ids), no server.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import load as safetensors_load

from arstream.models.fake import FakeKVPipeline
from arstream.runner.runner import runner_for_sessions
from arstream.runner.snapshot import SnapshotError, export_session, tensors_digest
from arstream.runner.snapshot_import import SessionImport
from arstream.runner.snapshot_stream import (
    DIGEST_BYTES,
    DIGEST_TENSOR,
    PIECE_BYTES,
    SnapshotReader,
    SnapshotTooLarge,
    import_pieces,
    parse_snapshot,
    plan_export,
    snapshot_bytes,
)
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
    return b"".join(plan.chunks())


@pytest.mark.parametrize("head_size", [4, PIECE_BYTES // 16])  # a few bytes a block, and a block a piece
def test_the_streamed_file_is_the_whole_file_byte_for_byte(head_size: int) -> None:
    runner = runner_with_history(head_size, chunks=3 if head_size > 4 else 5)
    whole = export_session(runner, SESSION, protocol_version=1)  # type: ignore[arg-type]
    data = streamed(runner)
    assert data == snapshot_bytes(whole)
    assert parse_snapshot(data).header == whole.header
    # Still a safetensors file: the library reads it, the digest as its last tensor.
    tensors = safetensors_load(data)
    assert set(tensors) == {*whole.tensors, DIGEST_TENSOR}
    assert all(torch.equal(tensors[k], whole.tensors[k]) for k in whole.tensors)


@pytest.mark.parametrize("cut", [1, 7, 8, 9, 100, 4096])
def test_the_reader_rebuilds_the_tensors_from_pieces_cut_anywhere(cut: int) -> None:
    runner = runner_with_history()
    whole = export_session(runner, SESSION, protocol_version=1)  # type: ignore[arg-type]
    data = snapshot_bytes(whole)
    reader = SnapshotReader(max_bytes=len(data))
    for start in range(0, len(data), cut):
        reader.feed(data[start : start + cut])
    got = reader.snapshot()
    assert got.header == whole.header
    assert tensors_digest(got.tensors) == tensors_digest({k: t.contiguous() for k, t in whole.tensors.items()})
    assert all(torch.equal(got.tensors[k], whole.tensors[k]) for k in whole.tensors)


def test_the_reader_refuses_what_is_not_one_whole_snapshot() -> None:
    data = snapshot_bytes(export_session(runner_with_history(), SESSION, protocol_version=1))  # type: ignore[arg-type]
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
        assert sum(part().numel() * part().element_size() for part in piece) <= PIECE_BYTES
    assert len(pieces) < len(plan.tensors[0].parts)


def test_a_header_the_receiver_refuses_stops_the_read_before_any_tensor_is_allocated() -> None:
    data = snapshot_bytes(export_session(runner_with_history(), SESSION, protocol_version=1))  # type: ignore[arg-type]
    seen: list[dict[str, object]] = []

    def refuse(header: dict[str, object]) -> None:
        seen.append(header)
        raise RuntimeError("no room")

    reader = SnapshotReader(max_bytes=len(data), check=refuse)
    with pytest.raises(RuntimeError, match="no room"):
        reader.feed(data)
    assert seen and seen[0]["model"] == "fake-kv"
    assert reader.header is None  # nothing taken: no tensor buffers were made


def test_a_corrupt_piece_is_refused_by_the_digest() -> None:
    data = bytearray(snapshot_bytes(export_session(runner_with_history(), SESSION, protocol_version=1)))  # type: ignore[arg-type]
    parse_snapshot(bytes(data))  # negative control: the bytes as sent are taken
    data[-DIGEST_BYTES - 5] ^= 0x01  # one bit of the KV (the last tensor before the digest) flipped on the way
    with pytest.raises(SnapshotError, match="corrupt"):
        parse_snapshot(bytes(data))


def peer(head_size: int = 4) -> Any:
    return runner_for_sessions(FakeKVPipeline(window_frames=4, head_size=head_size), 2)


def free_blocks(runner: Any) -> int:
    return int(runner.stats().blocks_free)


def stream_into(runner: Any, data: bytes, *, cut: int = 64, stop_after: int | None = None) -> SessionImport:
    """Feed ``data`` in reads of ``cut`` bytes into an import on ``runner``, as a server does; stop (leaving the
    import open) after ``stop_after`` bytes."""
    end = len(data) if stop_after is None else stop_after
    reads = (data[start : min(start + cut, end)] for start in range(0, end, cut))
    return import_pieces(runner, SESSION, reads, max_bytes=len(data), protocol_version=1, finish=stop_after is None)


def test_streamed_pieces_land_in_the_pool_blocks_as_they_arrive_and_continue_bit_identically() -> None:
    source: Any = runner_with_history(head_size=4096)  # KV of 1.3 MB: half the file is past its head
    whole = export_session(source, SESSION, protocol_version=1)
    data = snapshot_bytes(whole)
    target = peer(head_size=4096)
    job = stream_into(target, data, cut=65536, stop_after=len(data) // 2)
    # Half the bytes in: the session's first block already holds its bytes, in the pool itself (no copy of the
    # file is kept: the reader holds nothing).
    state = target.sessions.kv_state(SESSION)
    first = state.sink["main"][0]
    assert torch.equal(target.pool.kv[0, 0, first], whole.tensors["kv/main"][0, 0, 0])
    job.abort(target)
    # The whole stream: the session continues exactly as it would have on the source.
    stream_into(target, data, cut=65536)
    for i in range(5, 8):
        mine = target.execute_tick(TickRequest(session_id=SESSION, request_id=i))
        theirs = source.execute_tick(TickRequest(session_id=SESSION, request_id=i))
        assert (mine.frames == theirs.frames).all()


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 0.9, 0.999])
def test_an_import_cut_short_anywhere_leaves_the_pool_as_it_was(fraction: float) -> None:
    data = snapshot_bytes(export_session(runner_with_history(), SESSION, protocol_version=1))  # type: ignore[arg-type]
    target = peer()
    free = free_blocks(target)
    stop = max(1, int(len(data) * fraction))
    reader = SnapshotReader(max_bytes=len(data), hold=False)
    writes = reader.feed(data[:stop])
    job = None
    if reader.header is not None:
        job = SessionImport(SESSION, reader.header, reader.tensors, protocol_version=1)
        job.begin(target)
        assert free_blocks(target) < free  # the blocks are taken from the header on
        for write in writes:
            job.write(target, write.index, write.offset, write.as_tensor())
    with pytest.raises(SnapshotError, match="ended early"):
        reader.finish()
    if job is not None:
        job.abort(target)
    assert free_blocks(target) == free and target.resident_sessions() == []


def lying(header_change: Any = None, table_change: Any = None) -> tuple[dict[str, Any], list[Any]]:
    data = snapshot_bytes(export_session(runner_with_history(), SESSION, protocol_version=1))  # type: ignore[arg-type]
    reader = SnapshotReader(max_bytes=len(data), hold=False)
    reader.feed(data)
    assert reader.header is not None
    header, tensors = reader.header, list(reader.tensors)
    if header_change is not None:
        header_change(header)
    if table_change is not None:
        tensors = table_change(tensors)
    return header, tensors


def more_frames(tensors: list[Any]) -> list[Any]:
    kv = tensors[0]
    return [type(kv)(kv.name, kv.dtype, (*kv.shape[:2], 50, *kv.shape[3:]))]


@pytest.mark.parametrize(
    ("why", "header_change", "table_change", "match"),
    [
        ("more frames than the window", None, more_frames, "does not fit this spec"),
        ("a wrong dtype", None, lambda t: [type(t[0])(t[0].name, torch.float16, t[0].shape)], "does not fit"),
        ("an unknown tensor", None, lambda t: [*t, type(t[0])("junk/x", torch.uint8, (9,))], "does not know"),
        ("a tensor twice", None, lambda t: [t[0], t[0]], "twice"),
        ("more sink frames than frames", lambda h: h["kv"]["sink_frames"].update(main=99), None, "does not fit"),
        ("a negative counter", lambda h: h["kv"].update(frames_committed=-3), None, "not a count"),
        ("no KV section", lambda h: h.pop("kv"), None, "no KV section"),
        ("nothing resident, with tensors", lambda h: h.update(resident=False), None, "nothing resident"),
    ],
)
def test_a_header_that_lies_is_refused_before_a_byte_is_written(
    why: str, header_change: Any, table_change: Any, match: str
) -> None:
    header, tensors = lying(header_change, table_change)
    target = peer()
    free = free_blocks(target)
    with pytest.raises(SnapshotError, match=match):
        SessionImport(SESSION, header, tensors, protocol_version=1).begin(target)
    assert free_blocks(target) == free and target.resident_sessions() == [], why
