"""Ulysses sequence parallelism around self-attention, with every rank holding ``heads / P`` of the KV.

Every rank holds the whole hidden state of a forward (the rest of the block runs replicated). Around
self-attention each rank projects its own slice of the tokens (``tokens / P``, padded), an all-to-all
turns that into every token for its own heads (``heads / P``), which is what its share of the paged
KV pool holds; attention runs over those heads, a second all-to-all turns the result back into the
rank's tokens with every head, the output projection runs on them, and an all-gather makes the whole
hidden state again. So the projections and attention are divided by P, the pool is divided by P, and
what crosses between ranks per layer is the current chunk's activations, never a session's history.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..types import UnsupportedConfiguration


def check_heads_divide(heads: int, world: int) -> None:
    """Each rank holds ``heads / world`` heads: refuse a device count that does not divide the head count."""
    if world < 1 or heads % world:
        raise UnsupportedConfiguration(
            f"{world} devices cannot share the model's {heads} attention heads: the device count must divide "
            f"the head count (each device holds heads / devices of every KV block)"
        )


@dataclass
class SequenceParallel:
    """This rank's place in the group, and the bytes its collectives have sent (the benchmark reads them)."""

    rank: int
    world: int
    group: dist.ProcessGroup | None = None
    bytes_sent: int = field(default=0)

    def local_heads(self, heads: int) -> int:
        check_heads_divide(heads, self.world)
        return heads // self.world

    def slice_size(self, tokens: int) -> int:
        """Tokens each rank projects (the last slice is padded with zeros)."""
        return -(-tokens // self.world)

    def my_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``x`` ``[B, L, C]``, zero-padded to ``slice_size(L)`` tokens."""
        size = self.slice_size(x.shape[1])
        mine = x[:, self.rank * size : (self.rank + 1) * size]
        if mine.shape[1] < size:
            mine = torch.nn.functional.pad(mine, (0, 0, 0, size - mine.shape[1]))
        return mine

    def to_heads(self, stacked: torch.Tensor, tokens: int) -> torch.Tensor:
        """``[S, B, l, H, D]`` (this rank's tokens, every head) -> ``[S, B, L, H/P, D]`` (every token, its heads)."""
        s, b, size, heads, d = stacked.shape
        per = heads // self.world
        send = stacked.view(s, b, size, self.world, per, d).permute(3, 0, 1, 2, 4, 5).contiguous()
        received = self._all_to_all(send)  # [P (whose tokens), S, B, l, H/P, D]
        return received.permute(1, 2, 0, 3, 4, 5).reshape(s, b, self.world * size, per, d)[:, :, :tokens]

    def to_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """``[B, L, H/P, D]`` (every token, this rank's heads) -> ``[B, l, H, D]`` (its tokens, every head)."""
        b, tokens, per, d = out.shape
        size = self.slice_size(tokens)
        if tokens < size * self.world:
            out = torch.nn.functional.pad(out, (0, 0, 0, 0, 0, size * self.world - tokens))
        send = out.view(b, self.world, size, per, d).transpose(0, 1).contiguous()
        received = self._all_to_all(send)  # [P (whose heads), B, l, H/P, D]
        return received.permute(1, 2, 0, 3, 4).reshape(b, size, self.world * per, d)

    def gather_tokens(self, mine: torch.Tensor, tokens: int) -> torch.Tensor:
        """Every rank's ``[B, l, C]`` -> the whole ``[B, L, C]`` on every rank."""
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        self.bytes_sent += mine.numel() * mine.element_size() * (self.world - 1)
        dist.all_gather(parts, mine.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)[:, :tokens]

    def _all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        received = torch.empty_like(send)
        self.bytes_sent += send.numel() * send.element_size() * (self.world - 1) // self.world
        dist.all_to_all_single(received, send, group=self.group)
        return received
