"""matrix-game-2 loads a checkpoint directory in the published layout; bad files fail naming the file and keys."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from arstream.models.matrix_game.checkpoint import CheckpointError
from arstream.models.matrix_game.config import get_config
from arstream.models.matrix_game.dit import CausalWanDiT
from arstream.models.matrix_game.pipeline import load_matrix_game
from arstream.models.wan.vae import build_vae
from arstream.models.registry import load_pipeline
from arstream.runner.runner import ARRunner
from arstream.runner.types import TickRequest

DIT = "base_distilled_model/base_distill.safetensors"
VAE = "Wan2.1_VAE.pth"
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


@pytest.fixture(scope="module")
def weights() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A random tiny DiT and VAE state dict; the DiT's keys as published (``model.`` prefix)."""
    cfg = get_config("tiny")
    model = CausalWanDiT(cfg)
    model.init_random(7)
    dit = {f"model.{k}": v.clone().contiguous() for k, v in model.state_dict().items()}
    torch.manual_seed(7)
    vae = {k: v.clone().contiguous() for k, v in build_vae(cfg).state_dict().items()}
    return dit, vae


def write(directory: Path, dit: dict[str, torch.Tensor], vae: dict[str, torch.Tensor]) -> Path:
    (directory / DIT).parent.mkdir(parents=True, exist_ok=True)
    save_file(dit, str(directory / DIT))
    torch.save(vae, directory / VAE)
    return directory


def test_published_key_names_are_the_module_names(weights: tuple[dict, dict]) -> None:
    dit, _ = weights
    for key in (
        "model.patch_embedding.weight",
        "model.time_projection.1.weight",
        "model.img_emb.proj.4.weight",
        "model.blocks.0.self_attn.q.weight",
        "model.blocks.0.self_attn.norm_k.weight",
        "model.blocks.1.cross_attn.o.bias",
        "model.blocks.1.norm3.weight",
        "model.blocks.1.ffn.2.weight",
        "model.blocks.1.modulation",
        "model.blocks.0.action_model.keyboard_embed.0.weight",
        "model.blocks.0.action_model.mouse_mlp.3.weight",
        "model.blocks.0.action_model.t_qkv.weight",
        "model.blocks.0.action_model.keyboard_attn_kv.weight",
        "model.blocks.0.action_model.proj_mouse.weight",
        "model.head.head.weight",
        "model.head.modulation",
    ):
        assert key in dit, key
    # the action module sits only in the configured blocks (0 of 2 in tiny)
    assert not any(k.startswith("model.blocks.1.action_model") for k in dit)


def test_a_synthesised_checkpoint_directory_loads(tmp_path: Path, weights: tuple[dict, dict]) -> None:
    dit, vae = weights
    pipeline = load_pipeline("matrix-game-2", "cpu", config="tiny", checkpoint=str(write(tmp_path, dit, vae)))
    loaded = pipeline.model.state_dict()
    assert all(torch.equal(loaded[k.removeprefix("model.")], v) for k, v in dit.items())
    assert all(torch.equal(pipeline.vae.vae.state_dict()[k], v) for k, v in vae.items())
    assert pipeline.model_card()["name"] == "matrix-game-2"


def test_a_pth_dit_file_loads_too(tmp_path: Path, weights: tuple[dict, dict]) -> None:
    dit, vae = weights
    write(tmp_path, dit, vae)
    torch.save({"generator": dit}, tmp_path / "dit.pth")  # wrapped, as training scripts save it
    pipeline = load_matrix_game("cpu", config="tiny", checkpoint=str(tmp_path), dit_file="dit.pth")
    assert torch.equal(pipeline.model.state_dict()["head.head.weight"], dit["model.head.head.weight"])


def test_a_missing_file_is_named(tmp_path: Path, weights: tuple[dict, dict]) -> None:
    dit, vae = weights
    write(tmp_path, dit, vae)
    (tmp_path / VAE).unlink()
    with pytest.raises(CheckpointError, match=f"no VAE file in {tmp_path}: looked for Wan2.1_VAE.pth"):
        load_matrix_game("cpu", config="tiny", checkpoint=str(tmp_path))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_matrix_game("cpu", config="tiny", checkpoint=str(tmp_path / "nowhere"))


