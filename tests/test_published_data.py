"""The published-run data files (benchmarks/published/*.json) load and are self-consistent."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from autopar.spec import PRESETS, parse_model_spec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import published_rows as pub  # noqa: E402

SOURCES = pub.load_sources()
ROWS = [(s, r) for s in SOURCES for r in s.rows]


def _ids(pairs):
    return [f"{s.source}:{r.id}" for s, r in pairs]


def test_every_file_loads():
    files = sorted(pub.PUBLISHED_DIR.glob("*.json"))
    assert len(files) >= 8
    assert [s.source for s in SOURCES] == [f.stem for f in files]
    for s in SOURCES:
        assert s.rows, s.source
        assert s.cite.strip() and s.title.strip(), s.source


def test_row_ids_unique_within_source():
    for s in SOURCES:
        ids = [r.id for r in s.rows]
        assert len(ids) == len(set(ids)), s.source


@pytest.mark.parametrize("src,row", ROWS, ids=_ids(ROWS))
def test_row_consistent(src, row):
    where = f"{src.source}:{row.id}"
    for name in ("gpus", "seq_len", "global_batch", "micro_batch", "dp", "tp", "pp", "cp", "ep", "vpp"):
        assert getattr(row, name) >= 1, f"{where}: {name}"
    assert row.value > 0, where
    # Experts parallelism reuses data-parallel ranks in the frameworks recorded so far, so a
    # row with ep > 1 would need a rule of its own; none has one yet.
    assert row.ep == 1 or "moe" in row.needs, where
    assert row.dp * row.tp * row.pp * row.cp == row.gpus, f"{where}: dp*tp*pp*cp != gpus"
    assert row.global_batch % (row.dp * row.micro_batch) == 0, f"{where}: batch not divisible by dp*micro_batch"
    assert row.zero in (0, 1, 2, 3), where
    assert row.recompute_layers is None or (row.recompute != "none" and row.recompute_layers >= 1), where
    assert row.cp == 1 or "cp" in row.needs, where
    assert not row.fp8 or "fp8" in row.needs, where
    assert (row.metric in ("tflops_per_gpu", "mfu")) == (row.flops_convention is not None), where
    spec = parse_model_spec(row.model)
    assert row.seq_len <= spec.seq or row.model in PRESETS, f"{where}: seq_len beyond the spec's seq"
    if row.recompute_layers is not None:
        assert row.recompute_layers <= spec.layers, where
    if row.vpp > 1:
        assert row.pp > 1, where


def test_bad_row_names_file_and_row(tmp_path):
    good = json.loads((pub.PUBLISHED_DIR / "mtnlg.json").read_text())
    good["rows"][1].pop("gpus")
    path = tmp_path / "mtnlg.json"
    path.write_text(json.dumps(good))
    with pytest.raises(pub.PublishedDataError, match=r"mtnlg\.json: row 530b-350nodes: missing key\(s\) gpus"):
        pub.load_source(path)
    good["rows"][1]["gpus"] = "2800"
    path.write_text(json.dumps(good))
    with pytest.raises(pub.PublishedDataError, match="gpus='2800' has the wrong type"):
        pub.load_source(path)
