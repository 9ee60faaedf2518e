"""Property tests of every parser and loader (``fuzz_cases``): 200 cases each by default
(derandomized: the same cases on every run), 10,000 each under ``pytest -m fuzz`` (a fresh
random sample; ``benchmarks/fuzz.py`` counts what it finds instead of stopping)."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from fuzz_cases import PARSERS  # noqa: E402

DEFAULT_CASES = 200
FUZZ_CASES = 10_000


def _run(name: str, cases: int, derandomize: bool) -> None:
    strategy, check = PARSERS[name]

    @settings(max_examples=cases, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def prop(value) -> None:
        check(value)

    prop()


@pytest.mark.parametrize("name", PARSERS)
def test_parser_accepts_or_refuses_in_one_line(name):
    _run(name, DEFAULT_CASES, derandomize=True)


@pytest.mark.fuzz
@pytest.mark.parametrize("name", PARSERS)
def test_parser_fuzz(name):
    _run(name, FUZZ_CASES, derandomize=False)
