"""LongLive's weights in the published layout: tiny files written here, loaded, the LoRA merged as peft computes it."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
from longlive_reference import DenseContext
from transformers import UMT5EncoderModel

from arstream.models.longlive.checkpoint import T5_FILE, VAE_FILE, lora_targets
from arstream.models.longlive.config import get_config
from arstream.models.longlive.dit import LongLiveDiT
from arstream.models.longlive.loading import load_longlive
from arstream.models.longlive.text import TOKENIZER_DIR, byte_tokenizer, transformers_to_wan_t5, umt5_config
from arstream.models.wan.checkpoint import CheckpointError
from arstream.models.wan.vae import build_vae

CFG = get_config("tiny")


def write_published(directory: Path) -> tuple[LongLiveDiT, peft.PeftModel]:
    """longlive_base.pt (``generator``, ``model.`` keys), lora.pt (``generator_lora``, peft's keys), umT5 in Wan's
    layout, the VAE and the tokenizer directory; returns the base DiT and the peft model the LoRA came from."""
    base = LongLiveDiT(CFG)
    base.init_random(5)
    torch.save({"generator": {f"model.{k}": v for k, v in base.state_dict().items()}}, directory / CFG.dit_file)
    adapted = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=CFG.lora_rank, lora_alpha=CFG.lora_alpha,
                                                                       target_modules=lora_targets(base)))  # fmt: skip
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:  # lora_B starts at zero in peft: give both factors values so the merge shows
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    torch.save({"generator_lora": peft.get_peft_model_state_dict(adapted)}, directory / str(CFG.lora_file))
    torch.save(transformers_to_wan_t5(UMT5EncoderModel(umt5_config(CFG.text)).state_dict()), directory / T5_FILE)
    vae: Any = build_vae(CFG)
    torch.save(vae.state_dict(), directory / VAE_FILE)
    byte_tokenizer().save_pretrained(str(directory / TOKENIZER_DIR))
    return base, adapted


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LongLiveDiT, peft.PeftModel]:
    directory = tmp_path_factory.mktemp("longlive")
    base, adapted = write_published(directory)
    return directory, base, adapted


def forward(model: torch.nn.Module, kv_model: Any) -> torch.Tensor:
    torch.manual_seed(1)
    x = torch.randn(1, CFG.in_dim, 3, CFG.latent_height, CFG.latent_width)
    tokens = torch.randn(5, CFG.text.dim)
    with torch.inference_mode():
        kv = kv_model.cross_kv(kv_model.text_context(tokens))
        return model(x, torch.full((1, 3), 500.0), kv, DenseContext(3))


def test_the_published_layout_loads_with_the_lora_merged_as_peft_computes_it(
    published: tuple[Path, LongLiveDiT, peft.PeftModel],
) -> None:
    directory, base, adapted = published
    pipeline = load_longlive(config="tiny", checkpoint=str(directory))
    merged = pipeline.model
    # peft's adapter forward (unmerged), with cross-attention K/V through the adapter too
    assert float((forward(merged, merged) - forward(adapted, adapted.base_model.model)).abs().max()) <= 1e-5
    # the merge is not a no-op: the base weights alone compute something else
    assert float((forward(merged, merged) - forward(base, base)).abs().max()) >= 1e-3
    assert pipeline.prompts.encodes == 1  # the default prompt, warmed at load


def test_without_the_lora_the_base_loads_as_published(published: tuple[Path, LongLiveDiT, peft.PeftModel]) -> None:
    directory, base, _ = published
    pipeline = load_longlive(config="tiny", checkpoint=str(directory), no_lora=True)
    assert all(torch.equal(a, b) for a, b in zip(pipeline.model.state_dict().values(), base.state_dict().values()))


def test_a_missing_or_mismatched_file_fails_with_its_name_and_the_keys(
    published: tuple[Path, LongLiveDiT, peft.PeftModel], tmp_path: Path
) -> None:
    directory, _, _ = published
    with pytest.raises(CheckpointError, match=r"no umT5 encoder file in .*: looked for missing\.pth"):
        load_longlive(config="tiny", checkpoint=str(directory), t5_file="missing.pth")
    with pytest.raises(CheckpointError, match=r"no LongLive DiT file in .*: looked for longlive_base\.pt"):
        load_longlive(config="tiny", checkpoint=str(tmp_path))
    lora = torch.load(directory / str(CFG.lora_file), weights_only=True)["generator_lora"]
    del lora["base_model.model.blocks.1.ffn.2.lora_A.weight"]
    torch.save(lora, tmp_path / "lora.pt")
    with pytest.raises(CheckpointError, match=r"lora\.pt does not fit the model's LoRA \(rank 4\): missing keys: "
                                              r"base_model\.model\.blocks\.1\.ffn\.2\.lora_A\.weight"):  # fmt: skip
        load_longlive(config="tiny", checkpoint=str(directory), lora_file=str(tmp_path / "lora.pt"))
    state = torch.load(directory / CFG.dit_file, weights_only=True)
    state["generator"]["model.blocks.0.cross_attn.q.weight"] = torch.zeros(3, 3)
    torch.save(state, tmp_path / "base.pt")
    with pytest.raises(CheckpointError, match=r"base\.pt does not fit the model: wrong shapes: blocks\.0\.cross_attn\.q\.weight"):
        load_longlive(config="tiny", checkpoint=str(directory), dit_file=str(tmp_path / "base.pt"))


def test_self_forcings_and_causvids_published_checkpoints_load(
    published: tuple[Path, LongLiveDiT, peft.PeftModel],
) -> None:
    """Synthesised in their published layouts (as their inference scripts read them; the real files were not
    available here): Self-Forcing's ``self_forcing_dmd.pt`` holds ``generator``, ``generator_ema`` (with FSDP's
    wrapper segments in its names, as LongLive's loader expects of EMA copies) and ``critic``, and its README runs
    the EMA weights; CausVid's ``model.pt`` holds ``generator``. No LoRA for either."""
    directory, base, _ = published
    ema = LongLiveDiT(CFG)
    ema.init_random(11)
    critic = {"model.blocks.0.self_attn.q.weight": torch.zeros(2, 2)}

    def fsdp_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"model._fsdp_wrapped_module." + k.replace(".self_attn.", "._fsdp_wrapped_module.self_attn."): v
                for k, v in state.items()}  # fmt: skip

    plain = {f"model.{k}": v for k, v in base.state_dict().items()}
    torch.save({"generator": plain, "generator_ema": fsdp_names(ema.state_dict()), "critic": critic},
               directory / "self_forcing_dmd.pt")  # fmt: skip
    torch.save({"generator": plain}, directory / "model.pt")
    self_forcing = load_longlive(config="tiny-self-forcing", checkpoint=str(directory))
    assert all(torch.equal(a, b) for a, b in zip(self_forcing.model.state_dict().values(), ema.state_dict().values()))
    chosen = load_longlive(config="tiny-self-forcing", checkpoint=str(directory), dit_entry="generator")
    assert all(torch.equal(a, b) for a, b in zip(chosen.model.state_dict().values(), base.state_dict().values()))
    causvid = load_longlive(config="tiny-causvid", checkpoint=str(directory))
    assert all(torch.equal(a, b) for a, b in zip(causvid.model.state_dict().values(), base.state_dict().values()))
    with pytest.raises(CheckpointError, match=r"model\.pt has no 'generator_ema' entry \(its entries: generator\)"):
        load_longlive(config="tiny-self-forcing", checkpoint=str(directory), dit_file="model.pt")


