"""waypoint-1.5 on the paged runner equals a dense reference of the published engine; its loader reads the
published layout and refuses a file that does not fit; batching and parking change nothing."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file

from arstream.app.plan import fit_plan
from arstream.app.settings import Settings
from arstream.models.registry import load_pipeline
from arstream.models.wan.components import module_bytes
from arstream.models.waypoint.config import WaypointConfig, config_to_yaml, get_config
from arstream.models.waypoint.decoder import Decoder
from arstream.models.waypoint.encoder import AEEncoder
from arstream.models.waypoint.loading import WaypointWeightsError, load_waypoint, random_weights
from arstream.models.waypoint.pipeline import WaypointPipeline, control_vector
from arstream.runner.rewind_schedule import RewindSchedule
from arstream.runner.runner import ARRunner
from arstream.runner.types import ChunkResult, ParkingPolicy, TickRequest
from waypoint_reference import ReferenceWaypoint, reference_decode
from waypoint_schedule import SEEDS, controls_for, tick

BUDGET = 16 << 20
CHUNKS = 12  # the 4-frame window slides eight times; positions stay inside the 24-frame rotary table
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread
Files = dict[str, dict[str, torch.Tensor]]  # what write_published wrote: "model" and "decoder" tensors
Published = tuple[Path, Files]


def weight_normed(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An autoencoder half's tensors as the published file stores them: each convolution's weight as (g, v), v
    rescaled per output channel so that only a correct weight-norm bake gives the weight back."""
    out: dict[str, torch.Tensor] = {}
    convs = {n for n, m in module.named_modules() if isinstance(m, torch.nn.Conv2d)}
    generator = torch.Generator().manual_seed(7)
    for key, value in module.state_dict().items():
        stem = key.removesuffix(".weight")
        if key.endswith(".weight") and stem in convs:
            shape = [value.shape[0]] + [1] * (value.dim() - 1)
            g = value.flatten(1).norm(dim=1).view(shape)
            out[f"{stem}.parametrizations.weight.original0"] = g.clone()
            out[f"{stem}.parametrizations.weight.original1"] = value * (1 + torch.rand(shape, generator=generator))
        else:
            out[key] = value.clone()
    return out


def encoder_conf(cfg: WaypointConfig) -> dict[str, Any]:
    """The tiny encoder's encoder_conf.yml: RGB plus a depth channel (given as zeros), stages of its own."""
    return {**cfg.ae, "channels": 4, "encoder_blocks_per_stage": [2, 1]}


def write_published(root: Path, cfg: WaypointConfig, seed: int = 0) -> Files:
    """Random weights in the published layout: config.yaml + model.safetensors, ae/decoder_conf.yml +
    ae/decoder.safetensors, ae/encoder_conf.yml + ae/encoder.safetensors. Returns what was written (the reference
    reads it)."""
    model, decoder = random_weights(cfg, seed)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(config_to_yaml(cfg))
    # every layer's copy of the shared noise projections, as the published file names them (cloned: safetensors
    # stores no shared tensors)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    save_file(weights, str(root / "model.safetensors"))
    (root / "ae").mkdir(exist_ok=True)
    (root / "ae" / "decoder_conf.yml").write_text(yaml.safe_dump({"model": dict(cfg.ae)}))
    assert isinstance(decoder, Decoder)
    decoder_file = weight_normed(decoder)
    save_file(decoder_file, str(root / "ae" / "decoder.safetensors"))
    encoder = AEEncoder(encoder_conf(cfg), cfg.latent_shape[1:])
    encoder.init_random(seed + 5)
    (root / "ae" / "encoder_conf.yml").write_text(yaml.safe_dump({"model": encoder_conf(cfg)}))
    encoder_file = weight_normed(encoder)
    save_file(encoder_file, str(root / "ae" / "encoder.safetensors"))
    return {"model": weights, "decoder": decoder_file, "encoder": encoder_file}


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Published:
    root = tmp_path_factory.mktemp("waypoint")
    return root, write_published(root, get_config("tiny"))


@pytest.fixture(scope="module")
def pipeline(published: Published) -> WaypointPipeline:
    """Sessions that start from noise (``from_noise``): the generation path alone; start images have their own
    tests (test_waypoint_seed.py)."""
    return load_waypoint(weights_path=published[0], from_noise=True)


def reference_rollout(
    pipeline: WaypointPipeline, files: Files, controls: list[dict[str, Any]], seed: int, window: int | None = None
) -> tuple[list[torch.Tensor], list[np.ndarray]]:
    cfg = pipeline.cfg
    ref = ReferenceWaypoint(cfg, files["model"], files["decoder"], window=window)
    generator = torch.Generator().manual_seed(seed)
    latents, frames = [], []
    with torch.inference_mode():
        for c in controls:
            latent = ref.gen_frame(torch.randn(cfg.latent_shape, generator=generator), control_vector(c, cfg))
            latents.append(latent)
            frames.append(ref.decode(latent, (cfg.image_height, cfg.image_width)).numpy())
    return latents, frames


