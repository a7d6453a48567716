"""Choosing the runtime: the setting, the factory, and the message when vLLM-Omni is not installed."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from arstream.app.settings import Settings
from arstream.models.fake import FakeKVPipeline
from arstream.runner.runner import ARRunner, UnsupportedConfiguration
from arstream.runner.runtimes import build_runtime, vllm_omni_available


def test_default_runtime_is_arstreams_runner() -> None:
    assert Settings(model="fake-kv").runtime == "arstream"
    assert isinstance(build_runtime("arstream", FakeKVPipeline(), kv_budget_bytes=1 << 20), ARRunner)


def test_runtime_setting_takes_only_known_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARSTREAM_RUNTIME", "vllm-omni")
    assert Settings(model="fake-kv").runtime == "vllm-omni"
    with pytest.raises(ValidationError, match="arstream"):
        Settings(model="fake-kv", runtime="vllm")


def test_unknown_runtime_names_the_choices() -> None:
    with pytest.raises(UnsupportedConfiguration, match=r"unknown runtime 'vllm'; expected one of \['arstream', 'vllm-omni'\]"):
        build_runtime("vllm", FakeKVPipeline(), kv_budget_bytes=1 << 20)


@pytest.mark.skipif(vllm_omni_available(), reason="vLLM-Omni is installed here")
def test_vllm_omni_without_the_extra_says_how_to_install_it() -> None:
    with pytest.raises(UnsupportedConfiguration, match=r"pip install 'arstream\[vllm-omni\]'"):
        build_runtime("vllm-omni", FakeKVPipeline(), kv_budget_bytes=1 << 20)
