"""scripts/gpu-check.sh end to end in its CPU mode, from a fresh clone of HEAD, as it will first meet a GPU.

The GPU machine gets a checkout, not an installed package, and no network; the
first GPU scripts failed there because Python ran with the checkout root on
``sys.path`` and its ``arstream/`` folder shadowed the package. This test runs
the one script the same way (a clone in a temporary folder, the script
installing that clone itself), on the CPU with tiny configs: the same code
path and the same JSON keys as on the GPU. The wheels step is skipped because
this venv already has every package (the script installs wheels only when an
import fails).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from arstream.programs import bench, gpu_check
from arstream.programs.gpu_check import carried_requirements

ROOT = Path(__file__).resolve().parents[2]
SERVE_KEYS = (
    "fps_total", "fps_per_session", "chunk_ms_p50", "chunk_ms_p99", "ttff_ms", "action_to_frame_ms_p50",
    "action_to_frame_ms_p99", "server_vs_runner_ratio", "server_chunks_per_s", "runner_chunks_per_s",
)  # fmt: skip
H264_KEYS = ("encode_ms_per_frame_p50", "encode_ms_per_frame_p99", "keyframe_bytes", "bytes_per_frame",
             "encode_ms_per_session_second", "sessions_per_core")  # fmt: skip


def fresh_clone(target: Path) -> Path:
    """A clone of this repository at its HEAD commit (what CI or the GPU machine would get; no work-tree edits)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    subprocess.run(["git", "clone", "--quiet", "--no-checkout", str(ROOT), str(target)], check=True)
    subprocess.run(["git", "checkout", "--quiet", "--detach", head.stdout.strip()], cwd=target, check=True)
    return target


