"""Loading Waypoint from its published file layout, or random weights for the tiny config.

The published layout (``world_engine``'s ``WorldModel.from_pretrained`` and
``InferenceAE.from_pretrained``, commit 208c909824d906bf441122b7c40b9b4e1050d7c3):

- the world model's folder: ``config.yaml`` (OmegaConf) and ``model.safetensors``;
- the autoencoder's folder (``ae_path``; by default ``ae/`` inside the model's):
  ``decoder_conf.yml`` (its ``model`` mapping) and ``decoder.safetensors``
  with weight-normed convolutions, and beside them the encoder's
  ``encoder_conf.yml`` and ``encoder.safetensors`` (a session starts from a
  picture it encodes: :mod:`.seed`; with ``from_noise`` they are not read).
- Waypoint-1.5 (``taehv_ae: true`` in ``config.yaml``): the autoencoder is
  TAEHV's ``taehv1_5.pth`` (the ``ae_uri`` repository's one file; a
  ``.safetensors`` of the same keys is read too) in that same folder; its
  ``decoder.*`` and ``encoder.*`` tensors are read.

A file whose tensors do not match the config (missing, unexpected or of
another shape) is refused with :class:`WaypointWeightsError`, naming the file
and the keys, before anything is served.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file

from .config import WaypointConfig, WaypointConfigError, config_from_yaml, get_config
from .decoder import Decoder, bake_weight_norm
from .dit import WaypointDiT
from .encoder import AEEncoder, PictureEncoder, TAEHVEncoder, taehv_encoder_width
from .pipeline import WaypointPipeline
from .seed import offered_pictures
from .taehv_frames import FramesDecoder, taehv_shape
from ..quantize import check_weights_option, quantize_blocks
from ..wan.checkpoint import CheckpointError, read_state_dict
from ..wan_decoders.taehv import decoder_keys, fit_time_grow, shape_of

TAEHV_FILES = ("taehv1_5.pth", "taehv1_5.safetensors")

# weight-normed convolutions in the published decoder: each ``X.weight`` is stored as these two
WEIGHT_NORM = (".parametrizations.weight.original0", ".parametrizations.weight.original1")
_SHOWN = 8  # keys named in an error, at most
# the control fusion's first linear splits its weight by input (the frame's tokens, the control) rather than
# concatenate the control onto every token; a quantized weight cannot be split so, and it stays in the model's dtype
CONTROL_FUSION_INPUT = ("ctrl_mlpfusion.mlp.fc1",)


class WaypointWeightsError(ValueError):
    """A weights or config file that does not fit; the message names the file and the keys."""


def _names(keys: set[str]) -> str:
    shown = sorted(keys)[:_SHOWN]
    more = len(keys) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


def check_tensors(path: Path, found: dict[str, torch.Tensor], expected: dict[str, torch.Size]) -> None:
    """Refuse ``found`` (read from ``path``) unless it holds exactly ``expected``'s keys and shapes."""
    missing, unexpected = expected.keys() - found.keys(), found.keys() - expected.keys()
    problems = []
    if missing:
        problems.append(f"missing keys {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {_names(unexpected)}")
    wrong = {k for k in expected.keys() & found.keys() if tuple(found[k].shape) != tuple(expected[k])}
    if wrong:
        shapes = "; ".join(f"{k}: {tuple(found[k].shape)} != {tuple(expected[k])}" for k in sorted(wrong)[:_SHOWN])
        problems.append(f"keys of another shape ({shapes})")
    if problems:
        raise WaypointWeightsError(f"{path}: {', '.join(problems)}")


def published_shapes(module: torch.nn.Module) -> dict[str, torch.Size]:
    """The autoencoder half's tensors as the published file names them (convolution weights weight-normed)."""
    shapes: dict[str, torch.Size] = {}
    convs = {name for name, sub in module.named_modules() if isinstance(sub, torch.nn.Conv2d)}
    for key, value in module.state_dict().items():
        stem = key.removesuffix(".weight")
        if key.endswith(".weight") and stem in convs:
            shapes[stem + WEIGHT_NORM[0]] = torch.Size([value.shape[0]] + [1] * (value.dim() - 1))
            shapes[stem + WEIGHT_NORM[1]] = value.shape
        else:
            shapes[key] = value.shape
    return shapes


