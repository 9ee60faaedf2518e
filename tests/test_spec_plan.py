"""Model specs, presets and the Plan's JSON round trip."""

import dataclasses
import json

import pytest

from autopar.errors import UserError
from autopar.plan import PLAN_VERSION, Mesh, Plan, load_plan, plan_from_dict
from autopar.spec import PRESETS, parse_model_spec


def _plan(**kw) -> Plan:
    base = dict(model="gpt-tiny", cluster="cpu-local", gpus=4, global_batch=8, seq_len=32,
                mesh=Mesh(dp=2, pp=2), micro_batch_size=2, num_microbatches=2,
                stage_layers=(1, 3), recompute=("none", "full", "none", "selective"))
    return Plan(**{**base, **kw})


def test_spec_string_parses_all_keys():
    s = parse_model_spec("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=96,vocab=100,seq=16")
    assert (s.arch, s.layers, s.hidden, s.heads, s.num_kv_heads, s.ffn_hidden, s.vocab, s.seq) == (
        "llama", 2, 64, 4, 2, 96, 100, 16)
    g = parse_model_spec("gpt:layers=2,hidden=64,heads=4,vocab=100,seq=16")
    assert g.tied and g.ffn_hidden == 256
    assert not parse_model_spec("gpt:layers=2,hidden=64,heads=4,vocab=100,seq=16,tied=0").tied


@pytest.mark.parametrize("text, fragment", [
    ("gpt5-1t", "unknown model"),
    ("gpt:layers=2,hidden=64", "lacks"),
    ("gpt:layers=2,hidden=65,heads=4,vocab=10,seq=8", "not divisible"),
    ("gpt:layers=x,hidden=64,heads=4,vocab=10,seq=8", "not an integer"),
    ("gpt:layers=2,width=3", "malformed"),
    ("bert:layers=2", "unknown model architecture"),
    ("llama:layers=2,hidden=64,heads=4,kv_heads=3,vocab=10,seq=8", "kv_heads"),
])
def test_bad_specs_name_the_fix(text, fragment):
    with pytest.raises(UserError, match=fragment):
        parse_model_spec(text)


def test_design_presets_exist():
    for name in ["gpt3-175b", "llama3-8b", "llama3-70b", "llama3-405b", "gpt2", "gpt2-xl",
                 "megatron-1.7b", "megatron-1t"]:
        assert PRESETS[name].name == name
    assert sum(n.startswith("megatron-") for n in PRESETS) == 10


def test_plan_json_round_trip_is_identical(tmp_path):
    plan = _plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    again = load_plan(path)
    assert again == plan
    assert again.to_json() == plan.to_json()
    data = json.loads(plan.to_json())
    for key in ["version", "model", "cluster", "global_batch", "seq_len", "dtype", "mesh", "zero_stage",
                "micro_batch_size", "num_microbatches", "schedule", "virtual_stages",
                "sequence_parallel", "stage_layers", "recompute", "offload"]:
        assert key in data
    assert set(data["mesh"]) == {"dp", "tp", "pp", "cp", "ep"}


def test_plan_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _plan().zero_stage = 3


def test_wrong_version_is_refused_with_the_fix():
    data = json.loads(_plan().to_json())
    data["version"] = PLAN_VERSION + 1
    with pytest.raises(UserError, match="re-create it with `autopar plan`"):
        plan_from_dict(data)


@pytest.mark.parametrize("change, fragment", [
    (dict(gpus=8), "devices but gpus"),
    (dict(stage_layers=(4,)), "stage_layers"),
    (dict(recompute=("none",)), "recompute entries"),
    (dict(global_batch=16), "global_batch"),
])
def test_inconsistent_plans_are_refused(change, fragment):
    with pytest.raises(UserError, match=fragment):
        _plan(**change)
