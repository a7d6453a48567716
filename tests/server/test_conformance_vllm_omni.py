"""Conformance: ARStream's runner and vLLM-Omni's runner, same pipeline, same rollout, compared step by step.

Both runtimes run the same rollout through the same interface (``execute``),
each with its own instance of the same seeded pipeline: interleaved sessions
for more than three windows of chunks, a reset, a failure in the middle of a
committing pass, a close, and eviction past capacity. At every step they must
agree on the K/V every pass sees, the frames, the LRU order of resident
sessions and the pipeline's reset/close notifications; each side's block
usage must be its documented function of the sessions' histories (the two
differ by design: docs/vllm-omni.md, "Capacity"). Choices where they differ
are asserted as each side's documented behaviour.

Needs vLLM-Omni (``scripts/test-vllm-omni.sh`` installs it in its own venv);
the main suite skips this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm_omni", reason="vLLM-Omni is not installed; scripts/test-vllm-omni.sh runs this suite")

from arstream.models.fake import FakeKVPipeline  # noqa: E402
from arstream.models.toy_attention import ToyAttentionPipeline  # noqa: E402
from arstream.runner.pool import PoolBudgetError, plan_pool  # noqa: E402
from arstream.runner.runner import ARRunner  # noqa: E402
from arstream.runner.runtimes import Runtime  # noqa: E402
from arstream.runner.spec import KVCacheSpec  # noqa: E402
from arstream.runner.types import ChunkResult, TickFailure, TickRequest, TickResult  # noqa: E402
from arstream.runner.vllm_omni.runtime import VllmOmniRunner  # noqa: E402
from arstream.runner.vllm_omni.spec import omni_resident_blocks, omni_session_capacity  # noqa: E402

BUDGET = 64 << 20  # large: the spec's session cap (3) binds on both sides, so eviction order is comparable
SPEC = dict(num_layers=2, num_kv_heads=2, head_size=8, tokens_per_frame=4, sink_frames=1, window_frames=6, session_capacity=3)


class MidForwardError(RuntimeError):
    """Raised on purpose by the recording fake in the middle of a committing pass."""


class RecordedState:
    """Wraps a bound session state: logs the K/V of every pass and fails on demand (see ``mode``)."""

    def __init__(self, state: Any, log: list[tuple[str, bool, int, torch.Tensor, torch.Tensor]], mode: str | None):
        self.state = state
        self.log = log
        self.mode = mode
        self.commit = False

    @property
    def frame_start(self) -> int:
        return self.state.frame_start

    def begin_pass(self, *, commit: bool) -> None:
        # "no-commit": every pass is a denoise pass, so the forward never commits its chunk.
        self.commit = commit and self.mode != "no-commit"
        self.state.begin_pass(commit=self.commit)

    def write_and_gather(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, branch: str = "main"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k_all, v_all = self.state.write_and_gather(layer, k, v, branch)
        self.log.append((self.state.session_id, self.commit, layer, k_all.clone(), v_all.clone()))
        if self.commit and layer == 1:
            if self.mode == "fail":
                raise MidForwardError("asked to fail in the middle of the committing pass")
            if self.mode == "interrupt":
                raise KeyboardInterrupt
        return k_all, v_all

    def end_pass(self) -> None:
        self.state.end_pass()


class RecordingToyPipeline(ToyAttentionPipeline):
    """Test fake: the toy attention model, logging what every pass sees and the notifications it gets.

    Controls ``{"mode": "fail" | "interrupt" | "no-commit"}`` make a forward
    raise mid-commit, raise ``KeyboardInterrupt`` mid-commit, or commit nothing.
    ``close_raises`` names sessions whose close notification raises.
    """

    def __init__(self, **options: Any) -> None:
        super().__init__(steps=2, **{**SPEC, **options})
        self.passes: list[tuple[str, bool, int, torch.Tensor, torch.Tensor]] = []
        self.events: list[tuple[str, str]] = []
        self.close_raises: set[str] = set()
        self._mode: str | None = None

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        self._mode = tick.controls.get("mode")
        return super().generate_chunk(tick)

    def bound_state(self, session_id: str) -> Any:
        return RecordedState(super().bound_state(session_id), self.passes, self._mode)

    def reset_session(self, session_id: str) -> None:
        self.events.append(("reset", session_id))
        super().reset_session(session_id)

    def close_session(self, session_id: str) -> None:
        self.events.append(("close", session_id))
        super().close_session(session_id)
        if session_id in self.close_raises:
            raise RuntimeError(f"close hook of {session_id} raises")


def both(pipeline_factory: Callable[[], Any], **options: Any) -> tuple[Runtime, Runtime]:
    """(ARStream's runner, vLLM-Omni's runner), each over its own pipeline instance, from one budget."""
    options = {"kv_budget_bytes": BUDGET, **options}
    return ARRunner(pipeline_factory(), **options), VllmOmniRunner(pipeline_factory(), **options)


# ---- the rollout -------------------------------------------------------------------------


@dataclass
class Step:
    """One runner call: ticks through ``execute``, or a close."""

    ticks: list[TickRequest] = field(default_factory=list)
    close: str | None = None


def rollout() -> list[Step]:
    """Interleaved a/b past three windows, reset, mid-forward failure, close, and eviction past capacity 3."""
    steps: list[Step] = []
    request = iter(range(10_000))

    def tick(session: str, **kwargs: Any) -> Step:
        return Step([TickRequest(session_id=session, request_id=next(request), seed=7, **kwargs)])

    for i in range(12):  # 12 chunks each = 24 frames: four windows of 6
        steps += [tick("a", controls={"keys": ["w"]} if i % 3 else {}), tick("b")]
    steps += [tick("a", reset=True), tick("a"), tick("b", controls={"mode": "fail"}), tick("b"), tick("b")]
    steps += [tick("c"), tick("c"), Step(close="a"), tick("d"), tick("c")]
    steps += [tick("e")]  # resident b, d, c: e evicts b (least recently used)
    steps += [tick("b"), tick("a", close=True), tick("e")]  # b back (evicts d), a runs and closes in one tick
    return steps


def run_step(runner: Runtime, step: Step) -> list[TickResult]:
    if step.close is not None:
        runner.close_session(step.close)
        return []
    return runner.execute(step.ticks)


def same_result(left: TickResult, right: TickResult) -> bool:
    if isinstance(left, TickFailure) or isinstance(right, TickFailure):
        return type(left) is type(right) and type(left.error) is type(right.error)
    return (left.chunk_index, left.new_rollout, left.request_id) == (
        right.chunk_index,
        right.new_rollout,
        right.request_id,
    ) and np.array_equal(left.frames, right.frames)


def used_blocks(spec: KVCacheSpec, frames: dict[str, int], per_session: Callable[[int], int]) -> int:
    return sum(per_session(n) for n in frames.values()) * len(spec.kv_branches)


def test_same_rollout_same_kv_frames_lru_and_notifications() -> None:
    arstream, omni = both(RecordingToyPipeline, max_batch_sessions=1)
    spec = arstream.spec
    assert arstream.session_capacity == omni.session_capacity == 3
    free_at_start = (arstream.stats().blocks_free, omni.stats().blocks_free)
    frames: dict[str, int] = {}  # frames each resident session has committed (the same on both sides)
    for number, step in enumerate(rollout()):
        left, right = run_step(arstream, step), run_step(omni, step)
        where = f"step {number}: {step}"
        assert len(left) == len(right), where
        for a, b in zip(left, right):
            assert same_result(a, b), f"{where}: {a} != {b}"
            if isinstance(a, ChunkResult):
                frames[a.session_id] = (a.chunk_index + 1) * spec.frames_per_chunk
        assert arstream.resident_sessions() == omni.resident_sessions(), where
        frames = {s: frames.get(s, 0) for s in arstream.resident_sessions()}
        assert arstream.pipeline.events == omni.pipeline.events, where
        assert arstream.stats().blocks_used == used_blocks(spec, frames, lambda n: min(n, spec.resident_frames)), where
        assert omni.stats().blocks_used == used_blocks(spec, frames, lambda n: omni_resident_blocks(spec, n)), where

    passes_a, passes_b = arstream.pipeline.passes, omni.pipeline.passes
    assert len(passes_a) == len(passes_b)
    for i, (a, b) in enumerate(zip(passes_a, passes_b)):
        assert a[:3] == b[:3], f"pass {i}"
        assert torch.equal(a[3], b[3]) and torch.equal(a[4], b[4]), f"pass {i} ({a[:3]}) saw different K/V"
    # Negative control: the log is not trivially equal (K/V differ between sessions and chunks).
    assert not torch.equal(passes_a[0][3], passes_a[-1][3])

    assert ("close", "b") in omni.pipeline.events  # the eviction and the mid-forward failure were notified
    # e evicts b, b's return evicts d, a's return evicts c
    assert omni.stats().evictions_total == arstream.stats().evictions_total == 3
    for session in arstream.resident_sessions():
        arstream.close_session(session)
        omni.close_session(session)
    assert (arstream.stats().blocks_free, omni.stats().blocks_free) == free_at_start


def test_window_counts_the_current_chunk_on_both() -> None:
    """With sink 1, window 6 and 2 frames a chunk, a chunk attends to 1 + 6 frames once the window is full."""
    arstream, omni = both(RecordingToyPipeline)
    spec = arstream.spec
    for i in range(8):
        for runner in (arstream, omni):
            runner.execute_tick(TickRequest(session_id="s", request_id=i))
    visible = (spec.sink_frames + spec.window_frames) * spec.tokens_per_frame
    for runner in (arstream, omni):
        last = runner.pipeline.passes[-1]
        assert last[1] is True and last[3].shape[0] == visible


def test_reset_at_boundary_keeps_only_the_sink_on_both() -> None:
    """One meaning of ``reset_at_boundary``: every chunk sees the sink and itself (2, 3, 3, 3 frames), same K/V."""
    arstream, omni = both(lambda: RecordingToyPipeline(reset_at_boundary=True))
    spec = arstream.spec
    for i in range(6):
        for runner in (arstream, omni):
            runner.execute_tick(TickRequest(session_id="s", request_id=i, seed=5))
    seen = {}
    for runner in (arstream, omni):
        commits = [p for p in runner.pipeline.passes if p[1] and p[2] == 0]
        seen[runner] = [entry[3].shape[0] // spec.tokens_per_frame for entry in commits]
        assert seen[runner] == [2, 3, 3, 3, 3, 3]
    for left, right in zip(arstream.pipeline.passes, omni.pipeline.passes):
        assert torch.equal(left[3], right[3]) and torch.equal(left[4], right[4])
    assert arstream.stats().blocks_used == spec.sink_frames
    assert omni.stats().blocks_used == spec.sink_frames


@pytest.mark.parametrize("model", ["fake-kv", "tiny-world"])
def test_shipped_pipelines_give_the_same_frames(model: str) -> None:
    """fake-kv (frames encode the KV read) and tiny-world give identical chunks on both runtimes."""
    from arstream.models.registry import load_pipeline

    chunks = 14 if model == "fake-kv" else 6
    arstream, omni = both(lambda: load_pipeline(model))
    for runner in (arstream, omni):
        runner.warmup()
    for i in range(chunks):
        for session in ("x", "y"):
            controls = {"keys": ["w"]} if model == "fake-kv" and i % 2 else {}
            tick = TickRequest(session_id=session, request_id=i, seed=3, controls=controls)
            a, b = arstream.execute_tick(tick), omni.execute_tick(tick)
            assert a.chunk_index == b.chunk_index == i
            assert np.array_equal(a.frames, b.frames), f"{model} chunk {i} of {session} differs"


def test_fake_kv_frames_prove_the_visible_history() -> None:
    """fake-kv's pixel is the sum of the codes it read: on vLLM-Omni it matches the dense reference too."""
    from arstream.models.fake import expected_frame_value, frame_code

    omni = VllmOmniRunner(FakeKVPipeline(sink_frames=1, window_frames=6), kv_budget_bytes=BUDGET)
    spec = omni.spec
    codes: list[float] = []
    for i in range(10):
        result = omni.execute_tick(TickRequest(session_id="s", request_id=i))
        start = i * spec.frames_per_chunk
        chunk = [frame_code(start + f, {}) for f in range(spec.frames_per_chunk)]
        history = codes[: spec.sink_frames] + codes[spec.sink_frames :][-(spec.window_frames - spec.frames_per_chunk) :]
        expected = [expected_frame_value(history + chunk[: f + 1]) for f in range(spec.frames_per_chunk)]
        assert result.frames[:, 0, 0, 0].tolist() == expected, f"chunk {i}"
        codes += chunk