def test_served_latents_and_frames_equal_the_dense_reference(pipeline: WaypointPipeline, published: Published) -> None:
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET)
    latents: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    frames: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    for c in range(CHUNKS):
        for session in ("a", "b"):  # interleaved: each chunk regathers its history from the pool
            result = runner.execute_tick(tick(session, c))
            assert isinstance(result, ChunkResult)
            frames[session].append(result.frames[0])
            latents[session].append(pipeline.last_latents[session].clone())
    files = published[1]
    for session in ("a", "b"):
        want_latents, want_frames = reference_rollout(
            pipeline, files, [controls_for(session, c) for c in range(CHUNKS)], SEEDS[session]
        )
        for c in range(CHUNKS):
            torch.testing.assert_close(latents[session][c], want_latents[c], rtol=1e-4, atol=1e-4,
                                       msg=f"session {session} chunk {c}")
            # uint8 frames: rounding may move a pixel by one level
            assert np.abs(frames[session][c].astype(int) - want_frames[c].astype(int)).max() <= 1, (session, c)
    # negative controls: a longer window, other controls or other noise give other latents
    controls = [controls_for("a", c) for c in range(CHUNKS)]
    wider, _ = reference_rollout(pipeline, files, controls, SEEDS["a"], window=7)
    torch.testing.assert_close(wider[2], latents["a"][2], rtol=1e-4, atol=1e-4)  # nothing has left the window yet
    assert not torch.allclose(wider[-1], latents["a"][-1], atol=1e-3)
    other, _ = reference_rollout(pipeline, files, [controls_for("b", c) for c in range(CHUNKS)], SEEDS["a"])
    assert not torch.allclose(other[-1], latents["a"][-1], atol=1e-3)
    still = [dict(c, mouse=[0.0, 0.0]) for c in controls]
    unmoved, _ = reference_rollout(pipeline, files, still, SEEDS["a"])
    assert not torch.allclose(unmoved[-1], latents["a"][-1], atol=1e-3)
    for session in ("a", "b"):
        runner.close_session(session)
    assert pipeline.session_ids() == []


# Layer 1 is global (period 2 from offset 1): six frames, every second one kept; layers 0 and 2 see two frames.
MIXED = replace(get_config("tiny"), local_window=2, global_window=6, global_pinned_dilation=2, global_attn_period=2,
                global_attn_offset=1)
MIXED_CHUNKS = 14  # the global window slides eight times; positions stay inside the 24-frame rotary table


@pytest.fixture(scope="module")
def mixed_published(tmp_path_factory: pytest.TempPathFactory) -> Published:
    root = tmp_path_factory.mktemp("waypoint-mixed")
    return root, write_published(root, MIXED)


@pytest.fixture(scope="module")
def mixed_pipeline(mixed_published: Published) -> WaypointPipeline:
    return load_waypoint(weights_path=mixed_published[0], from_noise=True)


def test_per_layer_windows_equal_the_reference_batched_out_of_phase(
    mixed_pipeline: WaypointPipeline, mixed_published: Published
) -> None:
    """Dilated global and local layers: the session keeps the local window and the global one's frames on its beat,
    and each layer masks what it does not see. Session a runs a frame ahead of b, so once batched the rows keep
    different frames of the dilated layer."""
    pipeline, files = mixed_pipeline, mixed_published[1]
    assert [pipeline.cfg.layer_window(layer) for layer in range(3)] == [(2, 1), (6, 2), (2, 1)]
    spec = pipeline.kv_cache_spec()  # the local window dense, the global one strided behind it
    assert (spec.window_frames, spec.strided_window_frames, spec.frame_stride) == (2, 6, 2)
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET, max_batch_sessions=2)
    latents: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    runner.execute_tick(tick("a", 0))
    latents["a"].append(pipeline.last_latents["a"].clone())
    for c in range(MIXED_CHUNKS - 1):
        for result in runner.execute([tick("a", c + 1), tick("b", c)]):
            assert isinstance(result, ChunkResult)
        for session in ("a", "b"):
            latents[session].append(pipeline.last_latents[session].clone())
    assert runner.stats().batched_forwards_total >= 6  # batched once both histories are the whole window

    def reference(session: str, cfg: WaypointConfig, window: int | None = None) -> list[torch.Tensor]:
        ref = ReferenceWaypoint(cfg, files["model"], files["decoder"], window=window)
        generator = torch.Generator().manual_seed(SEEDS[session])
        with torch.inference_mode():
            return [ref.gen_frame(torch.randn(cfg.latent_shape, generator=generator),
                                  control_vector(controls_for(session, c), cfg)) for c in range(len(latents[session]))]

    for session in ("a", "b"):
        want = reference(session, MIXED)
        for c, (got, expected) in enumerate(zip(latents[session], want, strict=True)):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=f"session {session} chunk {c}")
    # negative controls: the global layer undilated, every layer the widest window, or every layer the narrowest
    for other in (reference("a", replace(MIXED, global_pinned_dilation=1)), reference("a", MIXED, window=6),
                  reference("a", MIXED, window=2)):
        assert not torch.allclose(other[-1], latents["a"][-1], atol=1e-3)
    for session in ("a", "b"):
        runner.close_session(session)
    assert runner.pool.num_free == runner.pool.num_blocks


