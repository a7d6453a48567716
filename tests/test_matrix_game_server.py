"""The whole server path with matrix-game-2 (tiny, random weights): real CLI, uvicorn and websockets."""

import asyncio
import json

from servers import server_process, session_client

OPTIONS = json.dumps({"config": "tiny", "random_init": True})


def test_serve_streams_a_steerable_world_with_9_then_12_frames_per_chunk() -> None:
    args = ["--model", "matrix-game-2", "--model-options", OPTIONS, "--torch-threads", "1", "--max-batch-sessions", "2"]
    with server_process(args) as server:
        server.wait_ready()
        card = server.get("/v1/model").json()
        assert (card["name"], card["width"], card["height"]) == ("matrix-game-2", 48, 32)
        assert (card["frames_per_chunk"], card["first_chunk_frames"]) == (12, 9)
        assert set(card["controls"]["properties"]) == {"keys", "camera"} and card["mouse"] == "camera"
        start_free = server.stats()["kv"]["blocks_free"]

        async def session(seed: int, keys: list[str]) -> list[tuple[int, int, int]]:
            seen = []
            async with session_client(server.ws_url, start={"seed": seed, "codec": "raw"}) as client:
                assert client.ready is not None and client.ready["model"]["first_chunk_frames"] == 9
                for tick_id in range(3):
                    camera = {"yaw": 0.2 * tick_id, "pitch": -0.1}
                    await client.send(type="tick", tick_id=tick_id, controls={"keys": keys, "camera": camera})
                for _ in range(3):
                    chunk, frames = await client.recv_chunk()
                    header, pixels = frames[0]
                    assert (header.width, header.height, pixels.shape) == (48, 32, (32, 48, 3))
                    seen.append((chunk["tick_id"], chunk["chunk_index"], chunk["frames"]))
                bad = {"keys": ["w"], "camera": {"roll": 1}}
                await client.send(type="tick", tick_id=3, controls=bad)
                refusal = await client.recv_json()
                assert refusal["type"] == "error", refusal
            return seen

        async def both() -> list[list[tuple[int, int, int]]]:
            return list(await asyncio.gather(session(1, ["w"]), session(2, ["a", "s"])))

        for seen in asyncio.run(both()):
            assert seen == [(0, 0, 9), (1, 1, 12), (2, 2, 12)]
        stats = server.settled(start_free)
        assert stats["kv"]["frames_per_chunk"] == 3  # latent frames: the KV unit