def assert_positive(figures: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    for key in keys:
        value = figures[key]
        assert isinstance(value, (int, float)) and value > 0, f"{where}: {key} = {value!r}"


# Four processes each import torch and build their models; on a shared 2-core machine under load that can
# pass the suite's 300 s hang guard, so this test's guard is wider (it is no speed limit).
@pytest.mark.timeout(1200)
def test_gpu_check_runs_from_a_fresh_clone_in_cpu_mode(tmp_path: Path) -> None:
    clone = fresh_clone(tmp_path / "clone")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "PYTHONPATH": ""}
    env.pop("PYTHONSAFEPATH", None)  # the script must set it itself
    # From the clone's root, as the device tool runs commands: the folder that used to shadow the package.
    done = subprocess.run(["bash", "scripts/gpu-check.sh", "--cpu"], cwd=clone, env=env, capture_output=True, text=True)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]

    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert json.loads((out / "gpu-check.json").read_text()) == result  # the file that comes back from $OUT
    assert (out / "gpu-check.txt").read_text().strip().splitlines()[-1] == done.stdout.strip().splitlines()[-1]
    assert result["complete"] is True and result["errors"] == {} and result["device"] == "cpu"
    # The package ran from the script's own install of the clone: not this worktree's editable install, not the clone.
    package = Path(result["arstream_package"])
    assert not package.is_relative_to(ROOT) and not package.is_relative_to(clone), package
    assert package.name == "arstream" and result["arstream_modules_elsewhere"] == []

    assert_positive(result["h264"], H264_KEYS, "h264")
    assert (result["h264"]["width"], result["h264"]["height"]) == (640, 352)
    tiny = result["tiny_world"]
    assert tiny["sessions"] == 2 and tiny["server_sessions_per_round"] > 0
    assert_positive(tiny, SERVE_KEYS, "tiny_world")

    game = result["matrix_game"]
    assert game["options"]["config"] == "tiny" and game["skipped"] == {}
    assert sorted(game["sessions"], key=int) == ["1", "2"]
    for count, figures in game["sessions"].items():
        assert figures["sessions"] == int(count) and figures["model"] == "matrix-game-2"
        assert_positive(figures, (*SERVE_KEYS, "dit_ms_per_round_p50", "vae_ms_per_round_p50"), f"{count} sessions")
        # every session's chunks came back: frames per second add up across sessions
        assert figures["fps_total"] >= figures["fps_per_session"] * 0.9
    assert result["longlive"]["options"]["config"] == "tiny" and result["longlive"]["recaches"] == 2
    assert set(result["aims"]) >= {"one_session_fps_at_least_25", "server_vs_runner_at_least_0_95_everywhere"}
    assert result["aims"]["aggregate_fps_vs_one_session"].keys() == {"2"}

    devices = result["devices"]  # one replica over cpu,cpu (gloo) against one device, tiny configs
    assert devices["errors"] == {} and devices["skipped"] == {}, devices
    assert set(devices["variants"]) == {f"{m}/P={p}" for m in ("krea-realtime", "matrix-game-2") for p in (1, 2)}
    for name, figures in devices["variants"].items():
        assert_positive(figures, ("chunk_ms_p50", "forward_ms_p50", "video_fps"), name)
        two = name.endswith("P=2")
        assert (figures["collective_share"] > 0) == two and (figures["collective_bytes_per_chunk"] > 0) == two, name
    assert set(devices["speedup"]) == {"krea-realtime/P=2", "matrix-game-2/P=2"}

    waypoint = result["waypoint"]  # Waypoint-1.5's tiny config, one session and two batched, a few chunks each
    assert waypoint["errors"] == {} and waypoint["skipped"] == {}
    assert list(waypoint["variants"]) == ["tiny-1.5", "tiny-1.5/w8a8"]  # its own and int8 weights and activations
    for name, quantized in (("tiny-1.5", {}), ("tiny-1.5/w8a8", {"weights": "w8a8"})):
        figures = waypoint["variants"][name]
        assert figures["options"] == {"config": "tiny-1.5", "dtype": "float32", **quantized}, name
        assert figures["video_frames_per_chunk"] == 4 and sorted(figures["sessions"]) == ["1", "2"]
        for count, run in figures["sessions"].items():
            keys = ("chunk_ms_p50", "fps_total", "fps_per_session")
            assert_positive(run, keys, f"waypoint {name}, {count} session(s)")
            assert run["chunks"] == 2 and run["fps_per_session_vs_published"] is None  # published: 720p only
        # the plan's figure is what the runner was sized for: its weights and the pool for these sessions
        assert figures["plan_bytes"] == figures["plan_weights_bytes"] + figures["kv_budget_bytes"]
        assert figures["peak_allocated_bytes"] is None  # the allocator's figure is CUDA's
    plain, w8a8 = waypoint["variants"]["tiny-1.5"], waypoint["variants"]["tiny-1.5/w8a8"]
    assert w8a8["plan_weights_bytes"] < plain["plan_weights_bytes"]  # the plan counts the quantized block weights
    side = waypoint["side_by_side"]["tiny-1.5/w8a8"]  # w8a8's fps beside float32's, each session count
    assert sorted(side["sessions"]) == ["1", "2"] and side["published_fps"] is None
    for count, pair in side["sessions"].items():
        assert pair["fps_per_session"] == w8a8["sessions"][count]["fps_per_session"]
        assert pair["unquantized_fps_per_session"] == plain["sessions"][count]["fps_per_session"]

    fit = result["fit"]
    eager = {f"{m}/{w}/eager" for m in ("matrix-game-2", "longlive") for w in ("float32", "int8", "fp8")}
    assert set(fit["variants"]) == eager and fit["errors"] == {}, fit
    assert {name.replace("compiled", "eager") for name in fit["skipped"]} == eager  # compiled: the compile lane's
    for name, figures in fit["variants"].items():
        assert_positive(figures, ("load_s", "warmup_to_ready_s", "fps", "plan_weights_bytes"), name)
        assert figures["allocated_by_load_bytes"] is None  # the allocator's figure is CUDA's
    # the plan (meta device) and the loaded model agree where the dtypes are the same (longlive: one dtype)
    for weights in ("float32", "int8", "fp8"):
        figures = fit["variants"][f"longlive/{weights}/eager"]
        assert figures["plan_weights_bytes"] == figures["card_weights_bytes_on_device"], figures
    quantized = fit["variants"]["longlive/int8/eager"]["plan_weights_bytes"]
    assert quantized < fit["variants"]["longlive/float32/eager"]["plan_weights_bytes"]


def test_the_carried_wheels_are_what_the_gpu_image_lacks() -> None:
    names = {line.split("==")[0].split(">")[0].split("<")[0] for line in carried_requirements()}
    # the server's own stack, PyAV for h264, diffusers for matrix-game-2's VAE, and their dependencies
    assert {"fastapi", "starlette", "uvicorn", "websockets", "httptools", "pydantic-core", "pydantic-settings"} <= names
    assert {"simplejpeg", "jsonschema", "rpds-py", "opentelemetry-api", "av", "diffusers", "huggingface-hub"} <= names
    # what the image has (about 3 GB) is never carried
    assert not names & {"torch", "numpy", "pillow", "safetensors"} and not any(n.startswith("nvidia-") for n in names)


class FakeServeBench:
    """Stands in for bench serve's ServeBench in unit tests of the check's control flow (no server, no model)."""

    measured: list[int] = []

    def __init__(self, args: Any) -> None:
        self.args = args

    def __enter__(self) -> FakeServeBench:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def measure(self, sessions: int, *, chunks: int) -> dict[str, Any]:
        FakeServeBench.measured.append(sessions)
        figures = {"fps_total": 10.0 * sessions, "fps_per_session": 10.0, "action_to_frame_ms_p99": 100.0}
        return {"sessions": sessions, "chunks_per_session": chunks, "server_vs_runner_ratio": 1.0, **figures}


