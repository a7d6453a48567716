"""docs/models.md's tables of `arstream plan` figures are the plan's output: rows of each are made again by
scripts/plan-table.py's functions (the meta device: nothing read) and must match the doc's, and the per-P table
has one row for each model, weights and P the script plans."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs/models.md").read_text()

pytest.importorskip("torchao", reason="the quant extra (pip install 'arstream[quant]')")
pytestmark = pytest.mark.usefixtures("one_thread")


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("plan_table", REPO / "scripts/plan-table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLE = load_script()


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    logging.disable(logging.WARNING)  # the runner's note on rewind, once per plan
    yield
    logging.disable(logging.NOTSET)


def doc_rows(header: str) -> list[str]:
    """The rows of the doc's table whose header line is ``header``."""
    start = DOC.index(header + "\n")
    lines = DOC[start:].splitlines()[2:]
    return [line for line in lines[: next(i for i, line in enumerate(lines) if not line.startswith("|"))]]


DEVICE_ROWS = doc_rows(TABLE.DEVICE_HEADER)
GPU_ROWS = doc_rows(TABLE.GPU_HEADER)


def row_of(rows: list[str], label: str, weights: str, world: int | None = None) -> str:
    prefix = f"| {label} | {weights} |" + ("" if world is None else f" {world} |")
    (row,) = [r for r in rows if r.startswith(prefix)]
    return row


def test_the_per_p_table_has_a_row_for_each_model_weights_and_p_the_script_plans() -> None:
    expected = [
        (label, weights or "bf16", str(world))
        for _model, _options, label, offered in TABLE.DEVICE_MODELS
        for weights in offered
        for world in TABLE.DEVICE_COUNTS
    ]
    assert [tuple(c.strip() for c in row.split("|")[1:4]) for row in DEVICE_ROWS] == expected


@pytest.mark.parametrize(
    ("model", "label", "weights", "world"),
    [
        ("krea-realtime", "krea-realtime 14b", "int8", 2),
        ("matrix-game-2", "matrix-game-2 1.3b", None, 4),
        ("matrix-game-2", "matrix-game-2 1.3b", None, 8),  # refused: 8 does not divide 12 heads
    ],
)
def test_per_p_rows_are_the_plans_output(model: str, label: str, weights: str | None, world: int) -> None:
    (options,) = [o for m, o, name, _ in TABLE.DEVICE_MODELS if (m, name) == (model, label)]
    made = TABLE.device_row(model, options, label, weights, world)
    assert row_of(DEVICE_ROWS, label, weights or "bf16", world) == made


def test_the_krea_row_of_the_one_gpu_table_is_the_plans_output() -> None:
    made = TABLE.gpu_row("krea-realtime", {"config": "14b"}, "krea-realtime 14b", "int8")
    assert row_of(GPU_ROWS, "krea-realtime 14b", "int8") == made
