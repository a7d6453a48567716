"""A bot that plays the world and takes its frames on a WebRTC video track (docs/PROTOCOL.md, "WebRTC video").

    python client_webrtc.py URL KEY CHUNKS OUT_DIR
    python client_webrtc.py ws://127.0.0.1:8000/v1/sessions d 40 saved/   # a server started with --webrtc

The WebSocket stays the control plane (start, ticks, every `chunk` message); the frames come on the track, and
are saved in OUT_DIR as PNG files in track order. A server that refuses the offer, or a track that does not
connect, leaves the frames on the WebSocket, where the library reads them as before: this bot saves both.
Needs the webrtc extra: pip install 'arstream[webrtc]' (aiortc).
"""

import asyncio
import pathlib
import sys

from PIL import Image

from arstream.programs.client_lib import Session
from arstream.programs.client_webrtc import TrackReceiver


async def play(url: str, key: str, chunks: int, out: pathlib.Path) -> None:
    async with await Session.connect(url) as session:
        ready = await session.start(seed=1)
        receiver = TrackReceiver(fps=ready.model.fps, ice_servers=session.ice_servers)  # a TURN relay, if any
        await session.offer_webrtc(receiver)  # the offer, its ICE candidates inside
        print("delivery:", await session.wait_for_track(timeout_s=10.0), receiver.codec or receiver.refused)
        frames, sent = [], 0
        while sent < chunks or session.ticks_in_flight:
            while sent < chunks and session.ticks_in_flight < ready.limits.max_pending_ticks:
                await session.tick(keys=[key])
                sent += 1
            chunk = await session.receive_chunk()  # on the track: its frames are not here, but in the receiver
            frames += chunk.frames
        await receiver.wait_shown()  # frames still on the server's track at the close are never sent
        await session.close()
    frames += await receiver.close()  # every frame the track showed, in order
    for index, frame in enumerate(frames):
        Image.fromarray(frame).save(out / f"{index:05d}.png")
    print(f"{len(frames)} frames saved to {out} ({len(receiver.frames)} from the track)")


if len(sys.argv) != 5:
    sys.exit(__doc__)  # the usage above
out_dir = pathlib.Path(sys.argv[4])
out_dir.mkdir(parents=True, exist_ok=True)
asyncio.run(play(sys.argv[1], sys.argv[2], int(sys.argv[3]), out_dir))
