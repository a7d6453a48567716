"""``arstream plan``: its figures (built on the meta device) against what a loaded, served model allocates.

The plan sums the meta tensors' shapes; here the loaded model's bytes are its
tensors' storage on the CPU (each storage once, a quantized weight through its
data and scales), and the runner's pool is the tensors it allocated: not the
plan's arithmetic again. Then the CLI on the published 1.3B geometries: a
refusal that names what to change, and the same model fitting once changed.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from servers import fake_settings, running_server

from arstream.app.plan import PlanDoesNotFit, check_plan_fits, fit_plan
from arstream.app.settings import Settings
from arstream.cli import main
from arstream.models.registry import load_pipeline
from arstream.models.waypoint.pipeline import WaypointPipeline
from arstream.runner.runner import ARRunner
from arstream.runner.runtimes import shard_planned_pipeline
from arstream.runner.types import ParkingPolicy
from arstream.runner.types import RuntimeOptions

pytest.importorskip("torchao", reason="the quant extra (pip install 'arstream[quant]')")
pytestmark = pytest.mark.usefixtures("one_thread")

GIB = 2**30
TINY = {
    "matrix-game-2": {"config": "tiny", "random_init": True, "weights": "int8"},
    "longlive": {"config": "tiny", "random_init": True, "weights": "int8", "text_encoder_device": "cpu"},
    "krea-realtime": {"config": "tiny", "random_init": True, "weights": "int8", "text_encoder_device": "cpu"},
    "waypoint-1.5": {"config": "tiny-1.5", "random_init": True, "weights": "int8"},
}


def storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return [s for name in names for s in storages(getattr(tensor, name))]
    return [tensor.untyped_storage()]


def allocated(*modules: nn.Module | torch.Tensor) -> int:
    """Bytes of the distinct storages behind ``modules``' parameters and buffers (or the tensors given)."""
    seen: dict[int, int] = {}
    for item in modules:
        tensors = [item] if isinstance(item, torch.Tensor) else [*item.parameters(), *item.buffers()]
        for tensor in tensors:
            for storage in storages(tensor):
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def loaded_modules(pipeline: Any) -> dict[str, nn.Module]:
    modules = {"dit": pipeline.model}
    if isinstance(pipeline, WaypointPipeline):  # its own decoder and start-image encoder
        modules |= {"decoder": pipeline.decoder, "encoder": pipeline.encoder}
    elif hasattr(pipeline, "text"):
        modules |= {"text_encoder": pipeline.text.model, "vae": pipeline.vae.vae}
    else:
        modules |= {"vae": pipeline.vae.vae, "clip": pipeline._clip}
    return modules


@pytest.mark.parametrize("model", sorted(TINY))
def test_the_plans_weights_and_pool_are_what_a_loaded_model_allocates(model: str) -> None:
    settings = Settings(model=model, model_options=TINY[model], max_batch_sessions=2)
    plan = fit_plan(settings, gpu_memory_bytes=2 * GIB)
    assert plan.refusal is None and plan.session_capacity >= 1

    # on the CPU in the dtypes a GPU gets by default, as the plan assumes
    gpu_dtypes = {"dtype": "bfloat16", **({"vae_dtype": "float16"} if model == "matrix-game-2" else {})}
    pipeline = load_pipeline(model, "cpu", **TINY[model], **gpu_dtypes)
    modules = loaded_modules(pipeline)
    assert {c.name: c.bytes for c in plan.components} == {name: allocated(m) for name, m in modules.items()}
    dit = next(c for c in plan.components if c.name == "dit")
    assert dit.weights == "int8 (bfloat16 compute)"  # the plan is for a GPU: bf16 there by default
    # the pool: a runner on the CPU with the plan's budget allocates the bytes the plan counts
    runner = ARRunner.for_pipeline(
        pipeline,
        RuntimeOptions(
            device="cpu", kv_budget_bytes=plan.kv_budget_bytes, max_batch_sessions=2,
            rewind_seconds=settings.rewind_seconds, rewind_budget_bytes=settings.rewind_budget_bytes(),
            parking=ParkingPolicy(),
        ),
    )  # fmt: skip
    pool = runner.pool
    assert allocated(pool.kv, *pool.staging.values()) == plan.pool_bytes
    assert runner.session_capacity == plan.session_capacity


