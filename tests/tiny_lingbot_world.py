"""A tiny random-weight LingBot-World checkpoint, in the published (diffusers) layout, for the vLLM-Omni lane.

The folders vLLM-Omni's ``LingBotWorldCausalDMDPipeline`` loads, each with its
config and weights as the published checkpoint has them: ``tokenizer``
(a word-level fast tokenizer), ``text_encoder`` (UMT5), ``vae`` (Wan),
``transformer`` (``CausalLingBotWorldTransformer3DModel``, Q/K/V stored
apart as in the checkpoint) and ``scheduler``; only the sizes are tiny, so
it loads and runs a tick in seconds on CPU. Its transformer config is not
the 14B one, which vLLM-Omni's ``from_config`` insists on:
:func:`tiny_transformers_allowed` lets it through for the tests.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from arstream.runner.vllm_omni.deprecations import ignoring_their_deprecations, importing_vllm
from arstream.runner.vllm_omni.workarounds import stub_torchvision_if_missing

HEIGHT = WIDTH = 64  # 4 x 4 tokens per latent frame (VAE 8x, patch 2x2)
SINK_FRAMES, WINDOW_FRAMES = 3, 9  # latent frames; the 14B checkpoint has 9 and 18
TRANSFORMER = {
    "_class_name": "CausalLingBotWorldTransformer3DModel",
    "patch_size": [1, 2, 2],
    "num_attention_heads": 2,
    "attention_head_dim": 12,
    "in_channels": 36,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 16,
    "ffn_dim": 32,
    "num_layers": 2,
    "cross_attn_norm": True,
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": 1024,
    "pos_embed_seq_len": None,
    "qk_norm": "rms_norm_across_heads",
    "sink_size": SINK_FRAMES,
    "num_frames_per_block": 3,
    "sliding_window_num_frames": WINDOW_FRAMES,
    "local_attn_size": -1,
}
SCHEDULER = {
    "_class_name": "UniPCMultistepScheduler",
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "predict_x0": True,
    "use_flow_sigmas": True,
    "use_dynamic_shifting": False,
    "use_beta_sigmas": False,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
    "final_sigmas_type": "zero",
    "timestep_spacing": "linspace",
    "flow_shift": 5.0,
    "solver_order": 2,
}
WORDS = ["<pad>", "</s>", "<unk>", "a", "walk", "through", "world", "the", "forest", "city", "first-person", "detailed"]


@contextmanager
def tiny_transformers_allowed() -> Iterator[None]:
    """Let ``CausalLingBotWorldTransformer3DModel.from_config`` build any size (see the module docstring).

    WORKAROUND (vLLM-Omni 0.30.0, tiny test models only): ``from_config``
    refuses every config but the published 14B checkpoint's, while the class
    itself builds any size. ``test_vllm_omni_lingbot.py`` checks the refusal is
    still there.
    """
    with importing_vllm():
        stub_torchvision_if_missing()
        from vllm_omni.diffusion.models.lingbot_world.transformer import CausalLingBotWorldTransformer3DModel
    cls = CausalLingBotWorldTransformer3DModel
    original = cls.__dict__["from_config"]

    def from_any_config(klass: type, config: dict[str, Any], *, quant_config: Any = None, prefix: str = "") -> Any:
        kwargs = {name: value for name, value in config.items() if not name.startswith("_")}
        kwargs["patch_size"] = tuple(kwargs["patch_size"])
        return klass(**kwargs, quant_config=quant_config, prefix=prefix)

    cls.from_config = classmethod(from_any_config)
    try:
        yield
    finally:
        cls.from_config = original


def _library(name: str) -> Any:
    """A library of the vllm-omni extra (tokenizers, transformers, diffusers): untyped here, and absent outside it."""
    return importlib.import_module(name)


def _tokenizer(path: Path) -> None:
    tokenizers, transformers = _library("tokenizers"), _library("transformers")
    vocabulary = {word: i for i, word in enumerate(WORDS)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)


def _transformer_weights(path: Path) -> None:
    """Random weights under the checkpoint's names (``self_attn.q/k/v`` apart, as vLLM-Omni's loader expects)."""
    from safetensors.torch import save_file

    with importing_vllm():
        stub_torchvision_if_missing()
        from vllm.config import set_current_vllm_config
        from vllm_omni.diffusion.data import OmniDiffusionConfig
        from vllm_omni.diffusion.models.lingbot_world.transformer import CausalLingBotWorldTransformer3DModel
        from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

        from arstream.runner.vllm_omni.distributed import ensure_single_rank

    od_config = OmniDiffusionConfig(model=str(path.parent), model_class_name="LingBotWorldCausalDMDPipeline")
    vllm_config = create_diffusion_vllm_config(torch.device("cpu"), od_config)
    ensure_single_rank(vllm_config, od_config)
    generator = torch.Generator().manual_seed(0)
    weights: dict[str, torch.Tensor] = {}
    with set_current_vllm_config(vllm_config):
        kwargs = {name: value for name, value in TRANSFORMER.items() if not name.startswith("_")}
        model = CausalLingBotWorldTransformer3DModel(**{**kwargs, "patch_size": (1, 2, 2)})
    for name, param in model.named_parameters():
        value = torch.randn(param.shape, generator=generator) * 0.05
        if ".self_attn.qkv." in name:
            for part, chunk in zip("qkv", value.chunk(3, dim=0)):
                weights[name.replace(".self_attn.qkv.", f".self_attn.{part}.")] = chunk.contiguous()
        else:
            weights[name] = value
    save_file(weights, str(path / "diffusion_pytorch_model.safetensors"))


def build_tiny_lingbot_world(root: Path) -> Path:
    """Write the checkpoint under ``root`` (created) and return it."""
    with ignoring_their_deprecations():
        diffusers, transformers = _library("diffusers"), _library("transformers")
        torch.manual_seed(0)
        _tokenizer(root / "tokenizer")
        encoder = transformers.UMT5Config(
            vocab_size=len(WORDS), d_model=TRANSFORMER["text_dim"], d_kv=8, d_ff=32, num_layers=1, num_heads=4,
            relative_attention_num_buckets=8,
        )
        transformers.UMT5EncoderModel(encoder).save_pretrained(root / "text_encoder")
        diffusers.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1).save_pretrained(root / "vae")
        (root / "scheduler").mkdir(parents=True, exist_ok=True)
        (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER))
        (root / "transformer").mkdir(parents=True, exist_ok=True)
        (root / "transformer" / "config.json").write_text(json.dumps(TRANSFORMER))
        _transformer_weights(root / "transformer")
        (root / "model_index.json").write_text(json.dumps({"_class_name": "LingBotWorldCausalDMDPipeline"}))
    return root
