"""`arstream bench runner` runs end to end and ends with its JSON summary line."""

import json

import pytest

from app.cli import main


def test_bench_runner_prints_a_json_summary_last(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "runner", "--chunks", "3", "--repeats", "2", "--threads", "1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert summary["bench"] == "runner" and summary["repeats"] == 2
    assert summary["runner_overhead_ratio"] > 0
    assert summary["runner_ms_per_chunk"] > 0 and summary["direct_ms_per_chunk"] > 0


def test_unknown_subcommand_prints_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    assert "usage: arstream" in capsys.readouterr().err