def _read(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise WaypointWeightsError(f"{path}: no such file")
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise WaypointWeightsError(f"{path}: not a readable safetensors file ({exc})") from None


def load_ae_conf(path: Path, blocks_key: str) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise WaypointWeightsError(f"{path}: not a readable YAML config ({exc})") from None
    conf = raw.get("model") if isinstance(raw, dict) else None
    needed = ("channels", "latent_channels", "ch_0", "ch_max", blocks_key)
    if not isinstance(conf, dict) or any(key not in conf for key in needed):
        raise WaypointWeightsError(f"{path}: expected a 'model' mapping with keys {list(needed)}")
    return conf


def make_decoder(cfg: WaypointConfig) -> Decoder | FramesDecoder:
    """The decoder ``cfg`` names, unfilled: Waypoint-1's autoencoder or Waypoint-1.5's TAEHV."""
    size = (cfg.image_height, cfg.image_width)
    return FramesDecoder(taehv_shape(cfg.ae), size) if cfg.taehv_ae else Decoder(cfg.ae, size)


def make_encoder(cfg: WaypointConfig) -> PictureEncoder:
    """The encoder ``cfg`` names, unfilled (Waypoint-1's reads pictures of RGB, in as many stages as it decodes)."""
    grid = (cfg.latent_shape[1], cfg.latent_shape[2])
    if cfg.taehv_ae:
        return TAEHVEncoder(cfg.channels, int(cfg.ae["patch_size"]), grid)
    conf = {**cfg.ae, "channels": 3, "encoder_blocks_per_stage": cfg.ae["decoder_blocks_per_stage"]}
    return AEEncoder(conf, grid)


def load_taehv(
    ae_dir: Path, cfg: WaypointConfig, *, with_encoder: bool = True
) -> tuple[WaypointConfig, FramesDecoder, TAEHVEncoder | None]:
    """Waypoint-1.5's TAEHV decoder (and encoder) from ``ae_dir``; widths and patch are read from the file's shapes."""
    path = next((ae_dir / name for name in TAEHV_FILES if (ae_dir / name).is_file()), None)
    if path is None:
        raise WaypointWeightsError(f"{ae_dir}: no TAEHV file (looked for {', '.join(TAEHV_FILES)})")
    try:
        raw = read_state_dict(path)
        state = decoder_keys(raw)
    except CheckpointError as exc:
        raise WaypointWeightsError(str(exc)) from None
    try:
        shape = shape_of(state)
    except KeyError as exc:
        raise WaypointWeightsError(f"{path}: not a TAEHV decoder, missing keys {exc.args[0]}") from None
    if shape.latent_channels != cfg.channels:
        raise WaypointWeightsError(f"{path}: decodes {shape.latent_channels}-channel latents; config.yaml's channels "
                                   f"are {cfg.channels}")
    ae = {"widths": list(shape.widths), "latent_channels": shape.latent_channels, "patch_size": shape.patch_size}
    cfg = WaypointConfig(**{**cfg.to_dict(), "ae": ae})
    decoder = FramesDecoder(shape, (cfg.image_height, cfg.image_width))
    if decoder.t_upscale != cfg.temporal_compression:
        raise WaypointWeightsError(f"{path}: makes {decoder.t_upscale} frames a latent frame; config.yaml's "
                                   f"temporal_compression is {cfg.temporal_compression}")
    state = fit_time_grow(decoder, state)
    check_tensors(path, state, {k: v.shape for k, v in decoder.state_dict().items()})
    decoder.load_state_dict(state)
    return cfg, decoder, _taehv_encoder(path, raw, cfg) if with_encoder else None


def _taehv_encoder(path: Path, raw: dict[str, torch.Tensor], cfg: WaypointConfig) -> TAEHVEncoder:
    state = {k: v for k, v in raw.items() if k.startswith("encoder.")}
    try:
        width = taehv_encoder_width(state)
    except KeyError:
        raise WaypointWeightsError(f"{path}: not a TAEHV encoder, missing keys encoder.0.weight") from None
    grid = (cfg.latent_shape[1], cfg.latent_shape[2])
    encoder = TAEHVEncoder(cfg.channels, int(cfg.ae["patch_size"]), grid, width)
    check_tensors(path, state, {k: v.shape for k, v in encoder.state_dict().items()})
    encoder.load_state_dict(state)
    return encoder


def load_ae_encoder(ae_dir: Path, cfg: WaypointConfig) -> AEEncoder:
    """Waypoint-1's encoder: ``encoder_conf.yml`` and the weight-normed ``encoder.safetensors``."""
    conf = load_ae_conf(ae_dir / "encoder_conf.yml", "encoder_blocks_per_stage")
    if int(conf["latent_channels"]) != cfg.channels:
        raise WaypointWeightsError(f"{ae_dir / 'encoder_conf.yml'}: latent_channels {conf['latent_channels']} != the "
                                   f"world model's channels {cfg.channels}")
    encoder = AEEncoder(conf, (cfg.latent_shape[1], cfg.latent_shape[2]))
    path = ae_dir / "encoder.safetensors"
    raw = _read(path)
    check_tensors(path, raw, published_shapes(encoder))
    encoder.load_state_dict(bake_weight_norm(raw))
    return encoder


def load_weights(
    weights_path: Path, ae_path: Path | None, base: WaypointConfig, *, with_encoder: bool = True
) -> tuple[WaypointDiT, Decoder | FramesDecoder, PictureEncoder | None]:
    """The world model, the decoder and (``with_encoder``) the encoder from their published folders."""
    try:
        cfg = config_from_yaml(weights_path / "config.yaml", base)
    except WaypointConfigError as exc:
        raise WaypointWeightsError(str(exc)) from None
    ae_dir = ae_path if ae_path is not None else weights_path / "ae"
    decoder: Decoder | FramesDecoder
    if cfg.taehv_ae:
        cfg, decoder, taehv_encoder = load_taehv(ae_dir, cfg, with_encoder=with_encoder)
        return _load_model(weights_path, cfg), decoder, taehv_encoder
    conf = load_ae_conf(ae_dir / "decoder_conf.yml", "decoder_blocks_per_stage")
    if int(conf["latent_channels"]) != cfg.channels:
        raise WaypointWeightsError(
            f"{ae_dir / 'decoder_conf.yml'}: latent_channels {conf['latent_channels']} != the world model's "
            f"channels {cfg.channels} ({weights_path / 'config.yaml'})"
        )
    cfg = WaypointConfig(**{**cfg.to_dict(), "ae": dict(conf)})
    model = _load_model(weights_path, cfg)
    decoder = Decoder(conf, (cfg.image_height, cfg.image_width))
    decoder_file = ae_dir / "decoder.safetensors"
    raw = _read(decoder_file)
    check_tensors(decoder_file, raw, published_shapes(decoder))
    decoder.load_state_dict(bake_weight_norm(raw))
    return model, decoder, load_ae_encoder(ae_dir, cfg) if with_encoder else None


def _load_model(weights_path: Path, cfg: WaypointConfig) -> WaypointDiT:
    model = WaypointDiT(cfg)
    state = _read(weights_path / "model.safetensors")
    check_tensors(weights_path / "model.safetensors", state, {k: v.shape for k, v in model.state_dict().items()})
    if cfg.noise_conditioning in ("dit_air", "wan"):  # shared by every layer: each layer's copy must agree
        differ = {
            f"transformer.blocks.{layer}.cond_head.cond_proj.{j}.weight"
            for layer in range(1, cfg.n_layers)
            for j in range(6)
            if not torch.equal(state[f"transformer.blocks.{layer}.cond_head.cond_proj.{j}.weight"],
                               state[f"transformer.blocks.0.cond_head.cond_proj.{j}.weight"])
        }  # fmt: skip
        if differ:
            raise WaypointWeightsError(
                f"{weights_path / 'model.safetensors'}: keys {_names(differ)} differ from layer 0's, which they share"
            )
    model.load_state_dict(state)
    return model


def quantize_dit(model: WaypointDiT, weights: str | None, device: torch.device) -> WaypointDiT:
    """The DiT with its block linears quantized to ``weights`` (the model option; None: as it is), on ``device``
    (torchao's kernels follow the tensors' device, so it is quantized where it runs)."""
    if weights is None:
        return model
    check_weights_option(weights, device)
    model = model.to(device)
    quantize_blocks(model, weights, blocks="transformer.blocks.", keep=CONTROL_FUSION_INPUT)
    return model


def random_weights(cfg: WaypointConfig, seed: int = 0) -> tuple[WaypointDiT, Decoder | FramesDecoder]:
    model = WaypointDiT(cfg)
    model.init_random(seed)
    decoder = make_decoder(cfg)
    decoder.init_random(seed + 1)
    return model, decoder


def random_encoder(cfg: WaypointConfig, seed: int = 0) -> PictureEncoder:
    encoder = make_encoder(cfg)
    encoder.init_random(seed + 2)
    return encoder


def load_waypoint(
    device: torch.device | str = "cpu",
    *,
    config: str | None = None,
    weights_path: str | Path | None = None,
    ae_path: str | Path | None = None,
    seed: int = 0,
    session_capacity: int = 64,
    dtype: str | None = None,
    random_init: bool = False,
    image: str | None = None,
    images: str | None = None,
    image_cache: int = 4,
    from_noise: bool = False,
    weights: str | None = None,
    **options: Any,
) -> WaypointPipeline:
    """``--model waypoint-1.5``: the published files at ``weights_path``, or seeded random weights of ``config``.

    Without ``weights_path`` the weights are random (``random_init`` may say so,
    as other models' options do; the card says ``weights: random`` either way),
    and only the ``tiny`` configs load: random weights at the published scale
    are no use to anyone and take gigabytes. No ``config`` is ``tiny-1.5``
    (Waypoint-1.5's own path, the model's name) without files, and ``tiny`` as
    the base of a published folder, whose ``config.yaml`` decides its shapes.

    A session starts from a start image (:mod:`.seed`): ``image`` (a file,
    the default, named by its stem) or else the built-in picture, and the
    pictures of an ``images`` directory, offered by name; clients' own are
    encoded on first use and the last ``image_cache`` kept. ``from_noise``
    starts every session from noise instead (no encoder read, no start images
    offered: a ``start`` with an image is refused).

    ``weights`` (``int8``, ``fp8``, ``w8a8``) quantizes the DiT's block linears
    once the files are read (:mod:`arstream.models.quantize`), all but the
    control fusion's first (``CONTROL_FUSION_INPUT``); the decoder and the
    encoder stay in ``dtype``.
    """
    if options:
        raise TypeError(
            f"load_waypoint got unknown options {sorted(options)}; expected config, weights_path, ae_path, seed, "
            "session_capacity, dtype, random_init, image, images, image_cache, from_noise, weights"
        )
    if config is None:  # a bare --model waypoint-1.5 serves Waypoint-1.5's own path (TAEHV, four frames a chunk)
        config = "tiny-1.5" if weights_path is None else "tiny"
    if from_noise and (image is not None or images is not None):
        raise ValueError("waypoint takes from_noise or start images (image, images), not both")
    base = get_config(config)
    target = torch.device(device)
    check_weights_option(weights, target)
    # bf16 on a GPU (and on the meta device that stands in for one in ``arstream plan``), fp32 on the CPU
    dtype = dtype or ("float32" if target.type == "cpu" else "bfloat16")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"waypoint dtype {dtype!r} is not one of float32, bfloat16")
    if weights_path is not None and random_init:
        raise ValueError("waypoint takes weights_path or random_init, not both")
    encoder: PictureEncoder | None
    if target.type == "meta":  # shapes and bytes only: nothing read, nothing filled
        with torch.device("meta"):
            model, decoder = WaypointDiT(base), make_decoder(base)
            encoder = None if from_noise else make_encoder(base)
    elif weights_path is not None:
        model, decoder, encoder = load_weights(
            Path(weights_path), None if ae_path is None else Path(ae_path), base, with_encoder=not from_noise
        )
    elif config.startswith("tiny"):
        model, decoder = random_weights(base, seed)
        encoder = None if from_noise else random_encoder(base, seed)
    else:
        raise ValueError(f"waypoint config {config!r} needs weights_path (the published folder); only the tiny ones run "
                         "on random weights")
    model, decoder = model.to(torch_dtype), decoder.to(torch_dtype)
    model = quantize_dit(model, weights, target)
    cfg = model.cfg
    pictures = None
    if encoder is not None and target.type != "meta":
        pictures = offered_pictures(image, images, cfg.image_height, cfg.image_width)
    pipeline = WaypointPipeline(
        model, decoder, target, session_capacity=session_capacity, random_weights=weights_path is None,
        encoder=None if encoder is None else encoder.to(torch_dtype), start_images=pictures, image_cache=image_cache,
    )
    pipeline.weights = weights  # the model card's DiT entry says how its weights are held
    return pipeline