# ---- capacity from one budget -------------------------------------------------------------


def _arstream_capacity(spec: KVCacheSpec, budget: int) -> int:
    try:
        return plan_pool(spec, budget).session_capacity
    except PoolBudgetError:
        return 0


def _omni_capacity(pipeline: Any, budget: int) -> int:
    try:
        return VllmOmniRunner(pipeline, kv_budget_bytes=budget).session_capacity
    except ValueError:  # vLLM-Omni: "available device memory cannot fit one session"
        return 0


def test_capacity_from_the_same_budget_within_the_documented_difference() -> None:
    """vLLM-Omni keeps sink + window blocks a session, ARStream sink + window - chunk plus a staging row.

    So ARStream admits at most one session fewer (its staging row is one
    session's worth at most), and more once the budget holds several sessions.
    Each side's figure is its documented formula.
    """
    pipeline = RecordingToyPipeline(session_capacity=64)
    spec = pipeline.spec
    block = spec.block_bytes
    seen_more = False
    for blocks in (9, 12, 13, 20, 27, 40, 70, 130, 400):
        budget = blocks * block
        mine, theirs = _arstream_capacity(spec, budget), _omni_capacity(pipeline, budget)
        assert theirs == omni_session_capacity(spec, budget), f"{blocks} blocks"
        assert mine >= theirs - 1, f"{blocks} blocks: ARStream {mine}, vLLM-Omni {theirs}"
        seen_more |= mine > theirs
    assert seen_more  # at larger budgets ARStream's smaller resident set admits more


