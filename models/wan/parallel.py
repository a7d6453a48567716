"""A Wan-family pipeline over several devices: its self-attention split by heads (Ulysses), its KV by heads.

A pipeline with the :class:`HeadParallel` mix-in answers ``shard_heads`` (the runner's distributed runtime
calls it on every rank before the pool is built): every self-attention layer of its DiT then projects its
slice of the tokens and attends over its ``heads / P`` heads, and ``kv_cache_spec`` says the pool holds
those heads only. Everything else in the forward runs whole on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from .layers import WanSelfAttention

if TYPE_CHECKING:
    from ...runner.distributed.sequence_parallel import SequenceParallel


class HeadParallel:
    """``shard_heads`` for a pipeline whose DiT is ``self.model``; ``kv_heads`` for its ``kv_cache_spec``."""

    head_parallel: SequenceParallel | None = None

    def shard_heads(self, parallel: SequenceParallel) -> None:
        """Split every self-attention layer's heads over ``parallel``'s ranks (refused unless P divides them)."""
        model: nn.Module = getattr(self, "model")  # noqa: B009 - each pipeline types its own DiT
        layers = [m for m in model.modules() if isinstance(m, WanSelfAttention)]
        for layer in layers:
            parallel.local_heads(layer.num_heads)  # raises, naming the counts, before anything changes
        for layer in layers:
            layer.parallel = parallel
        self.head_parallel = parallel

    def unshard_heads(self) -> None:
        """Every head on this device again (``arstream plan`` sizes one meta-device pipeline at several P)."""
        model: nn.Module = getattr(self, "model")  # noqa: B009
        for layer in model.modules():
            if isinstance(layer, WanSelfAttention):
                layer.parallel = None
        self.head_parallel = None

    def kv_heads(self, heads: int) -> int:
        """Heads of every KV block this rank holds."""
        return heads if self.head_parallel is None else self.head_parallel.local_heads(heads)
