"""A prompt change blended over chunks, as vLLM-Omni's prompt interaction blends it (its ``prompt.py``, 0.30.0).

vLLM-Omni lerps the prompt embedding: when a change starts, the embedding in
use (itself perhaps mid-blend) is the source; each chunk boundary advances
the blend by one chunk, ``alpha = elapsed / transition_chunks``, and the
first chunk of a change is already one step in (``1/N`` of the way); a
change over 0 chunks applies at once. A later change starts from wherever
the blend is.

Because the blend is linear in the embedding, it is written here as weights
over prompts (a source that was mid-blend stays a mix), so a pipeline with
``prompt_switch: "blend"`` computes ``sum(w * embed(p))`` for its own
embeddings and the schedule is the same for every model. The pipeline keeps
one :class:`PromptBlend` per session as model-owned state (it is plain data:
:meth:`to_json` / :meth:`from_json` for snapshots).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

Weights = tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class PromptBlend:
    """Where one session's prompt blend is: ``source`` blending into ``target`` over ``chunks`` chunks."""

    target: str
    source: Weights
    chunks: int = 0
    elapsed: int = 0

    @classmethod
    def holding(cls, prompt: str) -> PromptBlend:
        """A rollout's first chunk: its prompt alone, no blend."""
        return cls(prompt, ((prompt, 1.0),))

    @property
    def alpha(self) -> float:
        return 1.0 if self.chunks <= 0 else min(1.0, self.elapsed / self.chunks)

    @property
    def done(self) -> bool:
        """The target alone: the blend has reached it (or there was none)."""
        return self.alpha >= 1.0

    def weights(self) -> Weights:
        """The prompts and their weights (summing to 1) this chunk is conditioned on, heaviest source first."""
        alpha = self.alpha
        mix: dict[str, float] = {}
        for prompt, weight in self.source:
            mix[prompt] = mix.get(prompt, 0.0) + (1.0 - alpha) * weight
        mix[self.target] = mix.get(self.target, 0.0) + alpha
        return tuple((prompt, weight) for prompt, weight in mix.items() if weight > 0.0)

    def next_chunk(self, prompt: str, transition_chunks: int) -> PromptBlend:
        """The blend for the next chunk, conditioned on ``prompt`` (the session's latest).

        Advances a blend in progress by one chunk; a ``prompt`` other than the
        target starts a new blend from there, already one chunk in.
        """
        advanced = self if self.done else replace(self, elapsed=self.elapsed + 1)
        if prompt == self.target:
            return advanced
        chunks = max(0, transition_chunks)
        return PromptBlend(prompt, advanced.weights(), chunks, min(1, chunks))

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "source": [list(pair) for pair in self.source], "chunks": self.chunks,
                "elapsed": self.elapsed}  # fmt: skip

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> PromptBlend:
        source = tuple((str(prompt), float(weight)) for prompt, weight in value["source"])
        return cls(str(value["target"]), source, int(value["chunks"]), int(value["elapsed"]))