# ---- documented divergences ----------------------------------------------------------------


def _fill(runner: Runtime, sessions: Iterable[str]) -> None:
    for i, session in enumerate(sessions):
        runner.execute_tick(TickRequest(session_id=session, request_id=i))


def test_close_hook_raising_during_eviction() -> None:
    """ARStream logs the failed hook and serves the new session; vLLM-Omni fails the tick that needed the room."""
    arstream, omni = both(lambda: RecordingToyPipeline(session_capacity=2))
    for runner in (arstream, omni):
        _fill(runner, ["a", "b"])
        runner.pipeline.close_raises.add("a")
        (result,) = runner.execute([TickRequest(session_id="c", request_id=9)])
        assert not runner.is_resident("a")  # evicted and its blocks returned on both
        if runner is arstream:
            assert isinstance(result, ChunkResult) and runner.resident_sessions() == ["b", "c"]
        else:
            assert isinstance(result, TickFailure) and "close hook of a raises" in str(result.error)
            assert runner.resident_sessions() == ["b"]


def test_keyboard_interrupt_mid_forward() -> None:
    """ARStream releases the session; vLLM-Omni leaves it resident holding the chunk's uncommitted blocks."""
    arstream, omni = both(RecordingToyPipeline)
    spec = arstream.spec
    chunk_blocks = spec.frames_per_chunk * len(spec.kv_branches)
    for runner in (arstream, omni):
        _fill(runner, ["a"])
        free_before = runner.stats().blocks_free
        with pytest.raises(KeyboardInterrupt):
            runner.execute([TickRequest(session_id="a", request_id=5, controls={"mode": "interrupt"})])
        if runner is arstream:
            assert not runner.is_resident("a") and runner.stats().blocks_free == arstream.pool.num_blocks
        else:
            assert runner.is_resident("a") and runner.stats().blocks_free == free_before - chunk_blocks


