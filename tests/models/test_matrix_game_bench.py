"""`arstream bench model --model matrix-game-2`: video frames counted as delivered, DiT/VAE/rest split, bytes per session."""

import json

import pytest

from arstream.cli import main

OPTIONS = '{"config": "tiny", "random_init": true}'


def test_bench_model_reports_the_split_and_counts_video_frames(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "model", "--model", "matrix-game-2", "--model-options", OPTIONS,
            "--streams", "2", "--chunks", "2", "--repeats", "1", "--threads", "1"]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["model"] == "matrix-game-2" and summary["fps"] > 0
    assert summary["dit_ms_p50"] > 0 and summary["vae_ms_p50"] > 0 and summary["rest_ms_p50"] >= 0
    assert summary["kv_bytes_per_session"] > 0 and summary["model_owned_bytes_per_session"] > 0
    one = [line.split() for line in lines if line.split()[1:2] == ["one"]]
    assert one and one[0][3] == "21"  # 9 video frames on the first chunk, then 12
    assert any(line.startswith("one stream, per chunk (median): DiT passes") for line in lines)
