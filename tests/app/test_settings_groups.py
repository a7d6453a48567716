"""Settings in groups: ``arstream serve --help`` lists them group by group, every name that worked before the
groups still works (flag and ``ARSTREAM_*`` variable, flat attribute), and ``--rewind-points`` is accepted
with a one-line deprecation that says what it reads as."""

from __future__ import annotations

import os

import pytest

from arstream import cli
from arstream.app import settings as settings_module
from arstream.app.settings import SETTING_GROUPS, Settings, settings_from_argv

# Every setting as it was named on the day the groups came in (issue 32): each is still a flag, a variable
# and a flat attribute. A rename keeps the old name accepted (see --rewind-points) instead of removing it here.
NAMES_BEFORE_THE_GROUPS = (
    "host port model model_options device torch_threads kv_budget_bytes memory_fraction max_pending_ticks "
    "max_batch_sessions decode_overlap rewind_seconds rewind_budget_mib runtime admission encode_threads "
    "batch_wait_fraction encoder_nice keep_freed_memory idle_timeout_s start_timeout_s auth_token allowed_origins "
    "codec jpeg_quality small_frame_jpeg_quality max_message_bytes max_start_image_bytes max_start_image_pixels "
    "max_start_image_jpeg_scans start_image_timeout_s max_messages_per_s message_burst max_frames_per_s frame_burst "
    "frame_flood_ban_s max_send_buffer_bytes max_control_items max_sessions max_sessions_per_client "
    "max_sessions_per_token max_viewers_per_session viewer_stall_timeout_s max_viewer_encodings max_connections "
    "max_connections_per_client connection_rate_per_client connection_burst_per_client max_unstarted_connections "
    "max_unstarted_connections_per_client max_header_bytes request_head_timeout_s close_timeout_s "
    "refuse_before_upgrade forwarded_allow_ips allowed_hosts log_level shutdown_grace_s replica_id cluster_secret "
    "cluster_peers cluster_peers_file drain_timeout_s resume_grace_s agent_port"
).split()

# One setting of each group, as a variable's text and as the value it reads as.
ONE_OF_EACH_GROUP = {
    "port": ("8123", 8123),
    "runtime": ("arstream", "arstream"),
    "max_pending_ticks": ("2", 2),
    "rewind_budget_mib": ("8", 8.0),
    "park_after_s": ("30", 30.0),
    "jpeg_quality": ("70", 70),
    "allowed_hosts": ("App.Example", "app.example"),
    "idle_timeout_s": ("7", 7.0),
    "message_burst": ("9", 9),
    "max_start_image_pixels": ("1000", 1000),
    "max_header_bytes": ("2048", 2048),
    "drain_timeout_s": ("5", 5.0),
    "record_retention_s": ("60", 60.0),
}


@pytest.fixture(autouse=True)
def no_arstream_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ARSTREAM_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(settings_module, "_NOTES_TOLD", set())  # each test sees its own deprecation lines


def test_every_setting_is_in_exactly_one_group() -> None:
    grouped = [name for group in SETTING_GROUPS for name in group.model_fields]
    assert sorted(grouped) == sorted(Settings.model_fields)
    assert len(grouped) == len(set(grouped))


def test_every_name_from_before_the_groups_is_still_a_flat_setting() -> None:
    assert set(NAMES_BEFORE_THE_GROUPS) <= set(Settings.model_fields)
    defaults = Settings()
    for name in NAMES_BEFORE_THE_GROUPS:
        getattr(defaults, name)  # a flat attribute, whatever its group


def test_the_sample_covers_every_group() -> None:
    groups_sampled = {group for group in SETTING_GROUPS for name in ONE_OF_EACH_GROUP if name in group.model_fields}
    assert groups_sampled == set(SETTING_GROUPS)


@pytest.mark.parametrize("name", sorted(ONE_OF_EACH_GROUP))
def test_a_variable_and_a_flag_of_each_group_are_read(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    text, expected = ONE_OF_EACH_GROUP[name]
    assert getattr(settings_from_argv([f"--{name.replace('_', '-')}", text]), name) == expected
    monkeypatch.setenv(f"ARSTREAM_{name.upper()}", text)
    assert getattr(settings_from_argv([]), name) == expected


def test_help_lists_each_group_with_its_own_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    titles = [f"\n{group.group_title} settings:\n" for group in SETTING_GROUPS]
    starts = [out.index(title) for title in titles]
    assert starts == sorted(starts), "groups in SETTING_GROUPS' order"
    for group, start, end in zip(SETTING_GROUPS, starts, [*starts[1:], len(out)]):
        section = out[start:end]
        assert " ".join((group.__doc__ or "").split())[:40] in " ".join(section.split())
        for name in group.model_fields:
            assert f"\n  --{name.replace('_', '-')}" in section, (group.group_title, name)


def test_rewind_points_0_reads_as_rewind_off_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    settings = settings_from_argv(["--rewind-points", "0"])
    assert settings.rewind_seconds == 0
    assert capsys.readouterr().err.splitlines() == [
        "arstream serve: --rewind-points 0 (ARSTREAM_REWIND_POINTS) is deprecated: read as --rewind-seconds 0 "
        "(rewind off)"
    ]


def test_rewind_points_in_the_environment_is_ignored_beside_the_horizon(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ARSTREAM_REWIND_POINTS", "8")
    assert settings_from_argv([]).rewind_seconds == 30
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert "--rewind-points 8 (ARSTREAM_REWIND_POINTS) is deprecated and ignored" in err
    assert "the rewind horizon is --rewind-seconds 30" in err


def test_an_explicit_horizon_wins_over_rewind_points(capsys: pytest.CaptureFixture[str]) -> None:
    assert settings_from_argv(["--rewind-points", "0", "--rewind-seconds", "5"]).rewind_seconds == 5
    assert "--rewind-seconds 5" in capsys.readouterr().err


def test_a_deprecation_is_said_once_a_process(capsys: pytest.CaptureFixture[str]) -> None:
    # serve reads its settings twice (the precheck before torch, then run()): the line comes out once.
    assert cli.main(["serve", "--rewind-points", "0", "--host", "no-such-host.invalid"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert [line for line in lines if "deprecated" in line] == [
        "arstream serve: --rewind-points 0 (ARSTREAM_REWIND_POINTS) is deprecated: read as --rewind-seconds 0 "
        "(rewind off)"
    ]
    assert settings_from_argv(["--rewind-points", "0"]).rewind_seconds == 0
    assert capsys.readouterr().err == ""


def test_a_bad_rewind_points_is_refused_like_any_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--rewind-points", "-1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "arstream serve: --rewind-points (ARSTREAM_REWIND_POINTS): Input should be greater than or equal to 0, got -1"
    ]