def test_the_text_encoder_off_the_gpu_is_not_counted_on_it() -> None:
    options = {"config": "tiny", "random_init": True}
    on_gpu = fit_plan(Settings(model="longlive", model_options=options), gpu_memory_bytes=2 * GIB)
    off = fit_plan(
        Settings(model="longlive", model_options={**options, "text_encoder_device": "cpu"}), gpu_memory_bytes=2 * GIB
    )
    encoder = next(c for c in off.components if c.name == "text_encoder")
    assert encoder.device == "cpu" and not encoder.on_gpu
    assert on_gpu.gpu_weights_bytes - off.gpu_weights_bytes == encoder.bytes > 0


def test_a_served_models_stats_name_each_components_device_and_the_plans_bytes() -> None:
    model, options = "longlive", TINY["longlive"]
    plan = fit_plan(Settings(model=model, model_options=options), gpu_memory_bytes=2 * GIB)
    with running_server(fake_settings(model=model, model_options={**options, "dtype": "bfloat16"})) as server:
        stats = httpx.get(server.base_url + "/v1/stats", timeout=30).json()
        card = httpx.get(server.base_url + "/v1/model", timeout=30).json()
    served = {c["name"]: (c["device"], c["bytes"]) for c in stats["components"]}
    assert served == {c.name: ("cpu", c.bytes) for c in plan.components}
    assert card["components"] == stats["components"] and card["kv_dtype"] == "bfloat16"


def plan_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, dict[str, Any]]:
    code = main(["plan", *args, "--json"])
    out = capsys.readouterr().out
    return code, out, json.loads(out.strip().splitlines()[-1])


def test_longlive_on_24_gb_is_refused_naming_what_to_change_and_fits_once_changed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, document = plan_cli(capsys, "--model", "longlive", "--model-options", '{"config": "1.3b"}',
                                   "--gpu-memory", "24GB")  # fmt: skip
    assert code == 1 and document["sessions"] == 0, out
    assert "does not fit" in out and 'weights "int8"' in out and 'text_encoder_device "cpu"' in out, out
    encoder = next(c for c in document["components"] if c["name"] == "text_encoder")
    assert encoder["device"] == "gpu" and 11 * 10**9 < encoder["bytes"] < 12 * 10**9  # umT5-XXL in bf16

    changed = '{"config": "1.3b", "weights": "int8", "text_encoder_device": "cpu"}'
    code, out, document = plan_cli(capsys, "--model", "longlive", "--model-options", changed, "--gpu-memory", "24GB",
                                   "--max-batch-sessions", "1", "--replicas", "2")  # fmt: skip
    assert code == 0 and document["refusal"] is None, out
    assert document["session_capacity"] >= 1 and document["sessions"] == 2 * document["session_capacity"]
    dit = next(c for c in document["components"] if c["name"] == "dit")
    assert dit["weights"] == "int8 (bfloat16 compute)" and dit["bytes"] < 0.55 * 2.84e9  # about half of bf16's


def test_serve_on_a_gpu_that_cannot_hold_a_session_is_refused_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    # a fake of the CUDA free-memory query only (this machine has no GPU): 20 GB free
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * 10**9, 24 * 10**9))
    settings = Settings(model="longlive", model_options={"config": "1.3b", "checkpoint": "/none"}, device="cuda")
    with pytest.raises(PlanDoesNotFit, match='does not fit the .* free on cuda.*try: weights "int8"'):
        check_plan_fits(settings)
    assert check_plan_fits(Settings(model="tiny-world")) is None  # CPU: nothing planned


