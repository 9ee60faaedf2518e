"""The shipped A100 profile against published figures, at the thresholds of issue 5.

Rows and assumptions: benchmarks/validate_published.py. Thresholds: Narayanan et al. Table 1
5 % per row; Korthikanti et al. Table 5 4 % per row and 2 % on average; Table 4 overheads within
3 points; Figure 1 memory 2 %; ZeRO Table 1 0.5 %.

``KNOWN_MISSES`` lists the rows the current model does not yet bring under their threshold
with one set of constants (measured by ``python benchmarks/validate_published.py``). They are
strict xfails: a change that brings one under its bound fails here until it is taken off the
list, and every other row fails CI as soon as it goes over.
"""

import sys
from pathlib import Path

import pytest

from cost_models import load_profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import validate_published as validate  # noqa: E402

HW = load_profile("dgx-a100-80g")
TIME_ROWS = validate.time_rows(HW)
MEMORY_ROWS = validate.memory_rows(HW)
BOUND = {"Narayanan T1 TFLOP/s": 5.0, "Korthikanti T5 s": 4.0, "Korthikanti T4 %": 3.0,
         "Korthikanti F1 GiB": 2.0, "ZeRO T1 GB": 0.5}
KNOWN_MISSES: set[tuple[str, str]] = set()


def _params(rows):
    return [pytest.param(r, id=f"{r.source} {r.row}",
                         marks=[pytest.mark.xfail(strict=True, reason="known miss, see module docstring")]
                         if (r.source, r.row) in KNOWN_MISSES else [])
            for r in rows]


@pytest.mark.parametrize("row", _params(TIME_ROWS + MEMORY_ROWS))
def test_row_within_its_threshold(row):
    assert abs(row.error) <= BOUND[row.source], (
        f"{row.source} {row.row}: published {row.published}, predicted {row.predicted:.4g}")


def test_korthikanti_table5_mean_error_within_2_percent():
    errors = [abs(r.error) for r in TIME_ROWS if r.source == "Korthikanti T5 s"]
    assert len(errors) == 8
    assert sum(errors) / len(errors) <= 2.0


def test_every_published_row_is_checked():
    counts = {s: sum(r.source == s for r in TIME_ROWS + MEMORY_ROWS) for s in BOUND}
    assert counts == {"Narayanan T1 TFLOP/s": 10, "Korthikanti T5 s": 8, "Korthikanti T4 %": 3,
                      "Korthikanti F1 GiB": 12, "ZeRO T1 GB": 8}
