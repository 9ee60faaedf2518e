"""The trace cache (``autopar.profiles``): a model is traced once, then read back equal, without
torch; a damaged entry is traced again; user modules are never cached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import autopar.trace
from autopar import profiles
from autopar.spec import parse_model_spec

ROOT = Path(__file__).resolve().parent.parent
SPEC = "llama:layers=3,hidden=64,heads=4,kv_heads=2,ffn=160,vocab=96,seq=32"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path))
    profiles._kept.cache_clear()
    yield tmp_path
    profiles._kept.cache_clear()


def _no_trace(*_args, **_kwargs):
    raise AssertionError("traced although cached")


def test_cached_entry_equals_the_trace_and_is_read_without_tracing(cache, monkeypatch):
    spec = parse_model_spec(SPEC)
    traced = autopar.trace.profile_and_layout(spec)
    assert profiles.profile_and_layout(spec) == traced
    assert len(list((cache / "trace").glob("*.json"))) == 1
    profiles._kept.cache_clear()  # a new process: only the file remains
    monkeypatch.setattr(autopar.trace, "profile_and_layout", _no_trace)
    assert profiles.profile_and_layout(spec) == traced
    assert profiles.profile_spec(spec) == traced[0]


def test_a_damaged_entry_is_traced_again(cache):
    spec = parse_model_spec(SPEC)
    good = profiles.profile_and_layout(spec)
    (entry,) = (cache / "trace").glob("*.json")
    for damage in ("{", "[]", json.dumps({"profile": {"layers": "three"}, "layout": None}), "\xff"):
        entry.write_text(damage, encoding="latin-1")
        profiles._kept.cache_clear()
        assert profiles.profile_and_layout(spec) == good
        assert json.loads(entry.read_text()) is not None  # rewritten whole


def test_other_specs_other_entries(cache):
    profiles.profile_spec(parse_model_spec(SPEC))
    profiles.profile_spec(parse_model_spec(SPEC.replace("seq=32", "seq=48")))
    assert len(list((cache / "trace").glob("*.json"))) == 2


def test_user_modules_are_traced_every_time(cache, monkeypatch):
    spec = parse_model_spec(f"{ROOT / 'tests' / 'fixtures' / 'nanogpt' / 'make.py'}:make")
    profiles.profile_spec(spec)
    assert not (cache / "trace").exists()
    monkeypatch.setattr(autopar.trace, "profile_and_layout", _no_trace)
    with pytest.raises(AssertionError, match="traced"):
        profiles.profile_and_layout(spec)


HF_SPEC = ("hf:LlamaConfig:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
           "intermediate_size=96,vocab_size=128,seq=32")


@pytest.mark.parametrize("spec", [SPEC, HF_SPEC])
def test_a_warm_plan_command_imports_no_torch(cache, spec):
    """The second `autopar plan` of a model reads its trace (and an HF spec's shape): neither
    torch (about 1 s) nor transformers (about 3 s with the torch it imports) is imported."""
    args = ["plan", "--model", spec, "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "16"]
    code = ("import sys; from autopar.cli import main; sys.argv = ['autopar', *sys.argv[1:]]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch imported:', 'torch' in sys.modules or 'transformers' in sys.modules)")
    env = dict(os.environ, AUTOPAR_CACHE=str(cache))
    runs = [subprocess.run([sys.executable, "-c", code, *args, "--out", str(cache / f"plan{i}.json")],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=300) for i in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert "torch imported: True" in runs[0].stdout
    assert "torch imported: False" in runs[1].stdout
    assert (cache / "plan0.json").read_bytes() == (cache / "plan1.json").read_bytes()


def _shipping():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import ship_traces
    finally:
        sys.path.pop(0)
    return ship_traces


def test_shipped_entries_are_the_presets_current_traces(cache, monkeypatch):
    """Every preset on autopar's own model ships its entry under the current sources' key (no
    other file), so a first plan of one traces nothing; a stale set fails here until
    ``python benchmarks/ship_traces.py`` rewrites it. The smallest entry equals a fresh trace."""
    ship = _shipping()
    names = {f"{profiles.cache_key(parse_model_spec(n))}.json": n for n in ship.shipped_presets()}
    assert names and {p.name for p in profiles.SHIPPED.glob("*.json")} == set(names), \
        "stale autopar/traces: run `python benchmarks/ship_traces.py`"
    spec = parse_model_spec("gpt-tiny")
    fresh = profiles.entry_text(*autopar.trace.profile_and_layout(spec))
    assert (profiles.SHIPPED / f"{profiles.cache_key(spec)}.json").read_text(encoding="utf-8") == fresh
    monkeypatch.setattr(autopar.trace, "profile_and_layout", _no_trace)
    assert profiles.profile_spec(parse_model_spec("llama3-405b")).layers == 126  # shipped: not traced
    assert not (cache / "trace").exists()
