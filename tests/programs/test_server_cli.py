"""The ``arstream`` command tree and ``arstream serve``: help at every level, flags derived from Settings
over the environment, one-line errors before anything starts, the listening line, SIGINT shutdown."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, get_args

import pytest

from arstream import __version__
from arstream import cli
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


def test_max_sessions_is_a_flag_of_its_own() -> None:
    # Once a prefix of --max-sessions-per-client/-per-token, so argparse called it ambiguous.
    assert settings_from_argv(["--max-sessions", "1"]).max_sessions == 1
    assert settings_from_argv([]).max_sessions is None


def test_log_level_flag_is_case_insensitive_as_the_variable_is() -> None:
    assert settings_from_argv(["--log-level", "WARNING"]).log_level == "warning"


def test_max_batch_sessions_from_environment_and_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARSTREAM_MAX_BATCH_SESSIONS", "1")
    assert settings_from_argv([]).max_batch_sessions == 1
    assert settings_from_argv(["--max-batch-sessions", "8"]).max_batch_sessions == 8
    with pytest.raises(ValueError, match="max_batch_sessions"):
        settings_from_argv(["--max-batch-sessions", "0"])


def test_cuda_budget_defaults_to_the_memory_fraction() -> None:
    assert Settings(device="cuda", memory_fraction=0.5).resolved_kv_budget_bytes() is None


# ---- the command tree -----------------------------------------------------------------

HELP_LEVELS = [[], ["bench"], ["train"], ["eval"]] + [list(command.words) for command in cli.COMMANDS]


@pytest.mark.parametrize("words", HELP_LEVELS, ids=lambda words: " ".join(words) or "arstream")
def test_help_at_every_level_exits_0_and_describes_the_commands(
    words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([*words, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {' '.join(['arstream', *words])} ")
    below = [c for c in cli.COMMANDS if list(c.words[: len(words)]) == words and len(c.words) == len(words) + 1]
    for command in below:  # a level lists each command under it with its summary
        assert command.words[-1] in out and command.summary in out
    if not below:
        assert "--" in out.split("options:", 1)[1].replace("--help", "")  # a leaf lists its own options


def test_an_option_value_that_starts_with_a_dash_is_read_as_the_value() -> None:
    # `arstream client URL --keys "-*2,d*3"` (idle first) was refused: argparse took "-*2,d*3" for a flag.
    parsers: dict[tuple[str, ...], cli.CommandParser] = {}
    parser = cli.build_parser(lambda command: command.words == ("client",), parsers)
    argv = cli.attach_dash_values(["client", "ws://h", "--keys", "-*2,d*3", "--out", "o"], parsers[("client",)])
    args = parser.parse_args(argv)
    assert (args.keys, str(args.out)) == ("-*2,d*3", "o")


@pytest.mark.parametrize("command", cli.COMMANDS, ids=lambda command: " ".join(command.words))
def test_help_reads_as_plain_text(command: cli.Command) -> None:
    parsers: dict[tuple[str, ...], cli.CommandParser] = {}
    cli.build_parser(lambda candidate: candidate == command, parsers)
    text = parsers[command.words].format_help()
    assert "``" not in text and not re.search(r":[a-z]+:`", text), text


def test_serve_help_does_not_import_torch() -> None:
    # `arstream serve --help` once took 7-14 s on a loaded machine: it imported torch for the options.
    code = (
        "import sys; from arstream.cli import main; code = main(['serve', '--help']); "
        "sys.stdout.flush(); print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=EXIT_GUARD_S)
    assert result.stdout.splitlines()[-1] == "NO-TORCH 0", result.stdout[-500:] + result.stderr
    assert "--max-sessions" in result.stdout


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"arstream {__version__}"


@pytest.mark.parametrize(
    "command",
    [[str(Path(sys.executable).with_name("arstream"))], [sys.executable, "-m", "arstream"]],
    ids=["console-script", "python-m"],
)
def test_the_installed_command_runs_the_tree(command: list[str]) -> None:
    """The console script (pyproject's entry point) and ``python -m arstream`` both reach ``arstream.cli``."""
    version = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=EXIT_GUARD_S)
    assert (version.returncode, version.stdout.strip()) == (0, f"arstream {__version__}"), version.stderr
    help_text = subprocess.run([*command, "train", "--help"], capture_output=True, text=True, timeout=EXIT_GUARD_S)
    assert help_text.returncode == 0, help_text.stderr
    assert "tiny-world-decoder" in help_text.stdout