def test_forward_that_commits_no_chunk() -> None:
    """ARStream fails such a forward and releases the session; vLLM-Omni returns its frames, timeline unmoved."""
    arstream, omni = both(RecordingToyPipeline)
    for runner in (arstream, omni):
        _fill(runner, ["a"])
        (result,) = runner.execute([TickRequest(session_id="a", request_id=5, controls={"mode": "no-commit"})])
        if runner is arstream:
            assert isinstance(result, TickFailure) and "did not commit exactly one chunk" in str(result.error)
            assert not runner.is_resident("a")
        else:
            assert isinstance(result, ChunkResult) and result.chunk_index == 1
            assert runner.is_resident("a") and runner.frames_committed("a") == runner.spec.frames_per_chunk


# ---- the realtime video dialect against vLLM-Omni's own handlers (issue 37) ------------------------------


def vllm_omni_constant(relative_path: str, name: str) -> Any:
    """A module-level constant of vLLM-Omni, read from its source without importing it: the handler's package
    imports vLLM's OpenAI server (and, through transformers, torchvision, which this lane uninstalls)."""
    import ast

    import vllm_omni

    path = Path(vllm_omni.__file__).parent / relative_path
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return eval(compile(ast.Expression(node.value), str(path), "eval"), {}, {})  # upstream's own literal
    raise AssertionError(f"{relative_path} no longer defines {name}")


