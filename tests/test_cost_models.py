"""The cost model against its formulas and the papers' closed forms (pure Python, fast)."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from cost_models import (Axis, Degrees, ModelProfile, ProfileError, Strategy, estimate, even_stage_layers, load_profile,
                         model_flops_per_step, stage_costs)
from cost_models import blockcomm, comm, compute, host, memory, pieces, pipeline, ring, states
from cost_models.axes import parse_order
from cost_models.estimate import fsdp_partial_grads_s, partial_grads_sync_s, stage_details
from cost_models.states import STATE_LAYOUTS, state_bytes
from autopar.profiles import profile_spec
from autopar.spec import parse_model_spec
from cost_models.recipe import ContextParallel, SpCopy, load_recipe

MC, M21 = load_recipe("megatron-core"), load_recipe("megatron-2021")


def gpt(layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048) -> ModelProfile:
    """Narayanan's counts (Eq. 2, 3) and Korthikanti's activation decomposition 34 + 5as/h."""
    h = hidden
    return ModelProfile(
        name=f"gpt-{layers}x{h}", layers=layers, hidden=h, heads=heads, kv_heads=heads,
        ffn=4 * h, vocab=vocab, seq=seq, tied=True, block_params=12 * h * h + 13 * h,
        embed_params=(vocab + seq) * h, head_params=2 * h + vocab * h,
        block_matmul_flops_per_token=24.0 * h * h, block_attn_flops_per_token=4.0 * seq * h,
        head_flops_per_token=2.0 * vocab * h, block_act_bytes_replicated_per_token=10.0 * h,
        block_act_bytes_sharded_per_token=24.0 * h, block_act_bytes_attn_per_token=5.0 * heads * seq,
        # FlashAttention: the dropout masks of attention probabilities and scores go, a float32
        # log-sum-exp per head stays (Q, K, V and the output are in the 24h already).
        fused_act_bytes_replicated_per_token=10.0 * h, fused_act_bytes_sharded_per_token=24.0 * h,
        fused_act_bytes_attn_per_token=4.0 * heads)


A100 = load_profile("dgx-a100-80g")
A0 = dataclasses.replace(A100, overlap_penalty=0.0)  # perfect overlap, for the hiding laws
G22B = gpt(48, 6144, 64)  # Korthikanti et al. Table 3


# --- communication -------------------------------------------------------------------------

def test_alpha_beta_collectives():
    g = comm.Group(size=4, bw_bytes_s=100e9, p2p_bytes_s=50e9, latency_s=1e-5, inter_node=False)
    nbytes = 1e9
    assert comm.all_reduce_s(nbytes, g) == pytest.approx(2 * 3 / 4 * nbytes / 100e9 + 6 * 1e-5)
    assert comm.reduce_scatter_s(nbytes, g) == pytest.approx(3 / 4 * nbytes / 100e9 + 3 * 1e-5)
    assert comm.all_gather_s(nbytes, g) == comm.reduce_scatter_s(nbytes, g)
    assert comm.p2p_s(nbytes, g) == pytest.approx(1e-5 + nbytes / 50e9)
    one = dataclasses.replace(g, size=1)
    assert comm.all_reduce_s(nbytes, one) == comm.p2p_s(nbytes, one) == 0.0


def test_tier_follows_megatron_rank_order():
    groups = comm.axis_groups(A100, Strategy(recipe=MC, mesh=Degrees(tp=8, dp=2, pp=2)))
    assert not groups[Axis.TP].inter_node and groups[Axis.TP].bw_bytes_s == pytest.approx(230e9)
    # dp ranks are 8 apart: one member per node, one 24 GB/s NIC per ring.
    assert groups[Axis.DP].inter_node and groups[Axis.DP].bw_bytes_s == pytest.approx(24e9)
    assert groups[Axis.PP].inter_node
    groups = comm.axis_groups(A100, Strategy(recipe=MC, mesh=Degrees(tp=2, dp=4, pp=4)))
    assert not groups[Axis.TP].inter_node and not groups[Axis.DP].inter_node and groups[Axis.PP].inter_node
    # tp = 1, dp = 16: 8 members per node run 8 rings over 8 NICs: 8 x 24 = 192 GB/s.
    groups = comm.axis_groups(A100, Strategy(recipe=MC, mesh=Degrees(dp=16)))
    assert groups[Axis.DP].inter_node and groups[Axis.DP].bw_bytes_s == pytest.approx(192e9)


def test_one_axis_vocabulary():
    """A ``Degrees`` field per ``Axis`` member (a new axis is one member and its field); the
    order helpers read only the axes of degree > 1; names become members, anything else fails."""
    assert [f.name for f in dataclasses.fields(Degrees)] == [a.value for a in Axis]
    d = Degrees(dp=4, tp=2)
    assert d.size == 8 and d[Axis.DP] == 4 and d.active() == (Axis.DP, Axis.TP)
    order = parse_order(["tp", "dp", "pp"])
    assert order == (Axis.TP, Axis.DP, Axis.PP) and d.active(order) == (Axis.TP, Axis.DP)
    assert d.strides(order) == {Axis.PP: 1, Axis.DP: 1, Axis.CP: 1, Axis.TP: 4}
    assert d.strides() == {Axis.TP: 1, Axis.CP: 2, Axis.DP: 2, Axis.PP: 8}
    for bad in (["pp", "pp", "tp"], ["pp", "dp"], ["pp", "dp", "tp", "ep"], ["pp", "cp", "dp", "tp", "cp"]):
        with pytest.raises(ValueError, match="once each"):
            parse_order(bad)
    assert Strategy(mesh=d, axis_order=("tp", "dp", "pp")).axis_order == order
    # cp (an optional axis) is listed only when its degree is above 1: an old order gets it in
    # Megatron's place, and a listed cp of degree 1 is dropped.
    c = Degrees(dp=2, cp=4, tp=2)
    assert parse_order(["pp", "dp", "tp"], c) == (Axis.PP, Axis.DP, Axis.CP, Axis.TP) == c.default_order()
    assert parse_order(["tp", "dp", "pp"], c) == (Axis.TP, Axis.DP, Axis.CP, Axis.PP)
    assert parse_order(["dp", "pp", "tp"], c) == (Axis.DP, Axis.CP, Axis.PP, Axis.TP)
    assert parse_order(["pp", "cp", "dp", "tp"], d) == (Axis.PP, Axis.DP, Axis.TP) == d.default_order()
    assert Strategy(mesh=c, recipe=MC).axis_order == (Axis.PP, Axis.DP, Axis.CP, Axis.TP)
    assert Strategy(mesh=d).axis_order == (Axis.PP, Axis.DP, Axis.TP)
    assert c.strides(c.default_order()) == {Axis.TP: 1, Axis.CP: 2, Axis.DP: 8, Axis.PP: 16}
    # ep regroups dp x cp: no device count, no place in an order, still one field and member.
    e = Degrees(dp=8, tp=2, ep=4)
    assert e.size == 16 and e.edp == 2 and e.active() == (Axis.DP, Axis.TP)
    assert Strategy(mesh=e).axis_order == (Axis.PP, Axis.DP, Axis.TP)
    with pytest.raises(ValueError, match="once each"):
        parse_order(["pp", "dp", "ep", "tp"])
    with pytest.raises(ValueError, match="ep=3 must divide dp x cp = 8"):
        Strategy(mesh=Degrees(dp=8, ep=3))


# --- memory -------------------------------------------------------------------------------

@pytest.mark.parametrize("psi, dp, zero, published_gb", [
    (7.5e9, 64, 1, 31.4), (7.5e9, 64, 2, 16.6), (7.5e9, 64, 3, 1.88),
    (7.5e9, 16, 2, 21.6), (7.5e9, 4, 3, 30.0), (1e12, 1024, 3, 15.6),
])
def test_zero_table1_model_states(psi, dp, zero, published_gb):
    """Rajbhandari et al. 2020, Table 1 (GB = 1e9 bytes), 16 bytes/parameter recipe."""
    got = state_bytes(psi, Strategy(mesh=Degrees(dp=dp), zero=zero, recipe=M21)).total / 1e9
    assert got == pytest.approx(published_gb, rel=0.005)


def test_state_layouts_bytes_per_parameter():
    assert state_bytes(1, Strategy(recipe=MC)).total == 18
    assert state_bytes(1, Strategy(recipe=M21)).total == 16
    assert state_bytes(1, Strategy(dtype="fp32")).total == 16
    # autopar's FSDP2/autocast program: fp32 master weights + a bf16 copy for compute.
    assert state_bytes(1, Strategy()).total == 18
    # ZeRO-1 on FSDP2 shards the fp32 weights (the master) and keeps the bf16 copy whole, and
    # the gradients until the last micro-batch's reduce-scatter: with one, that one's (ZeRO-2's).
    z1 = state_bytes(8, Strategy(mesh=Degrees(dp=8), zero=1, num_microbatches=4))
    assert (z1.params, z1.grads, z1.optimizer) == (4 + 16, 32, 8)
    z1m1 = state_bytes(8, Strategy(mesh=Degrees(dp=8), zero=1, num_microbatches=1))
    assert (z1m1.params, z1m1.grads, z1m1.optimizer) == (4 + 16, 4, 8)
    z1mc = state_bytes(8, Strategy(mesh=Degrees(dp=8), zero=1, num_microbatches=1, recipe=MC))
    assert z1mc.grads == 32  # Megatron's distributed optimizer keeps its whole gradient buffer
    # ZeRO-3 under a pipeline (torch.distributed.pipelining + FSDP2): gathered weights and
    # unsharded gradients until the last backward; without a pipeline, all sharded.
    z3 = state_bytes(8, Strategy(mesh=Degrees(dp=8), zero=3))
    assert (z3.params, z3.grads, z3.optimizer) == (4, 4, 8)
    z3pp = state_bytes(8, Strategy(mesh=Degrees(dp=8, pp=2), zero=3))
    assert (z3pp.params, z3pp.grads, z3pp.optimizer) == (4 + 16, 32, 8)
    z3mc = state_bytes(8, Strategy(mesh=Degrees(dp=8, pp=2), zero=3, recipe=MC))
    assert (z3mc.params, z3mc.grads, z3mc.optimizer) == (2, 4, 12)


@pytest.mark.parametrize("tp, sp, rc, factor", [
    (1, False, "none", lambda a, s, h, t: 34 + 5 * a * s / h),
    (8, False, "none", lambda a, s, h, t: 10 + 24 / t + 5 * a * s / (h * t)),
    (8, True, "none", lambda a, s, h, t: 34 / t + 5 * a * s / (h * t)),
    (8, False, "selective", lambda a, s, h, t: 10 + 24 / t),
    (8, True, "selective", lambda a, s, h, t: 34 / t),
    (1, False, "full", lambda a, s, h, t: 2),
    (8, True, "full", lambda a, s, h, t: 2 / t),
])
def test_korthikanti_table2_activations(tp, sp, rc, factor):
    b, s, h, a = 2, 2048, 6144, 64
    strat = Strategy(recipe=MC, mesh=Degrees(tp=tp), sequence_parallel=sp, recompute=rc, micro_batch=b)
    expected = s * b * h * factor(a, s, h, tp)
    assert memory.block_act_bytes(G22B, strat) == pytest.approx(expected, rel=1e-12)


def test_torch_sequence_parallel_keeps_the_gathered_gemm_inputs():
    """Under torch's DTensor SP (autopar's runtime, torchtitan) each sub-layer's column GEMMs
    save the all-gathered norm output: two 2 h-byte tensors per token whole, not / tp, on top
    of Korthikanti's accounting (Megatron keeps the shard and gathers it again); with no
    recompute and with selective, not under full recompute (the block input only)."""
    b, s, h, t = 2, 2048, 6144, 8
    for rc in ("none", "selective", "full"):
        strat = Strategy(recipe=MC, mesh=Degrees(tp=t), sequence_parallel=True, recompute=rc, micro_batch=b)
        torch_sp = dataclasses.replace(strat, recipe=dataclasses.replace(MC, sp_saves_gathered_inputs=True))
        extra = 0.0 if rc == "full" else s * b * 2 * 2 * h * (1 - 1 / t)
        assert memory.block_act_bytes(G22B, torch_sp) == pytest.approx(memory.block_act_bytes(G22B, strat) + extra)
        no_sp = dataclasses.replace(torch_sp, sequence_parallel=False)
        assert memory.block_act_bytes(G22B, no_sp) == memory.block_act_bytes(G22B, dataclasses.replace(strat, sequence_parallel=False))
    assert load_recipe("autopar").sp_saves_gathered_inputs and load_recipe("torchtitan-asynctp").sp_saves_gathered_inputs
    assert not MC.sp_saves_gathered_inputs and not load_recipe("megatron-core-te").sp_saves_gathered_inputs


def test_korthikanti_figure1_params_and_optimizer_22b():
    """45.56 GiB of parameters + optimizer state per GPU for 22B at TP 8 (18 bytes/param)."""
    c = stage_costs(G22B, A100, Strategy(recipe=MC, mesh=Degrees(tp=8), micro_batch=4, num_microbatches=1))
    static = G22B.layers * c.layer_static_bytes + c.first_static_bytes + c.last_static_bytes
    assert static / 2**30 == pytest.approx(45.56, rel=0.02)


def test_ranks_sharing_cores_reclaim_the_pipeline_bubble():
    """With o ranks per core (rates measured with every rank busy) a uniform pipeline's step is
    the larger of its busy time m T and the whole schedule o times faster, (m + (p-1) f) T / o;
    one rank per core leaves the weights as they were; more ranks per core never cost more."""
    for schedule, chunks, f in (("1f1b", 1, 1.0), ("gpipe", 1, 1.0), ("interleaved", 2, 0.5),
                                ("zero-bubble", 1, 0.3)):
        for p, m in ((2, 2), (4, 4), (4, 16), (8, 8)):
            assert pipeline.weights(schedule, p, m, chunks, 0.3, 1.0) == pipeline.weights(schedule, p, m, chunks, 0.3)
            last = float("inf")
            for o in (1.0, 1.5, 2.0, 4.0):
                sw, mw = pipeline.weights(schedule, p, m, chunks, 0.3, o)
                uniform = sw * p + mw  # the step of p stages of T = 1
                assert uniform == pytest.approx(max(m, (m + (p - 1) * f) / o))
                assert sw >= 0 and uniform <= last
                last = uniform
    assert pipeline.weights("1f1b", 1, 8, 1, 0.3, 2.0) == (1.0, 7.0)  # no pipeline, no bubble


def test_inflight_micro_batches_per_schedule():
    assert pipeline.inflight(Strategy(recipe=MC, mesh=Degrees(pp=4), num_microbatches=8)) == (4, 3, 2, 1)
    assert pipeline.inflight(Strategy(recipe=MC, mesh=Degrees(pp=4), num_microbatches=2)) == (2, 2, 2, 1)
    assert pipeline.inflight(Strategy(recipe=MC, mesh=Degrees(pp=4), num_microbatches=8, schedule="gpipe")) == (8,) * 4
    p, v = 4, 2
    inter = pipeline.inflight(Strategy(recipe=MC, mesh=Degrees(pp=p), num_microbatches=16, schedule="interleaved",
                                       virtual_stages=v))
    assert inter[0] == pytest.approx(p * (1 + (p - 1) / (p * v)))  # Korthikanti's factor
    assert pipeline.inflight(Strategy(recipe=MC, num_microbatches=8)) == (1,)


def test_torch_zero_bubble_defers_weight_passes_and_keeps_their_output_gradients():
    """torch's zero-bubble schedule: min(p, m) micro-batches on every stage; at a stage's peak
    min(p, m) - min(p - s, m) weight passes deferred plus the one just split off (not on the
    first stage), each keeping its operators' output gradients (the built-in GPT block: two
    norms, the row GEMMs' h and the column GEMMs' q, k, v and 4h: 4h + 7h of 16-bit values per
    token), its input's gradient and its output; the m - p done ones' outputs and input
    gradients until the step ends; a middle stage's gradient receive buffers; the last stage
    frees all but one micro-batch's saved logits."""
    zb = Strategy(recipe=load_recipe("autopar"), mesh=Degrees(pp=4), num_microbatches=8,
                  schedule="zero-bubble", micro_batch=2)
    assert pipeline.inflight(zb) == (4, 4, 4, 4) and pipeline.pending(zb) == (0, 2, 3, 4)
    assert pipeline.pending(dataclasses.replace(zb, num_microbatches=2)) == (0, 1, 1, 2)
    assert pipeline.pending(dataclasses.replace(zb, schedule="1f1b")) == ()
    assert pipeline.pending(dataclasses.replace(zb, recipe=MC)) == ()  # ZB-H1 as its paper runs it

    from autopar.spec import parse_model_spec
    from autopar.trace.profile import profile_spec
    model = profile_spec(parse_model_spec("gpt:layers=8,hidden=256,heads=4,vocab=512,seq=128"))
    h, tokens = 256, 2 * 128
    assert (model.wgrad_bytes_replicated_per_token, model.wgrad_bytes_sharded_per_token) == (2 * 4 * h, 2 * 7 * h)
    assert memory.block_wgrad_bytes(model, zb) == tokens * 2 * 11 * h
    c = stage_costs(model, A100, zb)
    plain = stage_costs(model, A100, dataclasses.replace(zb, schedule="1f1b"))
    loads = (2, 2, 2, 2)
    b, logits = tokens * 2 * h, tokens * load_recipe("autopar").logits_bytes * 512
    for s, q in enumerate((0, 2, 3, 4)):
        held = q * ((s > 0) + (s < 3)) * b + (8 - 4) * (s > 0) * b + (8 * b if s in (1, 2) else 0)
        if s == 3:
            held += q * memory.head_wgrad_bytes(model, zb) - 3 * logits
        pending = q * 2 * memory.block_wgrad_bytes(model, zb) + held
        more = (c.inflight[s] - plain.inflight[s]) * (2 * plain.layer_act_bytes + (plain.last_act_bytes if s == 3 else 0)
                                                      + (plain.first_act_bytes if s == 0 else 0))
        extra = c.stage_memory_bytes(s, loads[s]) - plain.stage_memory_bytes(s, loads[s])
        kept = memory.stage_output_bytes(model, dataclasses.replace(zb, schedule="1f1b")) if s == 3 else 0.0
        assert extra == pytest.approx(pending + more - kept)  # 1F1B's last stage keeps one micro-batch's logits
        assert c.stage_pending_bytes(s, loads[s]) == pytest.approx(pending)
    # gloo keeps the done passes' sent outputs until the step ends too (NCCL's watchdog frees them)
    gloo = dataclasses.replace(A100, launcher="gloo")
    more = [memory.zero_bubble_held_bytes(model, gloo, zb, pipeline.pending(zb))[s]
            - memory.zero_bubble_held_bytes(model, A100, zb, pipeline.pending(zb))[s] for s in range(4)]
    assert more == pytest.approx([4 * b, 4 * b, 4 * b, 0])


