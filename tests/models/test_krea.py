"""Krea Realtime equals a dense reference written from its published server (tiny config, CPU, fp32).

Eleven chunks, the prompt changed before chunk 3 and blended over four chunks:
latents and frames. Each negative control changes one rule of the published
session (the context recomputed every chunk, its first frame re-encoded, the
blend, the recompute under the previous chunk's conditioning) and must differ
once the rule comes into play. Then: the published file layout loads (q/k/v
fused) and a bad file is refused by name and key; batched sessions equal
their alone runs; a session exported mid-blend continues bit-identically;
and the 14B figures on the meta device.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from krea_reference import PublishedKrea
from safetensors.torch import save_file
from transformers import UMT5EncoderModel

from arstream.models.krea.config import get_config
from arstream.models.krea.loading import load_krea
from arstream.models.krea.pipeline import KreaPipeline
from arstream.models.longlive.checkpoint import T5_FILE, VAE_FILE
from arstream.models.longlive.dit import LongLiveDiT
from arstream.models.longlive.text import (
    TOKENIZER_DIR,
    TextEncoder,
    byte_tokenizer,
    transformers_to_wan_t5,
    umt5_config,
)
from arstream.models.registry import load_pipeline
from arstream.models.wan.checkpoint import CheckpointError
from arstream.models.wan.layers import WanAttentionBlock
from arstream.models.wan.vae import StreamingVAE, build_vae, to_uint8
from arstream.runner.runner import ARRunner, runner_for_sessions
from arstream.runner.snapshot import export_session
from arstream.runner.snapshot_import import import_session
from arstream.runner.snapshot_stream import parse_snapshot, snapshot_bytes
from arstream.runner.types import ChunkResult, TickRequest

A, B = "a red fox in the snow", "a city street at night, rain"
SCHEDULE = [A] * 3 + [B] * 8  # a change before chunk 3, blended over chunks 3-6
SEED = 7
GIB = 2**30


@functools.cache
def pipeline() -> KreaPipeline:
    loaded = load_pipeline("krea-realtime", "cpu", config="tiny", random_init=True)
    assert isinstance(loaded, KreaPipeline)
    return loaded


def tick(session: str, index: int, prompt: str, seed: int = SEED) -> TickRequest:
    return TickRequest(session_id=session, request_id=index, controls={}, prompt=prompt, seed=seed)


@functools.cache
def served() -> tuple[list[torch.Tensor], list[np.ndarray]]:
    model = pipeline()
    runner = runner_for_sessions(model, 1)
    latents, frames = [], []
    for i, prompt in enumerate(SCHEDULE):
        result = runner.execute_tick(tick("s", i, prompt))
        assert isinstance(result, ChunkResult)
        latents.append(model.last_latents["s"].clone())
        frames.append(result.frames)
    runner.close_session("s")
    assert runner.pool.num_free == runner.blocks_free_at_start
    return latents, frames


@functools.cache
def reference(**knobs: bool) -> tuple[list[torch.Tensor], list[np.ndarray]]:
    dense = PublishedKrea(pipeline(), SEED, **knobs)
    steps = [dense.step(prompt) for prompt in SCHEDULE]
    return [latents for latents, _ in steps], [to_uint8(video) for _, video in steps]


def differences(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    return [float((x - y).abs().max()) for x, y in zip(a, b, strict=True)]


def gap(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


def test_the_served_latents_and_frames_equal_the_published_session() -> None:
    spec = pipeline().kv_cache_spec()
    assert (spec.frames_per_chunk, spec.sink_frames, spec.window_frames, spec.resident_frames) == (3, 0, 6, 3)
    card = pipeline().model_card()
    assert (card["name"], card["prompt_switch"], card["first_chunk_frames"]) == ("krea-realtime", "blend", 9)
    latents, frames = served()
    want_latents, want_frames = reference()
    assert max(differences(latents, want_latents)) <= 1e-5
    assert max(gap(a, b) for a, b in zip(frames, want_frames, strict=True)) <= 1


@pytest.mark.parametrize(
    ("control", "knobs", "first_changed", "last_changed"),
    [
        # the block's own t=0 K/V kept as the next context: near-clean input, so a small change at chunk 1
        ("no recompute: a plain KV cache", {"recompute": False}, 1, 11),
        ("the context's first frame not re-encoded", {"reencode": False}, 2, 11),
        ("the prompt changed at once, not blended", {"blend": False}, 3, 7),
        ("the context recomputed under the new conditioning", {"recompute_under_new": True}, 4, 7),
    ],
)
def test_each_negative_control_differs(control: str, knobs: dict[str, bool], first_changed: int,
                                       last_changed: int) -> None:  # fmt: skip
    latents, frames = served()
    want_latents, want_frames = reference(**knobs)
    diffs = differences(latents, want_latents)
    assert max(diffs[:first_changed]) <= 1e-5, control
    assert max(diffs[first_changed:last_changed]) >= 5e-2, (control, diffs)
    assert max(gap(a, b) for a, b in zip(frames, want_frames, strict=True)) >= 4, control  # 4x the equality bound


def test_batched_sessions_equal_their_alone_runs_through_a_blend() -> None:
    schedules = {"x": [A] * 2 + [B] * 4, "y": [B] * 6}
    alone: dict[str, list[np.ndarray]] = {}
    for session, prompts in schedules.items():
        runner = runner_for_sessions(pipeline(), 1)
        results = [runner.execute_tick(tick(session, i, p)) for i, p in enumerate(prompts)]
        alone[session] = [r.frames for r in results if isinstance(r, ChunkResult)]
        runner.close_session(session)
    runner = runner_for_sessions(pipeline(), 2, max_batch_sessions=2)
    batched: dict[str, list[np.ndarray]] = {"x": [], "y": []}
    for i in range(6):
        round_results = runner.execute([tick(s, i, schedules[s][i]) for s in "xy"])
        for s, result in zip("xy", round_results):
            assert isinstance(result, ChunkResult)
            batched[s].append(result.frames)
    assert runner.counters.batched_forwards_total == 6
    for s in "xy":
        assert max(gap(a, b) for a, b in zip(batched[s], alone[s], strict=True)) <= 1
    for s in "xy":
        runner.close_session(s)
    assert runner.pool.num_free == runner.blocks_free_at_start


def test_a_session_exported_mid_blend_continues_bit_identically_on_another_pipeline() -> None:
    here = runner_for_sessions(pipeline(), 1)
    for i, prompt in enumerate(SCHEDULE[:5]):  # the blend started at chunk 3
        here.execute_tick(tick("s", i, prompt))
    snapshot = parse_snapshot(snapshot_bytes(export_session(here, "s")))
    expected = [here.execute_tick(tick("s", i, SCHEDULE[i])).frames for i in range(5, 8)]
    here.close_session("s")
    there = runner_for_sessions(load_krea(config="tiny", random_init=True), 1)
    import_session(there, "s", snapshot)
    got = [there.execute_tick(tick("s", i, SCHEDULE[i])).frames for i in range(5, 8)]
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    there.close_session("s")
    assert there.pool.num_free == there.blocks_free_at_start


def test_the_published_layout_loads_fused_and_a_bad_file_is_refused(tmp_path: Path) -> None:
    """``krea-realtime-video-14b.safetensors``: a flat state dict with ``model.`` keys (synthesised here: the real
    file was not available), beside Wan's umT5, VAE and tokenizer."""
    cfg = get_config("tiny")
    dit = LongLiveDiT(cfg)
    dit.init_random(21)
    save_file({f"model.{k}": v.contiguous() for k, v in dit.state_dict().items()}, str(tmp_path / cfg.dit_file))
    torch.save(transformers_to_wan_t5(UMT5EncoderModel(umt5_config(cfg.text)).state_dict()), tmp_path / T5_FILE)
    vae: Any = build_vae(cfg)
    torch.save(vae.state_dict(), tmp_path / VAE_FILE)
    byte_tokenizer().save_pretrained(str(tmp_path / TOKENIZER_DIR))
    loaded = load_krea(config="tiny", checkpoint=str(tmp_path))
    block = cast(WanAttentionBlock, loaded.model.blocks[0]).self_attn
    assert block.qkv is not None and not hasattr(block, "q")  # fused at load
    published = cast(WanAttentionBlock, dit.blocks[0]).self_attn
    fused = torch.cat([published.q.weight, published.k.weight, published.v.weight])
    assert torch.equal(block.qkv.weight, fused)
    state = {f"model.{k}": v.contiguous() for k, v in dit.state_dict().items()}
    del state["model.blocks.1.self_attn.v.weight"]
    state["model.blocks.0.ffn.0.weight"] = torch.zeros(3, 3)
    save_file(state, str(tmp_path / "bad.safetensors"))
    refused = (r"bad\.safetensors does not fit the model: missing keys: blocks\.1\.self_attn\.v\.weight; "
               r"wrong shapes: blocks\.0\.ffn\.0\.weight \(3, 3\)")  # fmt: skip
    with pytest.raises(CheckpointError, match=refused):
        load_krea(config="tiny", checkpoint=str(tmp_path), dit_file="bad.safetensors")
    with pytest.raises(CheckpointError, match=r"no Krea Realtime DiT file in .*: looked for krea-realtime-video-14b"):
        load_krea(config="tiny", checkpoint=str(tmp_path / TOKENIZER_DIR))


