"""Pipelines registered in vLLM-Omni itself, named ``vllm-omni:<name>``: resolution and refusals.

Only that a name resolves to vLLM-Omni's own registry entry, and that every
wrong configuration is refused in one line before a server binds; serving
LingBot-World (a tiny random-weight checkpoint) is test_vllm_omni_lingbot.py.
Needs vLLM-Omni (``scripts/test-vllm-omni.sh``); the main suite skips this module.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

pytest.importorskip("vllm_omni", reason="vLLM-Omni is not installed; scripts/test-vllm-omni.sh runs these tests")

from vllm_omni.diffusion.registry import DiffusionModelRegistry  # noqa: E402

from arstream import cli  # noqa: E402
from arstream.app.settings import Settings, describe_settings_error  # noqa: E402
from arstream.models.registry import UnknownModel, load_pipeline  # noqa: E402
from arstream.runner.types import UnsupportedConfiguration  # noqa: E402
from arstream.runner.runtimes import build_runtime  # noqa: E402
from arstream.runner.vllm_omni.native import NativePipeline, registered_archs  # noqa: E402

LINGBOT = "LingBotWorldCausalDMDPipeline"
DREAMZERO = "DreamZeroPipeline"


@pytest.mark.parametrize("arch", [LINGBOT, DREAMZERO])
def test_a_name_resolves_to_vllm_omnis_registered_class(arch: str, tmp_path: Path) -> None:
    native = load_pipeline(f"vllm-omni:{arch}", model=str(tmp_path), num_inference_steps=4)
    entry = DiffusionModelRegistry.models[arch]
    assert isinstance(native, NativePipeline)
    assert (native.module_name, native.class_name) == (entry.module_name, entry.class_name)
    assert native.module_name.startswith("vllm_omni.diffusion.models.")
    assert native.weights == tmp_path and native.options == {"num_inference_steps": 4}
    settings = Settings(model=f"vllm-omni:{arch}", model_options={"model": str(tmp_path)}, runtime="vllm-omni")
    assert settings.model == f"vllm-omni:{arch}"


def test_an_unknown_name_is_one_line_listing_the_registered_names(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--runtime", "vllm-omni", "--model", "vllm-omni:NoSuchPipeline", "--model-options", "{}"]
    assert cli.main(argv) == 2  # returned before serving: nothing was bound
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert "--model (ARSTREAM_MODEL): unknown vLLM-Omni pipeline 'NoSuchPipeline'; vLLM-Omni registers " in err
    assert LINGBOT in err and DREAMZERO in err
    assert all(arch in err for arch in registered_archs())
    with pytest.raises(UnknownModel, match="NoSuchPipeline"):
        load_pipeline("vllm-omni:NoSuchPipeline", model="/")


def test_a_missing_weights_path_is_named_before_the_server_binds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "lingbot-world-weights"
    argv = ["serve", "--runtime", "vllm-omni", "--model", f"vllm-omni:{LINGBOT}", "--port", "0",
            "--model-options", f'{{"model": "{missing}"}}']
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert f"the weights path {str(missing)!r} does not exist" in err
    with pytest.raises(ValidationError) as no_path:
        Settings(model=f"vllm-omni:{LINGBOT}", runtime="vllm-omni")
    assert "loads its weights from a path" in describe_settings_error(no_path.value)


def test_the_arstream_runtime_refuses_a_vllm_omni_model(tmp_path: Path) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(model=f"vllm-omni:{LINGBOT}", model_options={"model": str(tmp_path)}, runtime="arstream")
    assert describe_settings_error(refused.value) == (
        f"--runtime (ARSTREAM_RUNTIME): model 'vllm-omni:{LINGBOT}' is a pipeline registered in vLLM-Omni: "
        "serve it with --runtime vllm-omni, got 'arstream'"
    )
    native = load_pipeline(f"vllm-omni:{LINGBOT}", model=str(tmp_path))
    with pytest.raises(UnsupportedConfiguration, match="serve it with --runtime vllm-omni"):
        build_runtime("arstream", native, kv_budget_bytes=1 << 20)


def test_a_registered_ar_diffusion_pipeline_that_is_no_world_model_is_refused_with_the_reason(tmp_path: Path) -> None:
    """DreamZero (a robot policy) is AR-Diffusion but returns actions; LingBot-World: test_vllm_omni_lingbot.py."""
    native = load_pipeline(f"vllm-omni:{DREAMZERO}", model=str(tmp_path))
    with pytest.raises(UnsupportedConfiguration, match=rf"^vllm-omni:{DREAMZERO} ") as refused:
        build_runtime("vllm-omni", native, kv_budget_bytes=1 << 20)
    message = str(refused.value)
    assert "robot policy" in message or "does not import here" in message, message


def test_a_registered_pipeline_that_is_not_ar_diffusion_is_refused_when_the_runtime_is_built(tmp_path: Path) -> None:
    """ZImagePipeline (text to image) imports here; it lacks the capability vLLM-Omni's AR runner requires."""
    native = load_pipeline("vllm-omni:ZImagePipeline", model=str(tmp_path))
    with pytest.raises(UnsupportedConfiguration) as refused:
        build_runtime("vllm-omni", native, kv_budget_bytes=1 << 20)
    assert str(refused.value) == (
        "vllm-omni:ZImagePipeline is not an AR-Diffusion pipeline: it lacks ar_diffusion_kv_cache_spec, "
        "bind_ar_diffusion_state, reset_ar_diffusion_session, close_ar_diffusion_session (SupportsARDiffusionPipeline)"
    )