def test_causal_forcings_published_checkpoints_load_and_a_mismatched_one_is_refused(
    published: tuple[Path, LongLiveDiT, peft.PeftModel], tmp_path: Path
) -> None:
    """Synthesised in the published layout (thu-ml/Causal-Forcing's README and ``inference.py``; the real files
    were not available here): ``chunkwise/causal_forcing.pt`` and ``framewise/causal_forcing.pt``, each holding
    ``generator`` and ``generator_ema`` with ``model.`` keys, the EMA copy's names under FSDP's
    ``model._fsdp_wrapped_module.`` (the prefix its loader rewrites). The README runs chunk-wise without
    ``--use_ema`` (``generator``) and frame-wise with it (``generator_ema``). No LoRA."""
    directory, base, _ = published
    ema = LongLiveDiT(CFG)
    ema.init_random(13)
    plain = {f"model.{k}": v for k, v in base.state_dict().items()}
    wrapped = {f"model._fsdp_wrapped_module.{k}": v for k, v in ema.state_dict().items()}
    for mode in ("chunkwise", "framewise"):
        (tmp_path / mode).mkdir()
        torch.save({"generator": plain, "generator_ema": wrapped}, tmp_path / mode / "causal_forcing.pt")
        for name in (T5_FILE, VAE_FILE, TOKENIZER_DIR.split("/")[0]):
            (tmp_path / mode / name).symlink_to(directory / name)
    chunkwise = load_longlive(config="tiny-causal-forcing", checkpoint=str(tmp_path / "chunkwise"))
    assert all(torch.equal(a, b) for a, b in zip(chunkwise.model.state_dict().values(), base.state_dict().values()))
    framewise = load_longlive(config="tiny-causal-forcing-framewise", checkpoint=str(tmp_path / "framewise"))
    assert all(torch.equal(a, b) for a, b in zip(framewise.model.state_dict().values(), ema.state_dict().values()))
    # a bad file is refused, naming it and the keys (the published loader's strict=False fallback would
    # have served it with the missing weights left at their initial values)
    broken = dict(wrapped)
    del broken["model._fsdp_wrapped_module.blocks.1.ffn.2.weight"]
    broken["model._fsdp_wrapped_module.head.head.weight"] = torch.zeros(2, 2)
    torch.save({"generator_ema": broken}, tmp_path / "framewise" / "bad.pt")
    refused = r"bad\.pt does not fit the model: missing keys: blocks\.1\.ffn\.2\.weight; wrong shapes: head\.head\.weight"
    with pytest.raises(CheckpointError, match=refused):
        load_longlive(config="tiny-causal-forcing-framewise", checkpoint=str(tmp_path / "framewise"), dit_file="bad.pt")
    # a checkpoint of another geometry (as a 14B file read into a 1.3B config): every shape named that differs
    other = LongLiveDiT(dataclasses.replace(CFG, dim=48))
    torch.save({"generator_ema": {f"model.{k}": v for k, v in other.state_dict().items()}}, tmp_path / "wide.pt")
    with pytest.raises(CheckpointError, match=r"wide\.pt does not fit the model: wrong shapes: patch_embedding\.weight "
                                              r"\(48, 16, 1, 2, 2\) \(model \(32, 16, 1, 2, 2\)\)"):  # fmt: skip
        load_longlive(config="tiny-causal-forcing-framewise", checkpoint=str(tmp_path / "framewise"),
                      dit_file=str(tmp_path / "wide.pt"))  # fmt: skip
