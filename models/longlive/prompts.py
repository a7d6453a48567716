"""Prompts shared across sessions: umT5 outputs per cleaned prompt (a bounded LRU) and cross-attention K/V.

Prompts come cleaned (the pipeline's ``prepare_prompt``, which the server runs
once as a prompt arrives, off the model thread): a chunk looks its prompt up
as it is, and never cleans it. The text encoder runs once per cleaned prompt while its output stays in the
LRU (``encodes`` counts the runs); the DiT's cross-attention K/V of a prompt
(every layer, 90 MiB at 1.3B in bf16) are computed once and shared by every
session whose chunks run under it: reference counted (:meth:`Prompts.acquire`,
:meth:`Prompts.drop`) by those sessions and by a forward while it runs under
it, and kept after the last reference goes only while the LRU has room. At
most ``spare`` entries are ever kept with no reference: that bound is what
the pipeline declares in capacity (``KVCacheSpec.model_owned_bytes_fixed``),
so cached prompts nobody uses never take memory capacity does not count. A
rewind point holds a prompt's text, not its K/V: going back looks the prompt
up (encoded again if it left the cache: the same weights give the same K/V).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .dit import PromptKV


@dataclass
class PromptEntry:
    text: str  # the cleaned prompt
    tokens: torch.Tensor  # umT5 outputs of its real tokens [L, text_dim]
    kv: PromptKV
    references: int = 0  # sessions whose history is under this prompt, and forwards running under it

    @property
    def nbytes(self) -> int:
        return self.tokens.numel() * self.tokens.element_size() + sum(
            t.numel() * t.element_size() for kv in self.kv for t in kv
        )


class Prompts:
    """Cleaned prompt -> :class:`PromptEntry`; entries with no reference are kept up to ``spare`` (LRU)."""

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
        """The entry of ``prompt`` (a cleaned one), encoding it if none is cached; takes no reference.

        With no reference the entry stays cached only while the LRU has room
        for it (``spare`` unreferenced entries; with 0, not at all).
        """
        entry = self._lookup(prompt)
        self._trim()
        return entry

    def acquire(self, prompt: str) -> PromptEntry:
        """The entry of ``prompt``, with a reference taken before anything is evicted (:meth:`drop` gives it back)."""
        entry = self._lookup(prompt)
        entry.references += 1
        self._trim()
        return entry

    def drop(self, text: str) -> None:
        """Give back a reference to ``text`` (a cleaned prompt); the entry stays while the LRU has room."""
        entry = self._entries.get(text)
        if entry is not None and entry.references > 0:
            entry.references -= 1
        self._trim()

    def _lookup(self, text: str) -> PromptEntry:
        entry = self._entries.get(text)
        if entry is None:
            tokens = self._encode(text)
            self.encodes += 1
            kv = self._project(tokens)
            self.projections += 1
            entry = PromptEntry(text, tokens, kv)
            self._entries[text] = entry
        self._entries.move_to_end(text)
        return entry

    def _trim(self) -> None:
        """Unreferenced entries beyond ``spare`` go, least recently used first."""
        unused = [text for text, entry in self._entries.items() if entry.references == 0]
        for text in unused[: max(0, len(unused) - self.spare)]:
            del self._entries[text]

    def cached(self) -> list[str]:
        return list(self._entries)

    def entry(self, text: str) -> PromptEntry | None:
        return self._entries.get(text)

    def unused(self) -> int:
        """Entries kept with no reference (at most ``spare``)."""
        return sum(1 for entry in self._entries.values() if entry.references == 0)
