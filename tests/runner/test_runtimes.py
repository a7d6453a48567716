"""Choosing the runtime: the setting, the factory, and the message when vLLM-Omni is not installed."""

from __future__ import annotations

from pathlib import Path
from typing import Generic, Protocol

import pytest
from pydantic import ValidationError

from arstream.app.settings import Settings, describe_settings_error
from arstream.models.fake import FakeKVPipeline
from arstream.runner.runner import ARRunner, runner_for_sessions
from arstream.runner.runtimes import RUNTIMES_BY_NAME, InspectableRuntime, Runtime, build_runtime
from arstream.runner.types import RUNTIMES, UnsupportedConfiguration
from arstream.runner.vllm_omni.native import vllm_omni_available


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


def test_a_vllm_omni_model_is_refused_on_the_arstream_runtime(tmp_path: Path) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(model="vllm-omni:LingBotWorldCausalDMDPipeline", model_options={"model": str(tmp_path)})
    assert describe_settings_error(refused.value) == (
        "--runtime (ARSTREAM_RUNTIME): model 'vllm-omni:LingBotWorldCausalDMDPipeline' is a pipeline registered in "
        "vLLM-Omni: serve it with --runtime vllm-omni, got 'arstream'"
    )


def test_a_vllm_omni_model_names_its_missing_weights_path(tmp_path: Path) -> None:
    missing = tmp_path / "weights"
    with pytest.raises(ValidationError, match=f"the weights path '{missing}' does not exist"):
        Settings(model="vllm-omni:DreamZeroPipeline", model_options={"model": str(missing)}, runtime="vllm-omni")


def members(interface: type) -> set[str]:
    """A Protocol's own members and its bases' (annotations and methods), without the Protocol machinery."""
    names: set[str] = set()
    for cls in interface.__mro__:
        if cls in (object, Protocol, Generic) or not getattr(cls, "_is_protocol", False):
            continue
        names |= {name for name in vars(cls) if not name.startswith("_")} | set(getattr(cls, "__annotations__", {}))
    return names


# What the server calls on a runtime (issue 32 narrowed it from 18): a member joins only when app/ needs it.
SERVER_INTERFACE = {
    "on_evict", "warmup_round_s", "batch_limit", "warmup", "model_card", "execute", "is_resident",
    "next_chunk_index", "branch_session", "close_session", "stats",
    "prepare_prompt",  # the transport prepares each prompt as it arrives, off the model thread
}


def test_the_servers_runtime_interface_stays_narrow() -> None:
    assert members(Runtime) == SERVER_INTERFACE
    assert members(InspectableRuntime) > SERVER_INTERFACE  # what tests and benches drive besides


def test_arstreams_runner_answers_every_member_of_both_interfaces() -> None:
    runner = build_runtime("arstream", FakeKVPipeline(), kv_budget_bytes=1 << 20)
    assert [name for name in sorted(members(InspectableRuntime)) if not hasattr(runner, name)] == []


def test_every_runtime_name_has_a_row_in_the_table() -> None:
    assert list(RUNTIMES_BY_NAME) == list(RUNTIMES)
    assert RUNTIMES_BY_NAME["arstream"].load() is ARRunner
    assert RUNTIMES_BY_NAME["arstream"].unavailable() is None


@pytest.mark.skipif(not vllm_omni_available(), reason="needs the vllm-omni extra (scripts/test-vllm-omni.sh)")
def test_vllm_omnis_runner_answers_every_member_of_both_interfaces() -> None:
    runner = build_runtime("vllm-omni", FakeKVPipeline(), kv_budget_bytes=64 << 20)
    assert [name for name in sorted(members(InspectableRuntime)) if not hasattr(runner, name)] == []


def test_stats_report_the_batch_limit_a_forward_uses_not_the_setting() -> None:
    """max_batch_sessions 8 over a pool of 2 sessions: a forward holds at most 2 (it must not evict its own)."""
    runner = runner_for_sessions(FakeKVPipeline(), 2, max_batch_sessions=8)
    assert runner.batch_limit == 2
    assert runner.stats().batch_limit == 2
