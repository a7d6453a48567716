"""A client of the realtime video dialect (``WS /v1/realtime/video``), written from docs/PROTOCOL.md's dialect section.

It starts one session, switches the prompt after the first chunk, writes the fMP4 stream it receives to a file and
prints one line per event, the way a user's script would. tests/test_realtime_video.py runs it as a separate
process against ``arstream serve``: the dialect as an outside client sees it.

    python tests/realtime_video_client.py ws://127.0.0.1:8000/v1/realtime/video --model fake-kv \\
        --width 64 --height 48 --num-frames 12 --prompt-after-first-chunk "a sunlit valley" --output stream.mp4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from websockets.sync.client import connect

RECEIVE_TIMEOUT_S = 60.0


def start_event(args: argparse.Namespace) -> dict[str, Any]:
    start: dict[str, Any] = {"type": "session.start", "model": args.model, "prompt": args.prompt}
    for field in ("width", "height", "fps", "num_frames"):
        if getattr(args, field) is not None:
            start[field] = getattr(args, field)
    return start


def prompt_interaction(prompt: str, transition_chunks: int) -> dict[str, Any]:
    event = {"prompt": prompt, "transition_chunks": transition_chunks}
    return {"type": "session.interaction", "interaction": {"event_id": "prompt-1", "event": event}}


def run(args: argparse.Namespace) -> int:
    """0 once ``session.done`` has come, 1 on an ``error`` event or a stream that ends without it."""
    switched = args.prompt_after_first_chunk is None
    expecting_media = False
    with connect(args.url, max_size=None) as ws, Path(args.output).open("wb") as out:
        ws.send(json.dumps(start_event(args)))
        while True:
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
                print(f"Stream started ({event.get('format')})")
            elif kind == "video.chunk_metadata":
                expecting_media = True
                print(f"[chunk {event['generation_chunk_index']}] frames={event['num_frames']} "
                      f"bytes={event['byte_length']} started={event['started_event_ids']}")  # fmt: skip
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
    parser.add_argument("--prompt-after-first-chunk", help="a new prompt, sent once the first chunk has come")
    parser.add_argument("--transition-chunks", type=int, default=1)
    parser.add_argument("--output", required=True, help="where the fMP4 stream is written")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