def test_a_missing_key_is_named_with_its_file(tmp_path: Path, weights: tuple[dict, dict]) -> None:
    dit, vae = weights
    broken = {k: v for k, v in dit.items() if k != "model.blocks.1.cross_attn.k.weight"}
    write(tmp_path, broken, vae)
    with pytest.raises(CheckpointError, match=r"base_distill\.safetensors does not fit.*missing keys: blocks\.1\.cross_attn\.k\.weight"):
        load_matrix_game("cpu", config="tiny", checkpoint=str(tmp_path))


def test_a_wrong_shape_is_named_with_both_shapes(tmp_path: Path, weights: tuple[dict, dict]) -> None:
    dit, vae = weights
    broken = dict(dit)
    broken["model.head.head.weight"] = torch.zeros(3, 3)
    write(tmp_path, broken, vae)
    with pytest.raises(CheckpointError, match=r"wrong shapes: head\.head\.weight \(3, 3\) \(model \(64, 32\)\)"):
        load_matrix_game("cpu", config="tiny", checkpoint=str(tmp_path))


def test_a_vae_that_fits_no_layout_is_named(tmp_path: Path, weights: tuple[dict, dict]) -> None:
    dit, vae = weights
    broken = {k: v for k, v in vae.items() if not k.startswith("decoder.conv_in")}
    write(tmp_path, dit, broken)
    with pytest.raises(CheckpointError, match=r"Wan2\.1_VAE\.pth"):
        load_matrix_game("cpu", config="tiny", checkpoint=str(tmp_path))


def test_an_unreadable_file_is_named(tmp_path: Path, weights: tuple[dict, dict]) -> None:
    dit, vae = weights
    write(tmp_path, dit, vae)
    (tmp_path / DIT).write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"cannot read .*base_distill\.safetensors"):
        load_matrix_game("cpu", config="tiny", checkpoint=str(tmp_path))


def test_options_must_choose_weights() -> None:
    with pytest.raises(ValueError, match="either checkpoint=DIR or random_init=true"):
        load_matrix_game("cpu", config="tiny")
    with pytest.raises(ValueError, match="unknown matrix-game-2 config 'huge'"):
        load_matrix_game("cpu", config="huge", random_init=True)


def test_start_image_and_clip_features_options(tmp_path: Path) -> None:
    from PIL import Image

    Image.new("RGB", (100, 60), (255, 0, 0)).save(tmp_path / "start.png")
    red = load_matrix_game("cpu", config="tiny", random_init=True, image=str(tmp_path / "start.png"))
    plain = load_matrix_game("cpu", config="tiny", random_init=True)
    # the start image conditions the model: its latent is part of every chunk's input
    assert not torch.allclose(red.images.default.stream.condition(0, 3), plain.images.default.stream.condition(0, 3))
    assert red.model_card()["start_images"] == ["start"]  # the `image` option's file, named by its stem
    save_file({"clip_features": torch.zeros(4, 16)}, str(tmp_path / "clip.safetensors"))
    with pytest.raises(CheckpointError, match=r"clip\.safetensors: clip_features must be \[5, 16\], got \[4, 16\]"):
        load_matrix_game("cpu", config="tiny", random_init=True, clip_features=str(tmp_path / "clip.safetensors"))


def clip_state(seed: int = 5) -> dict[str, torch.Tensor]:
    """A tiny CLIP file as published: the vision tower under ``visual.``, plus text-tower keys that are not needed."""
    from arstream.models.matrix_game.clip import ClipImageEncoder

    torch.manual_seed(seed)
    encoder = ClipImageEncoder(get_config("tiny").clip)
    state = {k: v.clone().contiguous() for k, v in encoder.state_dict().items()}
    state["textual.token_embedding.weight"] = torch.zeros(3, 4)
    state["log_scale"] = torch.tensor(2.0)
    return state


