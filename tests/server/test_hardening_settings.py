"""Configuration footguns: refused at start-up with a message that says what is wrong."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import pytest
from pydantic import ValidationError

from arstream.app.settings import Settings
from servers import REPO_ROOT, fake_settings, running_server, session_client


@pytest.mark.parametrize("token", ["", "  ", "a,,b"])
def test_empty_auth_tokens_are_refused(token: str) -> None:
    with pytest.raises(ValidationError, match="auth token"):
        Settings(auth_token=token)


def test_empty_auth_token_in_the_environment_stops_serve_before_it_starts() -> None:
    env = {**os.environ, "ARSTREAM_AUTH_TOKEN": ""}
    done = subprocess.run(
        [sys.executable, "-m", "arstream", "serve", "--model", "fake-kv", "--port", "0"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    assert "auth token is empty" in done.stderr and "ARSTREAM_AUTH_TOKEN" in done.stderr


def test_origins_are_normalised_as_browsers_send_them() -> None:
    settings = Settings(allowed_origins="HTTPS://App.Example:443/, http://LOCALHOST:8000, http://[::1]:80")
    assert settings.origin_allow_list() == ["https://app.example", "http://localhost:8000", "http://[::1]"]


@pytest.mark.parametrize(
    "origin", ["app.example", "ftp://app.example", "https://app.example/path", "https://app.example:99999"]
)
def test_origins_that_can_never_match_are_refused(origin: str) -> None:
    with pytest.raises(ValidationError, match="allowed origin"):
        Settings(allowed_origins=origin)


def test_a_mixed_case_origin_setting_admits_the_browser() -> None:
    with running_server(fake_settings(allowed_origins="https://App.Example")) as server:

        async def scenario() -> dict[str, Any]:
            origin = "https://app.example"
            async with session_client(server.ws_url, origin=origin, start={}) as client:
                assert client.ready is not None
                return client.ready

        assert asyncio.run(scenario())["type"] == "ready"


@pytest.mark.parametrize(
    ("field", "value"), [("allowed_hosts", "https://app.example"), ("forwarded_allow_ips", "proxy")]
)
def test_hosts_and_proxy_addresses_are_checked(field: str, value: str) -> None:
    with pytest.raises(ValidationError, match=field):
        Settings(**{field: value})


def test_connection_cap_beyond_the_open_file_limit_is_refused() -> None:
    """An explicit cap the process cannot hold is an error at start-up, not EMFILE under load."""
    done = subprocess.run(
        ["prlimit", "--nofile=256:256", sys.executable, "-m", "arstream", "serve", "--model", "fake-kv",
         "--port", "0", "--max-connections", "100000"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    assert "max_connections 100000 does not fit the open-file limit" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("bind", "origin", "host", "refused"),
    [
        # A loopback-only server: loopback names of this port only (a rebinding page's Host matches its Origin).
        ("127.0.0.1", "http://127.0.0.1:8000", "127.0.0.1:8000", False),
        ("127.0.0.1", "http://evil.example:8000", "evil.example:8000", True),
        # Listening beyond loopback: the page's own origin, whatever name it was served as.
        ("0.0.0.0", "http://192.168.1.5:8000", "192.168.1.5:8000", False),
        ("0.0.0.0", "https://box.lan", "box.lan", False),
        ("0.0.0.0", "http://evil.example", "192.168.1.5:8000", True),
        ("0.0.0.0", "ftp://192.168.1.5:8000", "192.168.1.5:8000", True),
    ],
)
def test_default_origin_policy_is_the_pages_own_origin(bind: str, origin: str, host: str, refused: bool) -> None:
    from starlette.datastructures import Headers

    from arstream.app import auth

    headers = Headers({"origin": origin, "host": host})
    refusal = auth.origin_refusal(headers, [], 8000, beyond_loopback=auth.listens_beyond_loopback(bind))
    assert (refusal is not None) == refused, refusal
    if refusal is not None:
        assert "origin" in refusal and "token" not in refusal


def test_loopback_binds_are_told_apart() -> None:
    from arstream.app.auth import listens_beyond_loopback

    assert [listens_beyond_loopback(h) for h in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.1.1")] == [False] * 5
    assert [listens_beyond_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.5")] == [True] * 3