def test_zero3_shards_parameters_and_adds_gather_buffers():
    model = gpt(24, 2048, 16)
    z0 = stage_costs(model, A100, Strategy(recipe=MC, mesh=Degrees(dp=8), zero=0))
    z3 = stage_costs(model, A100, Strategy(recipe=MC, mesh=Degrees(dp=8), zero=3))
    assert z3.layer_static_bytes == pytest.approx(z0.layer_static_bytes / 8)
    assert z3.buffer_bytes > z0.buffer_bytes


# --- compute ------------------------------------------------------------------------------

def test_block_time_roofline_and_recompute_order():
    strat = Strategy(recipe=MC, mesh=Degrees(tp=8), micro_batch=4)
    none = compute.block_times(G22B, A100, strat)
    weights, core = compute.block_gemm_s(G22B, A100, strat)
    flops = 4 * 2048 * 24 * 6144**2 / 8
    assert weights == pytest.approx(flops / (312e12 * A100.matmul_efficiency))
    rest, attn = compute.block_elementwise_bytes(G22B, strat, compute.FWD_TRAFFIC)
    # Korthikanti's 10 + 24/t bytes per token·h, and 5as for the attention core, times traffic.
    bsh = 4 * 2048 * 6144
    assert rest == pytest.approx(bsh * (2.2 * 10 + 2 / 3 * 24 / 8))
    assert attn == pytest.approx(1.8 * 5 * 64 * 2048 * 4 * 2048 / 8)
    assert none.forward_s == pytest.approx(weights + core + compute.memory_s(rest + attn, A100))
    assert none.recompute_s == 0 and none.forward_s < none.backward_s < 2.2 * none.forward_s
    sel = compute.block_times(G22B, A100, dataclasses.replace(strat, recompute="selective"))
    full = compute.block_times(G22B, A100, dataclasses.replace(strat, recompute="full"))
    assert 0 < sel.recompute_s < full.recompute_s == pytest.approx(none.forward_s)
    sp = compute.block_times(G22B, A100, dataclasses.replace(strat, sequence_parallel=True))
    assert sp.forward_s < none.forward_s  # SP splits the replicated element-wise work


def test_fused_attention_follows_its_kernels_sequence_law():
    """A fused kernel with a half-length S runs at efficiency · s / (s + S) at s tokens per
    rank (under CP, s = seq / cp); a family without one, and the fit's constants, at the
    long-sequence value."""
    h100 = load_profile("dgx-h100")
    law = dataclasses.replace(h100, attention_efficiency={"cudnn": 0.6, "flash2": 0.3},
                              attention_half_seq={"cudnn": 2048.0})
    assert law.attention_eff("cudnn", 2048) == pytest.approx(0.3)
    assert law.attention_eff("cudnn") == 0.6 and law.attention_eff("flash2", 2048) == 0.3
    te = Strategy(recipe=load_recipe("megatron-core-te"), micro_batch=1)
    short, long = gpt(2, 4096, 32, seq=2048), gpt(2, 4096, 32, seq=8192)
    flat = dataclasses.replace(law, attention_half_seq={})
    for model, factor in ((short, 0.5), (long, 0.8)):
        core, flat_core = compute.block_gemm_s(model, law, te)[1], compute.block_gemm_s(model, flat, te)[1]
        assert core == pytest.approx(flat_core / factor)
    cp = dataclasses.replace(te, mesh=Degrees(cp=4))
    assert compute.block_gemm_s(long, law, cp)[1] == pytest.approx(compute.block_gemm_s(long, flat, cp)[1] / 0.5)
    # Head-dimension law: d / (d + D) relative to 128; 64-wide heads (GPT-OSS, GPT-2 small)
    # run slower per FLOP, the priced heads of every fitted row (128) as before.
    flat = dataclasses.replace(flat, attention_half_head_dim={})
    dims = dataclasses.replace(flat, attention_half_head_dim={"cudnn": 64.0})
    assert dims.attention_eff("cudnn", head_dim=64) == pytest.approx(0.6 * (64 / 128) / (128 / 192))
    assert dims.attention_eff("cudnn") == 0.6 and dims.attention_eff("flash2", head_dim=64) == 0.3
    narrow = gpt(2, 2048, 32, seq=8192)  # head dim 64
    assert narrow.head_dim == 64 and long.head_dim == 128
    assert compute.block_gemm_s(narrow, dims, te)[1] == pytest.approx(compute.block_gemm_s(narrow, flat, te)[1] / 0.75)
    assert compute.block_gemm_s(long, dims, te)[1] == pytest.approx(compute.block_gemm_s(long, flat, te)[1])
    from cost_models.hardware import PROFILE_DIR, profile_from_dict
    with pytest.raises(ProfileError, match="attention_half_seq"):
        data = json.loads((PROFILE_DIR / "dgx-h100.json").read_text())
        profile_from_dict({**data, "attention_half_seq": {"cudnn": -1}})


def test_an_attention_core_written_by_hand_runs_as_written_only_in_autopar():
    """GPT-OSS writes its attention out (``written_attention``): autopar's runtime runs the
    module as written, keeping the scores and running the core's products as GEMMs with their
    s x s traffic; Megatron and torchtitan build their own blocks around a fused kernel,
    which keeps a float32 log-sum-exp per head and moves no scores."""
    h100 = load_profile("dgx-h100")
    base = gpt(2, 4096, 32, seq=4096)
    scores = 2.0 * 32 * (4096 + 1)
    written = dataclasses.replace(base, fused_act_bytes_attn_per_token=scores, written_attention=True)
    for recipe in ("megatron-core-te", "torchtitan"):
        strat = Strategy(recipe=load_recipe(recipe), micro_batch=1)
        assert memory.block_act_bytes(written, strat) == memory.block_act_bytes(base, strat)
        assert compute.block_times(written, h100, strat) == compute.block_times(base, h100, strat)
    own = Strategy(recipe=load_recipe("autopar"), micro_batch=1)
    tokens = 4096
    assert memory.block_act_bytes(written, own) - memory.block_act_bytes(base, own) == \
        pytest.approx(tokens * (scores - 4.0 * 32))
    # selective recompute drops the written core with the rest of the attention core
    selective = dataclasses.replace(own, recompute="selective")
    assert memory.block_act_bytes(written, selective) == memory.block_act_bytes(base, selective)
    assert compute.block_times(written, h100, own).forward_s > compute.block_times(base, h100, own).forward_s


def test_a_framework_keeps_its_own_grouped_mlp_not_the_models_expert_code():
    """The routed-expert region an HF model's code keeps (``expert_act_bytes_traced_per_token``:
    GPT-OSS's clamped GLU keeps 18 h per copy) is what autopar's runtime keeps; Megatron's
    grouped MLP with its fused activation keeps 2 (2h + 3f) bytes per copy
    (``expert_act_bytes_per_token``), whatever the model's code."""
    h, f, k = 2880, 2880, 4
    moe = dataclasses.replace(gpt(2, h, 64, seq=4096), experts=128, topk=k, expert_ffn=f,
                              expert_params=128 * 3 * h * f, expert_act_bytes_traced_per_token=k * 36.0 * h)
    dense = dataclasses.replace(moe, expert_act_bytes_traced_per_token=0.0)
    tokens = 4096
    te = Strategy(recipe=load_recipe("megatron-core-te"), micro_batch=1)
    saved = memory.block_act_bytes(dense, te) - memory.block_act_bytes(moe, te)
    assert saved == pytest.approx(tokens * (k * 36.0 * h - moe.expert_act_bytes_per_token()))
    assert moe.expert_act_bytes_per_token() == k * 2 * (2 * h + 3 * f)
    own = Strategy(recipe=load_recipe("autopar"), micro_batch=1)
    assert memory.block_act_bytes(moe, own) == memory.block_act_bytes(dense, own)


def test_a_recipe_with_a_base_is_that_recipe_with_its_own_keys(tmp_path):
    """``base`` names a shipped recipe or a file (relative to the one naming it); the file's keys
    win, the notes merge, and a recipe without a name of its own is named after its file."""
    compiled, asynctp = load_recipe("torchtitan-compile"), load_recipe("torchtitan-asynctp")
    titan = load_recipe("torchtitan")
    assert (compiled.elementwise_traffic, compiled.kernels_per_block) == (1.0, 14) != \
        (titan.elementwise_traffic, titan.kernels_per_block)
    assert dataclasses.replace(compiled, name=titan.name, description=titan.description, notes=titan.notes,
                               elementwise_traffic=titan.elementwise_traffic,
                               kernels_per_block=titan.kernels_per_block, logits_bytes=titan.logits_bytes,
                               loss_backward_bytes=titan.loss_backward_bytes,
                               loss_parallel_backward_bytes=titan.loss_parallel_backward_bytes) == titan
    eager = load_recipe("torchtitan-compile-eager-loss")  # a chain: base of a base
    assert (eager.logits_bytes, eager.loss_backward_bytes) == (titan.logits_bytes, titan.loss_backward_bytes)
    assert dataclasses.replace(eager, logits_bytes=2.0, loss_backward_bytes=2.0, loss_parallel_backward_bytes=None,
                               name=compiled.name, description=compiled.description, notes=compiled.notes) == compiled
    assert asynctp.tp_comm_overlap and not compiled.tp_comm_overlap
    assert set(titan.notes) < set(asynctp.notes) and asynctp.notes["source"] != titan.notes["source"]
    (tmp_path / "mine.json").write_text(json.dumps({"base": "megatron-core", "tp_comm_overlap": True}))
    (tmp_path / "more.json").write_text(json.dumps({"base": "mine.json", "elementwise_traffic": 1.5}))
    more = load_recipe(str(tmp_path / "more.json"))
    assert (more.name, more.tp_comm_overlap, more.elementwise_traffic) == ("more", True, 1.5)
    assert more.tp_overlap == load_recipe("megatron-core").tp_overlap


def test_the_autopar_recipe_prices_the_kernel_sdpa_dispatches_on_the_device():
    """``sdpa`` is the profile's ``sdpa_kernel`` (cuDNN on H100, FlashAttention-2 on A100)
    unless the profile measured ``sdpa`` itself (``autopar profile``: cpu-local)."""
    h100, cpu = load_profile("dgx-h100"), load_profile("cpu-local")
    assert h100.sdpa_kernel == "cudnn" and A100.sdpa_kernel == "flash2"
    assert h100.attention_eff("sdpa", 4096) == h100.attention_eff("cudnn", 4096) < h100.attention_eff("cudnn")
    assert A100.attention_eff("sdpa") == A100.attention_eff("flash2")
    assert cpu.attention_eff("sdpa") == cpu.attention_efficiency["sdpa"]
    model = gpt(2, 4096, 32, seq=4096)
    mine, cudnn = (Strategy(recipe=dataclasses.replace(load_recipe("autopar"), attention_kernel=k))
                   for k in ("sdpa", "cudnn"))
    assert compute.block_gemm_s(model, h100, mine) == compute.block_gemm_s(model, h100, cudnn)


