"""Expert parallelism on gloo trains exactly like one process: a tiny HF Mixtral (4 experts,
top-2, 2 blocks, hidden 64) with EP 2, EP 2 x DP 2 (experts replicated over edp = 2), EP 2 x
TP 2 (the experts replicated over tp), TP 2 with SP x DP 2 (ep = 1: the experts on each tp
rank's own tokens), EP 2 x PP 2 (one block per stage; 1F1B, and the
zero-bubble schedule, whose backward splits input and weight gradients) and plain DP 2 of the
MoE model (ep = 1), each against the single process on the same seed and global batch (and a
bf16 EP 2 run against it, loosely).

Driven through the plan-driven runtime (``run_job``, torchrun, the worker): the plan gives dp,
tp, ep (``Mesh.ep``, a regrouping of dp), ZeRO and recompute.

Gradients are compared through SGD (lr 0.1, so a weight's change is -lr x its gradients):
after ``STEPS`` steps every weight's change, divided by lr, is the sum of its gradients.
Tolerances. Each layout sums the same float32 products in another order (the experts' grouped
GEMMs over other row counts, all-to-all then a reduction over dp instead of one batch): the
loss agrees to float32 rounding (measured |Δ| ≤ 3.6e-7 on ~4.85; we allow 2e-6, as
test_runtime does); the summed gradients (entries up to 6.5e-2) to 1e-5 absolute (measured
≤ 7.5e-8: a weight's float32 rounding divided by lr). A missing reduction over edp or dp, or
a division by edp instead of dp, moves an expert's summed gradient by a multiple of itself
(measured: 2.5e-3 when torch divided twice); tokens sent to the wrong experts move the first
loss by ~2e-3. Under pipelining the same holds (measured ≤ 2.4e-7 and ≤ 7.5e-8); expert
gradients divided by 2 dp instead of dp move the second loss by 1.1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopar.errors import UserError
from autopar.plan import Mesh, Plan
from autopar.runtime import RunSpec, TrainConfig, run_job
from autopar.runtime.context import ParallelContext
from autopar.runtime.state import full_state
from autopar.runtime.train import build_program
from parity import HF_GLM4_MOE, dumped, hf_deepseek_v3, single_process

MOE = "moe:layers=2,hidden=64,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16,experts=4,topk=2"
HF_DEEPSEEK_V3 = hf_deepseek_v3(layers=5, lead=3)  # three dense blocks, as DeepSeek-V3 has
STEPS = 2
CFG = TrainConfig(optimizer="sgd", lr=0.1)
LOSS_TOL = 2e-6
GRAD_TOL = 1e-5
BF16_LOSS_TOL = 5e-2  # as test_runtime's (measured here: 1.5e-4)
BF16_GRAD_TOL = 1e-2  # 8 mantissa bits; measured 2.5e-3. The fp32 runs prove the reductions, this the bf16 path.


def make_plan(*, dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, zero: int = 0, mbs: int = 2, m: int = 2,
              recompute: str = "none", sp: bool = False, model: str = MOE, dtype: str = "fp32",
              schedule: str = "1f1b") -> Plan:
    return Plan(model=model, cluster="cpu-local", gpus=dp * tp * pp, global_batch=dp * mbs * m, seq_len=16,
                dtype=dtype, mesh=Mesh(dp=dp, tp=tp, pp=pp, ep=ep), zero_stage=zero, micro_batch_size=mbs,
                num_microbatches=m, sequence_parallel=sp, stage_layers=(2 // pp,) * pp, recompute=(recompute,) * 2,
                schedule=schedule)


# name -> (plan, ep); every plan has global batch 8.
RUNS_2 = {
    "dp2 ep1 ddp": (make_plan(dp=2, mbs=2, m=2, ep=1), 1),
    "dp2 ep2 zero0": (make_plan(dp=2, mbs=2, m=2, ep=2), 2),
    "dp2 ep2 zero2 bf16": (make_plan(dp=2, zero=2, mbs=2, m=2, dtype="bf16", ep=2), 2),
}
RUNS_4 = {
    "dp4 ep2 (edp2) zero3 full recompute": (make_plan(dp=4, zero=3, mbs=1, m=2, recompute="full", ep=2), 2),
    "dp2 tp2 ep2 zero1": (make_plan(dp=2, tp=2, zero=1, mbs=2, m=2, ep=2), 2),
    "dp4 ep4 zero2": (make_plan(dp=4, zero=2, mbs=2, m=1, ep=4), 4),
    # EP x PP: an ep group's ranks share a pipeline stage, so run the same micro-batches in the
    # same order and their all-to-alls pair up. Replicated experts (ZeRO 0, FSDP2's replicate)
    # under 1F1B; FSDP2 under the zero-bubble schedule, whose all-to-all backward runs in the
    # input-gradient pass and whose expert gradients reduce once, after the last weight pass.
    "dp2 pp2 ep2 zero0 1f1b": (make_plan(dp=2, pp=2, ep=2, mbs=2, m=2), 2),
    "dp2 pp2 ep2 zero2 zero-bubble": (make_plan(dp=2, pp=2, ep=2, zero=2, mbs=2, m=2, schedule="zero-bubble"), 2),
    # SP without EP: the experts run on each tp rank's own tokens, replicated over tp, their
    # gradients partial sums over the tp ranks (FSDP2 completes them)
    "dp2 tp2 sp ep1 zero3": (make_plan(dp=2, tp=2, sp=True, zero=3, mbs=2, m=2), 1),
}


@pytest.fixture(scope="module")
def reference():
    return single_process(make_plan(mbs=8, m=1), STEPS, CFG)


def _run(runs: dict[str, tuple[Plan, int]], tmp: Path,
         save: str = "") -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    """Every run in one torchrun job; the run named ``save`` saves a checkpoint in ``tmp/ckpt``."""
    specs = [RunSpec(plan=p, steps=STEPS, dump=True, save=tmp / "ckpt" if name == save else None)
             for name, (p, ep) in runs.items()]
    results = run_job(specs, workdir=tmp, cfg=CFG, timeout_s=900)
    return {name: (r.losses, dumped(tmp, f"run{i}.final")) for i, (name, r) in enumerate(zip(runs, results))}


SAVED = "dp2 ep2 zero0"
"""The world-2 run that also saves a checkpoint (after its last step)."""


@pytest.fixture(scope="module")
def ep2_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ep2")


@pytest.fixture(scope="module")
def runs_2(ep2_dir):
    return _run(RUNS_2, ep2_dir, save=SAVED)


@pytest.fixture(scope="module")
def runs_4(tmp_path_factory):
    return _run(RUNS_4, tmp_path_factory.mktemp("ep4"))


def _assert_parity(name: str, run, reference) -> None:
    (losses, state), (ref_losses, initial, ref_state) = run, reference
    low = name.endswith("bf16")
    loss_tol, grad_tol = (BF16_LOSS_TOL, BF16_GRAD_TOL) if low else (LOSS_TOL, GRAD_TOL)
    assert len(losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= loss_tol, f"{name}: step {step} loss {got} vs {want}"
    assert state.keys() == ref_state.keys(), f"{name}: parameters differ in names"
    assert any(".experts." in key for key in state)
    for key, want in ref_state.items():
        assert state[key].shape == want.shape, f"{name}: {key} has shape {tuple(state[key].shape)}"
        grads, ref_grads = (initial[key] - state[key]) / CFG.lr, (initial[key] - want) / CFG.lr
        err = (grads - ref_grads).abs().max().item()
        assert err <= grad_tol, f"{name}: {key}'s summed gradients differ by {err:.3g} (tolerance {grad_tol:g})"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS_2))
def test_parity_world_2(name, runs_2, reference):
    _assert_parity(name, runs_2[name], reference)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS_4))
def test_parity_world_4(name, runs_4, reference):
    _assert_parity(name, runs_4[name], reference)


@pytest.mark.slow
def test_expert_parallel_checkpoint_loads_on_one_process(runs_2, ep2_dir):
    """DCP saves the ep-sharded experts (DTensors) by their single-process names and shapes:
    one process loads the EP 2 run's checkpoint into the whole model, bit for bit."""
    from autopar.checkpoint_dir import resolve
    from autopar.runtime import checkpoint
    prog = build_program(make_plan(mbs=8, m=1), ParallelContext(mesh=None, device=torch.device("cpu")), CFG)
    where = checkpoint.load(prog, resolve(ep2_dir / "ckpt", trust_code=False))
    assert where.step == STEPS
    loaded, saved = full_state(prog), runs_2[SAVED][1]
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key


