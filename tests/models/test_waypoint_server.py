"""The whole server path with waypoint-1.5 (tiny and tiny-1.5, random weights): real CLI, uvicorn and websockets."""

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_hardening_start_image import b64, png

from arstream.programs import client
from servers import LiveServer, server_process, session_client, wait_until


def test_serve_streams_a_world_driven_by_any_key_and_mouse_deltas(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = ["--model-options", '{"config": "tiny"}']  # Waypoint-1's decoder, one frame a chunk
    args = ["--model", "waypoint-1.5", *tiny, "--torch-threads", "1", "--max-batch-sessions", "2"]
    with server_process(args) as server:
        server.wait_ready()
        card = server.get("/v1/model").json()
        assert (card["name"], card["width"], card["height"], card["frames_per_chunk"]) == ("waypoint-1.5", 40, 24, 1)
        # the terminal says what the page says: random weights draw noise (the capacity line is printed after it)
        wait_until(lambda: any(line.startswith("Sessions: ") for line in server.output), attempts=2400)
        assert any("random weights (a test set-up), so its pictures are noise" in line for line in server.output)
        assert set(card["controls"]["properties"]) == {"buttons", "mouse", "scroll"}
        # the page maps inputs from the card: browser key codes and mouse buttons to button ids, pointer deltas
        assert card["inputs"]["buttons"]["codes"]["KeyW"] == 87 and card["inputs"]["mouse"]["kind"] == "pointer_delta"
        start_free = server.stats()["kv"]["blocks_free"]

        async def session(seed: int, buttons: list[int]) -> list[tuple[int, int, int]]:
            seen = []
            async with session_client(server.ws_url, start={"seed": seed, "codec": "raw"}) as client:
                for tick_id in range(3):
                    controls = {"buttons": buttons, "mouse": [0.5 * tick_id, -0.25], "scroll": 1}
                    await client.send(type="tick", tick_id=tick_id, controls=controls)
                for _ in range(3):
                    chunk, frames = await client.recv_chunk()
                    header, pixels = frames[0]
                    assert (header.width, header.height, pixels.shape) == (40, 24, (24, 40, 3))
                    seen.append((chunk["tick_id"], chunk["chunk_index"], chunk["frames"]))
                for bad in ({"buttons": [256]}, {"mouse": [1.0]}, {"keys": ["w"]}):
                    await client.send(type="tick", tick_id=3, controls=bad)
                    refusal = await client.recv_json()
                    assert refusal["type"] == "error" and refusal["code"] == "invalid_controls", refusal
            return seen

        async def both() -> list[list[tuple[int, int, int]]]:
            return list(await asyncio.gather(session(1, [87]), session(2, [65, 32, 1])))

        for seen in asyncio.run(both()):
            assert seen == [(0, 0, 1), (1, 1, 1), (2, 2, 1)]
        server.settled(start_free)

        # arstream client maps its key names through the card as the page does: w -> KeyW -> 87, space -> 32,
        # mouse_right -> MouseEvent.button 2 -> 2.
        out = tmp_path / "frames"
        assert client.main([server.ws_url, "--keys", "w*2,space+d+mouse_right*2", "--out", str(out)]) == 0
        assert len(list(out.glob("*.png"))) == 4
        assert client.main([server.ws_url, "--keys", "F13*2", "--out", str(tmp_path / "none")]) == 2
        assert "the model takes no key 'F13'" in capsys.readouterr().err
        server.settled(start_free)


@pytest.fixture(scope="module")
def server_1_5() -> Iterator[LiveServer]:
    args = ["--model", "waypoint-1.5", "--model-options", '{"config": "tiny-1.5"}', "--torch-threads", "1"]
    with server_process(args) as server:
        server.wait_ready()
        yield server


def test_serve_streams_four_frames_a_control_with_waypoint_1_5s_decoder(server_1_5: LiveServer) -> None:
    """tiny-1.5 through the real server: each tick's one control makes a chunk of four frames (the TAEHV stream),
    and closing the sessions gives back every block."""
    server = server_1_5
    card = server.get("/v1/model").json()
    assert (card["width"], card["height"], card["frames_per_chunk"]) == (128, 72, 4)
    start_free = server.stats()["kv"]["blocks_free"]

    async def session() -> list[tuple[int, int]]:
        seen = []
        async with session_client(server.ws_url, start={"seed": 3, "codec": "raw"}) as client:
            for tick_id in range(3):
                await client.send(type="tick", tick_id=tick_id, controls={"buttons": [87], "mouse": [0.5, 0.0]})
            for _ in range(3):
                chunk, frames = await client.recv_chunk()
                assert [pixels.shape for _, pixels in frames] == [(72, 128, 3)] * 4
                seen.append((chunk["chunk_index"], chunk["frames"]))
        return seen

    assert asyncio.run(session()) == [(0, 4), (1, 4), (2, 4)]
    server.settled(start_free)


def test_a_world_starts_from_an_uploaded_picture(server_1_5: LiveServer) -> None:
    """`start.image` with a PNG: chunk 0 is the picture (four times: the seed the engine appends), the world moves
    on from it. A picture of another aspect is cut to the frame's (its centred part: here all blue); one too narrow
    for any part of it is `invalid_image`. Every block comes back."""
    server = server_1_5
    card = server.get("/v1/model").json()
    assert card["start_images"] == ["default"]
    start_free = server.stats()["kv"]["blocks_free"]
    landscape = np.random.default_rng(4).integers(0, 256, (72, 128, 3), dtype=np.uint8)
    square = np.zeros((100, 100, 3), np.uint8)
    square[:, :] = (255, 0, 0)
    square[25:75] = (0, 0, 255)  # the 16:9 band a 100-wide picture keeps is rows 22..77: blue but for its edges

    async def first_chunks(start: dict[str, Any]) -> list[np.ndarray]:
        chunks = []
        async with session_client(server.ws_url, start={"seed": 3, "codec": "raw", **start}) as client:
            for tick_id in range(2):
                await client.send(type="tick", tick_id=tick_id, controls={"buttons": [87]})
            for _ in range(2):
                _, frames = await client.recv_chunk()
                chunks.append(np.stack([pixels for _, pixels in frames]))
        return chunks

    async def refused(data: bytes) -> tuple[int | None, dict[str, Any]]:
        async with session_client(server.ws_url) as client:
            await client.send(type="start", image={"data": b64(data)})
            first = await client.recv_json()
            return (await client.closed_by_server()).code, first

    async def scenario() -> tuple[list[np.ndarray], ...]:
        return tuple(await asyncio.gather(
            first_chunks({"image": {"data": b64(png(landscape))}}), first_chunks({}),
            first_chunks({"image": {"data": b64(png(square))}}),
        ))

    uploaded, default, cut = asyncio.run(scenario())
    assert uploaded[0].shape == (4, 72, 128, 3) and all(np.array_equal(f, landscape) for f in uploaded[0])
    assert np.abs(uploaded[1].astype(int) - default[1].astype(int)).max() > 1  # the picture made the world
    assert np.abs(cut[0][:, 4:-4].astype(int) - np.array([0, 0, 255])).max() <= 1  # no red row was kept
    code, first = asyncio.run(refused(png(np.zeros((100, 1, 3), np.uint8))))
    assert (code, first["code"]) == (4004, "invalid_image") and "too narrow" in first["message"]
    server.settled(start_free)


def test_serve_streams_frames_from_int8_weights() -> None:
    """`--model-options '{"weights": "int8"}'`: the DiT's block linears quantized after loading, said on the card,
    and a session's chunks come back whole; closing it gives back every block."""
    args = ["--model", "waypoint-1.5", "--model-options", '{"weights": "int8"}', "--torch-threads", "1"]
    with server_process(args) as server:
        server.wait_ready()
        card = server.get("/v1/model").json()
        (dit,) = [c for c in card["components"] if c["name"] == "dit"]
        assert dit["weights"] == "int8 (float32 compute)", dit
        shape = (card["height"], card["width"], 3)
        start_free = server.stats()["kv"]["blocks_free"]

        async def session() -> list[tuple[int, int]]:
            seen = []
            async with session_client(server.ws_url, start={"seed": 5, "codec": "raw"}) as client:
                for tick_id in range(3):
                    await client.send(type="tick", tick_id=tick_id, controls={"buttons": [87], "mouse": [0.5, 0.0]})
                for _ in range(3):
                    chunk, frames = await client.recv_chunk()
                    assert [pixels.shape for _, pixels in frames] == [shape] * card["frames_per_chunk"]
                    seen.append((chunk["chunk_index"], chunk["frames"]))
            return seen

        assert asyncio.run(session()) == [(index, card["frames_per_chunk"]) for index in range(3)]
        server.settled(start_free)
