"""The per-prompt cache on its own (fake encoder and projection): cleaned keys, counted encodes, held entries kept,
unused ones bounded by ``spare`` in LRU order."""

from __future__ import annotations

import torch

from arstream.models.longlive.prompts import Prompts


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
    first = prompts.get("  a  fox ")
    assert prompts.get("a fox") is first and encoded == ["a fox"] and prompts.encodes == 1
    prompts.hold("a fox")  # a session's history is under it: kept whatever the LRU does
    prompts.get("b")
    prompts.get("c")  # unused "b" and "c": only one unused entry is kept, the most recent
    assert prompts.cached() == ["a fox", "c"]
    prompts.drop("a fox")  # no session under it any more: now it ages out like the others
    prompts.get("d")
    assert prompts.cached() == ["d"] and prompts.encodes == 4
    prompts.get("b")  # evicted earlier: encoded again (the same weights give the same K/V)
    assert prompts.encodes == 5 and encoded[-1] == "b"
    assert first.nbytes == first.tokens.numel() * 4 * 3  # tokens, K and V