@pytest.mark.parametrize("tp,sp", [(1, False), (4, False), (4, True)])
def test_per_op_recompute_sits_between_none_and_full(tp, sp):
    """Per-op recompute keeps less than none and more than full, repeats less than full and
    more than nothing, and under TP repeats the all-gathers (SP: half the forward's exchanges)
    or the all-reduces (all of them); a mixture of experts is refused."""
    model = profile_spec(parse_model_spec("llama3-8b"))
    h100 = load_profile("dgx-h100")
    base = Strategy(recipe=load_recipe("torchtitan"), mesh=Degrees(tp=tp), sequence_parallel=sp, micro_batch=2)
    by = {m: dataclasses.replace(base, recompute=m) for m in ("none", "op", "full")}
    kept = {m: memory.block_act_bytes(model, s) for m, s in by.items()}
    again = {m: compute.block_times(model, h100, s).recompute_s for m, s in by.items()}
    assert kept["none"] > kept["op"] > kept["full"] and again["full"] > again["op"] > again["none"] == 0.0
    assert memory.workspace_bytes(model, by["op"]) == pytest.approx(kept["none"] - kept["op"])
    if tp > 1:
        g = comm.group(h100, tp)
        tp_op, tp_full = (blockcomm.block_tp_s(model, h100, by[m], g) for m in ("op", "full"))
        assert tp_op.recompute_s == pytest.approx(tp_full.recompute_s / (2 if sp else 1))
    moe = profile_spec(parse_model_spec("moe:layers=2,hidden=64,heads=4,vocab=64,seq=8,experts=2,topk=1"))
    assert not moe.op_priced and model.op_priced
    with pytest.raises(ValueError, match="per-op recompute"):
        estimate(moe, h100, Strategy(recompute="op", micro_batch=1), global_batch=1)


def test_a_power_capped_clock_slows_compute_bound_kernels_only():
    """``sustained_clock`` divides compute-bound time (GEMMs, fused attention) and leaves the
    roofline's memory-bound side and MFU's datasheet peak alone."""
    capped = dataclasses.replace(A100, sustained_clock=0.8)
    big, thin = compute.Gemm(batch=1, m=8192, n=8192, k=8192), compute.Gemm(batch=1, m=8192, n=1, k=8192)
    assert compute.gemm_s(big, capped, "bf16", 2) == pytest.approx(compute.gemm_s(big, A100, "bf16", 2) / 0.8)
    assert compute.gemm_s(thin, capped, "bf16", 2) == pytest.approx(compute.gemm_s(thin, A100, "bf16", 2))
    model = profile_spec(parse_model_spec("llama:layers=2,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=32000,seq=8192"))
    strat = Strategy(recipe=load_recipe("torchtitan"), micro_batch=1)
    (_, core), (_, core_capped) = compute.block_gemm_s(model, A100, strat), compute.block_gemm_s(model, capped, strat)
    assert core_capped == pytest.approx(core / 0.8)
    fast, slow = (estimate(model, hw, strat, global_batch=1) for hw in (A100, capped))
    assert slow.step_time_s > fast.step_time_s and slow.mfu == pytest.approx(
        fast.mfu * fast.step_time_s / slow.step_time_s)


def test_gemm_shape_law_and_roofline():
    hw = dataclasses.replace(A100, matmul_efficiency=0.8, matmul_half_dim=100.0, matmul_half_depth=300.0)
    thin_out = compute.Gemm(batch=1, m=8192, n=100, k=8192)
    shallow = compute.Gemm(batch=1, m=8192, n=8192, k=100)
    assert compute.gemm_efficiency(thin_out, hw) == pytest.approx(0.8 * 0.5 * 8192 / 8292 * 8192 / 8492)
    assert compute.gemm_efficiency(shallow, hw) == pytest.approx(0.8 * (8192 / 8292) ** 2 * 0.25)
    big = compute.Gemm(batch=1, m=8192, n=8192, k=8192)
    assert compute.gemm_s(big, hw, "bf16", 2) == pytest.approx(
        big.flops / (312e12 * 0.8 * (8192 / 8292) ** 2 * 8192 / 8492))
    # The backward's gradients: input (m x n) @ (n x k), weight (k x m) @ (m x n).
    dgrad, wgrad = compute.grad_gemms(compute.Gemm(batch=1, m=4096, n=512, k=2048))
    assert (dgrad.m, dgrad.n, dgrad.k) == (4096, 2048, 512) and (wgrad.m, wgrad.n, wgrad.k) == (2048, 512, 4096)
    # Under the law a block's backward GEMMs are priced at their own shapes (a tp-split
    # output is the input gradient's reduction), exactly twice the forward without it.
    model = profile_spec(parse_model_spec("gpt:layers=2,hidden=4096,heads=32,vocab=32000,seq=2048"))
    strat = Strategy(recipe=MC, mesh=Degrees(tp=8), micro_batch=1)
    weights, _ = compute.block_gemms(model, strat)
    fwd, _ = compute.block_gemm_s(model, hw, strat)
    bwd, _ = compute.block_gemm_s(model, hw, strat, backward=True)
    own = sum(compute.gemm_s(x, hw, "bf16", 2) for g in weights for x in compute.grad_gemms(g))
    assert bwd / fwd == pytest.approx(own / sum(compute.gemm_s(g, hw, "bf16", 2) for g in weights))
    assert bwd != pytest.approx(2 * fwd, rel=1e-3)
    flat = dataclasses.replace(hw, matmul_half_dim=0.0, matmul_half_depth=0.0)
    assert compute.block_gemm_s(model, flat, strat, backward=True)[0] == pytest.approx(
        2 * compute.block_gemm_s(model, flat, strat)[0])
    # Float8 GEMMs have their own reduction half-dim where the profile gives one.
    h100 = dataclasses.replace(load_profile("dgx-h100"), matmul_half_dim=100.0, matmul_half_depth=300.0,
                               fp8_matmul_efficiency=0.6, fp8_matmul_half_depth=0.0)
    assert compute.gemm_efficiency(shallow, h100, "fp8") == pytest.approx(0.6 * (8192 / 8292) ** 2 * 0.25)
    deep = dataclasses.replace(h100, fp8_matmul_half_depth=900.0)
    assert compute.gemm_efficiency(shallow, deep, "fp8") == pytest.approx(0.6 * (8192 / 8292) ** 2 * 0.1)
    assert compute.gemm_efficiency(shallow, deep) == compute.gemm_efficiency(shallow, h100)
    # QKᵀ with head dim 16 writes s² scores per head: memory-bound, the bytes term rules.
    thin = compute.Gemm(batch=64, m=2048, n=2048, k=16)
    assert compute.gemm_s(thin, flat, "bf16", 2) == pytest.approx(compute.memory_s(thin.nbytes(2), flat))


def test_tensor_parallel_overlap_and_sequence_parallel_gathers():
    g = comm.axis_groups(A0, Strategy(recipe=MC, mesh=Degrees(tp=8)))[Axis.TP]
    base = Strategy(recipe=M21, mesh=Degrees(tp=8), micro_batch=4)  # 2021: no TP overlap
    plain = blockcomm.block_tp_s(G22B, A0, base, g)
    unit = comm.all_reduce_s(4 * 2048 * 6144 * 2, g)
    assert plain.forward_s == pytest.approx(2 * unit) and plain.backward_s == pytest.approx(2 * unit)
    hidden = blockcomm.block_tp_s(G22B, A0, dataclasses.replace(base, recipe=MC), g)
    assert hidden.backward_s == 0.0  # the all-reduce is shorter than the weight-gradient GEMMs
    sp = blockcomm.block_tp_s(G22B, A0, dataclasses.replace(base, recipe=MC,
                                                                   sequence_parallel=True), g)
    assert sp.backward_s == pytest.approx(4 * comm.all_gather_s(4 * 2048 * 6144 * 2, g))
    full = blockcomm.block_tp_s(G22B, A0, dataclasses.replace(base, recompute="full"), g)
    assert full.recompute_s == pytest.approx(2 * unit)


def test_data_parallel_reduction_hides_behind_the_backward_when_overlapped():
    model = gpt(24, 2048, 16)
    over = stage_costs(model, A0, Strategy(mesh=Degrees(dp=8), num_microbatches=4, recipe=MC))
    after = stage_costs(model, A0, Strategy(mesh=Degrees(dp=8, pp=1), num_microbatches=4,
                                              recipe=dataclasses.replace(MC, dp_overlap="never")))
    opt = compute.optimizer_memory_s(states.layer_params(model, Strategy(recipe=MC)) * 50, A0)
    assert over.layer_dp_time_s == pytest.approx(opt)  # the all-reduce is hidden, Adam is not
    assert after.layer_dp_time_s > over.layer_dp_time_s
    assert after.first_dp_time_s == pytest.approx(over.first_dp_time_s)  # embedding goes last
    z3 = stage_costs(model, A0, Strategy(mesh=Degrees(dp=8), zero=3, num_microbatches=4, recipe=MC))
    z3_exposed = stage_costs(model, A0, Strategy(mesh=Degrees(dp=8), zero=3, num_microbatches=4,
                                                   recipe=dataclasses.replace(MC, dp_overlap="never")))
    assert z3.layer_time_s < z3_exposed.layer_time_s


def test_overlapped_communication_costs_its_overlap_penalty():
    """What overlap hides still costs ``overlap_penalty`` of itself (NCCL shares the SMs)."""
    hw = dataclasses.replace(A100, overlap_penalty=0.2)
    assert comm.exposed_s(1.0, 3.0, hw) == pytest.approx(0.2)   # hidden: 20 % of it shows
    assert comm.exposed_s(3.0, 1.0, hw) == pytest.approx(2.0 + 0.2)  # excess + 20 % of the window
    assert comm.exposed_s(1.0, 3.0, A0) == 0.0


def test_optimizer_traffic_per_parameter():
    assert pieces.optimizer_bytes_per_param(STATE_LAYOUTS["megatron"]) == 50
    assert pieces.optimizer_bytes_per_param(STATE_LAYOUTS["fp32"]) == 5 * 4 + 2 * 12


def test_tree_and_all_to_all_collectives():
    g = comm.Group(size=16, bw_bytes_s=100e9, p2p_bytes_s=50e9, latency_s=1e-5, inter_node=True)
    assert comm.tree_all_reduce_s(1e9, g) == pytest.approx(2 * 1e9 / 100e9 + 8 * 1e-5)
    assert comm.all_to_all_s(1e9, g) == pytest.approx(15 / 16 * 1e9 / 100e9 + 15 * 1e-5)
    # Small messages: the tree's log2 n latency wins; large ones: the ring's (n-1)/n volume.
    assert comm.best_all_reduce_s(1e3, g) == comm.tree_all_reduce_s(1e3, g) < comm.all_reduce_s(1e3, g)
    assert comm.best_all_reduce_s(1e9, g) == comm.all_reduce_s(1e9, g) < comm.tree_all_reduce_s(1e9, g)
    one = dataclasses.replace(g, size=1)
    assert comm.tree_all_reduce_s(1e9, one) == comm.all_to_all_s(1e9, one) == 0.0


def test_interleaved_sends_and_stage0_memory():
    model, p, v, m = gpt(16, 1024, 16), 4, 2, 8
    inter = Strategy(recipe=MC, mesh=Degrees(pp=p, tp=2), num_microbatches=m, schedule="interleaved", virtual_stages=v)
    plain = dataclasses.replace(inter, schedule="1f1b", virtual_stages=1)
    ci, cp = stage_costs(model, A100, inter), stage_costs(model, A100, plain)
    assert ci.p2p_time_s == pytest.approx(v * cp.p2p_time_s)  # one exchange per chunk
    assert ci.inflight[0] == pytest.approx(p * (1 + (p - 1) / (p * v)))
    groups = comm.axis_groups(A100, plain)
    vol = 2048 * 1024 * 2
    assert cp.p2p_time_s == pytest.approx(2 * (comm.p2p_s(vol / 2, groups[Axis.PP])
                                               + comm.all_gather_s(vol, groups[Axis.TP])))


# --- pipeline weights and estimate ----------------------------------------------------------

def _uniform(c):
    """The same coefficients with no embedding/head and no tail: every stage costs the same."""
    return dataclasses.replace(c, first_time_s=0.0, last_time_s=0.0, mode_dp_time_s=(0.0, 0.0, 0.0),
                               first_dp_time_s=0.0, last_dp_time_s=0.0)


@pytest.mark.parametrize("schedule, v, bubble", [
    ("1f1b", 1, lambda p, m, v: (p - 1) / m), ("gpipe", 1, lambda p, m, v: (p - 1) / m),
    ("interleaved", 2, lambda p, m, v: (p - 1) / (v * m)),
    ("zero-bubble", 1, None),
])
def test_pipeline_bubble_fraction(schedule, v, bubble):
    p, m = 4, 8
    strat = Strategy(recipe=MC, mesh=Degrees(pp=p), num_microbatches=m, schedule=schedule, virtual_stages=v)
    c = _uniform(stage_costs(gpt(16, 1024, 16), A100, strat))
    t = c.stage_time_s(0, 4)
    if bubble is None:  # ZB-H1: (p-1)(F + B - W) with B = W: f = (F + R) / (F + R + backward)
        passes = compute.block_times(gpt(16, 1024, 16), A100, strat)
        f = pipeline.zb_fill_fraction(passes.forward_s, passes.recompute_s, passes.backward_s)
        assert 0.25 < f < 0.4
        bubble = lambda p, m, v: (p - 1) * f / m  # noqa: E731
    assert c.step_time_s((4, 4, 4, 4)) / (m * t) - 1 == pytest.approx(bubble(p, m, v))


def test_estimate_evaluates_stage_costs_and_its_parts_add_up():
    model = gpt(24, 4096, 32)
    strat = Strategy(recipe=MC, mesh=Degrees(dp=4, tp=2, pp=4), micro_batch=2, num_microbatches=8, zero=1,
                     sequence_parallel=True, recompute="selective", stage_layers=(5, 7, 7, 5))
    est = estimate(model, A100, strat, global_batch=64)
    c = stage_costs(model, A100, strat)
    assert est.step_time_s == pytest.approx(c.step_time_s((5, 7, 7, 5)), rel=1e-12)
    t = est.time
    parts = t.compute_s + t.tp_comm_s + t.dp_comm_s + t.pp_comm_s + t.bubble_s + t.optimizer_s
    assert parts == pytest.approx(est.step_time_s, rel=1e-9)
    assert min(t.compute_s, t.tp_comm_s, t.dp_comm_s, t.pp_comm_s, t.bubble_s, t.optimizer_s) > 0
    mem = est.memory
    assert est.stage_peak_bytes == tuple(c.stage_memory_bytes(s, n) for s, n in enumerate((5, 7, 7, 5)))
    assert mem.peak_bytes == max(est.stage_peak_bytes)
    assert (mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes + mem.activations_bytes
            + mem.buffers_bytes) == pytest.approx(mem.peak_bytes, rel=1e-12)
    flops = model_flops_per_step(model, 64)
    assert est.tflops_per_gpu * 1e12 * est.step_time_s * 32 == pytest.approx(flops)
    assert 0 < est.mfu < 1 and est.tokens_per_s == pytest.approx(64 * 2048 / est.step_time_s)
    assert estimate(model, A100, dataclasses.replace(strat, stage_layers=()),
                    global_batch=64).stage_peak_bytes != est.stage_peak_bytes  # (6,6,6,6)