def test_the_clip_file_encodes_the_start_image(tmp_path: Path, weights: tuple[dict, dict]) -> None:
    from arstream.models.matrix_game.clip import ClipImageEncoder
    from arstream.models.matrix_game.images import default_image

    dit, vae = weights
    write(tmp_path, dit, vae)
    clip = clip_state()
    torch.save(clip, tmp_path / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth")
    pipeline = load_matrix_game("cpu", config="tiny", checkpoint=str(tmp_path))
    encoder = ClipImageEncoder(get_config("tiny").clip)
    encoder.load_state_dict({k: v for k, v in clip.items() if k.startswith("visual.")})
    cfg = get_config("tiny")
    with torch.inference_mode():
        want = pipeline.model.image_context(encoder.encode(default_image(cfg))[None])
    torch.testing.assert_close(pipeline.context, want)
    assert encoder.encode(default_image(cfg)).shape == (cfg.clip_tokens, cfg.clip_dim)


def test_a_clip_file_missing_a_vision_key_is_named(tmp_path: Path, weights: tuple[dict, dict]) -> None:
    dit, vae = weights
    write(tmp_path, dit, vae)
    clip = {k: v for k, v in clip_state().items() if k != "visual.pre_norm.weight"}
    torch.save(clip, tmp_path / "clip.pth")
    with pytest.raises(CheckpointError, match=r"clip\.pth does not fit the model: missing keys: visual\.pre_norm\.weight"):
        load_matrix_game("cpu", config="tiny", checkpoint=str(tmp_path))
    with pytest.raises(CheckpointError, match=r"no CLIP file in .*: looked for other\.pth"):
        load_matrix_game("cpu", config="tiny", checkpoint=str(tmp_path), clip_file="other.pth")


def test_without_a_clip_file_the_image_context_is_zeros_and_says_so(
    tmp_path: Path, weights: tuple[dict, dict], caplog: pytest.LogCaptureFixture
) -> None:
    dit, vae = weights
    write(tmp_path, dit, vae)
    pipeline = load_matrix_game("cpu", config="tiny", checkpoint=str(tmp_path))
    cfg = get_config("tiny")
    with torch.inference_mode():
        zeros = pipeline.model.image_context(torch.zeros(1, cfg.clip_tokens, cfg.clip_dim))
    torch.testing.assert_close(pipeline.context, zeros)
    assert "image context is zeros" in caplog.text


# ---- the three published variants: each finds its own file; a file of another names the config it fits ----


def dit_state(config: str, seed: int = 7) -> dict[str, torch.Tensor]:
    model = CausalWanDiT(get_config(config))
    model.init_random(seed)
    return {f"model.{k}": v.clone().contiguous() for k, v in model.state_dict().items()}


def test_each_config_looks_for_its_published_file() -> None:
    assert get_config("1.3b").dit_file == "base_distilled_model/base_distill.safetensors"
    assert get_config("1.3b-gta").dit_file == "gta_distilled_model/gta_keyboard2dim.safetensors"
    assert get_config("1.3b-templerun").dit_file == "templerun_distilled_model/templerun_7dim_onlykey.safetensors"


@pytest.mark.parametrize("config", ["tiny-gta", "tiny-templerun"])
def test_a_variant_loads_its_own_file_from_a_directory_holding_all_three(
    tmp_path: Path, weights: tuple[dict, dict], config: str
) -> None:
    dit, vae = weights
    write(tmp_path, dit, vae)  # the universal model's file is there too
    own = dit_state(config, seed=11)
    path = tmp_path / get_config(config).dit_file
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(own, str(path))
    pipeline = load_matrix_game("cpu", config=config, checkpoint=str(tmp_path))
    assert all(torch.equal(pipeline.model.state_dict()[k.removeprefix("model.")], v) for k, v in own.items())


def test_a_file_that_fits_another_config_names_it(tmp_path: Path, weights: tuple[dict, dict]) -> None:
    _, vae = weights
    write(tmp_path, dit_state("tiny-gta"), vae)  # the GTA weights where the universal model's belong
    with pytest.raises(CheckpointError, match=r"base_distill\.safetensors does not fit.*; it fits config 'tiny-gta'"):
        load_matrix_game("cpu", config="tiny", checkpoint=str(tmp_path))
    write(tmp_path, dit_state("tiny-templerun"), vae)
    with pytest.raises(CheckpointError, match=r"missing keys: .*mouse.*; it fits config 'tiny-templerun'"):
        load_matrix_game("cpu", config="tiny", checkpoint=str(tmp_path))


def test_the_temple_run_layout_is_the_published_one() -> None:
    """Keyboard-only action module (``enable_mouse: false``, 7 keys), checked at full size on the meta device."""
    with torch.device("meta"):
        state = CausalWanDiT(get_config("1.3b-templerun")).state_dict()
    action = {k.removeprefix("blocks.0.action_model."): v.shape for k, v in state.items() if ".0.action_model." in k}
    assert action == {
        "keyboard_embed.0.weight": (128, 7),
        "keyboard_embed.0.bias": (128,),
        "keyboard_embed.2.weight": (128, 128),
        "keyboard_embed.2.bias": (128,),
        "key_attn_q_norm.weight": (64,),  # the published RMSNorm holds a weight it does not use
        "key_attn_k_norm.weight": (64,),
        "mouse_attn_q.weight": (1024, 1536),
        "keyboard_attn_kv.weight": (2048, 128 * 12),
        "proj_keyboard.weight": (1536, 1024),
    }
    assert sum(k.startswith("blocks.14.action_model") for k in state) and not any("blocks.15.action" in k for k in state)


def test_temple_run_offers_its_seven_keys_and_no_camera() -> None:
    from arstream.models.matrix_game.controls import condition_vectors

    cfg = get_config("tiny-templerun")
    pipeline = load_matrix_game("cpu", config="tiny-templerun", random_init=True)
    card = pipeline.model_card()
    assert card["controls"]["properties"]["keys"]["items"]["enum"] == ["q", "w", "s", "z", "c", "a", "d"]
    assert "camera" not in card["controls"]["properties"] and card["mouse"] is None
    assert cfg.denoise_timesteps == (1000, 750, 500, 250)
    # no key held is the "nomove" channel (0); W is jump (1), Z turn left (3), D right side (6)
    assert condition_vectors({}, cfg)[0].tolist() == [1, 0, 0, 0, 0, 0, 0]
    assert condition_vectors({"keys": ["w", "z", "d"]}, cfg)[0].tolist() == [0, 1, 0, 1, 0, 0, 1]
    assert condition_vectors({"keys": ["w"]}, cfg)[1].numel() == 0


def test_precision_options_set_the_dit_encoder_and_decoder_dtypes() -> None:
    """As the reference runs on CUDA: DiT, VAE encoder and CLIP in bf16, VAE decoder in fp16; fp32 on the CPU."""

    def dtypes(pipeline: object) -> dict[str, torch.dtype]:
        vae = pipeline.vae.vae  # type: ignore[attr-defined]
        return {
            "dit": next(pipeline.model.parameters()).dtype,  # type: ignore[attr-defined]
            "encoder": next(vae.encoder.parameters()).dtype,
            "decoder": next(vae.decoder.parameters()).dtype,
            "clip": next(pipeline._clip.parameters()).dtype,  # type: ignore[attr-defined]
        }

    cpu = load_matrix_game("cpu", config="tiny", random_init=True)
    assert set(dtypes(cpu).values()) == {torch.float32}
    mixed = load_matrix_game("cpu", config="tiny", random_init=True, dtype="bfloat16", vae_dtype="float16")
    assert dtypes(mixed) == {
        "dit": torch.bfloat16, "encoder": torch.bfloat16, "decoder": torch.float16, "clip": torch.bfloat16
    }
    runner = ARRunner(mixed, kv_budget_bytes=64 << 20)
    assert runner.execute_tick(TickRequest("a", 0, {"keys": ["w"]})).frames.shape == (9, 32, 48, 3)
    with pytest.raises(ValueError, match="vae_dtype must be one of"):
        load_matrix_game("cpu", config="tiny", random_init=True, vae_dtype="int8")
