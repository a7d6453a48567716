"""Prompts shared across sessions: umT5 outputs per cleaned prompt (a bounded LRU) and cross-attention K/V.

The text encoder runs once per cleaned prompt while its output stays in the
LRU (``encodes`` counts the runs); the DiT's cross-attention K/V of a prompt
(every layer, 90 MiB at 1.3B in bf16) are computed once and shared by every
session whose chunks run under it: reference counted by those sessions, and
kept after the last one leaves only while the LRU has room. A rewind point
holds a prompt's text, not its K/V: going back looks the prompt up (encoded
again if it left the cache: the same weights give the same K/V).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from arstream.models.longlive.dit import PromptKV
from arstream.models.longlive.text import clean_prompt


@dataclass
class PromptEntry:
    text: str  # the cleaned prompt
    tokens: torch.Tensor  # umT5 outputs of its real tokens [L, text_dim]
    kv: PromptKV
    sessions: int = 0  # sessions whose history is under this prompt

    @property
    def nbytes(self) -> int:
        return self.tokens.numel() * self.tokens.element_size() + sum(
            t.numel() * t.element_size() for kv in self.kv for t in kv
        )


class Prompts:
    """Cleaned prompt -> :class:`PromptEntry`; entries no session uses are kept up to ``spare`` (LRU)."""

    def __init__(self, encode: Callable[[str], torch.Tensor], project: Callable[[torch.Tensor], PromptKV],
                 spare: int = 4) -> None:  # fmt: skip
        if spare < 0:
            raise ValueError(f"the prompt cache's spare entries must be >= 0, got {spare}")
        self._encode = encode
        self._project = project
        self.spare = spare
        self._entries: OrderedDict[str, PromptEntry] = OrderedDict()
        self.encodes = 0  # text encoder runs
        self.projections = 0  # cross-attention K/V computed

    def get(self, prompt: str) -> PromptEntry:
        """The entry of ``prompt`` (cleaned first), encoding it if no entry is cached; does not take a reference."""
        text = clean_prompt(prompt)
        entry = self._entries.get(text)
        if entry is None:
            tokens = self._encode(text)
            self.encodes += 1
            kv = self._project(tokens)
            self.projections += 1
            entry = PromptEntry(text, tokens, kv)
            self._entries[text] = entry
        self._entries.move_to_end(text)
        self._trim(keep=text)
        return entry

    def hold(self, text: str) -> None:
        """A session's history is now under ``text`` (a cleaned prompt with an entry)."""
        self._entries[text].sessions += 1

    def drop(self, text: str) -> None:
        """A session left ``text``; the entry stays while the LRU has room for unused ones."""
        entry = self._entries.get(text)
        if entry is not None and entry.sessions > 0:
            entry.sessions -= 1
        self._trim()

    def _trim(self, keep: str | None = None) -> None:
        """Unused entries beyond ``spare`` go, oldest first; ``keep`` (just asked for) never does."""
        unused = [text for text, entry in self._entries.items() if entry.sessions == 0]
        excess = len(unused) - self.spare
        for text in [t for t in unused if t != keep][: max(0, excess)]:
            del self._entries[text]

    def cached(self) -> list[str]:
        return list(self._entries)

    def entry(self, text: str) -> PromptEntry | None:
        return self._entries.get(text)