def test_serve_flags_are_the_settings_fields_with_their_descriptions(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps help text
    for name, field in Settings.model_fields.items():
        assert f"--{name.replace('_', '-')}" in out, name
        assert field.description is not None and " ".join(field.description.split()) in out, name
    assert "--jpeg-quality N JPEG quality when `start` names none (>= 1, <= 100) [default: 80]" in out
    codecs = ",".join(get_args(Settings.model_fields["codec"].annotation))  # a Literal: its values are the choices
    assert f"--codec {{{codecs}}}" in out and "--model-options JSON" in out


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["serve", "--jpeg-quality", "0"], "--jpeg-quality (ARSTREAM_JPEG_QUALITY): Input should be greater than or equal to 1"),
        (["serve", "--model", "nope"], "--model (ARSTREAM_MODEL): unknown model 'nope'; expected one of"),
        (["serve", "--model-options", "not json"], "argument --model-options: expected JSON"),
        (["serve", "--model-options", "config=tiny"], """expected JSON such as '{"config": "tiny"}', got 'config=tiny'"""),
        (["serve", "--model-options", "[1]"], "argument --model-options: expected a JSON dict, got list"),
        (["serve", "--codec", "png"], "--codec (ARSTREAM_CODEC): Input should be 'jpeg', 'raw'"),
        (["serve", "--port", "x"], "argument --port: invalid int value: 'x'"),
        (["serve", "--max-batch-sessions", "0"], "--max-batch-sessions (ARSTREAM_MAX_BATCH_SESSIONS): Input should be"),
        (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'"),
        (["bench"], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1, captured.err
    assert captured.err.startswith(f"arstream {argv[0]}: " if argv[0] == "serve" else "arstream")
    assert complaint in captured.err


def test_a_bad_environment_variable_is_one_line_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ARSTREAM_IDLE_TIMEOUT_S", "-1")
    assert cli.main(["serve"]) == 2
    assert capsys.readouterr().err == (
        "arstream serve: --idle-timeout-s (ARSTREAM_IDLE_TIMEOUT_S): Input should be greater than 0, got '-1'\n"
    )


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


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--jpeg-quality", "0"], "Input should be greater than or equal to 1, got 0"),
        (["--model-options", '{"model": "/no/such/weights"}', "--model", "vllm-omni:LingBotWorldCausalDMDPipeline",
          "--runtime", "vllm-omni"], "the weights path '/no/such/weights' does not exist"),
    ],
    ids=["unknown-model", "bad-quality", "vllm-omni-weights-missing"],
)
def test_serve_refuses_bad_settings_in_one_line_before_binding_the_port(argv: list[str], complaint: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "arstream", "serve", *argv, "--port", "0", "--log-level", "info"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=EXIT_GUARD_S,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1, result.stderr  # no traceback, and uvicorn never logged a start
    assert result.stderr.startswith(f"arstream serve: {argv[0]} ")
    assert complaint in result.stderr  # the reason itself, not only the flag's name


# `arstream serve` with torch made unimportable: a refusal that needs no torch comes out, one that waits for it
# fails with an ImportError instead. (Fast refusals, checked without timing anything.) PyAV is made
# unimportable too, as on a machine installed without the video extra.
WITHOUT_TORCH = (
    "import sys; sys.modules['torch'] = None; sys.modules['av'] = None; "
    "from arstream.cli import main; sys.exit(main(sys.argv[1:]))"
)


def serve_without_torch(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, "serve", *argv],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=EXIT_GUARD_S,
        env=env,
    )


def test_a_port_in_use_is_one_line_naming_it_before_torch_loads() -> None:
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = serve_without_torch("--port", str(port), "--log-level", "info")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"arstream serve: cannot listen on 127.0.0.1:{port}: the port is in use; choose another with --port"
    ], result.stderr
    assert "ARSTREAM_LISTENING" not in result.stdout


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--port", "99999"], "--port (ARSTREAM_PORT): Input should be less than or equal to 65535, got 99999"),
        # TEST-NET-1: an address no machine here holds; the refusal names the host, not the port
        (["--host", "192.0.2.1", "--port", "8123"], "192.0.2.1 is not an address of this machine; choose another with --host"),
        (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid' is not an address or a name"),
        (["--codec", "h264"], "the h264 codec needs"),
    ],
)
def test_flag_and_address_errors_are_refused_before_torch_loads(argv: list[str], said: str) -> None:
    result = serve_without_torch(*argv)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.splitlines()) == 1 and said in result.stderr, result.stderr


def test_serve_with_a_model_that_fails_to_load_exits_nonzero() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "arstream", "serve", "--model", "fake-kv", "--model-options", '{"no_such_option": 1}',
         "--port", "0"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=EXIT_GUARD_S,
    )
    assert result.returncode == 1
    said = [line for line in result.stderr.splitlines() if "no_such_option" in line]
    assert len(said) == 1 and "--model-options" in said[0], result.stderr
    assert "Traceback" not in result.stderr, "a bad option is one line, not a traceback"
    assert "Uvicorn running" not in result.stderr, "a server whose model failed never says it is running"
    assert "ARSTREAM_LISTENING" not in result.stdout


