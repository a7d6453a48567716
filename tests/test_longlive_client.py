"""``arstream client --prompt A --prompt-at N B`` against a real server with LongLive (tiny, random weights)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from servers import server_process

from arstream.programs import client

OPTIONS = json.dumps({"config": "tiny", "random_init": True})


def test_prompt_at_switches_the_prompt_at_that_tick_and_says_which_chunk_applied_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with server_process(["--model", "longlive", "--model-options", OPTIONS, "--torch-threads", "1"]) as server:
        server.wait_ready()
        start_free = server.stats()["kv"]["blocks_free"]
        args = [server.base_url, "--keys", "-*5", "--codec", "raw", "--out", str(tmp_path / "out"),
                "--prompt", "a red fox in the snow", "--prompt-at", "3", "a city street at night"]  # fmt: skip
        code = client.main(args)
        output = capsys.readouterr().out
        assert code == 0, output
        # sent just before tick 3; the server applies an input at the next chunk that starts, which may be a
        # chunk already queued (the client keeps up to max_pending_ticks - 1 ticks in flight)
        applied = re.search(r"prompt 'a city street at night' applied at chunk (\d+)", output)
        assert applied is not None, output
        assert 1 <= int(applied.group(1)) <= 3
        assert len(list((tmp_path / "out").glob("frame_*.png"))) == 9 + 4 * 12
        server.settled(start_free)


@pytest.mark.parametrize("tick", ["5", "-1", "x"])
def test_prompt_at_refuses_a_tick_outside_the_key_script(tick: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = client.main(["ws://127.0.0.1:9/v1/sessions", "--keys", "-*5", "--out", "/tmp/unused", "--prompt-at", tick, "B"])
    assert code == 2
    assert "--prompt-at takes a tick 0..4 of the key script" in capsys.readouterr().err
