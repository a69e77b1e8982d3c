"""bench/cpu_default_model.py's table: the best rate per engine over rounds, and a dash where an
engine cannot give a figure (llama-cpp-python has no batched decode)."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from bench.cpu_default_model import best_interleaved, cell


def rates(*values: float) -> Callable[[], float]:
    sequence: Iterator[float] = iter(values)
    return lambda: next(sequence)


def test_best_rate_per_engine_and_nan_for_an_engine_that_cannot_measure() -> None:
    best = best_interleaved(3, {"ours": rates(10.0, 30.0, 20.0), "llama.cpp": rates(math.nan, math.nan, math.nan),
                                "flaky": rates(math.nan, 5.0, 4.0)})
    assert best["ours"] == 30.0
    assert math.isnan(best["llama.cpp"])
    assert best["flaky"] == 5.0


def test_cells_show_a_dash_for_a_missing_figure_and_for_a_ratio_with_one() -> None:
    assert cell(27.94, 1) == f"{'27.9':>14}"
    assert cell(math.nan, 1) == f"{'-':>14}"
    assert cell(79.7 / math.nan, 2) == f"{'-':>14}"
