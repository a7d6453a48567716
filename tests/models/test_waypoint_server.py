"""The whole server path with waypoint-1.5 (tiny and tiny-1.5, random weights): real CLI, uvicorn and websockets."""

import asyncio
from pathlib import Path

import pytest

from arstream.programs import client
from servers import server_process, session_client, wait_until


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


def test_serve_streams_four_frames_a_control_with_waypoint_1_5s_decoder() -> None:
    """tiny-1.5 through the real server: each tick's one control makes a chunk of four frames (the TAEHV stream),
    and closing the sessions gives back every block."""
    args = ["--model", "waypoint-1.5", "--model-options", '{"config": "tiny-1.5"}', "--torch-threads", "1"]
    with server_process(args) as server:
        server.wait_ready()
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
