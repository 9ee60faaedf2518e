"""The shipped A100 profile against published end-to-end figures: fails above a stated error.

Rows and assumptions: benchmarks/validate_published.py. The bound is what the first version
reaches with one set of constants for every row (max 7.5 % at the time of writing); a change
that makes any row worse than 10 % fails here.
"""

import importlib.util
from pathlib import Path

import pytest

from cost_models import load_profile

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "validate_published.py"
_SPEC = importlib.util.spec_from_file_location("validate_published", _PATH)
validate = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(validate)

TIME_ROWS = validate.time_rows(load_profile("dgx-a100-80g"))


@pytest.mark.parametrize("source, row, published, predicted", TIME_ROWS,
                         ids=[f"{s} {r}" for s, r, _, _ in TIME_ROWS])
def test_time_rows_within_10_percent(source, row, published, predicted):
    assert abs(validate.error_pct(published, predicted)) <= 10.0


@pytest.mark.parametrize("source, row, published, predicted", validate.zero_rows())
def test_zero_rows_within_half_a_percent(source, row, published, predicted):
    assert abs(validate.error_pct(published, predicted)) <= 0.5