def test_random_weights_are_filled_in_their_dtype_and_equal_the_float32_ones_rounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Random weights are materialised where they run, in their dtype, and filled from the CPU's seeded float32
    draws a parameter at a time (the host never holds the model in float32: Krea 14B's would be 80 GB a rank).
    A seed gives the same weights in any dtype up to rounding: bf16 here is the fp32 weights cast, bit for bit,
    and the loaded bytes are what the meta device plans."""
    filled: list[set[torch.dtype]] = []
    init_random = LongLiveDiT.init_random

    def recording(model: LongLiveDiT, seed: int) -> None:
        filled.append({p.dtype for p in model.parameters()})
        init_random(model, seed)

    monkeypatch.setattr(LongLiveDiT, "init_random", recording)
    half = load_krea(config="tiny", random_init=True, seed=3, dtype="bfloat16")
    assert filled == [{torch.bfloat16}]  # filled in its dtype, not drawn into a float32 model and cast
    whole = load_krea(config="tiny", random_init=True, seed=3, dtype="float32")
    for halves, wholes in ((half.model.state_dict(), whole.model.state_dict()),
                           (half.text.model.state_dict(), whole.text.model.state_dict())):  # the DiT, umT5
        assert halves.keys() == wholes.keys() and halves
        for name, tensor in wholes.items():
            assert torch.equal(halves[name], tensor.to(torch.bfloat16)), name
    planned = load_krea("meta", config="tiny", dtype="bfloat16").model_card()["components"]
    assert [c["bytes"] for c in half.model_card()["components"]] == [c["bytes"] for c in planned]


def test_the_14b_figures_on_the_meta_device() -> None:
    """Wan2.1-T2V-14B at 480x832, bf16: a pool block (one latent frame, 1560 tokens, 40 layers of 40 x 128) is
    1219 MiB; a session keeps 3 (the context the next chunk rewrites)."""
    cfg = get_config("14b")
    encoder: Any
    vae: Any
    with torch.device("meta"):
        model = LongLiveDiT(cfg).to(torch.bfloat16)
        encoder = UMT5EncoderModel(umt5_config(cfg.text))
        vae = build_vae(cfg)
    encoder, vae = encoder.to(torch.bfloat16), vae.to(torch.bfloat16)
    meta = torch.device("meta")
    krea = KreaPipeline(model, StreamingVAE(vae), TextEncoder(encoder, byte_tokenizer(), cfg.text_len), device=meta)
    spec = krea.kv_cache_spec()
    assert spec.block_bytes == 2 * 40 * 1560 * 5120 * 2 and round(spec.block_bytes / 2**20) == 1219
    assert spec.resident_frames == 3 and round(spec.resident_frames * spec.block_bytes / GIB, 2) == 3.57
    assert round(krea.prompt_bytes / 2**20) == 404  # one prompt's cross-attention K/V (400 MiB) and umT5 outputs
    runner = ARRunner(krea, device=meta, kv_budget_bytes=100 * GIB)
    per_session = runner.plan.per_session_bytes
    assert per_session == spec.resident_frames * spec.block_bytes + spec.model_owned_bytes_per_session
    assert round(per_session / GIB, 2) == 5.73  # with the VAE decoder's cache (1801 MiB) and one prompt