def test_an_unplanned_model_and_a_bad_size_are_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "tiny-world", "--gpu-memory", "24GB"]) == 2
    assert "is not built on the meta device" in capsys.readouterr().err
    assert main(["plan", "--model", "longlive", "--gpu-memory", "lots"]) == 2
    assert "expected a size such as 24GiB" in capsys.readouterr().err


# ---- over P devices (serve's --devices): each device's figures -------------------------------------------------


def test_over_two_devices_the_plan_is_a_ranks_pool_with_half_the_heads() -> None:
    """The plan at P = 2 against a runner built on the CPU over a pipeline given rank 0's share of the heads, as a
    rank is: the pool it allocates, and its heads."""
    model, options = "krea-realtime", TINY["krea-realtime"]
    settings = Settings(model=model, model_options=options, max_batch_sessions=2, devices="cpu,cpu")
    plan = fit_plan(settings, gpu_memory_bytes=2 * GIB)
    whole = fit_plan(Settings(model=model, model_options=options, max_batch_sessions=2), gpu_memory_bytes=2 * GIB)
    assert plan.refusal is None and (plan.replica_devices, plan.kv_heads, plan.device_kv_heads) == (2, 2, 1)
    assert plan.gpu_weights_bytes == whole.gpu_weights_bytes  # the weights are whole on every device
    assert 2 * plan.block_bytes == whole.block_bytes

    pipeline: Any = load_pipeline(model, "cpu", **options, dtype="bfloat16")
    shard_planned_pipeline(pipeline, 2)
    runner = ARRunner.for_pipeline(
        pipeline,
        RuntimeOptions(
            device="cpu", kv_budget_bytes=plan.kv_budget_bytes, max_batch_sessions=2,
            rewind_seconds=settings.rewind_seconds, rewind_budget_bytes=settings.rewind_budget_bytes(),
            parking=ParkingPolicy(),
        ),
    )  # fmt: skip
    assert allocated(runner.pool.kv, *runner.pool.staging.values()) == plan.pool_bytes
    assert runner.session_capacity == plan.session_capacity
    assert runner.spec.num_kv_heads == 1