def test_dialect_limits_and_defaults_are_vllm_omnis() -> None:
    """The control message limit, the seed range, the blend and target defaults: read from vLLM-Omni itself."""
    from pydantic import ValidationError

    from arstream.app import realtime_video_events as dialect
    from arstream.runner.contract import DEFAULT_PROMPT_TRANSITION_CHUNKS
    from arstream.runner.vllm_omni.deprecations import importing_vllm

    with importing_vllm():
        from vllm_omni.diffusion.interaction.modality_handlers import camera as omni_camera
        from vllm_omni.diffusion.interaction.modality_handlers import prompt as omni_prompt

    stream, videos = "entrypoints/openai/serving_video_output_stream.py", "entrypoints/openai/protocol/videos.py"
    assert dialect.MAX_CONTROL_MESSAGE_BYTES == vllm_omni_constant(stream, "_MAX_CONTROL_MESSAGE_SIZE")
    assert DEFAULT_PROMPT_TRANSITION_CHUNKS == omni_prompt.DEFAULT_TRANSITION_CHUNKS
    assert dialect.DEFAULT_TARGET_TRANSITION_CHUNKS == omni_camera.SE3DeltaCameraHandler.default_transition_chunks
    # vLLM-Omni's seed: Field(ge=_INT64_MIN, le=_INT64_MAX); ours takes exactly that range.
    low, high = vllm_omni_constant(videos, "_INT64_MIN"), vllm_omni_constant(videos, "_INT64_MAX")
    assert (low, high) == (-(2**63), 2**63 - 1)
    for seed in (low, -5, 0, high):
        dialect.SessionStart(type="session.start", prompt="x", seed=seed)
    for seed in (low - 1, high + 1):
        with pytest.raises(ValidationError):
            dialect.SessionStart(type="session.start", prompt="x", seed=seed)


def test_camera_target_default_mode_and_length_are_vllm_omnis() -> None:
    """A camera event without mode is a target on both; it lasts the chunks vLLM-Omni's timeline takes to reach it."""
    from vllm_omni.diffusion.interaction.modality_handlers.camera import CameraSession, SE3DeltaCameraHandler
    from vllm_omni.diffusion.worker.utils import StepRequestState
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    from arstream.app.realtime_video_events import camera_move

    card = FakeKVPipeline(width=8, height=8).model_card()
    payload = {"data": {"translation": [0.0, 0.0, 1.0], "rotation": [0.0, 0.0, 0.0, 1.0]}}  # no mode
    for transition in (None, 1, 2, 3):
        handler = SE3DeltaCameraHandler()
        state = StepRequestState(request_id="r", sampling=OmniDiffusionSamplingParams())
        handler.enqueue(state, event_id="e", received_at=0.0, payload=payload, transition_chunks=transition)
        session = state.interaction_sessions["camera"]
        assert isinstance(session, CameraSession) and session.pending_events[0].mode == "target"
        chunks = 0
        while True:
            chunks += 1
            meta = handler.apply_at_chunk_boundary(state, boundary_at=0.0, num_media_frames=2, fps=16.0)
            assert meta is not None
            if "e" in meta.completed_event_ids:
                break
        assert session.current_pose.translation == pytest.approx((0.0, 0.0, 1.0))
        move = camera_move(payload, card, transition)
        assert move.hold_chunks == chunks and move.controls == {"keys": ["w"]} and move.release == {"keys": []}


