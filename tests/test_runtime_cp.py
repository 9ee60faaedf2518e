"""Context parallelism (``autopar/runtime/context_parallel.py``) trains exactly like one process.

Single process: the zigzag shard and unshard are inverse, every rank's queries see as many keys
under the causal mask (the load balance), and each rank's attention over the whole K,V equals
the rows of plain causal attention, forward and backward.

On gloo, against the single process on the same seed and global batch: the built-in GPT
(learned positions) with CP 2 (DDP over cp) and CP 2 x TP 2; Llama (RoPE, GQA) with CP 2 x
TP 2 + SP under ZeRO-3 and CP 2 x DP 2 under ZeRO-1 with full recompute. Driven through the
plan-driven runtime (``run_job``: torchrun and the worker), one job per world size.

Gradients are compared through SGD (lr 0.1, as test_runtime_ep): after ``STEPS`` steps every
weight's change divided by lr is the sum of its gradients. Tolerances. Each layout sums the
same float32 products in another order (attention over two prefixes of the keys, a
reduce-scatter of dK, dV, the mean over dp x cp ranks instead of one batch): the loss agrees
to float32 rounding (measured |Δ| ≤ 7.7e-7 on ~4.85; we allow 2e-6, as test_runtime does);
the summed gradients (entries up to 0.24) to 1e-5 absolute (measured ≤ 1.2e-6, a weight's
float32 rounding divided by lr). A wrong position (learned or RoPE) or a mask off by one
chunk moves the first loss by ~1e-3; a missing reduction over cp halves a gradient.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autopar.plan import Mesh, Plan
from autopar.runtime import RunSpec, TrainConfig, run_job
from autopar.runtime.context import ParallelContext, check_plan
from autopar.runtime.context_parallel import (
    shard_sequence,
    unshard_sequence,
    zigzag_attention,
    zigzag_mask,
    zigzag_positions,
)
from autopar.runtime.train import train
from parity import dumped, single_process

GPT = "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16,tied=0"
LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"
STEPS = 2
CFG = TrainConfig(optimizer="sgd", lr=0.1)
LOSS_TOL = 2e-6
GRAD_TOL = 1e-5


def make_plan(model: str, *, cp: int = 1, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, mbs: int = 2,
              m: int = 2, sp: bool = False, recompute: str = "none", seq: int = 16) -> Plan:
    return Plan(model=model, cluster="cpu-local", gpus=cp * dp * tp * pp, global_batch=dp * mbs * m, seq_len=seq,
                dtype="fp32", mesh=Mesh(dp=dp, tp=tp, pp=pp, cp=cp), zero_stage=zero, micro_batch_size=mbs,
                num_microbatches=m, sequence_parallel=sp, stage_layers=(2 // pp,) * pp, recompute=(recompute,) * 2)


# name -> plan; every plan has global batch 4.
RUNS_2 = {
    "gpt cp2 ddp": make_plan(GPT, cp=2, mbs=2, m=2),
}
RUNS_4 = {
    "gpt cp2 x tp2": make_plan(GPT, cp=2, tp=2, mbs=4, m=1),
    "llama cp2 x tp2 sp zero0 selective": make_plan(LLAMA, cp=2, tp=2, sp=True, mbs=2, m=2, recompute="selective"),
    "llama cp2 x dp2 zero3 full": make_plan(LLAMA, cp=2, dp=2, zero=3, mbs=1, m=2, recompute="full"),
}


# ---- single process: the layout and the attention ----

@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_shard_unshard_and_balance(cp):
    """Rank r holds chunks r and 2cp-1-r; unshard inverts shard; every rank's queries see the
    same number of keys under the causal mask (s/cp (s+1)/2 of them each) and only earlier ones."""
    seq = 32
    assert zigzag_positions(seq, cp, 0).tolist()[:seq // (2 * cp)] == list(range(seq // (2 * cp)))
    assert sorted(torch.cat([zigzag_positions(seq, cp, r) for r in range(cp)]).tolist()) == list(range(seq))
    x = torch.arange(3 * seq).view(3, seq)
    shards = [shard_sequence(x, cp, r) for r in range(cp)]
    assert all(s.shape == (3, seq // cp) for s in shards)
    assert torch.equal(unshard_sequence(shards), x)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for r in range(cp):
        mask = zigzag_mask(seq, cp, r)
        assert torch.equal(mask, causal[zigzag_positions(seq, cp, r)])
        assert mask.sum().item() == seq * (seq + 1) // 2 // cp
    if cp > 1:
        with pytest.raises(ValueError, match="multiple of"):
            zigzag_positions(seq + 2, cp, 0)


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_attention_equals_causal_attention(cp):
    """Each rank's queries against the whole sequence's K,V (GQA: 4 query heads on 2), put back
    in order, equal causal SDPA over the sequence, and so do the gradients of q, k and v."""
    torch.manual_seed(0)
    b, heads, kv, seq, d = 2, 4, 2, 16, 8
    q, k, v = (torch.randn(b, h, seq, d, dtype=torch.float64, requires_grad=True) for h in (heads, kv, kv))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got = unshard_sequence([zigzag_attention(shard_sequence(q, cp, r, dim=2), k, v, cp, r) for r in range(cp)], dim=2)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_refusals_name_the_fix():
    """What CP does not run is refused before launch, in one line naming the fix."""
    hf = "hf:LlamaConfig:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2," \
         "intermediate_size=96,vocab_size=128,seq=16"
    cases = {"built-in gpt/llama models only": make_plan(hf, cp=2),
             "with pipelining": make_plan(GPT, cp=2, pp=2, m=2),
             "multiple of 2 x cp = 4": make_plan(GPT, cp=2, seq=14),
             "must divide": make_plan(GPT, cp=2, tp=4, sp=True, seq=12)}
    for fragment, plan in cases.items():
        with pytest.raises(ValueError, match=fragment) as err:
            check_plan(plan)
        assert "\n" not in str(err.value)


# ---- gloo: parity with one process ----

@pytest.fixture(scope="module")
def references():
    return {model: single_process(make_plan(model, mbs=4, m=1), STEPS, CFG) for model in (GPT, LLAMA)}


def _run(runs: dict[str, Plan], tmp: Path) -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    results = run_job([RunSpec(plan=p, steps=STEPS, dump=True) for p in runs.values()], workdir=tmp, cfg=CFG,
                      timeout_s=900)
    return {name: (r.losses, dumped(tmp, f"run{i}.final")) for i, (name, r) in enumerate(zip(runs, results))}


@pytest.fixture(scope="module")
def runs_2(tmp_path_factory):
    return _run(RUNS_2, tmp_path_factory.mktemp("cp2"))


@pytest.fixture(scope="module")
def runs_4(tmp_path_factory):
    return _run(RUNS_4, tmp_path_factory.mktemp("cp4"))


def _assert_parity(name: str, plan: Plan, run, references) -> None:
    (losses, state), (ref_losses, initial, ref_state) = run, references[plan.model]
    assert len(losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= LOSS_TOL, f"{name}: step {step} loss {got} vs {want}"
    assert state.keys() == ref_state.keys(), f"{name}: parameters differ in names"
    for key, want in ref_state.items():
        # Summed gradients: (initial - final) / lr, SGD without weight decay.
        got_g, want_g = (initial[key] - state[key]) / CFG.lr, (initial[key] - want) / CFG.lr
        err = (got_g - want_g).abs().max().item()
        assert err <= GRAD_TOL, f"{name}: {key} gradients differ by {err:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS_2))
def test_parity_world_2(name, runs_2, references):
    _assert_parity(name, RUNS_2[name], runs_2[name], references)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS_4))
def test_parity_world_4(name, runs_4, references):
    _assert_parity(name, RUNS_4[name], runs_4[name], references)


@pytest.mark.slow
def test_cli_plans_and_runs_cp(tmp_path, references):
    """``autopar plan --cp 2`` under the default recipe writes a cp plan, and ``autopar run``
    trains it: the losses of one process on the same batches."""
    import json
    from typer.testing import CliRunner
    from autopar.cli import app
    runner = CliRunner()
    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", "--model", GPT, "--cluster", "cpu-local", "--gpus", "2", "--global-batch", "4",
                              "--dtype", "fp32", "--cp", "2", "--mbs", "4", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    mesh = json.loads(res.output)["plan"]["mesh"]
    assert mesh["cp"] == 2 and mesh["dp"] == 1
    ran = runner.invoke(app, ["run", str(out), "--steps", "2", "--json"])
    assert ran.exit_code == 0, ran.output
    plan = make_plan(GPT, mbs=4, m=1)
    ctx = ParallelContext(mesh=None, device=torch.device("cpu"))
    want = train(plan, 2, ctx).losses  # autopar run's default optimizer (AdamW)
    got = json.loads(ran.stdout.strip().splitlines()[-1])["losses"]
    assert got == pytest.approx(want, abs=LOSS_TOL)
