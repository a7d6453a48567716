"""Measurement helpers shared by every layer: one percentile, one side-by-side harness.

Used by ``/v1/stats`` (the worker), ``arstream client``, and the three benches
(``bench runner``, ``bench model``, ``bench serve``), so that "p99" and "median
ratio" mean the same thing everywhere. Only the standard library: the runtime,
the models and the transport may all import it.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``; NaN when there are none.

    Linear interpolation between the two nearest ranks: the value at position
    ``(n - 1) * q / 100`` of the sorted values (Hyndman and Fan's type 7, NumPy's
    default, ``statistics.quantiles(method="inclusive")``). p0 is the minimum,
    p50 the median and p100 the maximum, it is defined for a single value, and
    it moves smoothly as samples arrive, where nearest rank jumps from one
    sample to the next (and with under 100 samples makes p99 the maximum).
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# ---- side-by-side measurements -------------------------------------------------------


@dataclass
class Comparison:
    """Two sides measured in the same repetitions; ``ratio`` is ``sides[0] / sides[1]`` per repetition."""

    sides: tuple[str, str]
    values: dict[str, list[float]] = field(default_factory=dict)
    ratios: list[float] = field(default_factory=list)

    def median(self, side: str) -> float:
        return statistics.median(self.values[side])

    @property
    def median_ratio(self) -> float:
        """The median of the per-repetition ratios (not the ratio of medians: noise cancels within a repetition)."""
        return statistics.median(self.ratios)


def order_for(sides: tuple[str, str], repetition: int) -> tuple[str, str]:
    """``sides`` on even repetitions, reversed on odd ones, so drift and warm caches favour neither."""
    return sides if repetition % 2 == 0 else (sides[1], sides[0])


def compare(
    sides: tuple[str, str],
    repeats: int,
    measure: Callable[[int, tuple[str, str]], Mapping[str, float]],
    report: Callable[[int, Mapping[str, float], float], None] | None = None,
) -> Comparison:
    """Run ``measure(repetition, order)`` ``repeats`` times; it returns one figure per side.

    ``order`` alternates (:func:`order_for`): a measure that runs its sides one
    after the other runs them in that order; one that interleaves finer (chunk
    by chunk) may start with ``order[0]``. ``report`` sees each repetition's
    figures and ratio as they come (for the printed table).
    """
    comparison = Comparison(sides, {side: [] for side in sides})
    for repetition in range(repeats):
        figures = measure(repetition, order_for(sides, repetition))
        ratio = figures[sides[0]] / figures[sides[1]]
        for side in sides:
            comparison.values[side].append(figures[side])
        comparison.ratios.append(ratio)
        if report is not None:
            report(repetition, figures, ratio)
    return comparison


def print_summary(summary: Mapping[str, Any]) -> None:
    """Print a bench's figures as one JSON object: by convention, the last line a bench prints."""
    print(json.dumps(summary), flush=True)