def test_anatomy_of_moe_blocks():
    """The tracer's labels become the layout: attention GEMMs column/row (tensor parallelism
    shards them), the router replicated, the stacked experts one module (expert parallelism
    shards it); a dense model has neither."""
    from autopar.runtime.train import _traced_layout
    from autopar.spec import parse_model_spec
    moe = _traced_layout(parse_model_spec(MOE))
    assert moe.experts == ("mlp.experts",) and moe.routers == ("mlp.gate",)
    assert set(moe.column) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}
    assert moe.row == ("self_attn.o_proj",)
    dense = _traced_layout(parse_model_spec("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"))
    assert dense.experts == () and dense.routers == () and len(dense.column) == 5


def test_anatomy_of_latent_attention():
    """DeepSeek-V3's latent attention: the low-rank GEMMs kept whole (``replicated``), their
    norms whole (``inner_norms``), the GEMMs after them column, and the RoPE key every head
    reads (the last 8 of ``kv_a_proj_with_mqa``'s 16 outputs) summed over the tp ranks in the
    backward; in its three leading dense blocks as in its MoE ones."""
    from autopar.runtime.train import _traced_layout
    from autopar.spec import parse_model_spec
    anat = _traced_layout(parse_model_spec(HF_DEEPSEEK_V3))
    for kind in anat.kinds():
        assert kind.replicated == ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")
        assert kind.inner_norms == ("self_attn.q_a_layernorm", "self_attn.kv_a_layernorm")
        assert {"self_attn.q_b_proj", "self_attn.kv_b_proj"} <= set(kind.column) and "self_attn.o_proj" in kind.row
        assert kind.partial_outputs == (("self_attn.kv_a_proj_with_mqa", (8, 16)),)
        assert not set(kind.inner_norms) & set(kind.norms + kind.width_norms)
    assert anat.lead is not None and len(anat.lead.blocks) == 3 and anat.experts == ("mlp.experts",)
    # a latent rank as wide as a head (24 = 16 + 8 here; GLM-4.7-Flash's twin): its norm is
    # still the low-rank GEMM's, whole, not a per-head one
    wide = _traced_layout(parse_model_spec(HF_DEEPSEEK_V3.replace("kv_lora_rank=8", "kv_lora_rank=24")))
    assert "self_attn.kv_a_layernorm" in wide.inner_norms and wide.head_norms == ()


