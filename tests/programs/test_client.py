"""The example client, its key-script parser, the client wire helpers and the serve benchmark.

Integration tests run the real server (``python -m arstream serve``) on a free
loopback port with the fake-kv pipeline. That fake paints every pixel of a
frame with (R: a KV-derived value, G: the frame's absolute position, B: a bit
per held key: w=1, a=2, s=4, d=8), so saved frames show exactly which chunk and
which controls they came from.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import websockets
from PIL import Image

from arstream.app import wire
from arstream.programs import bench, client, client_lib
from arstream.models.fake import KEYS
from servers import LiveServer, server_process

KEY_BITS = {key: 1 << index for index, key in enumerate(KEYS)}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with server_process(["--model", "fake-kv", "--model-options", '{"compute_delay_s": 0.005}']) as live:
        yield live


# ---- key script ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("d*20", [client.KeySegment(("d",), 20)]),
        ("w+d*5,-*3", [client.KeySegment(("w", "d"), 5), client.KeySegment((), 3)]),
        ("none*2, a * 4", [client.KeySegment((), 2), client.KeySegment(("a",), 4)]),
        ("s", [client.KeySegment(("s",), 1)]),
        ("NONE*1", [client.KeySegment((), 1)]),
    ],
)
def test_parse_key_script(script: str, expected: list[client.KeySegment]) -> None:
    assert client.parse_key_script(script) == expected


@pytest.mark.parametrize(
    ("script", "complaint"),
    [
        ("", "empty segment"),
        ("d*2,,w*1", "empty segment"),
        ("d*x", "must be an integer"),
        ("d*0", "at least 1"),
        ("d*-2", "at least 1"),
        ("w+*2", "empty key name"),
        ("w+w*2", "repeated"),
    ],
)
def test_parse_key_script_rejects(script: str, complaint: str) -> None:
    with pytest.raises(client.KeyScriptError, match=complaint):
        client.parse_key_script(script)


def test_keys_per_tick_expands_counts_in_order() -> None:
    segments = client.parse_key_script("d*2,-*1,w+a*2")
    assert client.keys_per_tick(segments) == [("d",), ("d",), (), ("w", "a"), ("w", "a")]


# ---- wire helpers -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("typed", "token", "expected"),
    [
        ("ws://127.0.0.1:8000/v1/sessions", None, "ws://127.0.0.1:8000/v1/sessions"),
        ("http://127.0.0.1:8000", None, "ws://127.0.0.1:8000/v1/sessions"),
        ("https://example.com/", None, "wss://example.com/v1/sessions"),
        ("127.0.0.1:9000", "s3cret", "ws://127.0.0.1:9000/v1/sessions?token=s3cret"),
        ("ws://h:1/v1/sessions?token=old", "new", "ws://h:1/v1/sessions?token=new"),
    ],
)
def test_session_url(typed: str, token: str | None, expected: str) -> None:
    assert client_lib.session_url(typed, token=token) == expected


def test_session_url_rejects_other_schemes() -> None:
    with pytest.raises(ValueError, match="scheme"):
        client_lib.session_url("ftp://127.0.0.1:8000")


def _frame_message(codec: int, payload: bytes, *, width: int = 2, height: int = 1, magic: bytes = b"ARF1") -> bytes:
    return struct.pack("<4sBBHIIHH", magic, codec, 1, 1, 7, 42, width, height) + payload


def test_parse_frame_reads_every_header_field() -> None:
    header, payload = wire.parse_frame(_frame_message(wire.Codec.RAW, bytes(range(6))))
    assert header == wire.FrameHeader(
        codec=wire.Codec.RAW, last_in_chunk=True, frame_index=1, chunk_index=7, tick_id=42, width=2, height=1
    )
    image = wire.decode_payload(header, payload)
    assert image.shape == (1, 2, 3)
    assert image.tolist() == [[[0, 1, 2], [3, 4, 5]]]


@pytest.mark.parametrize(
    ("message", "complaint"),
    [
        (b"ARF1", "shorter than"),
        (_frame_message(wire.Codec.RAW, bytes(6), magic=b"XXXX"), "magic"),
        (_frame_message(9, bytes(6)), "codec id"),
        (_frame_message(wire.Codec.RAW, bytes(5)), "raw payload is 5 bytes"),
    ],
)
def test_parse_frame_rejects(message: bytes, complaint: str) -> None:
    with pytest.raises(wire.WireError, match=complaint):
        wire.parse_frame(message)


def test_messages_are_strict_json() -> None:
    assert json.loads(client_lib.tick_message(3, reset=True)) == {"type": "tick", "tick_id": 3, "reset": True}
    assert json.loads(client_lib.input_message(5, controls={"keys": ["w"]})) == {
        "type": "input",
        "event_id": 5,
        "controls": {"keys": ["w"]},
    }
    with pytest.raises(ValueError, match="tick_id"):
        client_lib.tick_message(2**32)
    with pytest.raises(ValueError, match="event_id"):
        client_lib.input_message(-1)


# ---- the client against a real server -----------------------------------------------


def _saved_frames(out: Path) -> list[np.ndarray]:
    paths = sorted(out.glob("frame_*.png"))
    return [np.asarray(Image.open(path).convert("RGB")) for path in paths]


def test_client_saves_every_frame_and_prints_latencies(
    server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = server.get("/v1/model").json()
    ticks = 3 + 2 + 1
    code = client.main([server.base_url, "--keys", "d*3,w+a*2,-*1", "--out", str(tmp_path / "out")])
    output = capsys.readouterr().out
    assert code == 0, output
    frames = _saved_frames(tmp_path / "out")
    assert len(frames) == ticks * model["frames_per_chunk"]
    assert {frame.shape for frame in frames} == {(model["height"], model["width"], 3)}
    assert "time to first frame:" in output
    assert "chunk latency" in output and "p50" in output and "p90" in output and "p99" in output
    # Three distinct held-key sets, so three inputs, each applied by some chunk.
    assert "action-to-frame" in output and "n=3" in output
    assert "frames/s:" in output


def test_raw_frames_show_the_held_keys_in_order(
    server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = client.main([server.ws_url, "--codec", "raw", "--keys", "d*3,-*3", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr()
    frames = _saved_frames(tmp_path)
    assert len(frames) == 12
    # G is the frame's absolute position: every frame arrived, once, in order.
    assert [int(frame[0, 0, 1]) for frame in frames] == list(range(12))
    blue = [int(frame[0, 0, 2]) for frame in frames]
    # The "d" input went out before tick 0. The "no key" input went out with tick 3, after
    # chunk 0 had arrived, so chunk 0 shows d and ticks 3..5 show no key; ticks 1-2 may show either.
    assert blue[:2] == [KEY_BITS["d"]] * 2
    assert blue[6:] == [0] * 6
    assert set(blue[2:6]) <= {0, KEY_BITS["d"]}


def test_client_writes_a_video_when_pyav_is_installed(
    server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    av = pytest.importorskip("av")
    assert client.main([server.base_url, "--keys", "s*4", "--out", str(tmp_path)]) == 0
    assert "saved video" in capsys.readouterr().out
    with av.open(str(tmp_path / client.VIDEO_NAME)) as container:
        decoded = list(container.decode(video=0))
    assert len(decoded) == 8


def test_client_reports_a_server_error_clearly(
    server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = client.main([server.base_url, "--keys", "x*2", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 1
    assert "invalid_controls" in captured.err
    assert not list(tmp_path.glob("*.png"))


def test_client_rejects_a_bad_key_script_before_connecting(capsys: pytest.CaptureFixture[str]) -> None:
    # Port 9 (discard) is never contacted: the script error comes first.
    assert client.main(["ws://127.0.0.1:9/v1/sessions", "--keys", "d*0", "--out", "/nonexistent"]) == 2
    assert "at least 1" in capsys.readouterr().err


def test_a_server_not_running_is_said_with_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as bound:  # bound, never listening: a connection to it is refused
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}"
        assert client.main([url, "--keys", "w", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"arstream client: nothing listens at {url}: start the server there (arstream serve)"), err
    assert "Errno" not in err


def test_client_leaves_no_kv_behind(server: LiveServer, baseline: int, tmp_path: Path) -> None:
    assert client.main([server.base_url, "--keys", "w*3", "--out", str(tmp_path)]) == 0
    # The worker thread releases the session just after `closed` goes out: wait for it.
    stats = server.settled(baseline)
    assert stats["kv"]["blocks_used"] == 0
    assert stats["kv"]["blocks_free"] == stats["kv"]["blocks_total"]


# ---- the serve benchmark ------------------------------------------------------------


def test_bench_serve_ends_with_a_summary_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "fake-kv", "--sessions", "2", "--chunks", "6", "--repeat", "1"]
    assert bench.main([*argv, "--model-options", '{"compute_delay_s": 0.005}', "--kv-budget-bytes", "4194304"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    for key in (
        "server_vs_runner_ratio",
        "sessions",
        "fps_per_session",
        "ttff_ms",
        "chunk_ms_p50",
        "chunk_ms_p99",
        "action_to_frame_ms_p50",
        "action_to_frame_ms_p99",
    ):
        assert isinstance(summary[key], (int, float)), key
    assert summary["sessions"] == 2
    assert summary["server_vs_runner_ratio"] > 0
    assert sum(line.startswith("  session ") for line in lines) == 2


def test_client_sends_the_token_and_reports_unauthorized(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with server_process(["--model", "fake-kv", "--auth-token", "t0ken"]) as secured:
        assert client.main([secured.base_url, "--keys", "a*2", "--out", str(tmp_path / "no")]) == 1
        assert "unauthorized" in capsys.readouterr().err
        assert client.main([secured.base_url, "--token", "t0ken", "--keys", "a*2", "--out", str(tmp_path / "ok")]) == 0
        assert len(list((tmp_path / "ok").glob("frame_*.png"))) == 4


def test_a_refusal_that_closes_before_start_is_reported_with_its_code() -> None:
    """The server may send ``error`` and close before the client's ``start`` goes out (CI hit this race).

    The client waits until the connection is closed, so ``start`` always meets a closed socket here.
    """

    async def start_after_refusal(url: str) -> None:
        async with websockets.connect(client_lib.session_url(url)) as ws:
            await ws.wait_closed()
            await client_lib.Session(ws).start()

    with server_process(["--model", "fake-kv", "--auth-token", "t0ken"]) as secured:
        with pytest.raises(client_lib.ServerError) as refused:
            asyncio.run(start_after_refusal(secured.base_url))
    assert refused.value.code == "unauthorized"


def test_keys_for_a_model_that_takes_none_are_refused_in_words_before_any_tick(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # LongLive (tiny, random weights) is steered by its prompt: its controls take no keys.
    options = json.dumps({"config": "tiny", "random_init": True})
    with server_process(["--model", "longlive", "--model-options", options, "--torch-threads", "1"]) as live:
        code = client.main([live.base_url, "--keys", "d*3", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "longlive takes no keys" in err and "--prompt-at" in err and "invalid_controls" not in err
    assert not list(tmp_path.glob("*.png"))


def test_takes_keys_reads_the_model_cards_controls() -> None:
    assert client_lib.takes_keys({"controls": {"properties": {"keys": {}}, "additionalProperties": False}})
    assert not client_lib.takes_keys({"controls": {"properties": {}, "additionalProperties": False}})
    assert client_lib.takes_keys({"controls": {"type": "object"}})  # room for fields it does not name
    assert client_lib.takes_keys({})
    # A card whose inputs map key codes to another field (Waypoint's button ids) takes keys there.
    mapped = {
        "controls": {"properties": {"buttons": {}}, "additionalProperties": False},
        "inputs": {"buttons": {"kind": "keys", "codes": {"KeyW": 87, "Space": 32, "Digit1": 49, "ArrowUp": 38}}},
    }
    assert client_lib.takes_keys(mapped)
    keys = client_lib.key_input(mapped)
    assert keys.controls(["w", "space", "1", "up", "ArrowUp"]) == {"buttons": [87, 32, 49, 38, 38]}
    with pytest.raises(client_lib.KeyNotTaken, match="'q'"):
        keys.controls(["w", "q"])
    assert client_lib.key_input({}).controls(["w", "d"]) == {"keys": ["w", "d"]}  # names as they are


def test_a_key_script_holds_the_mouse_buttons_a_card_maps() -> None:
    """Mouse buttons go by the card's ``mouse_buttons`` (keyed by MouseEvent.button), as the page sends them."""
    card = {
        "controls": {"properties": {"buttons": {}}, "additionalProperties": False},
        "inputs": {"buttons": {"kind": "keys", "codes": {"KeyW": 87}, "mouse_buttons": {"0": 1, "2": 2}}},
    }
    keys = client_lib.key_input(card)
    assert keys.controls(["w", "mouse_left"]) == {"buttons": [87, 1]}
    assert keys.controls(["Mouse_Right"]) == {"buttons": [2]}
    with pytest.raises(client_lib.KeyNotTaken, match=r"'mouse_middle' \(it takes e\.g\. .*mouse_left, mouse_right\)"):
        keys.controls(["mouse_middle"])
    unmapped = dict(card, inputs={"buttons": {"kind": "keys", "codes": {"KeyW": 87}}})
    with pytest.raises(client_lib.KeyNotTaken, match="'mouse_left'"):
        client_lib.key_input(unmapped).controls(["mouse_left"])
