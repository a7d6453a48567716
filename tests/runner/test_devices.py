"""Every command that runs a model takes ``--device`` (a GPU when one is lent; here the CPU path runs)."""

from __future__ import annotations

import json

import pytest

from arstream.cli import main

COMMANDS = (("bench", "model"), ("bench", "runner"), ("bench", "serve"), ("eval", "tiny-world"), ("train", "tiny-world"))


@pytest.mark.parametrize("words", COMMANDS, ids=[" ".join(w) for w in COMMANDS])
def test_each_model_command_documents_device(words: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*words, "--help"]) == 0
    assert "--device" in capsys.readouterr().out


def test_bench_runner_runs_both_sides_on_the_device_it_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "runner", "--device", "cpu", "--chunks", "2", "--repeats", "1", "--threads", "1"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["device"] == "cpu" and summary["runner_ms_per_chunk"] > 0