def test_anatomy_of_a_leading_dense_block():
    """GLM-4.5's leading dense block is a kind of its own (``Anatomy.lead``): its MLP's GEMMs
    are column/row even where its width equals the expert count (96 here), since a router is
    a GEMM of a block that holds experts; the MoE blocks keep their own labels."""
    from autopar.runtime.train import _traced_layout
    from autopar.spec import parse_model_spec
    anat = _traced_layout(parse_model_spec(HF_GLM4_MOE.replace("n_routed_experts=4", "n_routed_experts=96")))
    assert anat.lead is not None and anat.lead.blocks == ("model.layers.0",)
    assert anat.blocks == tuple(f"model.layers.{i}" for i in range(4))
    assert anat.kind("model.layers.0") is anat.lead and anat.kind("model.layers.2") is anat
    assert set(anat.lead.column) >= {"mlp.gate_proj", "mlp.up_proj"} and "mlp.down_proj" in anat.lead.row
    assert anat.lead.experts == () and anat.lead.routers == ()
    assert anat.experts == ("mlp.experts",) and "mlp.shared_experts.down_proj" in anat.row
    assert anat.any_experts() and not anat.lead.any_experts()
    import dataclasses
    from autopar.layout import Anatomy
    from autopar.plan import rebuild
    assert rebuild(Anatomy, dataclasses.asdict(anat), "layout") == anat  # as a plan and the cache keep it