def test_a_session_count_projected_past_the_deadline_is_skipped_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "ServeBench", FakeServeBench)
    FakeServeBench.measured = []
    profile = gpu_check.profile_for("cuda")
    report: dict[str, Any] = {}
    saves: list[int] = []
    # no time left after the first count: every later one is projected past the deadline
    gpu_check.matrix_game_sweep(profile, "cuda", report, time_left_s=lambda: 0.0, save=lambda: saves.append(1))
    assert FakeServeBench.measured == [1]
    assert list(report["sessions"]) == ["1"] and report["sessions"]["1"]["chunks_per_session"] == 24
    assert sorted(report["skipped"], key=int) == ["2", "4", "8"] and "projected" in report["skipped"]["8"]
    assert len(saves) == 4  # the JSON is rewritten after each count, measured or skipped

    FakeServeBench.measured = []
    gpu_check.matrix_game_sweep(profile, "cuda", report := {}, time_left_s=lambda: math.inf, save=lambda: None)
    assert FakeServeBench.measured == [1, 2, 4, 8] and report["skipped"] == {}
    assert [report["sessions"][n]["chunks_per_session"] for n in ("1", "2", "4", "8")] == [24, 12, 6, 6]


def test_a_failed_phase_is_reported_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_model(profile: Any, device: str) -> dict[str, Any]:
        raise RuntimeError("tiny-world did not load")

    monkeypatch.setattr(gpu_check, "h264_figures", lambda *, frames, fps: {"encode_ms_per_frame_p50": 1.0})
    monkeypatch.setattr(gpu_check, "tiny_world_figures", no_model)
    monkeypatch.setattr(gpu_check, "devices_variant_figures", lambda *args: {"chunk_ms_p50": 1.0})
    monkeypatch.setattr(gpu_check, "waypoint_variant_figures", lambda *args: {"sessions": {}})
    monkeypatch.setattr(bench, "ServeBench", FakeServeBench)
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 1
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["errors"] == {"tiny_world": "RuntimeError: tiny-world did not load"}
    assert result["complete"] is False and result["tiny_world"] is None
    assert result["h264"] == {"encode_ms_per_frame_p50": 1.0} and list(result["matrix_game"]["sessions"]) == ["1", "2"]
    assert result["aims"]["aggregate_fps_vs_one_session"] == {"2": 2.0}
    assert result["aims"]["one_session_fps_at_least_25"] is False and result["aims"]["server_vs_runner_min"] == 1.0
    assert json.loads((tmp_path / "gpu-check.json").read_text()) == result


def test_the_longlive_phase_measures_normal_and_switch_chunks_on_the_cpu_with_the_tiny_config() -> None:
    profile = gpu_check.profile_for("cpu")
    figures = gpu_check.longlive_figures(profile, "cpu")
    assert figures["options"]["config"] == "tiny"
    assert figures["recaches"] == profile.longlive_chunks  # every switch chunk re-cached, no normal one did
    keys = ("normal_chunk_ms_p50", "normal_chunk_ms_p95", "switch_chunk_ms_p50", "switch_chunk_ms_p95",
            "recache_ms_p50", "text_encode_ms_p50", "fps")  # fmt: skip
    assert_positive(figures, keys, "longlive")
    assert figures["plays_at_fps"] == 16


def test_the_devices_phase_runs_krea_first_skips_what_the_machine_lacks_and_what_the_deadline_leaves_no_time_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    measured: list[str] = []

    def fake_variant(profile: Any, device: str, model: str, world: int) -> dict[str, Any]:
        measured.append(f"{model}/P={world}")
        return {"chunk_ms_p50": 100.0 / world}

    monkeypatch.setattr(gpu_check, "devices_variant_figures", fake_variant)
    monkeypatch.setattr(gpu_check, "device_count", lambda device: 2)  # a fake of the CUDA GPU count: two GPUs
    profile = gpu_check.profile_for("cuda")
    report: dict[str, Any] = {}
    gpu_check.devices_sweep(profile, "cuda", report, time_left_s=lambda: math.inf, save=lambda: None)
    assert measured == ["krea-realtime/P=1", "krea-realtime/P=2", "matrix-game-2/P=1", "matrix-game-2/P=2"]
    assert report["skipped"] == {f"{m}/P=4": "2 GPU(s) here (NCCL runs one rank a GPU)"
                                 for m in ("krea-realtime", "matrix-game-2")}  # fmt: skip
    assert report["speedup"] == {"krea-realtime/P=2": 2.0, "matrix-game-2/P=2": 2.0}
    assert report["variants"]["krea-realtime/P=1"] == {"chunk_ms_p50": 100.0}

    measured.clear()
    gpu_check.devices_sweep(profile, "cuda", report := {}, time_left_s=lambda: 0.0, save=lambda: None)
    assert measured == [] and all("left of --devices-deadline-s" in why for name, why in report["skipped"].items()
                                  if not name.endswith("P=4"))  # fmt: skip