def test_a_session_keeps_the_local_window_and_the_global_windows_beat_and_nothing_else(
    mixed_pipeline: WaypointPipeline,
) -> None:
    """The pool holds only what some layer reads: the frame before the current one (the local window) and, of the
    five before it, the even ones (the dilated global window); the plan counts that many. Dropping the strided
    frames or keeping the global window dense changes what is held."""
    spec = mixed_pipeline.kv_cache_spec()
    assert spec.resident_frames == 3  # one dense, two on the dilation's beat
    runner = ARRunner(mixed_pipeline, kv_budget_bytes=BUDGET)
    for c in range(MIXED_CHUNKS):
        runner.execute_tick(tick("a", c))
        committed = c + 1
        kept = sorted({committed - 1} | {f for f in range(max(0, committed - 5), committed) if f % 2 == 0})
        state = runner.sessions.kv_state("a")
        assert state is not None and state.history_frame_indexes() == [*kept, committed], c
        assert runner.pool.num_used == len(kept), c  # the frames off the beat went back to the pool
    runner.close_session("a")
    assert runner.pool.num_free == runner.pool.num_blocks


def test_the_released_shape_keeps_the_local_window_and_the_global_windows_beat() -> None:
    """Waypoint-1.5 (built on the meta device, as `arstream plan` does): of the 127 frames before the current one,
    the 15 of the local window and the 14 further back on the dilation's beat, not all 127."""
    pipeline = load_pipeline("waypoint-1.5", "meta", config="1.5")
    assert isinstance(pipeline, WaypointPipeline)
    spec = pipeline.kv_cache_spec()
    assert (spec.window_frames, spec.strided_window_frames, spec.frame_stride) == (16, 128, 8)
    assert spec.resident_frames == 15 + 14


def test_a_session_runs_past_the_rotary_table(pipeline: WaypointPipeline) -> None:
    """The published cache indexes past its n_frames-frame table; served positions shift and keep going."""
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET)
    for c in range(pipeline.cfg.n_frames + 3):
        assert isinstance(runner.execute_tick(tick("a", c)), ChunkResult)
    runner.close_session("a")


def frames_alone(pipeline: WaypointPipeline, rounds: int) -> dict[str, list[np.ndarray]]:
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET)
    out: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    for c in range(rounds):
        for session in ("a", "b"):
            out[session].append(runner.execute_tick(tick(session, c)).frames)
    for session in ("a", "b"):
        runner.close_session(session)
    return out


def test_batched_sessions_get_the_frames_they_get_alone(pipeline: WaypointPipeline) -> None:
    alone = frames_alone(pipeline, 6)
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET, max_batch_sessions=2)
    for c in range(6):
        results = runner.execute([tick("a", c), tick("b", c)])
        for session, result in zip(("a", "b"), results):
            assert isinstance(result, ChunkResult)
            assert np.abs(result.frames.astype(int) - alone[session][c].astype(int)).max() <= 1
    assert runner.stats().batched_forwards_total == 6


@pytest.mark.parametrize("served", ["pipeline", "mixed_pipeline"])
def test_a_parked_or_rewound_session_continues_bit_identically(served: str, request: pytest.FixtureRequest) -> None:
    """Parking keeps the KV and the noise generator; a rewind point holds both as they were at its boundary (and,
    with per-layer windows, the dilation's phase: the frame index)."""
    pipeline: WaypointPipeline = request.getfixturevalue(served)

    def rollout(park_at: int | None = None, rewind_at: int | None = None) -> list[torch.Tensor]:
        runner = ARRunner(pipeline, kv_budget_bytes=BUDGET, rewind=RewindSchedule.last(4),
                          parking=ParkingPolicy(64 << 20))
        latents = []
        for c in range(10):
            if c == park_at:
                assert runner.park_session("a") and not runner.sessions.in_pool("a")
            if c == rewind_at:  # a detour of two chunks with other controls, then back to boundary c
                for detour in range(2):
                    runner.execute_tick(tick("a", c + detour, controls={"buttons": [70], "mouse": [3.0, 3.0]}))
                runner.execute_tick(TickRequest(session_id="a", request_id=c, controls=controls_for("a", c),
                                                seed=SEEDS["a"], rewind_to=c))
            else:
                runner.execute_tick(tick("a", c))
            latents.append(pipeline.last_latents["a"].clone())
        runner.close_session("a")
        assert runner.pool.num_free == runner.pool.num_blocks  # every block came back
        return latents

    straight = rollout()
    for variant in (rollout(park_at=5), rollout(rewind_at=6)):
        for c, (want, got) in enumerate(zip(straight, variant, strict=True)):
            assert torch.equal(want, got), c


