"""Budgets a client cannot exceed: message and connection rates, and the size of a controls object.

Both run before any expensive work: the rate budget decides when the
receive loop reads the next message (a client past its rate is simply read
more slowly; TCP pushes back on it), and the controls size check refuses an
oversized object before the model's JSON Schema walks it.
"""

from __future__ import annotations

from typing import Any


class TokenBucket:
    """``burst`` tokens at once, refilled at ``rate_per_s``: a client's messages, frames, new connections or
    wrong cluster secrets, each spent as one token."""

    def __init__(self, rate_per_s: float, burst: int, now: float) -> None:
        self.rate_per_s = rate_per_s
        self.burst = float(burst)
        self._tokens = float(burst)
        self._stamp = now

    def _refill(self, now: float) -> None:
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate_per_s)
        self._stamp = now

    def delay(self, now: float) -> float:
        """Seconds to wait before the next message may be read (0 when it may be read now); spends a token."""
        self._refill(now)
        self._tokens -= 1.0
        if self._tokens >= 0.0:
            return 0.0
        return -self._tokens / self.rate_per_s

    def try_spend(self, now: float) -> bool:
        """Spend a token if there is a whole one; a refusal spends nothing, so the budget refills while refused."""
        self._refill(now)
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def has_token(self, now: float) -> bool:
        """Whether a whole token is there now (nothing is spent)."""
        self._refill(now)
        return self._tokens >= 1.0

    def full(self, now: float) -> bool:
        """Whether the bucket has refilled completely (its owner has been quiet long enough to be forgotten)."""
        self._refill(now)
        return self._tokens >= self.burst



def count_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` holds more than ``limit`` JSON values in all (containers count, so do their members).

    Stops as soon as the count passes ``limit``: the cost is bounded by the
    limit, not by what the client sent.
    """
    remaining = limit
    stack = [value]
    while stack:
        item = stack.pop()
        remaining -= 1
        if remaining < 0:
            return True
        if isinstance(item, dict):
            if len(item) > remaining:
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            if len(item) > remaining:
                return True
            stack.extend(item)
    return False