def test_model_flops_are_narayanans():
    B, s, L, h, V = 8, 2048, 24, 2304, 51200
    expected = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    assert model_flops_per_step(gpt(L, h, 24), B) == pytest.approx(expected, rel=1e-12)


def test_fits_flips_as_memory_shrinks():
    model, strat = gpt(16, 2048, 16), Strategy(recipe=MC, mesh=Degrees(dp=8), micro_batch=2, num_microbatches=4)
    roomy = estimate(model, A100, strat, global_batch=64)
    assert roomy.fits
    tight = dataclasses.replace(A100, memory_gib=roomy.memory.peak_bytes / 2**30 * 0.99)
    assert not estimate(model, tight, strat, global_batch=64).fits
    assert estimate(model, tight, dataclasses.replace(strat, zero=3),
                    global_batch=64).fits  # sharding gets it back under the cap


def test_more_microbatches_shrink_the_bubble():
    model = gpt(32, 4096, 32)
    fractions = []
    for m in (4, 16, 64):
        est = estimate(model, A100, Strategy(recipe=MC, mesh=Degrees(pp=4), num_microbatches=m), global_batch=m)
        fractions.append(est.time.bubble_s / est.step_time_s)
    assert fractions[0] > fractions[1] > fractions[2] > 0
    assert estimate(model, A100, Strategy(recipe=MC, num_microbatches=4), global_batch=4).time.bubble_s == \
        pytest.approx(0.0, abs=1e-12)


def test_estimate_refuses_an_inconsistent_global_batch():
    with pytest.raises(ValueError, match="num_microbatches"):
        estimate(G22B, A100, Strategy(recipe=MC, mesh=Degrees(dp=2), num_microbatches=4), global_batch=10)


def test_even_stage_layers():
    assert even_stage_layers(10, 4) == (3, 3, 2, 2)
    assert even_stage_layers(8, 1) == (8,)
    with pytest.raises(ValueError):
        even_stage_layers(2, 3)


BF16_DENSE_PEAK_TFLOPS = {"dgx-a100-80g": 312.0, "dgx-h100": 989.0, "dgx-h200": 989.0,
                          "grand-teton-h100-96g": 989.0, "dgx-b200": 2250.0, "jean-zay-a100-80g": 312.0}
"""Datasheet dense bf16 peaks (sparsity halved) of the shipped 8-GPU profiles."""


@pytest.mark.parametrize("name", sorted(BF16_DENSE_PEAK_TFLOPS))
def test_shipped_profiles_name_their_sources(name):
    hw = load_profile(name)
    assert hw.devices_per_node == 8 and hw.launcher == "nccl"
    for key in ("peak_tflops", "hbm_bw_gbps", "intra_node", "inter_node", "matmul_efficiency",
                "memory_efficiency", "reserve_gib", "memory_gib"):
        assert hw.notes.get(key), f"{name}: no note for {key}"
    assert math.isclose(hw.peak_flops("bf16"), BF16_DENSE_PEAK_TFLOPS[name] * 1e12)


def test_unfused_gradient_accumulation_costs_a_memory_pass_per_micro_batch():
    """Without gradient-accumulation fusion every micro-batch's backward adds the fresh 16-bit
    gradient into the buffer: read 2, read and write the buffer (2 + 2 with 16-bit gradients)."""
    from cost_models.pieces import grad_accum_bytes_per_param
    model = gpt(4, 1024, 16)
    base = Strategy(mesh=Degrees(tp=2), num_microbatches=4, recipe=M21)
    fused = dataclasses.replace(base, recipe=dataclasses.replace(M21, grad_accum_fusion=True))
    assert grad_accum_bytes_per_param(STATE_LAYOUTS["zero"], base) == 6
    assert grad_accum_bytes_per_param(STATE_LAYOUTS["megatron"], base) == 10
    assert grad_accum_bytes_per_param(STATE_LAYOUTS["zero"], fused) == 0
    slow, fast = stage_costs(model, A100, base), stage_costs(model, A100, fused)
    extra = model.block_params / 2 * 6 / (A100.hbm_bw_gbps * 1e9 * A100.memory_efficiency)
    assert slow.layer_time_s - fast.layer_time_s == pytest.approx(extra)


def test_optimizer_memory_efficiency_falls_back_to_memory_efficiency():
    fused = dataclasses.replace(A100, optimizer_memory_efficiency=0.9)
    plain = dataclasses.replace(A100, optimizer_memory_efficiency=0.0)
    assert compute.optimizer_memory_s(1e9, fused) == pytest.approx(1e9 / (A100.hbm_bw_gbps * 1e9 * 0.9))
    assert compute.optimizer_memory_s(1e9, plain) == pytest.approx(compute.memory_s(1e9, plain))


def test_fp8_linears_run_at_the_fp8_peak_and_pay_their_casts():
    """Float8 weight GEMMs at the fp8 peak, plus the cast traffic; attention stays 16-bit."""
    h100 = dataclasses.replace(load_profile("dgx-h100"), matmul_half_dim=0.0, matmul_half_depth=0.0,
                               fp8_matmul_half_depth=0.0)
    model = gpt(4, 4096, 32, seq=4096)
    bf16 = Strategy(micro_batch=2)
    f8 = dataclasses.replace(bf16, fp8=True)
    (w16, a16), (w8, a8) = compute.block_gemm_s(model, h100, bf16), compute.block_gemm_s(model, h100, f8)
    assert a8 == a16
    assert w8 == pytest.approx(w16 / 2 * h100.matmul_efficiency / h100.fp8_matmul_efficiency, rel=0.02)
    fwd_cast, bwd_cast = compute.fp8_cast_bytes(model, f8)
    assert fwd_cast > 0 and bwd_cast > 0 and compute.fp8_cast_bytes(model, bf16) == (0.0, 0.0)
    with pytest.raises(ProfileError, match="fp8"):
        compute.block_gemm_s(model, A100, f8)



def test_fp8_weights_are_cast_as_often_as_the_program_casts_them():
    """torchao casts each weight in both passes, Transformer Engine in the forward (the backward
    reuses its transpose), and under Megatron-Core's fp8 weight cache once per step: the
    weight's share of the cast traffic is w x bytes per pass, per forward, or w x bytes / m."""
    from cost_models.recipe import Fp8WeightCast
    te, h100 = load_recipe("megatron-core-te"), load_profile("dgx-h100")
    model = gpt(4, 4096, 32, seq=4096)
    w = model.dense_block_params * te.fp8_cast_bytes
    every, fwd, step = (Strategy(micro_batch=2, fp8=True, num_microbatches=8,
                                 recipe=dataclasses.replace(te, fp8_weight_cast=c)) for c in Fp8WeightCast)
    (f_every, b_every), (f_fwd, b_fwd), (f_step, b_step) = (compute.fp8_cast_bytes(model, s) for s in (every, fwd, step))
    assert f_every == f_fwd and b_every - b_fwd == pytest.approx(w)
    assert b_step == b_fwd and f_fwd - f_step == pytest.approx(w * 7 / 8)
    # Once per step: the forward gets cheaper as the step has more micro-batches, so the
    # micro-batch count is part of what block times are cached by.
    fewer = dataclasses.replace(step, num_microbatches=2)
    assert compute.block_times(model, h100, fewer).forward_s > compute.block_times(model, h100, step).forward_s
    assert compute.pass_key(fewer) != compute.pass_key(step)
    assert compute.pass_key(dataclasses.replace(every, num_microbatches=2)) == compute.pass_key(every)
    assert load_recipe("megatron-core-te").fp8_weight_cast == Fp8WeightCast.ONCE_PER_STEP
    assert load_recipe("llm-foundry").fp8_weight_cast == Fp8WeightCast.FORWARD
    assert load_recipe("torchtitan").fp8_weight_cast == Fp8WeightCast.EVERY_PASS

def test_torchtitan_float8_gathers_one_byte_weights_and_inputs():
    """torchao's Float8 under FSDP casts each rank's shard before the weight all-gather (1 byte
    per parameter moved, the cast on the shard only) and, under SP, casts the column-parallel
    inputs on the rank's sequence shard and all-gathers them in fp8, and in the backward the
    row-parallel layers' output gradients the same way (``Float8RowwiseParallel``); without
    the switches all stay 16-bit and every rank casts the whole weight, the gathered input and
    the gathered gradient."""
    tt, h100 = load_recipe("torchtitan"), load_profile("dgx-h100")
    plain = dataclasses.replace(tt, fp8_all_gather=False, fp8_tp_gather=False)
    model = gpt(4, 4096, 32, seq=4096)
    f8 = Strategy(mesh=Degrees(dp=8, tp=2), zero=3, sequence_parallel=True, fp8=True, recipe=tt)
    off = dataclasses.replace(f8, recipe=plain)
    assert states.gather_bytes(f8) == 1.0 and states.gather_bytes(off) == 2.0
    assert compute.tp_gathered(f8) == 2 and compute.tp_gathered(off) == 1
    assert compute.tp_gathered(dataclasses.replace(f8, sequence_parallel=False)) == 1
    weights, _ = compute.block_gemms(model, dataclasses.replace(f8, mesh=Degrees(dp=2, tp=8)))
    for g, column in zip(weights, compute.COLUMN_PARALLEL, strict=True):  # input full, or output full
        assert (g.k, g.n == model.hidden) == ((model.hidden, False) if column else (g.k, True))
    (f_on, b_on), (f_off, b_off) = compute.fp8_cast_bytes(model, f8), compute.fp8_cast_bytes(model, off)
    w = model.dense_block_params / 2 * tt.fp8_cast_bytes
    column_inputs = 2 * f8.tokens(model.seq) * model.hidden  # QKV's and the up projection's, full
    assert f_off - f_on == pytest.approx(w * 7 / 8 + column_inputs / 2 * tt.fp8_cast_bytes)
    row_grads = column_inputs  # the attention output's and the MLP down projection's, full
    assert b_off - b_on == pytest.approx(w * 7 / 8 + row_grads / 2 * tt.fp8_cast_bytes)
    g = comm.axis_groups(h100, f8)[Axis.TP]
    on, no = blockcomm.block_tp_s(model, h100, f8, g), blockcomm.block_tp_s(model, h100, off, g)
    vol = f8.tokens(model.seq) * model.hidden * 2
    copies = 2 * (compute.memory_s(2 * vol, h100) - compute.memory_s(vol, h100))  # SP's rearranging copies
    fp8_gathers = 2 * (comm.all_gather_s(vol, g) - comm.all_gather_s(vol / 2, g)) + copies
    assert no.forward_s - on.forward_s == pytest.approx(fp8_gathers)
    assert no.backward_s - on.backward_s == pytest.approx(fp8_gathers)
    assert estimate(model, h100, f8, global_batch=8).step_time_s < estimate(model, h100, off, global_batch=8).step_time_s
    # Transformer Engine's norm writes its fp8 output on the sequence shard and SP gathers that.
    te = dataclasses.replace(f8, recipe=load_recipe("megatron-core-te"))
    assert compute.fp8_sp_gather(te) and blockcomm.gather_elem_bytes(te) == 1.0 and compute.tp_gathered(te) == 2


@pytest.mark.parametrize("name", ["dgx-h100", "cpu-local"])
def test_every_profile_field_round_trips_through_the_loader(name):
    """A profile written with every field (as ``autopar calibrate`` and ``profile`` write it)
    loads back equal: each field has a checked range (price_per_gpu_hour once had none)."""
    from cost_models.hardware import profile_from_dict
    hw = dataclasses.replace(load_profile(name), price_per_gpu_hour=2.5, host_memory_gib=1.0)
    assert profile_from_dict(dataclasses.asdict(hw)) == hw


# --- context parallelism ------------------------------------------------------------------

TE = load_recipe("megatron-core-te")
H100 = load_profile("dgx-h100")


def test_cp_divides_activations_and_attention_flops_and_keeps_cp_1():
    """Each cp rank holds seq/cp tokens of every sequence: activations, the block's GEMMs and
    the (load-balanced causal) attention core all shrink by cp; cp = 1 adds nothing."""
    model = gpt(layers=8, hidden=4096, heads=32, seq=32768)
    one = Strategy(recipe=TE, mesh=Degrees(tp=2, dp=4))
    for cp in (2, 4, 8):
        s = Strategy(recipe=TE, mesh=Degrees(tp=2, dp=4, cp=cp))
        assert memory.block_act_bytes(model, s) == pytest.approx(memory.block_act_bytes(model, one) / cp)
        assert memory.last_act_bytes(model, s) == pytest.approx(memory.last_act_bytes(model, one) / cp)
        flat = dataclasses.replace(H100, attention_half_seq={})  # no sequence law: exactly 1/cp
        core, core1 = compute.block_gemm_s(model, flat, s)[1], compute.block_gemm_s(model, flat, one)[1]
        assert core == pytest.approx(core1 / cp)
        assert compute.block_gemm_s(model, H100, s)[1] > compute.block_gemm_s(model, H100, one)[1] / cp
        # ZeRO shards over dp x cp (the weights are replicated over cp).
        z = dataclasses.replace(s, zero=1)
        assert states.state_bytes(1e9, z).optimizer == pytest.approx(12e9 / (4 * cp))
    assert blockcomm.block_cp_s(model, H100, one, comm.axis_groups(H100, one)[Axis.CP]).total_s == 0.0
    # cp = 1 named in the order is the same strategy (the order is canonical): the same price.
    listed = Strategy(recipe=TE, mesh=Degrees(tp=2, dp=4), axis_order=("pp", "dp", "cp", "tp"))
    assert listed == one and estimate(model, H100, listed, global_batch=4) == estimate(model, H100, one, global_batch=4)


@pytest.mark.parametrize("recipe", ["megatron-core-te", "torchtitan"])
def test_cp_exchange_is_positive_and_grows_with_cp(recipe):
    """The K,V exchange (ring: cp - 1 sends per pass, partly hidden; all-gather: exposed)
    costs something for every cp > 1 and more as cp grows, in each pass."""
    model = gpt(layers=8, hidden=4096, heads=32, seq=32768)
    rec = load_recipe(recipe)
    last = None
    for cp in (2, 4, 8, 16):
        s = Strategy(recipe=rec, mesh=Degrees(cp=cp, tp=8, dp=2), recompute="full")
        t = blockcomm.block_cp_s(model, H100, s, comm.axis_groups(H100, s)[Axis.CP])
        assert t.forward_s > 0 and t.backward_s > t.forward_s and t.recompute_s == t.forward_s
        if last is not None:
            assert t.total_s > last
        last = t.total_s


