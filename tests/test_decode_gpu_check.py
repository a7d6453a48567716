"""The GPU check's decode-path phase, rehearsed on the CPU with the tiny config (the same code path and keys)."""

from __future__ import annotations

import math
from typing import Any

from arstream.programs import gpu_check

KEYS = ("fps_per_session", "dit_ms_per_round", "decode_ms_per_round", "overlap_ms_per_round", "rounds")


def test_the_decode_path_phase_measures_both_decoders_serial_and_overlapped() -> None:
    profile = gpu_check.profile_for("cpu")
    report: dict[str, Any] = {}
    gpu_check.decode_path_sweep(profile, "cpu", report, time_left_s=lambda: math.inf, save=lambda: None)
    assert report["skipped"] == {} and report["options"]["config"] == "tiny"
    assert sorted(report["variants"]) == ["taehv/overlapped", "taehv/serial", "wan-vae/overlapped", "wan-vae/serial"]
    for name, by_sessions in report["variants"].items():
        assert sorted(by_sessions) == ["1", "2"], name
        for figures in by_sessions.values():
            assert set(figures) == set(KEYS)
            assert figures["fps_per_session"] > 0 and figures["dit_ms_per_round"] > 0 and figures["rounds"] > 0
            if name.endswith("serial"):  # the decode runs inside the forward: counted as DiT, never apart
                assert figures["decode_ms_per_round"] == 0 and figures["overlap_ms_per_round"] == 0
            else:
                assert figures["decode_ms_per_round"] > 0


def test_a_variant_past_the_deadline_is_skipped_and_says_so() -> None:
    profile = gpu_check.profile_for("cpu")
    report: dict[str, Any] = {}
    left = iter([math.inf] + [1.0] * 3)  # time for the first variant; then less than it took
    gpu_check.decode_path_sweep(profile, "cpu", report, time_left_s=lambda: next(left), save=lambda: None)
    assert list(report["variants"]) == ["wan-vae/serial"]
    assert sorted(report["skipped"]) == ["taehv/overlapped", "taehv/serial", "wan-vae/overlapped"]
    assert "the last variant took" in report["skipped"]["taehv/serial"]


def test_no_variant_starts_past_the_deadline() -> None:
    report: dict[str, Any] = {}
    gpu_check.decode_path_sweep(gpu_check.profile_for("cpu"), "cpu", report, time_left_s=lambda: 0.0, save=lambda: None)
    assert report["variants"] == {} and len(report["skipped"]) == 4
    assert report["skipped"]["wan-vae/serial"] == "nothing measured yet, 0 s left"
