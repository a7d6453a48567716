"""``arstream serve``: flags over environment, the listening line, SIGINT shutdown, load failures."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from arstream.app.settings import CPU_KV_BUDGET_BYTES, Settings, settings_from_argv
from servers import REPO_ROOT, server_process, session_client

# A hang guard for subprocesses that should exit on their own.
EXIT_GUARD_S = 120


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ARSTREAM_"):
            monkeypatch.delenv(name)
    settings = settings_from_argv([])
    assert (settings.host, settings.port, settings.model, settings.device) == ("127.0.0.1", 8000, "tiny-world", "cpu")
    assert (settings.max_pending_ticks, settings.idle_timeout_s, settings.start_timeout_s) == (4, 60.0, 10.0)
    assert settings.max_batch_sessions is None and settings.resolved_max_batch_sessions() == 1
    assert Settings(device="cuda").resolved_max_batch_sessions() == 4
    assert (settings.codec, settings.jpeg_quality, settings.max_message_bytes) == ("jpeg", 80, 65536)
    assert settings.auth_token is None and settings.origin_allow_list() == []
    assert settings.resolved_kv_budget_bytes() == CPU_KV_BUDGET_BYTES == 256 * 1024 * 1024
    assert settings.ws_max_size > settings.max_message_bytes


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARSTREAM_MAX_PENDING_TICKS", "2")
    monkeypatch.setenv("ARSTREAM_IDLE_TIMEOUT_S", "7")
    monkeypatch.setenv("ARSTREAM_MODEL_OPTIONS", '{"session_capacity": 5}')
    settings = settings_from_argv(
        ["--max-pending-ticks", "3", "--model-options", '{"compute_delay_s": 0.05, "session_capacity": 2}',
         "--allowed-origins", "http://a.example, http://b.example", "--kv-budget-bytes", "1048576"]
    )
    assert settings.max_pending_ticks == 3
    assert settings.idle_timeout_s == 7.0
    assert settings.model_options == {"compute_delay_s": 0.05, "session_capacity": 2}
    assert settings.origin_allow_list() == ["http://a.example", "http://b.example"]
    assert settings.resolved_kv_budget_bytes() == 1048576


def test_max_batch_sessions_from_environment_and_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARSTREAM_MAX_BATCH_SESSIONS", "1")
    assert settings_from_argv([]).max_batch_sessions == 1
    assert settings_from_argv(["--max-batch-sessions", "8"]).max_batch_sessions == 8
    with pytest.raises(ValueError, match="max_batch_sessions"):
        settings_from_argv(["--max-batch-sessions", "0"])


def test_cuda_budget_defaults_to_the_memory_fraction() -> None:
    assert Settings(device="cuda", memory_fraction=0.5).resolved_kv_budget_bytes() is None


@pytest.mark.parametrize(
    "argv",
    [["--model-options", "not json"], ["--model-options", "[1]"], ["--codec", "png"], ["--port", "x"]],
    ids=["options-not-json", "options-not-object", "bad-codec", "bad-port"],
)
def test_bad_flags_exit_with_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        settings_from_argv(argv)
    assert exited.value.code == 2
    assert "arstream serve" in capsys.readouterr().err


def test_out_of_range_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="jpeg_quality"):
        settings_from_argv(["--jpeg-quality", "0"])


def test_serve_subprocess_prints_listening_line_and_shuts_down_gracefully_on_sigint() -> None:
    env = {"ARSTREAM_IDLE_TIMEOUT_S": "9", "ARSTREAM_MAX_PENDING_TICKS": "2"}
    args = ["--model", "fake-kv", "--max-pending-ticks", "3", "--codec", "raw",
            "--model-options", '{"session_capacity": 2}']
    with server_process(args, env=env) as server:
        listening = [line for line in server.output if "ARSTREAM_LISTENING" in line]
        assert listening == [f"ARSTREAM_LISTENING http://127.0.0.1:{server.port}\n"]
        assert server.get("/readyz").status_code == 200
        assert server.stats()["kv"]["session_capacity"] == 2

        async def scenario() -> tuple[dict[str, Any], Any]:
            async with session_client(server.ws_url, start={}) as client:
                assert client.ready is not None
                await client.send(type="tick", tick_id=1)
                await client.recv_chunk()
                assert server.process is not None
                server.process.send_signal(signal.SIGINT)
                return client.ready, await client.closed_by_server()

        ready, closed = asyncio.run(scenario())
        assert ready["codec"] == "raw"
        assert ready["limits"]["max_pending_ticks"] == 3  # the flag beats the environment
        assert ready["limits"]["idle_timeout_s"] == 9.0  # the environment beats the default
        assert closed.messages == [{"type": "closed", "reason": "server_shutdown"}]
        assert closed.code == 1001
        assert server.process is not None
        assert server.process.wait(EXIT_GUARD_S) == 0


def test_serve_with_an_unknown_model_exits_nonzero() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "arstream", "serve", "--model", "no-such-model", "--port", "0"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=EXIT_GUARD_S,
    )
    assert result.returncode == 1
    assert "unknown model 'no-such-model'" in result.stderr
    assert "ARSTREAM_LISTENING" not in result.stdout


def test_torch_threads_leave_a_core_free_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert Settings().resolved_torch_threads() == 7
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert Settings().resolved_torch_threads() == 1
    assert settings_from_argv(["--torch-threads", "3"]).resolved_torch_threads() == 3
    monkeypatch.setenv("ARSTREAM_TORCH_THREADS", "2")
    assert Settings().resolved_torch_threads() == 2