def test_prompt_blend_weights_are_vllm_omnis_lerp() -> None:
    """vLLM-Omni's prompt handler on one-hot embeddings gives, chunk by chunk, the weights PromptBlend gives."""
    from vllm_omni.diffusion.interaction.modality_handlers.prompt import PromptInteractionHandler
    from vllm_omni.diffusion.worker.utils import StepRequestState
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    from arstream.runner.prompt_blend import PromptBlend

    prompts = ["a", "b", "c", "d"]

    def one_hot(prompt: str, **_: Any) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.one_hot(torch.tensor(prompts.index(prompt)), len(prompts)).double(), None

    handler = PromptInteractionHandler(encode_prompt=one_hot, device="cpu", dtype=torch.float64)
    state = StepRequestState(request_id="r", sampling=OmniDiffusionSamplingParams())
    state.prompt_embeds = one_hot("a")[0]
    blend = PromptBlend.holding("a")
    # (chunk, new prompt, transition_chunks): a change cut short by another, a sharp one, and vLLM-Omni's default.
    changes = {1: ("b", 4), 3: ("c", 2), 6: ("d", 0), 8: ("b", None)}
    current, transition = "a", 0
    for chunk in range(14):
        if chunk in changes:
            current, chunks = changes[chunk]
            handler.enqueue(state, event_id=f"e{chunk}", received_at=0.0, payload={"prompt": current},
                            transition_chunks=chunks)  # fmt: skip
            transition = 3 if chunks is None else chunks
        if "prompt" in state.interaction_sessions:
            handler.apply_at_chunk_boundary(state, boundary_at=0.0)
        if chunk > 0:
            blend = blend.next_chunk(current, transition)
        ours = torch.zeros(len(prompts), dtype=torch.float64)
        for prompt, weight in blend.weights():
            ours[prompts.index(prompt)] += weight
        assert torch.allclose(ours, state.prompt_embeds.double()), (chunk, ours, state.prompt_embeds)


def vllm_omni_function(relative_path: str, name: str) -> Any:
    """A function (or method) of vLLM-Omni's source, as an AST, found without importing the module."""
    import ast

    import vllm_omni

    tree = ast.parse((Path(vllm_omni.__file__).parent / relative_path).read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise AssertionError(f"{relative_path} no longer defines {name}")


def string_constants(node: Any) -> list[str]:
    import ast

    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_the_dialects_ends_are_vllm_omnis() -> None:
    """A message over the limit and a stall end as vLLM-Omni's handler ends them (issue 37's second part)."""
    import ast

    from arstream.app.protocol import CloseReason
    from arstream.app.realtime_video import RealtimeVideo

    stream = "entrypoints/openai/serving_video_output_stream.py"
    control_loop = vllm_omni_function(stream, "_control_loop")
    # Over the limit: its error, then `continue` (the session goes on), in the branch that tests the size.
    branches = [n for n in ast.walk(control_loop) if isinstance(n, ast.If)]
    (too_large,) = [n for n in branches if "_MAX_CONTROL_MESSAGE_SIZE" in ast.unparse(n.test)]
    assert "control message too large" in string_constants(too_large)
    assert isinstance(too_large.body[-1], ast.Continue)
    # A stall: its error, the request stopped; handle_session then sends session.done with stopped true.
    (stall,) = [n for n in branches if "stalled_for" in ast.unparse(n.test)]
    (stall_message,) = [text for text in string_constants(stall) if text.startswith("Stall timeout")]
    assert "stop_event.set()" in ast.unparse(stall)
    handle_session = ast.unparse(vllm_omni_function(stream, "handle_session"))
    assert "'type': 'session.done'" in handle_session and "stop_event.is_set()" in handle_session

    dialect = RealtimeVideo()
    assert dialect.idle_detail.startswith(stall_message) and dialect.idle_close_code == 1000

    class UnusedLiveSession:  # closed() reads nothing of its live session for a stall (only on shutdown)
        metrics = None

    done = dialect.closed(UnusedLiveSession(), CloseReason.IDLE_TIMEOUT)  # type: ignore[arg-type]
    assert done is not None and '"type":"session.done"' in done.replace(" ", "") and '"stopped":true' in done
