"""Strict JSON, shared by every layer: the wire's client messages (app/protocol.py) and a moved session's
snapshot header (runner/snapshot_header.py) are parsed the same way.

``json.loads`` recurses once per nesting level, so a few kilobytes of ``[`` end
in a RecursionError (a 500 where nobody catches it); the depth is therefore
checked before parsing, in linear time whatever the input. NaN, Infinity and
numbers that overflow a float are refused too. Only the standard library.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_JSON_DEPTH = 32

# Possessive, and an unterminated string runs to the end: linear time on hostile input.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.?)*+(?:"|\Z)', re.DOTALL)
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def nests_deeper_than(text: str, limit: int) -> bool:
    """Whether brackets outside strings nest deeper than ``limit`` (checked before parsing, so
    hostile input can neither recurse in the parser nor cost more than linear time here)."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    for match in _JSON_BRACKET.finditer(_JSON_STRING.sub('""', text)):
        if match.group() in "[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def loads_strict(text: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` that refuses NaN, Infinity, overflowing numbers and nesting deeper than ``max_depth``
    (ValueError for each)."""
    if nests_deeper_than(text, max_depth):
        raise ValueError(f"JSON nests deeper than {max_depth} levels")
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
