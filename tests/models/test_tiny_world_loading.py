"""Loading tiny-world weights: the shipped file loads; bad files fail naming the file and the expectation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from arstream.models.registry import DEFAULT_MODEL, load_pipeline
from arstream.models.tiny_world.model import TinyWorldConfig, TinyWorldDiT
from arstream.models.tiny_world.pipeline import TinyWorldPipeline, load_tiny_world
from arstream.models.tiny_world.weights import DEFAULT_WEIGHTS, WeightsError, save_weights

SMALL = TinyWorldConfig(d_model=32, num_layers=1, num_heads=2)
MAX_SHIPPED_BYTES = 20 * 1024 * 1024


@pytest.fixture
def small_weights(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "tiny_world.safetensors"
    save_weights(TinyWorldDiT(SMALL), path, tmp_path / "config.json")
    return path


def test_shipped_weights_exist_within_size_limit_and_load() -> None:
    assert DEFAULT_WEIGHTS.is_file(), f"{DEFAULT_WEIGHTS} is missing"
    assert DEFAULT_WEIGHTS.stat().st_size <= MAX_SHIPPED_BYTES
    pipeline = load_tiny_world(torch.device("cpu"))
    assert isinstance(pipeline, TinyWorldPipeline)
    assert pipeline.model_card()["name"] == "tiny-world"


def test_registry_default_is_tiny_world() -> None:
    assert DEFAULT_MODEL == "tiny-world"
    assert isinstance(load_pipeline(DEFAULT_MODEL, "cpu"), TinyWorldPipeline)


def test_small_weights_round_trip(small_weights: Path) -> None:
    pipeline = load_tiny_world(torch.device("cpu"), str(small_weights))
    assert pipeline.cfg == SMALL
    torch.manual_seed(0)
    saved = TinyWorldDiT(SMALL)
    for name, tensor in saved.state_dict().items():
        assert torch.equal(pipeline.model.state_dict()[name], tensor)


def test_missing_weights_file_is_named(tmp_path: Path, small_weights: Path) -> None:
    missing = tmp_path / "nowhere.safetensors"
    (tmp_path / "config.json").rename(tmp_path / "elsewhere.json")
    with pytest.raises(WeightsError, match="nowhere.safetensors: weights file not found"):
        load_tiny_world(torch.device("cpu"), str(missing), config_path=tmp_path / "elsewhere.json")


def test_missing_config_file_is_named(small_weights: Path) -> None:
    (small_weights.parent / "config.json").unlink()
    with pytest.raises(WeightsError, match=r"config\.json: config file not found"):
        load_tiny_world(torch.device("cpu"), str(small_weights))


def test_truncated_weights_file_is_named(small_weights: Path) -> None:
    data = small_weights.read_bytes()
    small_weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match=r"tiny_world\.safetensors: cannot read safetensors .*truncated"):
        load_tiny_world(torch.device("cpu"), str(small_weights))


def test_weights_not_matching_config_name_the_tensor_and_shapes(small_weights: Path) -> None:
    config = small_weights.parent / "config.json"
    payload = json.loads(config.read_text())
    payload["model"]["d_model"] = 64
    payload["model"]["num_heads"] = 4
    config.write_text(json.dumps(payload))
    with pytest.raises(WeightsError, match=(
            r"tiny_world\.safetensors: tensor '[\w.]+' is \(\d+(, \d+)*,?\) torch\.float32, "
            r"expected \(\d+(, \d+)*,?\) torch\.float32 for the config in .*config\.json"
        ),):
        load_tiny_world(torch.device("cpu"), str(small_weights))


def test_weights_with_missing_layers_are_rejected(small_weights: Path) -> None:
    config = small_weights.parent / "config.json"
    payload = json.loads(config.read_text())
    payload["model"]["num_layers"] = 2
    config.write_text(json.dumps(payload))
    with pytest.raises(WeightsError, match=r"do not match the config .*missing \['blocks\.1\."):
        load_tiny_world(torch.device("cpu"), str(small_weights))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"model": {}}), "expected a JSON object with format"),
        (json.dumps({"format": "arstream-tiny-world-v1", "model": {"d_model": 32, "warp": 9}}), "unknown config keys"),
        (json.dumps({"format": "arstream-tiny-world-v1", "model": {"d_model": 30, "num_heads": 4}}), "invalid model config"),
    ],
)
def test_bad_config_is_named(small_weights: Path, content: str, message: str) -> None:
    (small_weights.parent / "config.json").write_text(content)
    with pytest.raises(WeightsError, match=rf"config\.json: .*{message}"):
        load_tiny_world(torch.device("cpu"), str(small_weights))


def test_unknown_loader_option_is_rejected(small_weights: Path) -> None:
    with pytest.raises(TypeError, match="unknown options"):
        load_tiny_world(torch.device("cpu"), str(small_weights), turbo=True)


def test_a_config_saved_with_the_old_window_frames_key_loads_as_history_frames() -> None:
    """``window_frames`` meant the history besides the chunk here, and the chunk included in KVCacheSpec."""
    old = TinyWorldConfig.from_dict({"window_frames": 6, "frames_per_chunk": 2})
    assert old == TinyWorldConfig(history_frames=6, frames_per_chunk=2)
    pipeline = TinyWorldPipeline(TinyWorldDiT(TinyWorldConfig(history_frames=6)), torch.device("cpu"))
    assert pipeline.kv_cache_spec().window_frames == 8  # the runner's window counts the chunk