def test_experts_contract_is_checked():
    """Only a module of stacked experts with transformers' experts forward is sharded; anything
    else is named, not guessed at."""
    from torch import nn
    from autopar.runtime.experts import experts_unsupported

    class Stacked(nn.Module):
        def __init__(self, count: int, leading: int) -> None:
            super().__init__()
            self.num_experts = count
            self.w = nn.Parameter(torch.zeros(leading, 4, 4))

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return hidden_states

    class Other(Stacked):
        def forward(self, x):
            return x

    assert experts_unsupported(Stacked(4, 4), 2) is None
    assert "does not divide the 4 experts" in experts_unsupported(Stacked(4, 4), 3)
    assert "not stacked by its 4 experts" in experts_unsupported(Stacked(4, 5), 2)
    assert "transformers' experts arguments" in experts_unsupported(Other(4, 4), 2)
    assert "no stacked expert weights" in experts_unsupported(nn.Linear(4, 4), 2)


def test_reference_moves_every_expert(reference):
    """Every expert of every layer gets a gradient in the reference, so the comparison covers
    each rank's experts (a rank's experts left untrained would show)."""
    _, initial, final = reference
    for key in (k for k in initial if k.endswith(("experts.gate_up_proj", "experts.down_proj"))):
        moved = (initial[key] - final[key]).flatten(1).abs().amax(dim=1)
        assert (moved > 1e-4).all(), f"{key}: experts {moved.tolist()}"


@pytest.mark.parametrize(("plan", "ep", "match"), [
    (make_plan(dp=4, mbs=1, m=2, ep=3), 3, "ep=3 must divide dp=4"),
    (make_plan(dp=2, tp=2, ep=4), 4, "ep=4 must divide dp=2"),
    (make_plan(dp=4, mbs=2, m=1, ep=4, model=MOE.replace("experts=4", "experts=6")), 4, "ep=4 must divide the 6 experts"),
    (make_plan(dp=2, tp=2, sp=True, ep=2), 2, "--no-sp or ep = 1"),
    (make_plan(dp=2, ep=2, model="llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"), 2, "has none"),
])
def test_refused_before_launch(plan, ep, match, tmp_path):
    """What expert parallelism cannot run is refused in one line before any process starts."""
    with pytest.raises(UserError, match=match) as err:
        run_job([RunSpec(plan=plan, steps=1)], workdir=tmp_path, timeout_s=60)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "job.json").exists()


@pytest.fixture
def one_rank():
    """A gloo process group of this one process (destroyed after the test)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tokens", [0, 1, 24])
def test_dispatch_equals_the_module(one_rank, tokens):
    """The EP forward (sort by expert, counts and rows by all-to-all, the module's own experts
    kernel on the local experts, back, combine) on one rank equals HF's forward, outputs and
    gradients, also where experts get no token (one token, top-2 of 4) and for no token at all
    (each weight's gradient is zeros, which FSDP2 can reduce, not missing)."""
    import copy
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from autopar.runtime.experts import _shard_experts
    config = MixtralConfig(hidden_size=64, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "grouped_mm"  # what the runtime's models use
    gen = torch.Generator().manual_seed(0)
    whole = MixtralExperts(config)
    with torch.no_grad():
        for p in whole.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    sharded = copy.deepcopy(whole)
    _shard_experts(sharded, one_rank)
    x = torch.randn(tokens, 64, generator=gen)
    index = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, 2, dtype=torch.long)
    weights = torch.rand(tokens, 2, generator=gen)
    outs, grads = [], []
    for module in (whole, sharded) if tokens else (sharded,):  # HF's grouped GEMM takes no empty batch
        xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = module(xi, index, wi)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append(out)
        grads.append([xi.grad, wi.grad] + [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                                           for p in module.parameters()])
    assert outs[-1].shape == (tokens, 64)
    if not tokens:
        assert all(g is not None and not g.any() for g in grads[0])
        return
    assert torch.allclose(outs[0], outs[1], atol=1e-6)
    for want, got in zip(*grads):
        assert got is not None and want is not None and torch.allclose(want, got, atol=1e-6)