def test_torch_threads_leave_a_core_free_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert Settings().resolved_torch_threads() == 7
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert Settings().resolved_torch_threads() == 1
    assert settings_from_argv(["--torch-threads", "3"]).resolved_torch_threads() == 3
    monkeypatch.setenv("ARSTREAM_TORCH_THREADS", "2")
    assert Settings().resolved_torch_threads() == 2


@pytest.mark.parametrize(("cores", "load", "threads"), [(2, 0.1, 1), (2, 1.5, 1), (16, 0.0, 15), (16, 9.5, 6), (16, 40, 1)])
def test_default_threads_are_the_cores_free_now(
    monkeypatch: pytest.MonkeyPatch, cores: int, load: float, threads: int
) -> None:
    # On a loaded 2-core machine two threads ran ten times slower than one; a busy 16-core host keeps its free cores.
    from arstream.runner.threads import default_torch_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    assert default_torch_threads() == threads


def test_small_frames_get_a_higher_default_jpeg_quality() -> None:
    settings = settings_from_argv([])
    assert settings.default_jpeg_quality({"width": 64, "height": 64}) == 95
    assert settings.default_jpeg_quality({"width": 640, "height": 352}) == 80
    assert settings.default_jpeg_quality({}) == 80  # a card without a frame size: the general default
    tuned = settings_from_argv(["--jpeg-quality", "70", "--small-frame-jpeg-quality", "90"])
    assert (tuned.default_jpeg_quality({"width": 8, "height": 8}), tuned.default_jpeg_quality({})) == (90, 70)


def test_listening_on_every_interface_announces_the_lan_urls() -> None:
    from arstream.app.address import lan_addresses, network_lines

    assert network_lines("127.0.0.1", 8000) == [], "a loopback server says nothing about the network"
    with server_process(["--model", "fake-kv", "--host", "0.0.0.0"]) as server:
        port = server.port
        expected = network_lines("0.0.0.0", port)
        deadline = 600  # polls of 0.05 s: a hang guard, not a speed check
        while not any(expected[0] in line for line in server.output) and deadline:
            deadline -= 1
            time.sleep(0.05)
        printed = "".join(server.output)
    assert expected[0] in printed, printed
    for address in lan_addresses():
        assert f"http://{address}:{port}/" in expected[0] and not address.startswith("127.")
    # Without a token anyone on that network can play: the banner says how to ask for one.
    assert "Anyone who can reach this address can play: add --auth-token TOKEN" in printed, printed
    assert "Players need the access token (--auth-token)" in network_lines("0.0.0.0", 8000, token_required=True)[-1]


@pytest.mark.parametrize("has_pyav", [False, True])
def test_without_pyav_the_start_says_what_to_install_as_info_not_a_warning(
    has_pyav: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The README's install has no PyAV: its note is the first line a stranger reads, so it reads as a choice.
    from arstream.app import server, video

    monkeypatch.setattr(video, "h264_available", lambda: has_pyav)
    with caplog.at_level("DEBUG", logger="arstream.server"):
        server.note_optional_pages()
    if has_pyav:
        assert caplog.records == []
        return
    (record,) = caplog.records
    assert record.levelname == "INFO", record.levelname
    note = record.getMessage()
    assert "/realtime-video.html" in note and "pip install 'arstream[video]'" in note, note
    assert "missing" not in note and "is off" not in note, note


def test_a_plain_start_opens_with_the_address_and_says_its_capacity_parked_sessions_included(tmp_path: Path) -> None:
    # An install without PyAV (a stand-in `av` that cannot be imported): its optional-page note comes after the
    # address, and with parking on the capacity line says the parked sessions too, as /v1/stats counts them.
    (tmp_path / "av").mkdir()
    (tmp_path / "av" / "__init__.py").write_text("raise ImportError('no PyAV in this install')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    args = ["--model", "fake-kv", "--park-budget-bytes", str(64 << 20)]
    with server_process(args, env) as server:
        stats = server.stats()
        deadline = 600  # polls of 0.05 s: a hang guard, not a speed check
        while not any("optional:" in line for line in server.output) and deadline:
            deadline -= 1
            time.sleep(0.05)
        printed = list(server.output)
    ours = [line for line in printed if "uvicorn" not in line.lower() and not line.startswith("INFO:")]
    first = next(i for i, line in enumerate(ours) if "open http" in line or "optional:" in line)
    assert "open http" in ours[first], ours
    held, parked = stats["kv"]["session_capacity"], stats["parking"]["park_capacity"]
    assert parked > 0
    line = next(line for line in printed if line.startswith("Sessions: "))
    assert f"room for {held} at once" in line and f"{parked} more parked in host memory" in line, line
    # the pool's own line leads with what it means (memory, sessions, what each remembers, rewind in seconds)
    pool = next(line for line in printed if "model memory (KV pool): " in line)
    resident = stats["parking"]["resident_capacity"]
    assert re.search(rf"\d+ MiB, room for {resident} sessions", pool), pool
    assert "each remembers its first" in pool and "back to 30 s (none older than 36 s)" in pool, pool
