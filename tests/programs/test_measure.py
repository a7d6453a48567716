"""The one percentile definition and the side-by-side harness every bench uses."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

import pytest

from arstream.measure import compare, order_for, percentile


def test_percentile_interpolates_between_the_nearest_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0], 100) == 3.0
    assert percentile([1.0, 2.0, 3.0], 0) == 1.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)  # nearest rank would say 10
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="0, 100"):
        percentile([1.0], 101)


@pytest.mark.parametrize("q", [1, 25, 50, 90, 99])
def test_percentile_is_the_inclusive_quantile_of_the_standard_library(q: int) -> None:
    values = [float(v * v % 37) for v in range(53)]
    assert percentile(values, q) == pytest.approx(statistics.quantiles(values, n=100, method="inclusive")[q - 1])


def test_compare_alternates_the_order_and_takes_the_median_of_per_repetition_ratios() -> None:
    orders: list[tuple[str, str]] = []
    figures = [{"new": 2.0, "old": 1.0}, {"new": 9.0, "old": 3.0}, {"new": 4.0, "old": 4.0}]

    def measure(repetition: int, order: tuple[str, str]) -> Mapping[str, float]:
        orders.append(order)
        return figures[repetition]

    reported: list[float] = []
    result = compare(("new", "old"), 3, measure, report=lambda rep, figs, ratio: reported.append(ratio))
    assert orders == [("new", "old"), ("old", "new"), ("new", "old")]
    assert result.ratios == reported == [2.0, 3.0, 1.0]
    assert result.median_ratio == 2.0  # the ratio of the medians would be 4 / 3
    assert result.median("new") == 4.0 and result.median("old") == 3.0
    assert order_for(("a", "b"), 7) == ("b", "a")