def test_the_waypoint_phase_runs_after_devices_and_before_the_measured_phases_within_its_own_cap(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[str] = []
    waypoint_left: list[float] = []

    def sweep(name: str) -> Any:
        def fake(profile: Any, device: str, report: dict[str, Any], *, time_left_s: Any, save: Any) -> None:
            ran.append(name)
            if name == "waypoint":
                waypoint_left.append(time_left_s())

        return fake

    def figures(name: str) -> Any:
        def fake(*args: Any, **kwargs: Any) -> None:
            ran.append(name)

        return fake

    # fakes of every phase's measurement: only the order and the waypoint phase's time left are checked
    monkeypatch.setattr(gpu_check, "h264_figures", figures("h264"))
    monkeypatch.setattr(gpu_check, "tiny_world_figures", figures("tiny_world"))
    monkeypatch.setattr(gpu_check, "longlive_figures", figures("longlive"))
    for name in ("devices", "waypoint", "matrix_game", "decode_path", "fit"):
        monkeypatch.setattr(gpu_check, f"{name}_sweep", sweep(name))
    assert gpu_check.main(["--device", "cuda", "--out", str(tmp_path)]) == 0
    assert ran == ["h264", "devices", "waypoint", "tiny_world", "matrix_game", "decode_path", "longlive", "fit"]
    # its own cap, counted from its own start: the devices phase before it spends none of it
    assert gpu_check.profile_for("cuda").waypoint_deadline_s == 90.0 and 0 < waypoint_left[0] <= 90.0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(result).index("waypoint") == list(result).index("devices") + 1

    ran.clear()
    assert gpu_check.main(["--device", "cuda", "--waypoint-deadline-s", "5", "--out", str(tmp_path)]) == 0
    assert 0 < waypoint_left[1] <= 5.0


def test_the_waypoint_phase_runs_720p_first_and_names_what_its_deadline_leaves_no_time_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    measured: list[str] = []
    out_of_memory = {("1.5", None)}

    def fake_variant(profile: Any, device: str, config: str, dtype: str, weights: str | None) -> dict[str, Any]:
        measured.append(f"{config}/{weights or dtype}")
        if (config, weights) in out_of_memory:
            raise RuntimeError("CUDA out of memory")
        return {"sessions": {"1": {"fps_per_session": 2.0 if weights else 1.0}}}

    monkeypatch.setattr(gpu_check, "waypoint_variant_figures", fake_variant)
    profile = gpu_check.profile_for("cuda")
    assert profile.waypoint_sessions == (1, 4)
    report: dict[str, Any] = {}
    saves: list[int] = []
    with pytest.raises(RuntimeError, match="1 waypoint config"):
        gpu_check.waypoint_sweep(profile, "cuda", report, time_left_s=lambda: math.inf, save=lambda: saves.append(1))
    # 720p first, bf16 then w8a8; a variant that fails says why and the next still runs; the JSON is rewritten after
    # each; w8a8 has no bf16 figure beside it to compare with
    assert measured == ["1.5/bfloat16", "1.5/w8a8", "1.5-360p/bfloat16"] and len(saves) == 3
    assert report["errors"] == {"1.5": "RuntimeError: CUDA out of memory"} and list(report["variants"]) == [
        "1.5/w8a8", "1.5-360p"
    ]
    assert report["side_by_side"] == {}
    assert report["published_on"].startswith("RTX 5090")  # another card than the check's: the JSON says which

    measured.clear()
    out_of_memory.clear()
    gpu_check.waypoint_sweep(profile, "cuda", report := {}, time_left_s=lambda: math.inf, save=lambda: None)
    assert report["side_by_side"]["1.5/w8a8"] == {
        "sessions": {"1": {"fps_per_session": 2.0, "unquantized_fps_per_session": 1.0, "speedup": 2.0}},
        "published_fps": 72.0, "published_unquantized_fps": 56.0, "published_speedup": 1.286,
    }

    measured.clear()
    gpu_check.waypoint_sweep(profile, "cuda", report := {}, time_left_s=lambda: 0.0, save=lambda: None)
    skipped = ("1.5", "1.5/w8a8", "1.5-360p")
    assert measured == [] and report["skipped"] == {c: "0 s left of --waypoint-deadline-s" for c in skipped}
