"""The per-prompt cache: on its own (fake encoder and projection) cleaned keys as they come, counted encodes, referenced entries
kept, unreferenced ones bounded by ``spare`` in LRU order; in the real tiny pipeline, that bound counted in capacity."""

from __future__ import annotations

import torch

from arstream.models.longlive.loading import load_longlive
from arstream.models.longlive.pipeline import LongLivePipeline
from arstream.models.longlive.prompts import Prompts
from arstream.runner.pool import budget_for_sessions
from arstream.runner.runner import ARRunner, runner_for_sessions
from arstream.runner.types import ChunkResult, TickRequest


def fake_prompts(spare: int) -> tuple[Prompts, list[str]]:
    encoded: list[str] = []

    def fake_encode(text: str) -> torch.Tensor:
        encoded.append(text)
        return torch.full((len(text), 2), float(len(text)))

    def fake_project(tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(tokens, -tokens)]

    return Prompts(fake_encode, fake_project, spare=spare), encoded


def test_one_encode_per_cleaned_prompt_and_unused_entries_bounded_in_lru_order() -> None:
    prompts, encoded = fake_prompts(spare=1)
    first = prompts.get("a fox")  # prompts come cleaned (the pipeline's prepare_prompt, as they arrive)
    assert prompts.get("a fox") is first and encoded == ["a fox"] and prompts.encodes == 1
    assert prompts.acquire("a fox") is first  # a session's history is under it: kept whatever the LRU does
    prompts.get("b")
    prompts.get("c")  # unused "b" and "c": only one unused entry is kept, the most recent
    assert prompts.cached() == ["a fox", "c"]
    prompts.drop("a fox")  # no session under it any more: now it ages out like the others
    prompts.get("d")
    assert prompts.cached() == ["d"] and prompts.encodes == 4
    prompts.get("b")  # evicted earlier: encoded again (the same weights give the same K/V)
    assert prompts.encodes == 5 and encoded[-1] == "b"
    assert first.nbytes == first.tokens.numel() * 4 * 3  # tokens, K and V


# ---- the real tiny pipeline: what the cache holds is inside what capacity reserves -------------------------


def cached_bytes(pipeline: LongLivePipeline) -> int:
    entries = [pipeline.prompts.entry(text) for text in pipeline.prompts.cached()]
    return sum(entry.nbytes for entry in entries if entry is not None)


def test_cached_prompts_no_session_uses_are_counted_in_capacity() -> None:
    """A budget that fits two sessions when the cache keeps nothing spare fits one when it keeps three; and at
    every moment, mid-forward included, the cache holds at most the prompts capacity reserved room for."""
    none_spare = load_longlive(config="tiny", random_init=True, prompt_cache=0)
    three_spare = load_longlive(config="tiny", random_init=True, prompt_cache=3)
    prompt = three_spare.prompt_bytes
    assert three_spare.kv_cache_spec().model_owned_bytes_fixed == 3 * prompt
    tight = budget_for_sessions(none_spare.kv_cache_spec(), 2, max_batch_sessions=2)
    assert ARRunner(none_spare, kv_budget_bytes=tight, max_batch_sessions=2).stats().session_capacity == 2
    # /v1/stats reports this figure (the hub reads RunnerStats.session_capacity)
    assert ARRunner(three_spare, kv_budget_bytes=tight, max_batch_sessions=2).stats().session_capacity == 1

    runner = runner_for_sessions(three_spare, 2, max_batch_sessions=2)
    seen: list[tuple[int, int]] = []  # (cached bytes, bytes reserved for prompts) inside each re-cache
    original = three_spare._recache

    def recording(*args: object) -> None:
        seen.append((cached_bytes(three_spare), (3 + 2 + 2) * prompt))  # spare, 2 sessions, 2 rows in flight
        original(*args)  # type: ignore[arg-type]

    three_spare._recache = recording  # type: ignore[method-assign,assignment]
    words = ["fox", "street", "reef", "desert", "forest", "harbour", "glacier", "market", "canyon"]
    for i in range(6):  # every chunk both sessions switch to prompts never seen before
        ticks = [TickRequest(session_id=s, request_id=i, controls={}, prompt=f"a {words[(2 * i + j) % 9]} {i}")
                 for j, s in enumerate("xy")]  # fmt: skip
        assert all(isinstance(r, ChunkResult) for r in runner.execute(ticks))
        assert three_spare.prompts.unused() <= 3
        assert cached_bytes(three_spare) <= (3 + len(runner.resident_sessions())) * prompt
    assert len(seen) == 10 and all(held <= reserved for held, reserved in seen)  # chunks 1..5 switch, 2 rows each
    assert runner.counters.batched_forwards_total == 6
    for s in "xy":
        runner.close_session(s)
    assert three_spare.prompts.unused() <= 3 and cached_bytes(three_spare) <= 3 * prompt
    assert runner.pool.num_free == runner.blocks_free_at_start