def test_torch_cp_exchanges_repeated_heads_and_passes_fp32_gradients_round_the_ring():
    """torch's context parallelism as torchtitan runs it (``GATHER_RING``): K,V gathered behind
    the first of cp kernels, repeated to the query heads for a GQA model (4x the bytes of
    Llama-3 8B's 8 kv heads), fp32 dK,dV passed round the ring with the last send always
    exposed, and fp32 merges that add element-wise traffic per kernel; none of it at cp = 1."""
    model = profile_spec(parse_model_spec("llama:layers=2,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=32000,seq=65536"))
    tt = load_recipe("torchtitan")
    grouped = dataclasses.replace(tt, kv_repeated=False)
    slow = dataclasses.replace(H100, intra_node=dataclasses.replace(H100.intra_node, bw_gbps=1.0, p2p_bw_gbps=1.0))
    times = {}
    for rec in (tt, grouped):
        s = Strategy(recipe=rec, mesh=Degrees(cp=4, dp=2), recompute="full", zero=3)
        g = comm.axis_groups(slow, s)[Axis.CP]
        t = blockcomm.block_cp_s(model, slow, s, g)
        block = s.tokens(model.seq) * 2 * ring.cp_heads(model, s) * 128 * 2  # local K,V bytes
        # Over a slow link nothing hides: the gather of the other ranks' blocks, and four fp32 sends.
        assert t.forward_s == pytest.approx(comm.all_gather_s(4 * block, g) - compute.block_gemm_s(model, slow, s)[1] / 4
                                            + slow.overlap_penalty * compute.block_gemm_s(model, slow, s)[1] / 4)
        send = 2 * block / g.p2p_bytes_s  # dK, dV in fp32: twice the 16-bit K, V
        assert t.backward_s > 4 * send
        fast = blockcomm.block_cp_s(model, H100, s, comm.axis_groups(H100, s)[Axis.CP])
        assert fast.backward_s > 2 * block / comm.axis_groups(H100, s)[Axis.CP].p2p_bytes_s  # the last send
        times[rec.kv_repeated] = t.total_s
    assert times[True] == pytest.approx(4 * times[False], rel=0.05)
    merges = [ring.cp_merge_bytes(model, Strategy(recipe=tt, mesh=Degrees(cp=c, dp=8 // c))) for c in (1, 2, 4, 8)]
    # Per rank: 1/c of the tokens, about c merges of them each.
    assert merges[0] == (0.0, 0.0) and all(0 < a[0] < b[0] and a[1] > 0 for a, b in zip(merges[1:], merges[2:]))
    assert ring.cp_merge_bytes(model, Strategy(recipe=load_recipe("autopar"), mesh=Degrees(cp=4, dp=2))) == (0.0, 0.0)
    # Transformer Engine's ring corrects its 16-bit output and accumulates 16-bit gradients once
    # per kernel too: linear in the kernels, and less per kernel than torch's fp32 merges.
    te = [tuple(x * c for x in ring.cp_merge_bytes(model, Strategy(recipe=TE, mesh=Degrees(cp=c, dp=8 // c))))
          for c in (1, 2, 3, 4)]  # per sequence: a rank holds 1/c of its tokens
    assert te[0] == (0.0, 0.0)
    for a, b, c in zip(te[1:], te[2:], te[3:]):  # the same bytes per later kernel
        assert all(y - x == pytest.approx(z - y) for x, y, z in zip(a, b, c))
    assert all(x / 2 < y for x, y in zip(te[1], merges[1]))
    gather_once = dataclasses.replace(tt, context_parallel=ContextParallel.ALL_GATHER)
    t = [compute.block_times(model, H100, Strategy(recipe=r, mesh=Degrees(cp=4, dp=2))).total_s
         for r in (gather_once, grouped, tt)]
    assert t[0] < t[1] < t[2]  # merges cost time; repeated heads concatenate more


def test_pipelined_tp_hides_each_exchange_behind_its_own_gemm_only():
    """Async TP and Transformer Engine's userbuffers pipeline each exchange with the GEMM it
    feeds or follows. Llama-3 8B at TP 8 (QKV 768 wide, the attention output 512 deep on a
    rank) cannot hide its exchanges behind those two GEMMs, though the backward's GEMMs
    together are longer than all of them: the difference shows. At TP 2 every GEMM is wider and
    each exchange hides (only the overlap penalty shows), and pipelining never costs more than
    the same exchanges unpipelined."""
    model = profile_spec(parse_model_spec("llama3-8b"))
    rec = dataclasses.replace(load_recipe("torchtitan-asynctp"), tp_overlap_reduces_partials=False)  # the exchanges only
    for tp, hides in ((8, False), (2, True)):
        s = Strategy(recipe=rec, mesh=Degrees(tp=tp, dp=8), sequence_parallel=True, micro_batch=12, recompute="full")
        g = comm.axis_groups(H100, s)[Axis.TP]
        vol = s.tokens(model.seq) * model.hidden * 2
        ag, rs = comm.all_gather_s(vol, g), comm.reduce_scatter_s(vol, g)
        fwd, bwd = blockcomm.pipelined_tp_s(model, H100, s, g)
        win, win_b = compute.tp_windows_s(model, H100, s), compute.tp_windows_s(model, H100, s, backward=True)
        assert compute.block_gemm_s(model, H100, s, backward=True)[0] > 2 * (ag + rs)
        if hides:
            assert fwd == pytest.approx(H100.overlap_penalty * 2 * (ag + rs))
        else:
            assert ag > win[0] and rs > win[1]
            assert fwd >= ag - win[0] + rs - win[1]
            whole = comm.exposed_s(2 * (ag + rs), compute.block_gemm_s(model, H100, s)[0], H100)
            assert fwd > whole  # what hiding behind the pass's GEMMs together would show
            assert bwd >= rs - win_b[0] + ag - win_b[1]
        plain = blockcomm.block_tp_s(model, H100, dataclasses.replace(s, recipe=load_recipe("torchtitan-compile")), g)
        assert plain.forward_s >= fwd and plain.backward_s >= bwd


def test_torch_async_tp_sums_the_stacked_partials_after_each_pipelined_reduce_scatter():
    """torch's fused matmul-reduce-scatter exchanges each chunk's partial sums and returns
    their sum over the tp ranks: one more kernel after the GEMM that reads the full partials
    and writes the shard, twice per pass; Transformer Engine's userbuffers reduce inside the
    communication kernel. The backward's unfused reduce-scatters (torchtitan) have none."""
    model = profile_spec(parse_model_spec("llama3-8b"))
    shipped = load_recipe("torchtitan-asynctp")
    assert shipped.tp_overlap_reduces_partials and not load_recipe("megatron-core-te").tp_overlap_reduces_partials
    full = 12 * model.seq * model.hidden * 2
    reduce = compute.memory_s(full * (1 + 1 / 8), H100)
    for rec, backward in ((dataclasses.replace(shipped, tp_overlap_backward_scatter=True), 2), (shipped, 0)):
        s = Strategy(recipe=rec, mesh=Degrees(tp=8, dp=8), sequence_parallel=True, micro_batch=12, recompute="full")
        g = comm.axis_groups(H100, s)[Axis.TP]
        te_like = dataclasses.replace(s, recipe=dataclasses.replace(rec, tp_overlap_reduces_partials=False))
        (fwd, bwd), (f0, b0) = blockcomm.pipelined_tp_s(model, H100, s, g), blockcomm.pipelined_tp_s(model, H100, te_like, g)
        assert fwd == pytest.approx(f0 + 2 * reduce) and bwd == pytest.approx(b0 + backward * reduce)


def test_torch_async_tp_leaves_the_backward_reduce_scatter_of_summed_gradients_unfused():
    """Inductor's micro-pipeline TP pass fuses a reduce-scatter only where one matmul makes
    its input (checked on the installed torch). torchtitan's Llama sums its separate q/k/v (and
    w1/w3) projections' input gradients first, so the backward's two reduce-scatters run
    plain, whole and with their rearranging copy, while Transformer Engine (one fused QKV, one
    fused up projection) pipelines them; the forward is the same either way."""
    from torch._inductor.fx_passes import micro_pipeline_tp

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x, wq, wk = (graph.placeholder(n) for n in ("x", "wq", "wk"))
    dq, dk = (graph.call_function(aten.mm.default, (x, w)) for w in (wq, wk))
    summed = graph.call_function(aten.add.Tensor, (dq, dk))
    assert micro_pipeline_tp._find_producer_matmul(dq) is not None
    assert micro_pipeline_tp._find_producer_matmul(summed) is None
    model = profile_spec(parse_model_spec("llama3-8b"))
    titan = load_recipe("torchtitan-asynctp")
    assert not titan.tp_overlap_backward_scatter and load_recipe("megatron-core-te").tp_overlap_backward_scatter
    s = Strategy(recipe=dataclasses.replace(titan, tp_overlap_reduces_partials=False), mesh=Degrees(tp=8, dp=8),
                 sequence_parallel=True, micro_batch=12, recompute="full")
    piped = dataclasses.replace(s, recipe=dataclasses.replace(s.recipe, tp_overlap_backward_scatter=True))
    g = comm.axis_groups(H100, s)[Axis.TP]
    vol = s.tokens(model.seq) * model.hidden * 2
    rs, ag = comm.reduce_scatter_s(vol, g), comm.all_gather_s(vol, g)
    win_b = compute.tp_windows_s(model, H100, s, backward=True)
    (fwd, bwd), (f1, b1) = blockcomm.pipelined_tp_s(model, H100, s, g), blockcomm.pipelined_tp_s(model, H100, piped, g)
    gathers = comm.exposed_s(ag, win_b[1], H100) + comm.exposed_s(ag, win_b[3], H100)
    assert fwd == f1 and bwd == pytest.approx(2 * rs + 2 * compute.memory_s(2 * vol, H100) + gathers)
    assert b1 < bwd


def test_batch_first_sp_copies_the_hidden_states_around_its_collectives():
    """torch's functional collectives on DTensor SP's batch-first [b, s, h] shards copy the
    full hidden states once more: the reduce-scatter always (its input rearranged by
    ``torch.cat``), the all-gather unless the micro-batch is one sequence (a view since torch
    2.10), and at every micro-batch before. Megatron's sequence-first program and the
    pipelined (async TP) one copy nothing."""
    from torch._utils import _chunk_or_narrow_cat, _maybe_view_chunk_cat

    for b, viewed in ((1, True), (3, False)):  # the torch this runs on makes the copies priced
        gathered = torch.arange(2 * b * 4 * 3.0).reshape(2 * b, 4, 3)
        out = _maybe_view_chunk_cat(gathered, 2, 1)
        assert out.shape == (b, 8, 3) and (out.data_ptr() == gathered.data_ptr() and out._base is not None) == viewed
        scattered = _chunk_or_narrow_cat(out, 2, narrow_dim=1, cat_dim=0)
        assert scattered.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
    model = profile_spec(parse_model_spec("llama3-8b"))
    titan = load_recipe("torchtitan-compile")
    assert load_recipe("autopar").sp_copy == SpCopy.BATCH_FIRST
    assert titan.sp_copy == SpCopy.BATCH_FIRST_BEFORE_2_10
    assert MC.sp_copy == load_recipe("torchtitan-asynctp").sp_copy == SpCopy.NONE
    for mb in (1, 12):
        s = Strategy(recipe=titan, mesh=Degrees(tp=8, dp=8), sequence_parallel=True, micro_batch=mb, recompute="full")
        g = comm.axis_groups(H100, s)[Axis.TP]
        copy = compute.memory_s(2 * s.tokens(model.seq) * model.hidden * 2, H100)
        plain = blockcomm.block_tp_s(model, H100, dataclasses.replace(s, recipe=dataclasses.replace(titan, sp_copy=SpCopy.NONE)), g)
        for recipe, gathers in ((titan, 2), (dataclasses.replace(titan, sp_copy=SpCopy.BATCH_FIRST), 0 if mb == 1 else 2)):
            t = blockcomm.block_tp_s(model, H100, dataclasses.replace(s, recipe=recipe), g)
            assert t.forward_s == pytest.approx(plain.forward_s + (2 + gathers) * copy)
            assert t.backward_s == pytest.approx(plain.backward_s + (2 + gathers) * copy)
            assert t.recompute_s == pytest.approx(t.forward_s)
    no_sp = Strategy(recipe=titan, mesh=Degrees(tp=8, dp=8), micro_batch=12)
    assert blockcomm.sp_copy_s(model, H100, no_sp) == (0.0, 0.0)


def test_cp_needs_a_recipe_that_has_it():
    with pytest.raises(ValueError, match="no context parallelism"):
        Strategy(mesh=Degrees(cp=2), recipe=load_recipe("deepspeed"))
    assert load_recipe("autopar").has_context_parallel and MC.has_context_parallel
    assert not load_recipe("deepspeed").has_context_parallel


def test_autopar_cp_activations_fall_with_cp_and_none_is_priced_as_selective():
    """Under the autopar recipe (all-gathered K,V, never kept: ``runtime.context_parallel``) a
    GPT of 32 blocks of hidden 4096 at 32K tokens keeps 1/cp of the activations per rank at every recompute
    mode, and a block planned without recompute pays the attention core's forward and K,V
    gather again in its backward (it runs as selective), which it does not at cp = 1."""
    model = gpt(layers=32, hidden=4096, heads=32, seq=32768)
    rec = load_recipe("autopar")
    for mode in ("none", "selective", "full"):
        acts = []
        for cp in (1, 2, 4, 8):
            s = Strategy(recipe=rec, mesh=Degrees(cp=cp, tp=8, dp=1), recompute=mode, sequence_parallel=True)
            acts.append(estimate(model, H100, dataclasses.replace(s, stage_layers=(32,)), global_batch=1)
                        .memory.activations_bytes)
        assert all(b < a for a, b in zip(acts, acts[1:])), (mode, acts)
        assert acts[-1] <= acts[0] / 8 * 1.01, (mode, acts)  # 1/cp (the fp32 log-sum-exp aside)
    one, two = (Strategy(recipe=rec, mesh=Degrees(cp=c, tp=8), recompute="none") for c in (1, 2))
    assert compute.block_times(model, H100, one).recompute_s == 0.0
    assert compute.block_times(model, H100, two).recompute_s == \
        compute.block_times(model, H100, dataclasses.replace(two, recompute="selective")).recompute_s > 0
    cp_comm = blockcomm.block_cp_s(model, H100, two, comm.axis_groups(H100, two)[Axis.CP])
    assert cp_comm.recompute_s == cp_comm.forward_s > 0


def test_host_time_adds_to_a_pass_where_operators_run_on_the_host():
    """CUDA kernels run behind the host: a pass takes the larger of host and device time. CPU
    operators run on the dispatching thread: the sum (``host_overlaps_device``)."""
    model, strat = gpt(2, 256, 4, vocab=512, seq=128), Strategy(recipe=load_recipe("autopar"), mesh=Degrees(dp=1),
                                                          dtype="fp32")
    cpu = dataclasses.replace(load_profile("cpu-local"), kernel_dispatch_us=20.0)
    dispatch = host.dispatch_s(cpu, strat)
    none = compute.block_times(model, dataclasses.replace(cpu, kernel_dispatch_us=0.0), strat)
    sync = compute.block_times(model, dataclasses.replace(cpu, host_overlaps_device=False), strat)
    async_ = compute.block_times(model, dataclasses.replace(cpu, host_overlaps_device=True), strat)
    assert sync.forward_s == pytest.approx(none.forward_s + dispatch)
    assert sync.backward_s == pytest.approx(none.backward_s + 2 * dispatch)
    assert async_.forward_s == pytest.approx(max(none.forward_s, dispatch))


def test_moe_terms_experts_over_ep_all_to_all_over_its_tier():
    """Expert parallelism: the expert weights' states divide by ep (then shard over edp under
    ZeRO), the dense ones do not; the all-to-all is zero at ep = 1, inside a node while ep x the
    replicas' stride fits one, across nodes past it; model FLOPs (routed tokens only) do not
    move with ep; the load imbalance grows the expert GEMMs, the all-to-all and activations."""
    from tests.test_solver import moe_profile
    from cost_models.blockcomm import block_ep_s
    model = moe_profile(layers=4, hidden=1024, heads=8, experts=8, topk=2, seq=2048)
    hw = load_profile("dgx-h100")
    one, four = (Strategy(mesh=Degrees(dp=8, ep=e), zero=0) for e in (1, 4))
    dense_state = states.state_bytes(model.dense_block_params, one).total
    expert_state = states.state_bytes(model.expert_params, one).total
    assert states.layer_state_bytes(model, one).total == pytest.approx(dense_state + expert_state)
    assert states.layer_state_bytes(model, four).total == pytest.approx(dense_state + expert_state / 4)
    z1 = Strategy(mesh=Degrees(dp=8, ep=4), zero=1)  # optimizer states: dense over 8, experts over edp = 2
    lay = states.state_layout(z1)
    assert states.layer_state_bytes(model, z1).optimizer == pytest.approx(
        lay.optimizer * (model.dense_block_params / 8 + model.expert_params / 4 / 2))
    groups = lambda s: comm.axis_groups(hw, s)  # noqa: E731
    assert block_ep_s(model, one, groups(one)[Axis.EP]).total_s == 0.0
    inside = block_ep_s(model, four, groups(four)[Axis.EP])
    assert inside.total_s > 0 and inside.forward_s == inside.backward_s and not groups(four)[Axis.EP].inter_node
    wide = Strategy(mesh=Degrees(dp=8, tp=4, ep=4))  # ep ranks 4 apart: 16 > 8 per node
    assert groups(wide)[Axis.EP].inter_node
    assert estimate(model, hw, one, global_batch=8).tflops_per_gpu * estimate(model, hw, one, global_batch=8).step_time_s \
        == pytest.approx(estimate(model, hw, four, global_batch=8).tflops_per_gpu
                         * estimate(model, hw, four, global_batch=8).step_time_s)
    skewed = dataclasses.replace(four, recipe=dataclasses.replace(four.recipe, moe_load_imbalance=1.5))
    assert compute.expert_gemm_s(model, hw, skewed) == pytest.approx(1.5 * compute.expert_gemm_s(model, hw, four), rel=0.2)
    assert block_ep_s(model, skewed, groups(skewed)[Axis.EP]).total_s > inside.total_s
    assert memory.block_act_bytes(model, skewed) > memory.block_act_bytes(model, four)
    capped = dataclasses.replace(model, capacity_factor=1.25)
    assert memory.moe_load(capped, skewed) == 1.25 and memory.moe_load(model, skewed) == 1.5


def _as_lead(model: ModelProfile, k: int) -> ModelProfile:
    """``model`` whose first ``k`` blocks are its leading blocks (the same block, no
    embedding or head): priced with the first stage instead of placed."""
    lead = dataclasses.replace(model, name="lead", layers=k, embed_params=0, head_params=0,
                               head_flops_per_token=0.0, tied=False)
    return dataclasses.replace(model, layers=model.layers - k, lead=lead)


@pytest.mark.parametrize("zero,rc", [(1, "none"), (3, "none"), (1, "full")])
def test_leading_blocks_cost_what_the_same_blocks_cost_on_the_first_stage(zero, rc):
    """Leading blocks alike the repeated ones price exactly as those blocks placed first on
    stage 0: the same step (time, tails, bubble) and model FLOPs; memory the same, except that
    the leading blocks' recompute workspace adds to the stage's instead of maxing with it (a
    bound above the peak by one block's workspace, ``cost_models.stages``)."""
    hw, k = load_profile("dgx-a100-80g"), 3
    base = Strategy(mesh=Degrees(dp=2, tp=8, pp=4), zero=zero, num_microbatches=8, recompute=rc,
                    stage_layers=(14, 12, 11, 11))
    led = dataclasses.replace(base, stage_layers=(11, 12, 11, 11))
    a = estimate(G22B, hw, base, global_batch=16)
    b = estimate(_as_lead(G22B, k), hw, led, global_batch=16)
    assert _as_lead(G22B, k).params == G22B.params
    assert b.step_time_s == pytest.approx(a.step_time_s, rel=1e-12)
    assert b.tflops_per_gpu == pytest.approx(a.tflops_per_gpu, rel=1e-12)
    ws = memory.workspace_bytes(G22B, base) if rc != "none" else 0.0
    assert b.stage_peak_bytes[0] == pytest.approx(a.stage_peak_bytes[0] + ws, rel=1e-12)
    assert b.stage_peak_bytes[1:] == pytest.approx(a.stage_peak_bytes[1:], rel=1e-12)
    # The first stage carries them: taking them away makes it cheaper, and a placement that
    # counts them again is refused, not priced.
    none = estimate(dataclasses.replace(G22B, layers=45), hw, led, global_batch=16)
    assert none.stage_peak_bytes[0] < b.stage_peak_bytes[0] and none.step_time_s < b.step_time_s
    with pytest.raises(ValueError, match="repeats 45"):
        estimate(_as_lead(G22B, k), hw, base, global_batch=16)


# --- host-executed devices (CPU ranks): what the autopar runtime does there ------------------

CPU = load_profile("cpu-local")


def test_reduce_scatter_factor_scales_reduce_scatter_only():
    g = comm.Group(size=4, bw_bytes_s=1e9, p2p_bytes_s=1e9, latency_s=1e-3, inter_node=False, rs_factor=2.0)
    ring = dataclasses.replace(g, rs_factor=1.0)
    assert comm.reduce_scatter_s(1e6, g) == pytest.approx(2 * comm.reduce_scatter_s(1e6, ring))
    assert comm.all_gather_s(1e6, g) == comm.all_gather_s(1e6, ring)
    assert comm.all_reduce_s(1e6, g) == comm.all_reduce_s(1e6, ring)
    tier = dataclasses.replace(CPU.intra_node, reduce_scatter_factor=3.0)
    assert comm.group(dataclasses.replace(CPU, intra_node=tier), 4).rs_factor == 3.0


def _cpu_step(hw, zero: int, tp: int = 1) -> float:
    from autopar.spec import parse_model_spec
    from autopar.trace.profile import profile_spec
    model = profile_spec(parse_model_spec("gpt:layers=4,hidden=128,heads=4,vocab=512,seq=64,tied=0"))
    strat = Strategy(recipe=load_recipe("autopar"), mesh=Degrees(dp=4 // tp, tp=tp), zero=zero, micro_batch=4,
                     num_microbatches=1, recompute="none", dtype="fp32")
    return estimate(model, hw, strat, global_batch=16 // tp).step_time_s


def test_fsdp_collectives_are_exposed_where_the_host_runs_the_operators():
    """On CPU ranks FSDP2's all-gathers and reduce-scatters are synchronous: ZeRO 2 costs
    its collectives on top of DDP; behind CUDA streams they would hide (where overlap is free:
    the shipped CPU ranks' measured ``overlap_penalty`` is 1)."""
    streams = dataclasses.replace(CPU, host_overlaps_device=True, dtensor_optimizer_us=0.0, overlap_penalty=0.0)
    on_host = dataclasses.replace(CPU, dtensor_optimizer_us=0.0, overlap_penalty=0.0)
    assert _cpu_step(on_host, 2) - _cpu_step(on_host, 0) > 4 * 2 * 3 * CPU.intra_node.latency_us * 1e-6
    assert _cpu_step(streams, 2) - _cpu_step(streams, 0) < 0.5 * (_cpu_step(on_host, 2) - _cpu_step(on_host, 0))


def test_dtensor_parameters_add_their_dispatch_to_the_optimizer_step():
    """FSDP2 and tp weights are DTensors (the autopar recipe): each parameter tensor's step
    pays ``dtensor_optimizer_us``; DDP's plain tensors do not."""
    base = dataclasses.replace(CPU, dtensor_optimizer_us=0.0)
    slow = dataclasses.replace(CPU, dtensor_optimizer_us=1000.0)
    tensors = 4 * 16 + 2 + 3  # gpt blocks have 16 parameter tensors; 2 embedding tables; norm + head 3
    assert _cpu_step(slow, 0) == _cpu_step(base, 0)
    assert _cpu_step(slow, 1) - _cpu_step(base, 1) == pytest.approx(tensors * 1e-3, rel=0.01)
    assert _cpu_step(slow, 0, tp=2) > _cpu_step(base, 0, tp=2) + 0.5 * tensors * 1e-3


def test_every_parameter_tensor_adds_its_host_time_to_the_optimizer_step():
    """torch's AdamW on CPU steps each parameter tensor with its own operators: every plan
    pays ``optimizer_tensor_us`` per tensor it steps, on top of the bytes the step moves, so
    a model of many small tensors steps slower than its bytes say; behind CUDA streams the
    host time hides under the kernels' (the larger of the two)."""
    base = dataclasses.replace(CPU, optimizer_tensor_us=0.0, dtensor_optimizer_us=0.0)
    slow = dataclasses.replace(base, optimizer_tensor_us=1000.0)
    tensors = 4 * 16 + 2 + 3
    for zero in (0, 3):
        assert _cpu_step(slow, zero) - _cpu_step(base, zero) == pytest.approx(tensors * 1e-3, rel=0.01)
    both = dataclasses.replace(slow, dtensor_optimizer_us=500.0)
    assert _cpu_step(both, 1) - _cpu_step(base, 1) == pytest.approx(tensors * 1.5e-3, rel=0.01)
    streams = dataclasses.replace(slow, host_overlaps_device=True)
    quiet = dataclasses.replace(base, host_overlaps_device=True)
    assert _cpu_step(streams, 0) - _cpu_step(quiet, 0) < tensors * 1e-3


def test_fsdp_hooks_add_per_group_and_micro_batch_where_the_host_runs_the_operators():
    """Each FSDP2 group (4 blocks, the embedding, the head) pays ``fsdp_hook_us`` per
    micro-batch under ZeRO 1-3 and under FSDP2's replicate (ZeRO 0 with tp); DDP has no
    hooks, and behind CUDA streams the hooks hide."""
    base = dataclasses.replace(CPU, fsdp_hook_us=0.0)
    slow = dataclasses.replace(CPU, fsdp_hook_us=1000.0)
    assert _cpu_step(slow, 0) == _cpu_step(base, 0)
    for zero in (1, 3):
        assert _cpu_step(slow, zero) - _cpu_step(base, zero) == pytest.approx(6 * 1e-3, rel=0.01)
    assert _cpu_step(slow, 0, tp=2) - _cpu_step(base, 0, tp=2) == pytest.approx(6 * 1e-3, rel=0.01)
    streams = dataclasses.replace(slow, host_overlaps_device=True)
    assert _cpu_step(streams, 3) == _cpu_step(dataclasses.replace(base, host_overlaps_device=True), 3)


def test_dtensor_tensor_parallelism_adds_its_host_time_per_split_linear_and_loss():
    """Under DTensor TP (the autopar recipe) each split Linear of a block pays ``tp_linear_us``
    per micro-batch (a GPT block has 6: q, k, v, o, up, down; a third in the forward), the
    embedding one more, the vocab-parallel head and loss ``tp_loss_us``; nothing at tp 1 or
    where the weights are plain tensors (Megatron)."""
    from autopar.trace.profile import profile_spec as traced
    model = traced(parse_model_spec("gpt:layers=4,hidden=128,heads=4,vocab=512,seq=64,tied=0"))
    assert model.block_tp_linears == 6
    base = dataclasses.replace(CPU, tp_linear_us=0.0, tp_loss_us=0.0)
    slow = dataclasses.replace(CPU, tp_linear_us=1000.0, tp_loss_us=5000.0)
    tp2 = Strategy(recipe=load_recipe("autopar"), mesh=Degrees(dp=2, tp=2), micro_batch=4, num_microbatches=2,
                   dtype="fp32")
    fast_block, slow_block = (compute.block_times(model, hw, tp2) for hw in (base, slow))
    assert slow_block.forward_s - fast_block.forward_s == pytest.approx(6e-3 / 3)
    assert slow_block.backward_s - fast_block.backward_s == pytest.approx(2 * 6e-3 / 3)
    step = lambda hw, st: estimate(model, hw, st, global_batch=16).step_time_s  # noqa: E731
    assert step(slow, tp2) - step(base, tp2) == pytest.approx(2 * (4 * 6e-3 + 1e-3 + 5e-3), rel=1e-6)  # 2 micro-batches
    for other in (dataclasses.replace(tp2, mesh=Degrees(dp=2)), dataclasses.replace(tp2, recipe=MC)):
        assert step(slow, other) == step(base, other)


def test_a_torch_pipeline_adds_its_schedules_host_time_per_chunk_and_zero_bubble_per_block():
    """Where the host runs the operators, ``torch.distributed.pipelining`` adds ``pp_chunk_us``
    per model chunk and micro-batch to every stage (with the sends), and the zero-bubble
    schedule's split backward ``zb_block_us`` per block and micro-batch; nothing without a
    pipeline, on CUDA (the host runs ahead of the device) or under Megatron's own pipeline."""
    model = profile_spec(parse_model_spec("gpt:layers=8,hidden=128,heads=4,vocab=512,seq=64,tied=0"))
    base = dataclasses.replace(CPU, pp_chunk_us=0.0, zb_block_us=0.0)
    slow = dataclasses.replace(CPU, pp_chunk_us=700.0, zb_block_us=1500.0)
    pp = Strategy(recipe=load_recipe("autopar"), mesh=Degrees(dp=2, pp=2), micro_batch=1, num_microbatches=16,
                  dtype="fp32")
    for sched, v, block in (("1f1b", 1, 0.0), ("interleaved", 2, 0.0), ("zero-bubble", 1, 1.5e-3)):
        st = dataclasses.replace(pp, schedule=sched, virtual_stages=v)
        fast, more = (stage_costs(model, hw, st) for hw in (base, slow))
        assert more.p2p_time_s - fast.p2p_time_s == pytest.approx(v * 7e-4)
        assert all(b - a == pytest.approx(block) for a, b in zip(fast.mode_time_s, more.mode_time_s))
        assert (more.first_time_s, more.last_time_s) == (fast.first_time_s, fast.last_time_s)
        details = estimate(model, slow, dataclasses.replace(st, stage_layers=(4, 4)),
                           global_batch=32)
        assert details.time.compute_s + details.time.tp_comm_s + details.time.dp_comm_s + details.time.pp_comm_s \
            + details.time.bubble_s + details.time.optimizer_s == pytest.approx(details.step_time_s)
    zb = dataclasses.replace(pp, schedule="zero-bubble")
    for hw, st in ((dataclasses.replace(slow, host_overlaps_device=True), zb),
                   (slow, dataclasses.replace(zb, mesh=Degrees(dp=4), num_microbatches=8)),
                   (slow, dataclasses.replace(zb, recipe=MC))):
        off = dataclasses.replace(base, host_overlaps_device=hw.host_overlaps_device)
        assert stage_costs(model, hw, st) == stage_costs(model, off, st)


def test_activation_checkpointing_adds_its_machinery_per_block_in_each_recompute_mode():
    """``checkpoint_us[mode]`` adds to a block's recompute pass per micro-batch where the host
    runs the operators (every block, every micro-batch: the compute grows by blocks x
    micro-batches x the figure, of which the backward hides more of DDP's reduction), nothing
    to a block kept whole; where the device runs behind the host it is a floor the recomputed
    kernels hide."""
    model = profile_spec(parse_model_spec("gpt:layers=4,hidden=128,heads=4,vocab=512,seq=64,tied=0"))
    figures = {"selective": 400.0, "full": 1000.0, "op": 3000.0}
    base, slow = dataclasses.replace(CPU, checkpoint_us={}), dataclasses.replace(CPU, checkpoint_us=figures)
    st = Strategy(recipe=load_recipe("autopar"), mesh=Degrees(dp=4), micro_batch=2, num_microbatches=2,
                  dtype="fp32")
    for mode in ("none", *figures):
        run = dataclasses.replace(st, recompute=mode)
        fast, more = (compute.block_times(model, hw, run) for hw in (base, slow))
        assert (more.forward_s, more.backward_s) == (fast.forward_s, fast.backward_s)
        assert more.recompute_s - fast.recompute_s == pytest.approx(figures.get(mode, 0.0) * 1e-6)
        fast_step, slow_step = (estimate(model, hw, run, global_batch=16) for hw in (base, slow))
        assert slow_step.time.compute_s - fast_step.time.compute_s == pytest.approx(
            4 * 2 * figures.get(mode, 0.0) * 1e-6, rel=1e-6)
        assert slow_step.step_time_s > fast_step.step_time_s or mode == "none"
    from cost_models.hardware import PROFILE_DIR, profile_from_dict
    data = json.loads((PROFILE_DIR / "cpu-local.json").read_text())
    for bad in ({"none": 1.0}, {"full": -1.0}):
        with pytest.raises(ProfileError, match="checkpoint_us"):
            profile_from_dict({**data, "checkpoint_us": bad})
    streams = dataclasses.replace(slow, host_overlaps_device=True)
    full = dataclasses.replace(st, recompute="full")
    hidden = compute.block_times(model, dataclasses.replace(base, host_overlaps_device=True), full)
    assert compute.block_times(model, streams, full).recompute_s == pytest.approx(
        max(hidden.recompute_s, host.dispatch_s(streams, full) + 1e-3))


def test_a_collective_pays_its_call_latency_once_whatever_its_steps():
    """``call_latency_us`` adds once to every collective (ring or tree all-reduce, all-gather,
    reduce-scatter, all-to-all), never to a send."""
    g = comm.Group(size=4, bw_bytes_s=1e9, p2p_bytes_s=1e9, latency_s=1e-3, inter_node=False)
    c = dataclasses.replace(g, call_s=5e-3)
    for f in (comm.all_reduce_s, comm.tree_all_reduce_s, comm.all_gather_s, comm.all_to_all_s):
        assert f(1e6, c) - f(1e6, g) == pytest.approx(5e-3)
    assert comm.reduce_scatter_s(1e6, c) - comm.reduce_scatter_s(1e6, g) == pytest.approx(5e-3)
    assert comm.p2p_s(1e6, c) == comm.p2p_s(1e6, g)
    tier = dataclasses.replace(CPU.intra_node, call_latency_us=700.0)
    assert comm.group(dataclasses.replace(CPU, intra_node=tier), 2).call_s == pytest.approx(700e-6)


def test_vocab_parallel_loss_costs_three_small_all_reduces_under_tp():
    """Megatron's vocab-parallel cross-entropy and torch's loss_parallel all-reduce the logits'
    maximum, sum of exponentials and target logit: one fp32 value per token each."""
    g = comm.Group(size=2, bw_bytes_s=1e9, p2p_bytes_s=1e9, latency_s=1e-3, inter_node=False)
    tp2 = Strategy(recipe=MC, mesh=Degrees(tp=2), micro_batch=4)
    assert blockcomm.vocab_parallel_loss_s(G22B, tp2, g) == pytest.approx(3 * comm.all_reduce_s(4 * 2048 * 4.0, g))
    assert blockcomm.vocab_parallel_loss_s(G22B, Strategy(recipe=MC, mesh=Degrees(dp=2)), g) == 0.0


def test_pass_key_holds_everything_the_pass_times_read():
    """``compute.pass_key`` (what the search's caches share block times by): strategies equal in
    it get equal block, embedding and head times whatever their dp, pp, ZeRO, offload,
    schedule, chunks, axis order and leading-block mode, under a profile and under its
    order-free twin (links changed, device kept); strategies that differ in it differ."""
    import itertools
    from autopar.solve.space import order_free_hardware
    from tests.test_solver import gpt_profile, moe_profile
    hw = load_profile("dgx-h100")
    for model in (moe_profile(layers=4, hidden=1024, heads=8, experts=8, topk=2, seq=2048),
                  gpt_profile(layers=4, hidden=1024, heads=8, vocab=32000, seq=2048)):
        times: dict = {}
        for dp, pp, zero, off, (sched, v), order, lead, tp, sp, b, rc in itertools.product(
                (2, 4), (1, 2), (0, 3), (False, True), (("1f1b", 1), ("interleaved", 2)), (("pp", "dp", "tp"), ("tp", "dp", "pp")),
                ("", "full"), (1, 2), (False, True), (1, 2), ("none", "full")):
            if (sp and tp == 1) or (off and zero == 0):
                continue
            st = Strategy(mesh=Degrees(dp=dp, pp=pp, tp=tp, ep=2 if model.moe else 1), zero=zero, offload=off,
                          schedule=sched if pp > 1 else "1f1b", virtual_stages=v if pp > 1 else 1, axis_order=order,
                          lead_recompute=lead, sequence_parallel=sp, micro_batch=b, recompute=rc)
            for h in (hw, order_free_hardware(hw, st.mesh)[0]):
                got = (compute.block_times(model, h, st), compute.first_times(model, h, st),
                       compute.last_times(model, h, st))
                assert times.setdefault(compute.pass_key(st), got) == got, st
        assert len(times) == 2 * 2 + 2 * 2 * 2  # b x recompute at tp 1, and x SP at tp 2: all differ
        assert len(set(times.values())) == len(times)


def test_autocast_blocks_keep_what_an_h100_kept():
    """Under torch.autocast (the runtime's DDP and one-device paths) a block keeps its norms'
    inputs in fp32 and one 16-bit cast of a norm's output per GEMM reading it. The trace's
    count equals what an H100 kept (tests/data/gpu_saved_tensors.json: the autograd graph's
    saved tensors, autocast less bf16 weights, less the final norm's share)."""
    data = json.loads((Path(__file__).parent / "data" / "gpu_saved_tensors.json").read_text())
    totals = {(r["model"], r["mode"]): r["total_h_per_token_per_layer_incl_head"] for r in data["runs"]}
    for arch, spec_text in data["models"].items():
        spec = parse_model_spec(spec_text)
        final_norm = 2.0 / spec.layers  # the final norm's fp32 input, h per token, over the layers
        measured = totals[(arch, "autocast")] - totals[(arch, "bf16")] - final_norm
        assert profile_spec(spec).autocast_act_bytes_per_token / spec.hidden == pytest.approx(measured, abs=0.1)


def test_one_gpu_peak_memory_is_what_an_h100_measured():
    """A 1B GPT on one H100 under the autopar recipe (autocast, eager fp32 cross-entropy, no
    gradient until the backward): the predicted peak within 5 % of the allocator's, with one
    micro-batch of 16 and with 4 of 4 (tests/data/gpu_saved_tensors.json, ``full_plan``)."""
    data = json.loads((Path(__file__).parent / "data" / "gpu_saved_tensors.json").read_text())["full_plan"]
    model = profile_spec(parse_model_spec("gpt:layers=16,hidden=2048,heads=16,vocab=32000,seq=2048,tied=0"))
    hw = load_profile("dgx-h100")
    for mbs, measured in ((16, data["peak_gib_mbs16"]), (4, data["peak_gib_mbs4_x4"])):
        strat = Strategy(mesh=Degrees(), micro_batch=mbs, num_microbatches=16 // mbs, dtype="bf16",
                         recipe=load_recipe("autopar"))
        peak = estimate(model, hw, strat, global_batch=16).memory.peak_bytes / 2**30
        assert peak == pytest.approx(measured, rel=0.05)


def test_torch_ddp_reduces_its_buckets_after_they_fill():
    """torch DDP all-reduces a 1 MiB first bucket, then 25 MB ones, each once full and after
    the one before: gradients that fill one bucket at the end of the backward are reduced
    after it, whatever the blocks that make them (one call, not one per block); a long
    backward of many buckets hides all but the last where overlap costs nothing, and hides
    nothing where it costs the whole collective (``overlap_penalty`` 1: CPU ranks, whose gloo
    thread takes the cores the backward runs on, as ``autopar profile`` measured it)."""
    rep = comm.Group(size=4, bw_bytes_s=1e9, p2p_bytes_s=1e9, latency_s=1e-3, inter_node=False)
    ar = lambda n: comm.best_all_reduce_s(n, rep)  # noqa: E731
    mib, cap = states.DDP_FIRST_BUCKET_BYTES, states.DDP_BUCKET_BYTES
    free, full = dataclasses.replace(CPU, overlap_penalty=0.0), dataclasses.replace(CPU, overlap_penalty=1.0)
    assert pieces.ddp_exposed_s([(3 * mib, 1.0)], rep, free) == pytest.approx(ar(mib) + ar(2 * mib))
    assert pieces.ddp_exposed_s([(mib, 1.0), (mib, 1.0), (mib, 1.0)], rep, free) == pytest.approx(ar(2 * mib))
    assert pieces.ddp_exposed_s([(mib, 1.0), (mib, 1.0), (mib, 1.0)], rep, full) == pytest.approx(ar(mib) + ar(2 * mib))
    many = [(mib, 1.0)] + [(cap, 10.0)] * 5 + [(cap / 2, 1.0)]
    assert pieces.ddp_exposed_s(many, rep, free) == pytest.approx(ar(cap / 2))
    assert pieces.ddp_exposed_s(many, rep, full) == pytest.approx(ar(mib) + 5 * ar(cap) + ar(cap / 2))
    model = profile_spec(parse_model_spec("gpt:layers=8,hidden=128,heads=4,vocab=512,seq=64,tied=0"))
    ddp = Strategy(recipe=load_recipe("autopar"), mesh=Degrees(dp=4), micro_batch=8, dtype="fp32")
    grads = model.params * 4
    assert mib < grads < mib + cap  # two buckets: the first (the head and a block), then the rest
    group = comm.replica_group(CPU, ddp)
    for hw, exposed in ((free, comm.best_all_reduce_s(grads - mib, group)),
                        (full, comm.best_all_reduce_s(mib, group) + comm.best_all_reduce_s(grads - mib, group))):
        assert estimate(model, hw, ddp, global_batch=32).time.dp_comm_s == pytest.approx(exposed, rel=1e-6)
    fsdp = estimate(model, CPU, dataclasses.replace(ddp, zero=1), global_batch=32)
    assert fsdp.time.dp_comm_s > 0  # FSDP2 prices its own collectives per group


def test_a_stage_whose_forwards_all_come_first_peaks_without_one_micro_batch_or_its_gradients():
    """torch's pipelining with FSDP2 (autopar, torchtitan) makes the gradients in the backward:
    a stage that runs all its forwards before its first backward (GPipe's, 1F1B's with
    m <= p - s) holds at its last forward's end no gradient, and after that backward one
    micro-batch fewer: per piece, the smaller of the two comes off. Megatron's gradient
    buffers live all step, and a stage whose 1F1B steady state returns to its in-flight count
    with the gradients made saves nothing."""
    torch_recipe = load_recipe("autopar")
    base = Strategy(recipe=torch_recipe, mesh=Degrees(dp=2, pp=4), zero=1, micro_batch=1, num_microbatches=2,
                    schedule="gpipe")
    assert memory.forward_first(base) == (True,) * 4
    assert memory.forward_first(dataclasses.replace(base, schedule="1f1b")) == (True, True, True, False)
    assert memory.forward_first(dataclasses.replace(base, schedule="1f1b", num_microbatches=8)) == ()
    assert memory.forward_first(dataclasses.replace(base, recipe=MC)) == ()
    c = stage_costs(G22B, A100, base)
    plain = dataclasses.replace(c, forward_first=())
    a, g = c.mode_act_bytes[0], c.layer_grad_bytes
    assert 0 < g and 0 < a
    for s in range(4):
        saved = plain.stage_memory_bytes(s, 10) - c.stage_memory_bytes(s, 10)
        edges = ((min(c.first_act_bytes, c.first_grad_bytes) if s == 0 else 0.0)
                 + (min(c.last_act_bytes, c.last_grad_bytes) if s == 3 else 0.0))
        assert saved == pytest.approx(10 * min(a, g) + edges, rel=1e-9)
        detail = stage_details(G22B, A100, dataclasses.replace(base, stage_layers=(12, 12, 12, 12)))[s]
        assert detail.memory.peak_bytes == pytest.approx(
            detail.memory.params_bytes + detail.memory.grads_bytes + detail.memory.optimizer_bytes
            + detail.memory.activations_bytes + detail.memory.buffers_bytes, rel=1e-9)


def test_every_stage_but_the_last_peaks_with_its_first_backward_gemms_gradients():
    """A pipeline stage's first backward starts at its last GEMM, the MLP's down projection:
    its input gradient, b s ffn / tp, and its weight gradient, ffn h / tp, in the compute dtype,
    come on top of what the stage keeps (CPU censuses: 5 MiB on wide's tp 2 stage 0, its peak).
    The last stage's loss backward comes before it; without a pipeline that is the only stage."""
    strat = Strategy(mesh=Degrees(dp=2, tp=2, pp=4), zero=1, micro_batch=2, num_microbatches=8)
    t = memory.backward_start_bytes(G22B, strat)
    tokens = 2 * G22B.seq
    assert t == pytest.approx(2 * G22B.ffn * (tokens + G22B.hidden) / 2)  # 16-bit
    c = stage_costs(G22B, A100, strat)
    plain = dataclasses.replace(c, backward_start_bytes=0.0)
    for s in range(4):
        extra = c.stage_memory_bytes(s, 12) - plain.stage_memory_bytes(s, 12)
        assert extra == pytest.approx(t if s < 3 else 0.0)
    alone = dataclasses.replace(strat, mesh=Degrees(dp=8, tp=2))
    c1 = stage_costs(G22B, A100, alone)
    assert c1.stage_memory_bytes(0, 48) == dataclasses.replace(c1, backward_start_bytes=0.0).stage_memory_bytes(0, 48)


def test_torch_pipelining_keeps_the_last_stages_logits_until_their_backward():
    """``PipelineStage`` keeps each forward's output (the logits, compute dtype, / tp) until
    that micro-batch's backward: GPipe's last stage holds m of them at its peak, 1F1B's one;
    Megatron's pipeline, torch's zero-bubble (priced from its censuses) and no pipeline none."""
    torch_recipe = load_recipe("autopar")
    base = Strategy(recipe=torch_recipe, mesh=Degrees(dp=2, tp=2, pp=4), zero=1, micro_batch=2,
                    num_microbatches=8, schedule="gpipe")
    one = 2 * 2 * G22B.seq * G22B.vocab / 2
    assert memory.stage_output_bytes(G22B, base) == pytest.approx(8 * one)
    assert memory.stage_output_bytes(G22B, dataclasses.replace(base, schedule="1f1b")) == pytest.approx(one)
    for other in (dataclasses.replace(base, schedule="zero-bubble"), dataclasses.replace(base, recipe=MC),
                  dataclasses.replace(base, mesh=Degrees(dp=8, tp=2))):
        assert memory.stage_output_bytes(G22B, other) == 0.0
    c = stage_costs(G22B, A100, base)
    assert c.last_transient_bytes == pytest.approx(memory.loss_backward_bytes(G22B, base) + 8 * one)


def test_sequence_parallel_sums_partial_gradients_once_a_step():
    """Under SP the replicated parameters' gradients (norms, row-parallel biases: at most 4 h a
    block) are partial over tp and summed once a step, one coalesced all-reduce on the stages
    the step waits for: the dp time grows by exactly that collective, the same at 1 and 8
    micro-batches; nothing without SP or without tp."""
    cpu = load_profile("cpu-local")
    model = gpt(4, 128, 4, vocab=512, seq=512)
    auto = load_recipe("autopar")
    for m in (1, 8):
        base = Strategy(recipe=auto, mesh=Degrees(tp=4), micro_batch=1, num_microbatches=m, dtype="fp32")
        sp = dataclasses.replace(base, sequence_parallel=True)
        tp = comm.axis_groups(cpu, sp)[Axis.TP]
        sync = comm.all_reduce_s(4 * 128 * 4 * states.state_layout(sp).grad, tp)
        assert sync > 1e-3  # gloo: a few ms, latency-bound
        assert partial_grads_sync_s(model, sp, tp, comm.replica_group(cpu, sp)) == pytest.approx(sync)
        assert partial_grads_sync_s(model, base, tp, comm.replica_group(cpu, base)) == 0.0
        got = estimate(model, cpu, sp, global_batch=m).time.dp_comm_s
        assert got == pytest.approx(estimate(model, cpu, dataclasses.replace(sp, sequence_parallel=False),
                                             global_batch=m).time.dp_comm_s + sync)


def test_fsdp_reduces_sequence_parallel_partial_gradients_one_parameter_at_a_time():
    """Under FSDP2 (dp > 1) torch all-reduces each partial SP gradient to its parameter's tp
    placement before its own reduction: 4 all-reduces of h elements a block, every micro-batch
    under ZeRO-2/3 (in the pass), once a step under ZeRO 0/1 (in the tail); the coalesced
    once-a-step collective is then not priced; Megatron's recipe (plain tensors) keeps it."""
    cpu = load_profile("cpu-local")
    model = gpt(4, 128, 4, vocab=512, seq=512)
    auto = load_recipe("autopar")
    for zero in (0, 1, 2, 3):
        sp = Strategy(recipe=auto, mesh=Degrees(dp=2, tp=2), zero=zero, micro_batch=1, num_microbatches=4,
                      dtype="fp32", sequence_parallel=True)
        groups, rep = comm.axis_groups(cpu, sp), comm.replica_group(cpu, sp)
        per_block = fsdp_partial_grads_s(model, sp, groups[Axis.TP], rep)
        assert per_block == pytest.approx(4 * comm.all_reduce_s(128 * states.state_layout(sp).grad, groups[Axis.TP]))
        assert partial_grads_sync_s(model, sp, groups[Axis.TP], rep) == 0.0
        with_sp = estimate(model, cpu, sp, global_batch=8).time
        without = estimate(model, cpu, dataclasses.replace(sp, sequence_parallel=False), global_batch=8).time
        times = 4 if zero >= 2 else 1  # per micro-batch or per step
        assert with_sp.dp_comm_s - without.dp_comm_s == pytest.approx(times * model.layers * per_block, rel=1e-6)
    mc = Strategy(recipe=MC, mesh=Degrees(dp=2, tp=2), zero=1, micro_batch=1, num_microbatches=4,
                  dtype="fp32", sequence_parallel=True)
    groups, rep = comm.axis_groups(cpu, mc), comm.replica_group(cpu, mc)
    assert fsdp_partial_grads_s(model, mc, groups[Axis.TP], rep) == 0.0
    assert partial_grads_sync_s(model, mc, groups[Axis.TP], rep) > 0.0


def test_replicated_experts_under_sp_run_the_ranks_own_tokens():
    """autopar's runtime replicates the experts over tp (no expert TP): without SP every tp rank
    routes and computes all the micro-batch's tokens, under SP only its sequence shard, 1 / tp
    of them (``Strategy.moe_rows``). Expert TP (Megatron-Core) splits each expert's GEMMs
    whatever SP does."""
    from cost_models import memory
    moe = profile_spec(parse_model_spec("moe:layers=2,hidden=1024,heads=8,vocab=1024,seq=2048,experts=8,topk=2"))
    hw = load_profile("dgx-h100")
    own = Strategy(recipe=load_recipe("autopar"), mesh=Degrees(tp=4), micro_batch=1)
    shard = dataclasses.replace(own, sequence_parallel=True)
    assert (own.moe_rows, shard.moe_rows) == (1.0, 0.25)
    assert compute.expert_gemms(moe, shard)[0].m == pytest.approx(compute.expert_gemms(moe, own)[0].m / 4)
    assert compute.expert_gemm_s(moe, hw, shard) < compute.expert_gemm_s(moe, hw, own)  # the weights read alike
    assert compute.moe_traffic_bytes(moe, shard) == pytest.approx(compute.moe_traffic_bytes(moe, own) / 4)
    assert memory.expert_extra_act_bytes(moe, shard) == 0.0 < memory.expert_extra_act_bytes(moe, own)
    etp = dataclasses.replace(own, recipe=MC)
    assert dataclasses.replace(etp, sequence_parallel=True).moe_rows == etp.moe_rows == 1.0


def test_multi_query_tp_keeps_the_qkv_projection_whole():
    """One K,V head, which tp does not split: autopar's runtime keeps the K,V-making GEMMs
    whole on every tp rank, priced as a QKV packed in one GEMM (Falcon-7B's, GPT-BigCode's):
    its parameters whole on each rank, its GEMM as wide as one process's, and its gradients a
    partial sum reduced over tp. The solver plans tp for it under autopar's recipe only."""
    from autopar.solve.space import splits_heads
    mqa = profile_spec(parse_model_spec("llama:layers=2,hidden=1024,heads=8,kv_heads=1,ffn=2816,vocab=1024,seq=2048"))
    qkv = (8 + 2) * 128 * 1024
    one, four = Strategy(micro_batch=1), Strategy(mesh=Degrees(tp=4), micro_batch=1)
    assert states.whole_qkv_params(mqa, one) == 0 and states.whole_qkv_params(mqa, four) == qkv
    assert states.dense_layer_params(mqa, four) == pytest.approx((mqa.dense_block_params - qkv) / 4 + qkv)
    assert compute.block_gemms(mqa, four)[0][0].n == compute.block_gemms(mqa, one)[0][0].n == 10 * 128
    rep = comm.group(load_profile("dgx-h100"), 1)
    assert partial_grads_sync_s(mqa, four, comm.group(load_profile("dgx-h100"), 4), rep) > 0
    assert splits_heads(mqa, 4, load_recipe("autopar")) and not splits_heads(mqa, 4, MC)


def test_latent_attention_low_rank_projections_are_whole_under_tp():
    """DeepSeek's latent attention: the tracer labels ``q_a_proj`` and ``kv_a_proj_with_mqa``
    (a norm hands their output to a column GEMM) ``replicate``, and the cost model keeps their
    weights whole on every tp rank."""
    ds = profile_spec(parse_model_spec(
        "hf:DeepseekV3Config:first_k_dense_replace=1,hidden_size=256,intermediate_size=512,kv_lora_rank=32,"
        "q_lora_rank=48,qk_nope_head_dim=16,qk_rope_head_dim=8,v_head_dim=16,n_routed_experts=8,n_group=1,"
        "topk_group=1,num_experts_per_tok=2,moe_intermediate_size=64,num_attention_heads=4,num_key_value_heads=4,"
        "num_hidden_layers=3,"
        "vocab_size=1024,seq=64"))
    whole = 256 * 48 + 256 * (32 + 8)  # q_a_proj, kv_a_proj_with_mqa
    assert ds.block_tp_whole_params == whole and ds.lead is not None and ds.lead.block_tp_whole_params == whole
    one, four = Strategy(micro_batch=1), Strategy(mesh=Degrees(tp=4), micro_batch=1)
    assert states.dense_layer_params(ds, one) == ds.dense_block_params
    assert states.dense_layer_params(ds, four) == pytest.approx((ds.dense_block_params - whole) / 4 + whole)
    dense = ds.block_matmul_flops_per_token - ds.expert_flops_per_token  # each rank computes them whole
    assert compute.dense_flops_per_token(ds, one) == pytest.approx(dense)
    assert compute.dense_flops_per_token(ds, four) == pytest.approx((dense - 2 * whole) / 4 + 2 * whole)


def test_rows_an_all_to_all_brings_are_grouped_by_local_expert_and_back():
    """Under ep > 1 with several experts on a rank, the received rows are sorted by local expert
    after the dispatch and back to source order before the combine (Megatron's
    ``sort_chunks_by_idxs``, torchtitan's ``_permute``): twice the permutation bytes of ep = 1,
    or of one expert a rank."""
    moe = profile_spec(parse_model_spec("moe:layers=2,hidden=1024,heads=8,vocab=1024,seq=2048,experts=8,topk=2"))
    tokens, h, k = 2048, 1024, 2
    router = 12.0 * 8 * tokens
    for ep, passes in ((1, 4), (2, 8), (4, 8), (8, 4)):
        strat = Strategy(recipe=MC, mesh=Degrees(dp=8, ep=ep), micro_batch=1)
        assert compute.moe_traffic_bytes(moe, strat) == pytest.approx(router + passes * k * h * 2 * tokens)


def test_experts_the_models_code_runs_densely_are_priced_routed_under_a_frameworks_blocks():
    """A model whose code runs every expert on every token (``expert_copies`` = experts, HF's
    Llama 4) costs that under autopar's runtime, which runs the module; a framework building
    its own routed MLP runs top-k copies: its expert GEMMs are experts / topk times cheaper,
    their shapes those of routed rows, and model FLOPs count top-k either way."""
    h, f, e = 1024, 2048, 16
    routed = dataclasses.replace(gpt(2, h, 8, seq=2048), experts=e, topk=1, expert_ffn=f, expert_copies=1.0,
                                 expert_params=e * 3 * h * f, expert_flops_per_token=2.0 * 3 * h * f)
    extra = (e - 1) * 6.0 * h * f  # the other experts' GEMMs on every token
    dense = dataclasses.replace(routed, expert_copies=float(e), expert_flops_per_token=e * 2.0 * 3 * h * f,
                                block_matmul_flops_per_token=routed.block_matmul_flops_per_token + extra)
    hw = load_profile("dgx-h100")
    te = Strategy(recipe=load_recipe("megatron-core-te"), micro_batch=1)
    own = Strategy(recipe=load_recipe("autopar"), micro_batch=1)
    assert compute.expert_gemm_s(dense, hw, te) == pytest.approx(compute.expert_gemm_s(routed, hw, te))
    assert compute.expert_gemms(dense, te) == compute.expert_gemms(routed, te)
    # 16x the FLOPs, in GEMMs of 2,048 rows rather than 128 (which read the same weights)
    assert compute.expert_gemm_s(dense, hw, own) > 4 * compute.expert_gemm_s(routed, hw, own)
    assert [g.m for g in compute.expert_gemms(dense, own)] == [2048, 2048]  # every expert, every token
    assert dense.model_flops_per_token() == pytest.approx(routed.model_flops_per_token())


def test_the_grouped_gemms_gpu_kernels_times_are_those_the_model_prices():
    """``benchmarks/gpu_kernels.py`` times the published MoE runs' grouped GEMMs (``GROUPED``)
    and compares them with ``compute.gemm_s``: for GPT-OSS 120B's H100 row (EP 8, 16 local
    experts, 4,096 tokens of top-4 copies) its shapes are those ``expert_gemms`` prices, and
    the timing code runs (on CPU here, tiny)."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import gpu_kernels
    local, rows, h, up, f = gpu_kernels.GROUPED["gpt-oss-120b h100 ep8 mbs1"]
    oss = dataclasses.replace(gpt(2, h, 64, seq=4096), experts=128, topk=4, expert_ffn=f, expert_copies=4.0,
                              expert_params=128 * 3 * h * f, expert_flops_per_token=4 * 2.0 * 3 * h * f)
    strat = Strategy(recipe=load_recipe("megatron-core-te"), mesh=Degrees(dp=16, ep=8), micro_batch=1)
    assert compute.expert_gemms(oss, strat) == [compute.Gemm(batch=local, m=rows, n=up, k=h),
                                                compute.Gemm(batch=local, m=rows, n=h, k=f)]
    hw = load_profile("dgx-h100")
    priced = compute.expert_gemm_s(oss, hw, strat)
    assert gpu_kernels.grouped_predicted(local, rows, h, up, f, hw)[0] == pytest.approx(priced)
    runs = []
    fwd, bwd = gpu_kernels.grouped_times(2, 8, 16, 32, 16, device="cpu", time=lambda fn: runs.append(fn) or 1.0)
    assert (fwd, bwd) == (1.0, 0.0) and len(runs) == 2
    for fn in runs:
        fn()