def test_krea_14b_over_devices_matches_a_hand_computation(capsys: pytest.CaptureFixture[str]) -> None:
    """Krea Realtime 14B at 480x832 in bf16 (40 layers, 40 heads of 128, 5120 wide, FFN 13824; 30x52 = 1560 tokens
    a latent frame, 3 a chunk, a 6-frame window) over 1, 2 and 4 devices of 141 GB."""
    options = '{"config": "14b", "weights": "int8", "session_capacity": 256}'
    documents, outs = {}, {}
    for world in (1, 2, 4):
        devices = [] if world == 1 else ["--devices", ",".join(f"cuda:{i}" for i in range(world))]
        code, out, document = plan_cli(capsys, "--model", "krea-realtime", "--model-options", options,
                                       "--gpu-memory", "141GB", "--max-batch-sessions", "1", *devices)  # fmt: skip
        assert code == 0, out
        documents[world], outs[world] = document, out
    # a KV block: layers x (K, V) x tokens x heads on the device x head size x 2 bytes
    for world, document in documents.items():
        assert document["block_bytes"] == 40 * 2 * 1560 * (40 // world) * 128 * 2
        assert document["device_kv_heads"] == 40 // world and document["gpus"] == world
    assert documents[2]["block_bytes"] == 638_976_000
    assert len({d["gpu_weights_bytes"] for d in documents.values()}) == 1  # whole on every device
    # the KV of a session (3 frames) halves with P; the model-owned state (VAE cache, prompts) does not
    per_session = [documents[w]["per_session_bytes"] for w in (1, 2, 4)]
    assert per_session[0] - per_session[1] == 3 * 638_976_000 == 2 * (per_session[1] - per_session[2])
    # activations at P = 2 (attention's, the larger): 2 T C + 3 (T/2) C + 6 T (C/2) + 2 K (C/2) + (T + K)(C/2)
    # + T (C/2), with T = 4680 queries, K = 9360 keys, C = 5120: 251,596,800 values in 2 bytes
    assert documents[2]["activation_bytes"] == 503_193_600
    assert documents[1]["activation_bytes"] > documents[2]["activation_bytes"] > documents[4]["activation_bytes"]
    assert documents[1]["session_capacity"] < documents[2]["session_capacity"] < documents[4]["session_capacity"]
    assert "each holds the weights whole and 20 of the 40 attention heads of every KV block" in outs[2], outs[2]


def test_a_plan_over_cpu_devices_calls_them_cpus_not_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    options = json.dumps(TINY["krea-realtime"])
    code, out, document = plan_cli(capsys, "--model", "krea-realtime", "--model-options", options,
                                   "--gpu-memory", "2GiB", "--devices", "cpu,cpu")  # fmt: skip
    assert code == 0 and document["gpus"] == 2, out
    assert "1 replica(s) of 2 devices (2 CPUs)" in out and "weights on each device" in out, out
    assert "GPU" not in out and " gpu " not in out, out


def test_the_plan_names_the_picture_size_and_the_kv_window_a_session_keeps(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A test config's picture is plain to see; so is the window, with the strided tail the released shape keeps
    (the 15 frames of its local window and, further back, the global window's frames on the dilation's beat)."""
    released = "its first 0 and last 15 frames, and of the last 127 the frames whose index is a multiple of 8"
    for options, picture, kept, frames in (
        ("{}", "128x72", "its first 0 and last 3 frames", 3),
        ('{"config": "1.5"}', "1280x720", released, 15 + 14),
    ):
        code, out, document = plan_cli(
            capsys, "--model", "waypoint-1.5", "--model-options", options, "--gpu-memory", "80GB"
        )
        assert out.startswith(f"plan: waypoint-1.5 {options} at {picture} on 1 GPU(s)"), out
        assert f"({frames} frames x " in out and f"\n  KV a session keeps between chunks: {kept}\n" in out, out
        assert (document["resident_frames"], document["kv_window"]) == (frames, kept)


def test_a_device_count_that_does_not_divide_the_heads_is_refused_naming_both(capsys: pytest.CaptureFixture[str]) -> None:
    for model, config, world, heads in (("krea-realtime", "14b", 3, 40), ("matrix-game-2", "1.3b", 8, 12)):
        devices = ",".join(f"cuda:{i}" for i in range(world))
        code = main(["plan", "--model", model, "--model-options", f'{{"config": "{config}"}}', "--gpu-memory", "80GB",
                     "--devices", devices])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2, err
        assert f"{world} devices cannot share the model's {heads} attention heads" in err, err


def test_a_model_whose_extra_is_not_installed_is_refused_in_one_line_naming_the_extra() -> None:
    """A fresh install (no extras) asked for a Wan model's plan: one line naming what to install, exit 2, no
    traceback. Run in an interpreter of its own where diffusers cannot be imported, as on such an install."""
    import subprocess
    import sys

    no_diffusers = (
        "import sys; sys.modules['diffusers'] = None; from arstream.cli import main; "
        "sys.exit(main(['plan', '--model', 'matrix-game-2', '--gpu-memory', '24GB']))"
    )
    done = subprocess.run([sys.executable, "-c", no_diffusers], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "arstream plan: matrix-game-2 cannot be built here: the Wan models need diffusers' AutoencoderKLWan: "
        "pip install 'arstream[wan]'"
    ]


def test_a_plan_of_a_bf16_wan_model_prints_no_library_warning(capfd: pytest.CaptureFixture[str]) -> None:
    """The plan's output is the plan: diffusers warned on casting the VAE to bf16 ("modules ... that should be kept
    in float32: []"), naming none, before every LongLive or Krea plan and start."""
    options = '{"config": "tiny", "dtype": "bfloat16"}'
    assert main(["plan", "--model", "longlive", "--model-options", options, "--gpu-memory", "80GB"]) == 0
    captured = capfd.readouterr()
    assert "plan: longlive" in captured.out
    assert "float32" not in captured.err, captured.err