def test_a_file_that_does_not_fit_is_refused_naming_it_and_its_keys(tmp_path: Path) -> None:
    cfg = get_config("tiny")
    files = write_published(tmp_path, cfg)
    weights = dict(files["model"])
    weights.pop("ctrl_emb.mlp.fc1.weight")
    weights["extra.weight"] = torch.zeros(1)
    weights["patchify.weight"] = torch.zeros(3, 3)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(WaypointWeightsError) as refused:
        load_waypoint(weights_path=tmp_path)
    message = str(refused.value)
    for named in ("model.safetensors", "ctrl_emb.mlp.fc1.weight", "extra.weight", "patchify.weight"):
        assert named in message

    weights = dict(files["model"])
    shared = "transformer.blocks.2.cond_head.cond_proj.4.weight"  # a layer's copy of the shared noise projection
    weights[shared] = weights[shared] + 1
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(WaypointWeightsError, match=r"model\.safetensors.*blocks\.2\.cond_head\.cond_proj\.4.*share"):
        load_waypoint(weights_path=tmp_path)

    write_published(tmp_path, cfg)
    decoder = dict(files["decoder"])
    decoder.pop("conv_in.proj.parametrizations.weight.original1")
    save_file(decoder, str(tmp_path / "ae" / "decoder.safetensors"))
    with pytest.raises(WaypointWeightsError, match=r"decoder\.safetensors.*conv_in\.proj\.parametrizations"):
        load_waypoint(weights_path=tmp_path)

    write_published(tmp_path, cfg)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(WaypointWeightsError, match="model.safetensors"):
        load_waypoint(weights_path=tmp_path)

    write_published(tmp_path, cfg)
    raw = yaml.safe_load((tmp_path / "config.yaml").read_text())
    raw.update(global_window=7, global_pinned_dilation=2, prompt_conditioning="cross_attention")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(WaypointWeightsError,
                       match=r"config\.yaml.*prompt_conditioning.*global_window not a multiple of global_pinned"):
        load_waypoint(weights_path=tmp_path)
    raw.update(global_window=8, global_pinned_dilation=0, prompt_conditioning=None)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(WaypointWeightsError, match=r"config\.yaml.*global_pinned_dilation \(a whole number"):
        load_waypoint(weights_path=tmp_path)


def test_the_published_decoder_file_decodes_as_the_reference() -> None:
    """The weight-norm bake: the served decoder on baked weights equals the reference on (g, v)."""
    cfg = get_config("tiny")
    _, decoder = random_weights(cfg, 3)
    assert isinstance(decoder, Decoder)
    stored = weight_normed(decoder)
    from arstream.models.waypoint.decoder import bake_weight_norm, to_uint8

    served = Decoder(cfg.ae, (cfg.image_height, cfg.image_width))
    served.load_state_dict(bake_weight_norm(stored))
    z = torch.randn(2, *cfg.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = to_uint8(served(z))
        want = reference_decode(stored, cfg.ae, z, (cfg.image_height, cfg.image_width))
    assert np.abs(got.numpy().astype(int) - want.numpy().astype(int)).max() <= 1


def test_the_plan_counts_what_a_loaded_model_holds() -> None:
    """`arstream plan` builds waypoint on the meta device: its weights' bytes are a loaded model's (bf16, as on a GPU),
    the noise projections shared by every layer counted once."""
    plan = fit_plan(Settings(model="waypoint-1.5", model_options={"random_init": True}, max_batch_sessions=2),
                    gpu_memory_bytes=2 << 30)  # fmt: skip
    assert plan.refusal is None and plan.session_capacity >= 1
    loaded = load_waypoint(dtype="bfloat16", random_init=True)
    assert loaded.encoder is not None  # the start images' encoder is held too
    assert {c.name: c.bytes for c in plan.components} == {
        "dit": module_bytes(loaded.model), "decoder": module_bytes(loaded.decoder),
        "encoder": module_bytes(loaded.encoder),
    }
    untied = sum(p.numel() * p.element_size() for _, p in loaded.model.named_parameters(remove_duplicate=False))
    assert module_bytes(loaded.model) < untied

