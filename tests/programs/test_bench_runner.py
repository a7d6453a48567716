"""`arstream bench runner` and `bench model` run end to end and end with their JSON summary line."""

import json

import pytest

from arstream.cli import main


def test_bench_runner_prints_a_json_summary_last(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "runner", "--chunks", "3", "--repeats", "2", "--threads", "1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert summary["bench"] == "runner" and summary["repeats"] == 2
    assert summary["runner_overhead_ratio"] > 0
    assert summary["runner_ms_per_chunk"] > 0 and summary["direct_ms_per_chunk"] > 0


def test_unknown_bench_is_refused_with_the_list_of_benches(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "frobnicate"]) == 2
    assert "arstream bench: argument COMMAND: invalid choice: 'frobnicate' (choose from" in capsys.readouterr().err


def test_bench_model_compares_batched_streams_with_round_robin(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "model", "--streams", "2", "--chunks", "2", "--repeats", "2", "--threads", "1"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["streams"] == 2 and summary["fps"] > 0
    assert summary["fps_total_streams"] > 0 and summary["fps_total_batched"] > 0
    assert summary["batched_vs_round_robin_ratio"] > 0
    modes = [line.split()[1] for line in lines if line.split()[1:2] in (["round_robin"], ["batched"])]
    assert modes == ["round_robin", "batched", "batched", "round_robin"]  # alternating repetitions


def test_bench_model_takes_any_registered_model(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "model", "--model", "fake-kv", "--model-options", '{"session_capacity": 4}',
            "--streams", "2", "--chunks", "2", "--repeats", "1", "--threads", "1"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["model"] == "fake-kv" and summary["denoise_passes"] is None
    assert summary["fps"] > 0 and summary["batched_vs_round_robin_ratio"] > 0
