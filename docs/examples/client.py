"""A minimal ARStream client: one session, hold a key, save the frames (docs/PROTOCOL.md).

    pip install websockets
    python client.py URL KEY CHUNKS OUT_DIR
    python client.py ws://127.0.0.1:8000/v1/sessions d 40 saved/   # hold d for 40 chunks (not frames)
    python client.py http://127.0.0.1:8000/ d 40 saved/             # the address serve prints works too

Each chunk brings the model card's frames_per_chunk frames; all are saved in OUT_DIR as JPEG files.
"""

import json
import pathlib
import sys
import time

from websockets.sync.client import connect

if len(sys.argv) != 5:
    sys.exit(__doc__)  # the usage above
url, key, chunks, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), pathlib.Path(sys.argv[4])
# The page's address (what `arstream serve` prints) names the same server: its sessions are at /v1/sessions.
if url.startswith(("http://", "https://")):
    url = "ws" + url[len("http"):]
    if url.count("/") < 3 or url.split("/", 3)[3] == "":
        url = url.rstrip("/") + "/v1/sessions"
if not url.startswith(("ws://", "wss://")):
    sys.exit(f"URL must start with ws://, wss://, http:// or https://, got {url!r}")
out.mkdir(parents=True, exist_ok=True)

with connect(url, max_size=None) as ws:
    ws.send(json.dumps({"type": "start", "seed": 1, "codec": "jpeg"}))
    ready = json.loads(ws.recv())
    if ready["type"] != "ready":
        sys.exit(f"refused: {ready}")
    window = ready["limits"]["max_pending_ticks"]  # ticks in flight: the flow control
    print("model", ready["model"]["name"], ready["model"]["width"], "x", ready["model"]["height"])
    sent = saved = done = 0
    started = time.monotonic()
    while done < chunks:
        while sent < chunks and sent - done < window:
            ws.send(json.dumps({"type": "tick", "tick_id": sent, "controls": {"keys": [key]}}))
            sent += 1
        message = ws.recv()
        if isinstance(message, bytes):  # a frame: 20-byte header (magic ARF1 ...), then the JPEG
            (out / f"{saved:05d}.jpg").write_bytes(message[20:])
            saved += 1
            continue
        reply = json.loads(message)
        if reply["type"] == "chunk":
            done += 1
        elif reply["type"] == "error":
            sys.exit(f"error: {reply['code']}: {reply['message']}")
    ws.send(json.dumps({"type": "close"}))
    # The last chunk's frames may still be on their way: read until the server's `closed`.
    for message in ws:
        if isinstance(message, bytes):
            (out / f"{saved:05d}.jpg").write_bytes(message[20:])
            saved += 1
    print(f"{saved} frames in {time.monotonic() - started:.1f} s, saved to {out}")
