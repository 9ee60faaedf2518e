"""The HF family matrix (marker ``families``, minutes: ``pytest -m families``): each family's
twin is either equal to one process on every runtime feature or refuses the feature with one
line, and the plan made for the family on 64 H100 uses only proved features."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from hf_families import FAMILIES, family_row  # noqa: E402


@pytest.mark.families
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_is_proved_or_refused_and_planned_within_it(family, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path))
    row = family_row(family, use_cache=False)
    for check, reason in row["checks"].items():
        assert reason == "ok" or (reason and "\n" not in reason), (check, reason)
    assert row["plan_refusal"] is None
    assert all(row["checks"][f] == "ok" for f in row["plan_features"]), row


@pytest.mark.families
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_compositions_are_equal_to_one_process(family, tmp_path, monkeypatch):
    """``benchmarks/hf_compositions.py``: tp+sp+pp and fsdp+tp+sp on 4 ranks, each run where the
    twin proved its features alone."""
    from hf_compositions import family_row as composed_row
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path))
    row = composed_row(family)
    assert all(v == "ok" or v.startswith("not run") for v in row["compositions"].values()), row
