"""A client of the realtime video dialect (``WS /v1/realtime/video``), written from docs/PROTOCOL.md's dialect section.

It starts one session, switches the prompt after the first chunk, writes the fMP4 stream it receives to a file and
prints one line per event, the way a user's script would. tests/test_realtime_video.py runs it as a separate
process against ``arstream serve``: the dialect as an outside client sees it.

    python tests/realtime_video_client.py ws://127.0.0.1:8000/v1/realtime/video --model fake-kv \\
        --width 64 --height 48 --num-frames 12 --prompt-after-first-chunk "a sunlit valley" --output stream.mp4

The options vLLM-Omni's newer example client has, in our words: ``--image-reference`` (a picture file, sent as a
``data:`` URL, or a URL / ``file_id:NAME`` as they are) and ``--camera-updates`` (a JSON list of updates, each sent
``at`` seconds after ``video.start``: a structural ``camera`` payload, or ``actions`` keys turned into a velocity the
way vLLM-Omni's helper turns them, with an optional ``transition_chunks``).
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import mimetypes
import sys
import time
from pathlib import Path
from typing import Any

from websockets.sync.client import connect

RECEIVE_TIMEOUT_S = 60.0
# vLLM-Omni's key helper: a step a frame along +Z/+X for W/S and D/A, degrees a frame for the look keys.
KEY_STEP = 0.05
KEY_PITCH_DEGREES = 4.0
KEY_YAW_DEGREES = 6.0


def image_reference(value: str) -> dict[str, str]:
    """``--image-reference``: a file becomes a data: URL; ``file_id:NAME`` names a model's image; a URL goes as is."""
    if value.startswith("file_id:"):
        return {"file_id": value.removeprefix("file_id:")}
    if value.startswith(("data:", "http://", "https://")):
        return {"image_url": value}
    kind = mimetypes.guess_type(value)[0] or "image/png"
    return {"image_url": f"data:{kind};base64," + base64.b64encode(Path(value).read_bytes()).decode()}


def keys_to_camera(actions: list[str]) -> dict[str, Any]:
    """Held keys as a structural SE3 velocity (W/S/A/D move, I/K look up/down, J/L look left/right)."""
    keys = {a.lower() for a in actions}
    dx = KEY_STEP * (("d" in keys) - ("a" in keys))
    dz = KEY_STEP * (("w" in keys) - ("s" in keys))
    yaw = math.radians(KEY_YAW_DEGREES * (("l" in keys) - ("j" in keys))) / 2
    pitch = math.radians(KEY_PITCH_DEGREES * (("i" in keys) - ("k" in keys))) / 2
    # pitch (about +X) applied after yaw (about +Y): q = q_pitch * q_yaw
    cy, sy, cp, sp = math.cos(yaw), math.sin(yaw), math.cos(pitch), math.sin(pitch)
    rotation = [sp * cy, cp * sy, sp * sy, cp * cy]
    return {"mode": "velocity", "data": {"translation": [dx, 0.0, dz], "rotation": rotation}}


def camera_interactions(updates: list[dict[str, Any]]) -> list[tuple[float, dict[str, Any]]]:
    """``--camera-updates`` as (seconds after video.start, session.interaction), in time order."""
    scheduled = []
    for index, update in enumerate(updates):
        camera = update["camera"] if "camera" in update else keys_to_camera(update["actions"])
        body: dict[str, Any] = {"event_id": f"camera-{index}", "event": {"multi_modal_data": {"camera": camera}}}
        if "transition_chunks" in update:
            body["transition_chunks"] = update["transition_chunks"]
        scheduled.append((float(update.get("at", 0.0)), {"type": "session.interaction", "interaction": body}))
    return sorted(scheduled, key=lambda pair: pair[0])


def start_event(args: argparse.Namespace) -> dict[str, Any]:
    start: dict[str, Any] = {"type": "session.start", "model": args.model, "prompt": args.prompt}
    for field in ("width", "height", "fps", "num_frames", "seed"):
        if getattr(args, field) is not None:
            start[field] = getattr(args, field)
    if args.image_reference is not None:
        start["image_reference"] = image_reference(args.image_reference)
    return start


def prompt_interaction(prompt: str, transition_chunks: int) -> dict[str, Any]:
    event = {"prompt": prompt, "transition_chunks": transition_chunks}
    return {"type": "session.interaction", "interaction": {"event_id": "prompt-1", "event": event}}


def run(args: argparse.Namespace) -> int:
    """0 once ``session.done`` has come, 1 on an ``error`` event or a stream that ends without it."""
    switched = args.prompt_after_first_chunk is None
    expecting_media = False
    camera_updates = camera_interactions(json.loads(args.camera_updates)) if args.camera_updates else []
    started_at: float | None = None
    with connect(args.url, max_size=None) as ws, Path(args.output).open("wb") as out:
        ws.send(json.dumps(start_event(args)))
        while True:
            # Updates that are due go out between messages (a chunk arrives at least every chunk's time).
            while camera_updates and started_at is not None and time.monotonic() - started_at >= camera_updates[0][0]:
                ws.send(json.dumps(camera_updates.pop(0)[1]))
            message = ws.recv(timeout=RECEIVE_TIMEOUT_S)
            if isinstance(message, bytes):
                if not expecting_media:
                    print("ERROR binary message without chunk metadata")
                    return 1
                out.write(message)  # the init segment comes first: the file is a playable fragmented MP4
                expecting_media = False
                continue
            event = json.loads(message)
            kind = event.get("type")
            if kind == "video.start":
                started_at = time.monotonic()
                print(f"Stream started ({event.get('format')})")
            elif kind == "video.chunk_metadata":
                expecting_media = True
                print(f"[chunk {event['generation_chunk_index']}] frames={event['num_frames']} "
                      f"bytes={event['byte_length']} started={event['started_event_ids']} "
                      f"active={event['active_event_ids']} completed={event['completed_event_ids']}")  # fmt: skip
                if not switched:
                    ws.send(json.dumps(prompt_interaction(args.prompt_after_first_chunk, args.transition_chunks)))
                    switched = True
            elif kind == "session.interaction.queued":
                print(f"Interaction queued by server: {event.get('event_id')}")
            elif kind == "error":
                print(f"ERROR {event.get('code')}: {event.get('message')}")
                return 1
            elif kind == "session.done":
                print(f"Session complete: {event.get('chunks')} chunks")
                return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("url", help="ws://HOST:PORT/v1/realtime/video")
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt", default="a quiet meadow")
    parser.add_argument("--width", type=int)
    parser.add_argument("--height", type=int)
    parser.add_argument("--fps", type=int)
    parser.add_argument("--num-frames", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--image-reference", help="the first frame: a picture file, a URL, or file_id:NAME")
    parser.add_argument("--camera-updates", help='JSON list: [{"at": 1.0, "actions": ["w"]}, {"at": 2.0, "camera": '
                        '{"mode": "target", "data": {...}}, "transition_chunks": 2}]')  # fmt: skip
    parser.add_argument("--prompt-after-first-chunk", help="a new prompt, sent once the first chunk has come")
    parser.add_argument("--transition-chunks", type=int, default=1)
    parser.add_argument("--output", required=True, help="where the fMP4 stream is written")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
