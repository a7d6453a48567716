"""The outbox on its own: the bounds the writer's queue keeps (no socket, no server)."""

from __future__ import annotations

import asyncio

from arstream.app.outbox import VIEWER_CHUNK_BACKLOG, Outbox, QueuedClose, QueuedText, ViewerChunk


def viewer_chunk(seq: int, size: int = 10) -> ViewerChunk:
    return ViewerChunk({"type": "chunk"}, '{"type":"chunk"}', (b"x" * size,), seq)


def test_replies_fill_to_the_limit_and_the_writer_taking_one_makes_room() -> None:
    async def scenario() -> None:
        outbox = Outbox(reply_limit=2)
        outbox.push_reply("a")
        assert not outbox.replies_full
        outbox.push_reply("b")
        assert outbox.replies_full and outbox.replies_queued == 2
        waiter = asyncio.ensure_future(outbox.wait_reply_space())
        await asyncio.sleep(0)
        assert not waiter.done()  # the receive loop waits while the client has not taken its replies
        assert await outbox.get() == QueuedText("a", is_reply=True)
        await asyncio.wait_for(waiter, 1)
        assert not outbox.replies_full

    asyncio.run(scenario())


def test_a_latest_state_message_replaces_its_queued_predecessor() -> None:
    async def scenario() -> None:
        outbox = Outbox()
        outbox.push(QueuedText("viewers 1", latest_of="viewers"))
        outbox.push(QueuedText("other"))
        outbox.push(QueuedText("viewers 2", latest_of="viewers"))
        assert [(await outbox.get()), (await outbox.get())] == [
            QueuedText("other"),
            QueuedText("viewers 2", latest_of="viewers"),
        ]
        assert outbox.bytes_queued == 0

    asyncio.run(scenario())


def test_a_viewer_keeps_a_couple_of_chunks_and_counts_what_it_skipped() -> None:
    async def scenario() -> None:
        outbox = Outbox()
        for seq in range(VIEWER_CHUNK_BACKLOG + 3):
            outbox.push(viewer_chunk(seq))
        assert outbox.chunks_skipped == 3
        assert outbox.bytes_queued == VIEWER_CHUNK_BACKLOG * 10
        kept = [await outbox.get() for _ in range(VIEWER_CHUNK_BACKLOG)]
        assert [item.seq for item in kept if isinstance(item, ViewerChunk)] == [3, 4]  # the newest, in order

    asyncio.run(scenario())


def test_drop_pending_forgets_everything_and_a_closed_outbox_takes_nothing() -> None:
    async def scenario() -> None:
        outbox = Outbox(reply_limit=1)
        outbox.push_reply("a")
        outbox.push(viewer_chunk(0))
        outbox.drop_pending()
        assert outbox.bytes_queued == 0 and not outbox.replies_full
        outbox.push(QueuedClose(1000, "bye", "client"))
        assert await outbox.get() == QueuedClose(1000, "bye", "client")
        outbox.close()
        outbox.push_reply("late")
        assert outbox.replies_queued == 0 and outbox.bytes_queued == 0

    asyncio.run(scenario())
