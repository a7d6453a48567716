"""A bot that plays the world with ARStream's client library: hold a key, save the frames (docs/PROTOCOL.md).

    python client.py URL KEY CHUNKS OUT_DIR
    python client.py ws://127.0.0.1:8000/v1/sessions d 40 saved/   # hold d for 40 chunks (not frames)
    python client.py http://127.0.0.1:8000/ d 40 saved/             # the address serve prints works too

Each chunk brings the model card's frames_per_chunk frames; all are saved in OUT_DIR as JPEG files.
The library (arstream.programs.client_lib) imports no torch: numpy, pydantic, websockets and simplejpeg.
"""

import asyncio
import pathlib
import sys
import time

from arstream.programs.client_lib import Session


async def play(url: str, key: str, chunks: int, out: pathlib.Path) -> None:
    async with await Session.connect(url, decode=False) as session:  # decode=False: each frame's JPEG bytes
        ready = await session.start(codec="jpeg", seed=1)
        print("model", ready.model.name, ready.model.width, "x", ready.model.height)
        window = ready.limits.max_pending_ticks  # ticks in flight: the flow control
        sent = saved = 0
        started = time.monotonic()
        while sent < chunks or session.ticks_in_flight:
            while sent < chunks and session.ticks_in_flight < window:
                await session.tick(keys=[key])
                sent += 1
            chunk = await session.receive_chunk()  # a typed chunk: chunk_index, tick_id, frames
            for frame in chunk.frames:
                (out / f"{saved:05d}.jpg").write_bytes(frame)
                saved += 1
        await session.close()
    print(f"{saved} frames in {time.monotonic() - started:.1f} s, saved to {out}")


if len(sys.argv) != 5:
    sys.exit(__doc__)  # the usage above
if not sys.argv[1].startswith(("ws://", "wss://", "http://", "https://")):  # the page's address names the server too
    sys.exit(f"URL must start with ws://, wss://, http:// or https://, got {sys.argv[1]!r}")
out_dir = pathlib.Path(sys.argv[4])
out_dir.mkdir(parents=True, exist_ok=True)
asyncio.run(play(sys.argv[1], sys.argv[2], int(sys.argv[3]), out_dir))
