"""A prompt's preparation (app/prompts.py): once per prompt, remembered, and a session's new prompts bounded in
rate (a fake clock: no sleeps)."""

from __future__ import annotations

import pytest

from arstream.app.prompts import (
    PREPARED_MEMO,
    PROMPT_CHANGE_BURST,
    PROMPT_CHANGES_PER_S,
    PromptAllowance,
    PromptPreparer,
    PromptRateExceeded,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_prompt_is_prepared_once_and_remembered() -> None:
    seen: list[str] = []

    def prepare(text: str) -> str:
        seen.append(text)
        return text.strip().upper()

    preparer = PromptPreparer()
    preparer.use(prepare)
    assert preparer.prepare(None) is None
    assert [preparer.prepare(" a ") for _ in range(5)] == ["A"] * 5
    assert seen == [" a "] and preparer.prepared == 1
    for n in range(PREPARED_MEMO + 1):  # the oldest is forgotten past the memo's size
        preparer.prepare(f"p{n}")
    preparer.prepare(" a ")
    assert seen.count(" a ") == 2 and preparer.prepared == PREPARED_MEMO + 3


def test_new_prompts_take_a_token_and_remembered_ones_none() -> None:
    clock = FakeClock()
    allowance, preparer = PromptAllowance(clock), PromptPreparer()
    for n in range(PROMPT_CHANGE_BURST):
        preparer.prepare(f"new {n}", allowance)
    with pytest.raises(PromptRateExceeded, match=f"at most {PROMPT_CHANGE_BURST} at once and 4 a second"):
        preparer.prepare("one too many", allowance)
    assert preparer.prepare("new 3", allowance) == "new 3"  # remembered: costs nothing, takes no token
    clock.now += 1 / PROMPT_CHANGES_PER_S  # one token back
    preparer.prepare("after a while", allowance)
    with pytest.raises(PromptRateExceeded):
        preparer.prepare("and another", allowance)
    clock.now += 3600  # refilled to the burst, not beyond
    for n in range(PROMPT_CHANGE_BURST):
        preparer.prepare(f"later {n}", allowance)
    with pytest.raises(PromptRateExceeded):
        preparer.prepare("past the burst", allowance)
