"""Verified plans: each runtime feature is proved on a tiny twin of the model (2 gloo ranks
against one process) before a plan uses it; what fails is refused in one line, and the planner
never searches it.

OPT is the case that ran silently wrong before (its attention reshapes with the global head
count held as ``self.num_heads``: with TP 2 and no SP the losses were 1e-2 off one process);
minGPT's selective recompute is the refusal followed end to end (a user module whose attention is
written out op by op in its block's forward).
The full family matrix (41 HF families) is ``benchmarks/hf_families.py`` (marker ``families``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopar.cli import app
from autopar.plan import load_plan
from autopar.solve import Pins, search
from autopar.spec import parse_model_spec
from autopar.trace import profile_spec
from autopar.verify import Check, check_plan, twin_spec_text, verify
from cost_models import load_profile
from cost_models.strategy import RECOMPUTE

runner = CliRunner()
OPT = "hf:OPTConfig:num_hidden_layers=4,hidden_size=256,num_attention_heads=8,ffn_dim=1024,seq=512"
BLOOM = "hf:BloomConfig:n_layer=4,hidden_size=256,n_head=8,vocab_size=1024,seq=512"
FALCON_MQA = "hf:FalconConfig:num_hidden_layers=4,hidden_size=256,num_attention_heads=8,vocab_size=1024,seq=512"
MINI = f"{Path(__file__).resolve().parent / 'fixtures' / 'mingpt' / 'make.py'}:make"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_twin_keeps_the_architecture_at_toy_size():
    twin = parse_model_spec(twin_spec_text(parse_model_spec(OPT)))
    assert (twin.layers, twin.hidden, twin.heads, twin.vocab, twin.seq) == (2, 64, 4, 128, 16)
    assert "word_embed_proj_dim=64" in twin.name  # tied to the hidden size in the real model
    assert "dropout=0.0" in twin.name
    gqa = parse_model_spec(twin_spec_text(parse_model_spec(
        "hf:LlamaConfig:num_attention_heads=32,num_key_value_heads=8,seq=128")))
    assert (gqa.heads, gqa.num_kv_heads) == (4, 2)
    mqa = parse_model_spec(twin_spec_text(parse_model_spec("hf:FalconConfig:seq=128")))
    assert (mqa.heads, mqa.num_kv_heads) == (4, 1)  # Falcon-7B's multi-query stays multi-query
    # an option naming a shape field by another of its names is replaced, not kept beside it
    falcon = twin_spec_text(parse_model_spec("hf:FalconConfig:new_decoder_architecture=True,num_attention_heads=128,"
                                             "hidden_size=8192,num_kv_heads=8"))
    assert "num_kv_heads=8" not in falcon and parse_model_spec(falcon).num_kv_heads == 2
    # GPT-J rotates 64 of each head's 256 dimensions: the twin, 4 of 16
    assert "rotary_dim=4," in twin_spec_text(parse_model_spec("hf:GPTJConfig"))
    # PhiMoE's router jitter is random in training, like a dropout: off in the twin
    assert "router_jitter_noise=0.0" in twin_spec_text(parse_model_spec("hf:PhimoeConfig"))
    assert twin_spec_text(parse_model_spec("llama3-8b")).startswith("llama:layers=2,")
    # leading dense blocks (GLM-4.5's one, Ernie 4.5's): one, then the twin's two repeated ones
    glm = twin_spec_text(parse_model_spec("hf:Glm4MoeConfig"))
    assert "first_k_dense_replace=1," in glm and parse_model_spec(glm).layers == 3
    ernie = twin_spec_text(parse_model_spec("hf:Ernie4_5_MoeConfig"))
    assert "moe_layer_start_index=1," in ernie and "moe_layer_end_index=2," in ernie
    # Ernie 4.5's 64 experts, as many as the twin's hidden width (and 32 its K/V width): 16,
    # so that no twin GEMM looks like a router
    assert "moe_num_experts=16," in ernie


def test_check_plans_use_exactly_their_feature():
    twin = twin_spec_text(parse_model_spec(OPT))
    for check in Check:
        plan = check_plan(twin, check)
        assert plan.gpus == 2 and plan.global_batch == check_plan(twin, None).global_batch
        want = {Check.SP: ("tp", "sp"), Check.TP_SELECTIVE: ("tp", "selective", "tp+selective"),  # SP rides on TP
                Check.SP_FULL: ("tp", "sp", "sp+full"), Check.SP_OP: ("tp", "sp", "op", "sp+op")}.get(check, (check.value,))
        assert plan.features() == want, check


def test_a_plan_records_every_check_by_name():
    from autopar.plan import FEATURES
    from autopar.verify import COMPOSED
    assert FEATURES == tuple(c.value for c in Check)
    assert all(c.value == "+".join(pair) for c, pair in COMPOSED.items())


def test_refused_features_are_never_searched():
    model, hw = profile_spec(parse_model_spec("llama3-70b")), load_profile("dgx-h100")
    free = search(model, hw, 64, 512, "bf16", Pins()).strategy
    assert free.mesh.tp > 1 or free.mesh.pp > 1, "the test needs a plan that uses model parallelism"
    for refused in (("tp",), ("pp",), ("tp", "pp", "selective"), ("dp",), ("sp+full", "sp+op", "tp+selective")):
        s = search(model, hw, 64, 512, "bf16", Pins(refused=refused)).strategy
        assert not ("tp" in refused and s.mesh.tp > 1) and not ("pp" in refused and s.mesh.pp > 1)
        assert not ("dp" in refused and s.zero > 0)
        assert not ("selective" in refused and any(c[1] for c in s.stage_recompute)), s
        if "sp+full" in refused:  # the pairs: neither recompute mode beside SP, nor selective beside TP
            modes = {m for c in s.stage_recompute for m, n in zip(RECOMPUTE, c) if n}
            assert not (s.sequence_parallel and modes & {"full", "op"}), s
            assert not (s.mesh.tp > 1 and "selective" in modes), s


def test_a_plan_names_what_failed_on_its_twin():
    base = check_plan(twin_spec_text(parse_model_spec(OPT)), Check.SP)
    plan = dataclasses.replace(base, verified=(("tp", ""), ("sp", "rank 0: RuntimeError: shapes")))
    assert plan.features() == ("tp", "sp")
    assert "failed the sp check" in plan.refusal() and "RuntimeError: shapes" in plan.refusal()
    assert dataclasses.replace(plan, sequence_parallel=False).refusal() is None


@pytest.mark.slow
def test_bloom_and_multi_query_are_proved_and_mingpt_selective_refused_end_to_end(cache, tmp_path):
    """verify: Bloom's TP (its model-built ALiBi cut to each rank's heads) and selective
    recompute (its attention written out op by op, checkpointed as a module under a policy),
    and Falcon-7B's multi-query TP (one K,V head, kept whole on every rank) are equal to one
    process. minGPT (a module of the user's own) writes its attention out op by op in its
    block's forward: its selective recompute is refused with the rank's error; the planner
    plans it without, records the verdicts, a pinned ``--recompute selective`` exits 2, `run`
    refuses a hand-made selective plan before launching anything and `explain` shows the
    refusal."""
    bloom = verify(BLOOM, checks=(Check.TP, Check.SELECTIVE))
    assert bloom.allows(Check.TP) and bloom.allows(Check.SELECTIVE), bloom.refusals()
    assert verify(FALCON_MQA, checks=(Check.TP,)).allows(Check.TP)
    result = verify(MINI, checks=(Check.SELECTIVE,))
    assert not result.allows(Check.SELECTIVE)
    reason = result.refusals()["selective"]
    assert reason.startswith("rank ") and "\n" not in reason and "op by op" in reason
    assert any(cache.glob("verify/*.json"))

    out = tmp_path / "mingpt.json"
    job = ["--model", MINI, "--cluster", "cpu-local", "--gpus", "2", "--global-batch", "8", "--dtype", "fp32"]
    r = runner.invoke(app, ["plan", *job, "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    plan = load_plan(out)
    assert "selective" not in plan.recompute and dict(plan.verified)["selective"] == reason
    r = runner.invoke(app, ["plan", *job, "--recompute", "selective"])
    assert r.exit_code == 2 and "failed autopar verify's selective check" in r.output, r.output

    bad = tmp_path / "selective.json"
    dataclasses.replace(check_plan(MINI, Check.SELECTIVE), recompute=("selective",) * 4).save(bad)
    r = runner.invoke(app, ["run", str(bad), "--steps", "1", "--trust-code"])
    assert r.exit_code == 2 and "failed the selective check on its twin" in r.output, r.output

    r = runner.invoke(app, ["explain", str(out), "--json", "--time-limit", "5", "--trust-code"])
    assert r.exit_code == 0, r.output
    assert json.JSONDecoder().raw_decode(r.stdout)[0]["refused"]["selective"] == reason


def test_a_twin_that_cannot_run_in_one_process_is_one_line(cache, monkeypatch):
    from autopar import verify as verify_module
    from autopar.errors import UserError

    def broken(twin):
        raise AttributeError("'Llama4ForCausalLM' object has no attribute 'language_model'")
    monkeypatch.setattr(verify_module, "_reference", broken)
    with pytest.raises(UserError, match=r"cannot train the twin of .*\(AttributeError: 'Llama4ForCausalLM' object has "
                                        r"no attribute 'language_model'\); this model is not supported yet"):
        verify(OPT, checks=(Check.TP,))


def test_launch_verifies_the_checks_a_plan_records_no_verdict_of(monkeypatch):
    """A plan made before the pair checks existed records the six single-feature verdicts only:
    launch verifies the pair its layout uses, and refuses it when the twin fails it."""
    from autopar import verify as verify_module
    from autopar.verify import Verdict, Verification
    from autopar.workflow import launch_refusal
    asked = []

    def fake(model, *, checks, use_cache=True):
        asked.append(checks)
        return Verification(model=model, twin=model, verdicts=tuple(
            Verdict(check=c, ok=c != Check.TP_SELECTIVE, reason="" if c != Check.TP_SELECTIVE else "rank 0: boom")
            for c in checks))
    monkeypatch.setattr(verify_module, "verify", fake)
    plan = check_plan(twin_spec_text(parse_model_spec(OPT)), Check.TP_SELECTIVE)
    old = dataclasses.replace(plan, model=OPT, verified=tuple((c, "") for c in ("dp", "tp", "sp", "pp", "selective", "op")))
    assert "failed the tp+selective check" in launch_refusal(old) and asked == [(Check.TP_SELECTIVE,)]
    assert launch_refusal(dataclasses.replace(old, recompute=("none",) * len(old.recompute))) is None
    assert asked == [(Check.TP_SELECTIVE,)]  # nothing left unrecorded: nothing verified
