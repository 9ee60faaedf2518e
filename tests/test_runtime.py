"""Runtime parity on gloo: every parallel dimension and their compositions train exactly like
one process (same seed, same global batch), losses and final weights.

Tolerances. Each plan sums the same float32 products in another order (sharded matmuls,
all-reduces, micro-batch accumulation), so values differ by float32 rounding: a few ulps of
the loss (|Δ| ≈ 1e-7 on ~4.9; we allow 2e-6). Weights after 3 AdamW steps of lr 1e-3 agree
within 1e-4, 10 % of one step. Adam's first step is lr·g/(|g| + ε), ε = 1e-8: an entry whose
gradient is near ε carries the gradient's relative rounding error into a step of size ~lr
(measured worst: 5.5e-5, one of 16384 entries of HF GPT-2's last c_proj under TP, whose first
gradient is 2.9e-9 against a median of 1.3e-3; every other entry is within 8e-6). A missing or
doubled reduction moves weights by ~lr. A gradient that is exactly zero in exact arithmetic (the key
bias: softmax is invariant to it) becomes noise ÷ noise, an O(lr) step in a random direction:
those entries are compared with 5 lr. bf16 plans (FSDP2's MixedPrecisionPolicy, or autocast
without FSDP2) are compared with the fp32 run: loss within 5e-2, weights within 5 lr.

The same path trains the built-in models and HF transformers models (Llama, GPT-2), their
tensor-parallel layout read off the tracer's graph. Plans of one world size share one torchrun job (start-up is paid once): 4 processes for the
1-D and 2-D plans, 8 for the 3-D ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autopar.plan import Mesh, Plan
from autopar.runtime import RunResult, RunSpec, TrainConfig, run_job
from autopar.runtime.context import ParallelContext
from autopar.runtime.train import build_program, synthetic_batch, train, train_step
from autopar.runtime.state import full_state
from parity import HF_GLM4_MOE, dumped, hf_deepseek_v3

GPT = "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=16,tied=0"
GPT_TIED = "gpt:layers=4,hidden=64,heads=4,vocab=131,seq=16,tied=1"  # odd, like GPT-2's 50257: uneven vocab shards
LLAMA = "llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"
HF_LLAMA = ("hf:LlamaConfig:num_hidden_layers=4,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
            "intermediate_size=96,vocab_size=128,seq=16")
# GPT-2 with its dropouts off (a dropout mask cannot match across layouts); tied head.
HF_GPT2 = "hf:GPT2Config:n_layer=4,n_embd=64,n_head=4,vocab_size=128,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0,seq=16"
# Two more HF families: Gemma (√h-scaled embedding buffer, 1 + w norms, tied head) and Phi
# (attention and MLP in parallel off one LayerNorm, partial rotary, biases everywhere).
HF_GEMMA = ("hf:GemmaConfig:num_hidden_layers=4,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
            "head_dim=16,intermediate_size=96,vocab_size=128,seq=16")
HF_PHI = ("hf:PhiConfig:num_hidden_layers=4,hidden_size=64,num_attention_heads=4,intermediate_size=96,"
          "vocab_size=128,resid_pdrop=0,embd_pdrop=0,attention_dropout=0,seq=16")
# Falcon's attention calls SDPA itself (not through transformers' AttentionInterface), its
# dropouts off.
HF_FALCON = ("hf:FalconConfig:num_hidden_layers=4,hidden_size=64,num_attention_heads=4,vocab_size=128,"
             "new_decoder_architecture=True,num_kv_heads=2,attention_dropout=0,hidden_dropout=0,seq=16")
# Bloom: ALiBi built by the model for every head (each rank takes its heads' slice).
HF_BLOOM = ("hf:BloomConfig:n_layer=4,hidden_size=64,n_head=4,vocab_size=128,hidden_dropout=0,"
            "attention_dropout=0,seq=16")
# OPT flattens its tokens to [b·s, h] around the MLP (sequence shards of dim -2).
HF_OPT = ("hf:OPTConfig:num_hidden_layers=4,hidden_size=64,num_attention_heads=4,ffn_dim=96,vocab_size=128,"
          "word_embed_proj_dim=64,dropout=0,attention_dropout=0,activation_dropout=0,seq=16")
# Gemma 2 soft-caps its attention logits: HF runs its own eager attention function.
HF_GEMMA2 = ("hf:Gemma2Config:num_hidden_layers=4,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
             "head_dim=16,intermediate_size=96,vocab_size=128,seq=16")
# Qwen3 norms each query and key head (q_norm, k_norm: one head's width, shared by the heads).
HF_QWEN3 = ("hf:Qwen3Config:num_hidden_layers=4,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
            "head_dim=16,intermediate_size=96,vocab_size=128,seq=16")
# OLMo 2 norms q and k across all their heads (RMS over the whole projection: reduced over
# the tp ranks) and has no pre-norms (SP gathers each sub-layer's input where it is called).
HF_OLMO2 = ("hf:Olmo2Config:num_hidden_layers=4,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
            "intermediate_size=96,vocab_size=128,seq=16")
# GPT-OSS: an attention sink per head (a parameter the attention holds, sliced per tp rank),
# experts, alternating sliding-window layers.
HF_GPT_OSS = ("hf:GptOssConfig:num_hidden_layers=4,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
              "head_dim=16,intermediate_size=96,num_local_experts=4,vocab_size=128,seq=16")
# Multi-query attention (one K,V head, which tp does not split): Falcon-7B's Q, K, V cut by a
# view of one GEMM, GPT-BigCode's packed c_attn; the K,V-making GEMMs stay whole on every rank.
HF_FALCON_MQA = ("hf:FalconConfig:num_hidden_layers=4,hidden_size=64,num_attention_heads=4,vocab_size=128,"
                 "attention_dropout=0,hidden_dropout=0,seq=16")
# DeepSeek-V3: latent attention (low-rank q_a_proj, kv_a_proj_with_mqa kept whole on every tp
# rank, the RoPE key's gradient summed over them), one leading dense block, MoE blocks.
HF_DEEPSEEK_V3 = hf_deepseek_v3(layers=4, lead=1)
HF_BIGCODE = ("hf:GPTBigCodeConfig:n_layer=4,n_embd=64,n_head=4,n_inner=96,vocab_size=128,resid_pdrop=0,"
              "embd_pdrop=0,attn_pdrop=0,seq=16")
STEPS = 3
LOSS_TOL = 2e-6
PARAM_TOL = 1e-4
BF16_LOSS_TOL = 5e-2  # bf16 keeps 8 mantissa bits (~4e-3 relative per op); measured |Δloss| ≤ 2e-2
ZERO_GRAD_PARAMS = ("attn.k.bias",)  # softmax(q kᵀ) does not depend on the key bias
LR = TrainConfig().lr


def make_plan(model: str, *, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, mbs: int = 2,
              m: int = 2, schedule: str = "1f1b", v: int = 1, sp: bool = False, recompute: str = "none",
              layers: tuple[int, ...] | None = None, dtype: str = "fp32", offload: bool = False,
              order: tuple[str, ...] = ("pp", "dp", "tp")) -> Plan:
    stages = pp * v
    return Plan(model=model, cluster="cpu-local", gpus=dp * tp * pp, global_batch=dp * mbs * m, seq_len=16,
                dtype=dtype, mesh=Mesh(dp=dp, tp=tp, pp=pp), zero_stage=zero, micro_batch_size=mbs,
                num_microbatches=m, schedule=schedule, virtual_stages=v, sequence_parallel=sp,
                stage_layers=layers or (4 // stages,) * stages, recompute=(recompute,) * 4, offload=offload,
                axis_order=order)


# name -> plan; every plan of a model has global batch 8.
PLANS_4 = {
    "gpt ddp": make_plan(GPT, dp=4, mbs=1, m=2),
    "gpt zero1 selective": make_plan(GPT, dp=4, zero=1, mbs=2, m=1, recompute="selective"),
    "gpt fsdp zero2": make_plan(GPT, dp=4, zero=2, mbs=1, m=2),
    "gpt fsdp zero3 full recompute": make_plan(GPT, dp=4, zero=3, mbs=2, m=1, recompute="full"),
    "gpt fsdp zero3 cpu offload": make_plan(GPT, dp=4, zero=3, mbs=1, m=2, offload=True),
    "gpt fsdp zero2 bf16": make_plan(GPT, dp=4, zero=2, mbs=1, m=2, dtype="bf16"),
    "gpt tp2 x dp2 bf16 autocast": make_plan(GPT, tp=2, dp=2, mbs=2, m=2, dtype="bf16"),
    "gpt tp4": make_plan(GPT, tp=4, mbs=4, m=2),
    "gpt tp2 sp x dp2": make_plan(GPT, tp=2, dp=2, sp=True, mbs=2, m=2),
    "gpt pp4 1f1b non-uniform": make_plan(GPT, pp=4, mbs=2, m=4, layers=(1, 1, 1, 1)),
    "gpt pp2 gpipe x dp2 zero1 offload, dp outermost": make_plan(
        GPT, pp=2, dp=2, zero=1, mbs=1, m=4, schedule="gpipe", layers=(1, 3), offload=True, order=("dp", "pp", "tp")),
    "gpt pp2 interleaved v2 x dp2 zero2": make_plan(GPT, pp=2, dp=2, zero=2, mbs=1, m=4,
                                                     schedule="interleaved", v=2),
    "gpt pp2 zero-bubble x dp2 zero2": make_plan(GPT, pp=2, dp=2, zero=2, mbs=2, m=2, schedule="zero-bubble"),
    "gpt tied pp2 x dp2 zero3": make_plan(GPT_TIED, pp=2, dp=2, zero=3, mbs=2, m=2, layers=(3, 1)),
    "gpt pp2 x tp2 sp": make_plan(GPT, pp=2, tp=2, sp=True, mbs=2, m=4),
    "llama tp2 sp x dp2 zero3 full": make_plan(LLAMA, tp=2, dp=2, zero=3, sp=True, mbs=2, m=2, recompute="full"),
    "llama tp2 sp x dp2 zero3 per-op recompute": make_plan(LLAMA, tp=2, dp=2, zero=3, sp=True, mbs=2, m=2,
                                                           recompute="op"),
    "gpt pp2 x tp2 per-op recompute": make_plan(GPT, pp=2, tp=2, mbs=2, m=4, recompute="op"),
    "llama pp2 zero-bubble x dp2 ddp-like": make_plan(LLAMA, pp=2, dp=2, mbs=1, m=4, schedule="zero-bubble"),
    "llama pp2 zero-bubble x dp2 full recompute": make_plan(LLAMA, pp=2, dp=2, mbs=1, m=4, schedule="zero-bubble",
                                                            recompute="full"),
    "llama pp4 interleaved v1 selective": make_plan(LLAMA, pp=4, mbs=2, m=4, schedule="interleaved",
                                                    recompute="selective"),
    "gpt tied tp2 x dp2 zero1": make_plan(GPT_TIED, tp=2, dp=2, zero=1, mbs=1, m=4),
    "hf llama tp2 x dp2 zero3 selective": make_plan(HF_LLAMA, tp=2, dp=2, zero=3, mbs=2, m=2, recompute="selective"),
    "hf llama tp2 sp x dp2 zero1": make_plan(HF_LLAMA, tp=2, dp=2, zero=1, sp=True, mbs=1, m=4),
    "hf llama pp2 interleaved x dp2 zero2": make_plan(HF_LLAMA, pp=2, dp=2, zero=2, mbs=1, m=4,
                                                      schedule="interleaved", v=2),
    "hf llama pp4 full recompute": make_plan(HF_LLAMA, pp=4, mbs=2, m=4, recompute="full"),
    "hf llama dp4 zero2 per-op recompute": make_plan(HF_LLAMA, dp=4, zero=2, mbs=2, m=1, recompute="op"),
    "hf gpt2 tied pp2 x tp2 full recompute": make_plan(HF_GPT2, pp=2, tp=2, mbs=2, m=4, layers=(1, 3),
                                                       recompute="full"),
    "hf gpt2 tp2 sp x dp2 zero2": make_plan(HF_GPT2, tp=2, dp=2, zero=2, sp=True, mbs=1, m=4),
    "hf gemma tp2 sp x dp2 zero3": make_plan(HF_GEMMA, tp=2, dp=2, zero=3, sp=True, mbs=2, m=2),
    "hf phi pp2 x tp2 sp": make_plan(HF_PHI, pp=2, tp=2, sp=True, mbs=2, m=4),
    "hf bloom tp2 sp x dp2 zero1 selective": make_plan(HF_BLOOM, tp=2, dp=2, zero=1, sp=True, mbs=2, m=2,
                                                       recompute="selective"),
    "hf opt tp2 sp x dp2 zero2": make_plan(HF_OPT, tp=2, dp=2, zero=2, sp=True, mbs=2, m=2),
    "hf gemma2 tp2 x dp2 zero3 selective": make_plan(HF_GEMMA2, tp=2, dp=2, zero=3, mbs=2, m=2,
                                                      recompute="selective"),
    "hf qwen3 tp2 sp x dp2 zero3": make_plan(HF_QWEN3, tp=2, dp=2, zero=3, sp=True, mbs=2, m=2),
    "hf olmo2 tp2 sp x dp2 zero2": make_plan(HF_OLMO2, tp=2, dp=2, zero=2, sp=True, mbs=2, m=2),
    "hf gpt-oss tp2 x dp2 zero3": make_plan(HF_GPT_OSS, tp=2, dp=2, zero=3, mbs=2, m=2),
    # the attention function's recompute reads the rank's slice of the sinks; a checkpoint's
    # recompute stopped early leaves the experts' weights whole for the next micro-batch
    # (benchmarks/hf_compositions.py found both)
    "hf gpt-oss tp2 x dp2 zero1 selective": make_plan(HF_GPT_OSS, tp=2, dp=2, zero=1, mbs=2, m=2,
                                                      recompute="selective"),
    "hf gpt-oss pp2 x tp2 sp full recompute": make_plan(HF_GPT_OSS, pp=2, tp=2, sp=True, mbs=2, m=4,
                                                        recompute="full"),
    "hf falcon mqa tp2 x dp2 zero3": make_plan(HF_FALCON_MQA, tp=2, dp=2, zero=3, mbs=2, m=2),
    # Falcon's blocks return tuples: the last stage's gather of whole sequences takes the first
    # (benchmarks/hf_compositions.py found it crashing)
    "hf falcon mqa pp2 x tp2 sp selective": make_plan(HF_FALCON_MQA, pp=2, tp=2, sp=True, mbs=2, m=4,
                                                       recompute="selective"),
    "hf gpt-bigcode mqa tp2 sp x dp2": make_plan(HF_BIGCODE, tp=2, dp=2, sp=True, mbs=2, m=2),
    "hf glm4-moe dense lead tp2 sp x dp2 zero3": make_plan(HF_GLM4_MOE, tp=2, dp=2, zero=3, sp=True, mbs=2, m=2),
    "hf deepseek-v3 mla tp2 x dp2 zero2": make_plan(HF_DEEPSEEK_V3, tp=2, dp=2, zero=2, mbs=2, m=2),
    "hf deepseek-v3 mla tp2 sp x dp2 zero3 selective": make_plan(HF_DEEPSEEK_V3, tp=2, dp=2, zero=3, sp=True,
                                                                 mbs=2, m=2, recompute="selective"),
    "hf glm4-moe dense lead pp2 x tp2 full recompute": make_plan(HF_GLM4_MOE, pp=2, tp=2, mbs=2, m=4,
                                                                 layers=(2, 2), recompute="full"),
}
PLANS_8 = {
    "gpt tied 3d pp2 dp2 tp2 sp zero2, pp innermost": make_plan(GPT_TIED, pp=2, dp=2, tp=2, sp=True, zero=2, mbs=1, m=4,
                                                                order=("tp", "dp", "pp")),
    "llama 3d pp2 dp2 tp2 zero1 interleaved": make_plan(LLAMA, pp=2, dp=2, tp=2, zero=1, mbs=2, m=2,
                                                        schedule="interleaved", v=2),
    "hf llama 3d pp2 dp2 tp2 sp zero2 1f1b": make_plan(HF_LLAMA, pp=2, dp=2, tp=2, zero=2, sp=True, mbs=1, m=4),
}


def reference(model: str, steps: int = STEPS) -> tuple[RunResult, dict[str, torch.Tensor]]:
    """One process, whole model, the global batch of 8 in one micro-batch."""
    plan = make_plan(model, mbs=8, m=1)
    ctx = ParallelContext(mesh=None, device=torch.device("cpu"))
    prog = build_program(plan, ctx)
    result = train(plan, steps, ctx, program=prog)
    return result, full_state(prog)


@pytest.fixture(scope="module")
def references():
    return {m: reference(m) for m in sorted({p.model for p in (*PLANS_4.values(), *PLANS_8.values())})}


def _run(plans: dict[str, Plan], tmp: Path) -> dict[str, tuple[RunResult, dict[str, torch.Tensor]]]:
    results = run_job([RunSpec(plan=p, steps=STEPS, dump=True) for p in plans.values()], workdir=tmp,
                      timeout_s=900)
    return {name: (result, dumped(tmp, f"run{i}.final")) for i, (name, result) in enumerate(zip(plans, results))}


@pytest.fixture(scope="module")
def runs_4(tmp_path_factory):
    return _run(PLANS_4, tmp_path_factory.mktemp("world4"))


@pytest.fixture(scope="module")
def runs_8(tmp_path_factory):
    return _run(PLANS_8, tmp_path_factory.mktemp("world8"))


def _assert_parity(name: str, plan: Plan, run, references) -> None:
    (result, state), (ref, ref_state) = run, references[plan.model]
    low = plan.dtype != "fp32"
    assert plan.global_batch == 8, f"{name}: the reference trains on a global batch of 8"
    assert len(result.losses) == STEPS and len(result.step_times_s) == STEPS
    for step, (got, want) in enumerate(zip(result.losses, ref.losses)):
        assert abs(got - want) <= (BF16_LOSS_TOL if low else LOSS_TOL), f"{name}: step {step} loss {got} vs {want}"
    assert state.keys() == ref_state.keys(), f"{name}: parameters differ in names"
    for key, want in ref_state.items():
        tol = 5 * LR if key.endswith(ZERO_GRAD_PARAMS) or low else PARAM_TOL
        err = (state[key] - want).abs().max().item()
        assert err <= tol, f"{name}: {key} differs by {err:.3g} (tolerance {tol:g})"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS_4))
def test_parity_world_4(name, runs_4, references):
    _assert_parity(name, PLANS_4[name], runs_4[name], references)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS_8))
def test_parity_world_8(name, runs_8, references):
    _assert_parity(name, PLANS_8[name], runs_8[name], references)


def test_reference_learns():
    """The synthetic task is learnable, so equal losses are not trivially equal: repeating one
    batch, the loss falls."""
    plan = make_plan(GPT, mbs=8, m=1)
    ctx = ParallelContext(mesh=None, device=torch.device("cpu"))
    prog = build_program(plan, ctx, TrainConfig(lr=1e-2))
    losses = [train_step(prog, 0, TrainConfig(lr=1e-2)) for _ in range(10)]
    assert losses[-1] < losses[0] - 1.0


def test_hf_buffers_are_hf_values():
    """``to_empty`` leaves buffers uninitialised: each HF stage gets HF's values (RoPE
    frequencies, Gemma's √h embedding scale — garbage there made every logit ~0), on any stage."""
    import transformers
    gemma = HF_GEMMA
    ctx = ParallelContext(mesh=None, device=torch.device("cpu"))
    (stage,) = build_program(make_plan(gemma, mbs=8, m=1), ctx).modules
    config = transformers.GemmaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=128)
    fresh = transformers.GemmaForCausalLM(config)
    want = dict(fresh.named_buffers())
    assert want.keys() == dict(stage.named_buffers()).keys() and want
    for name, buf in stage.named_buffers():
        assert torch.equal(buf, want[name]), name
    x, y = synthetic_batch(make_plan(gemma, mbs=8, m=1), 0, 0)
    assert stage(x).std() > 1e-3


def test_failure_on_a_rank_is_one_line(tmp_path, monkeypatch):
    """A plan the runtime refuses fails on every rank with one line naming the fix and the kept
    run directory: each rank's traceback (rank<R>.err) and its own stderr file (torchrun's
    --log-dir/--redirects), so two ranks' messages are never spliced into one line."""
    import re
    import tempfile
    from autopar.errors import UserError
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    bad = make_plan(GPT, pp=2, dp=2, zero=3, mbs=1, m=2, schedule="zero-bubble")
    with pytest.raises(UserError, match="zero-bubble schedule does not compose with ZeRO-3") as err:
        run_job([RunSpec(plan=bad, steps=1)], timeout_s=300)
    message = str(err.value)
    assert "\n" not in message
    assert re.match(r"the run failed: rank \d: ValueError: ", message), message
    kept = Path(message.rpartition("; rank logs and tracebacks in ")[2])
    assert kept.parent == tmp_path and kept.is_dir()
    for rank in range(4):
        assert "Traceback" in (kept / f"rank{rank}.err").read_text()
        [stderr] = kept.glob(f"logs/*/attempt_0/{rank}/stderr.log")
        assert stderr.read_text().startswith(f"autopar: rank {rank}: ValueError: the zero-bubble")
    assert (kept / "run.log").is_file()


def test_a_rank_killed_without_a_report_is_named(tmp_path):
    """No rank reported (killed by a signal, e.g. out of memory): the rank torchrun names as the
    root cause, how it ended, and the last line it wrote."""
    from autopar.runtime.launch import _first_error
    logs = tmp_path / "logs" / "job_x"
    for rank, text in ((0, "step 0\n"), (1, "loading stage 1\n=====\n")):
        (logs / "attempt_0" / str(rank)).mkdir(parents=True)
        (logs / "attempt_0" / str(rank) / "stderr.log").write_text(text)
    log = ("Failures:\n[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 11)\n"
           "Root Cause (first observed failure):\n[0]:\n  time      : now\n  rank      : 1 (local_rank: 1)\n"
           "  exitcode  : -9 (pid: 12)\n============\n")
    assert _first_error(tmp_path, logs, log) == "rank 1 killed by signal 9: loading stage 1"
    assert _first_error(tmp_path, None, "torchrun: bad flag\n=====\n") == "torchrun: bad flag"
    # A rank SIGKILLed without a report, the others failing on their lost connection (which
    # torchrun may call the root cause): the kill comes first, then the first report.
    (logs / "attempt_0" / "0" / "stderr.log").write_text("autopar: rank 0: RuntimeError: Connection reset by peer\n")
    log = ("Failures:\n[1]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 12)  (SIGKILL)\n"
           "Root Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 11)\n")
    assert _first_error(tmp_path, logs, log) == ("rank 1 killed by signal 9 (SIGKILL); then rank 0: RuntimeError: "
                                                 "Connection reset by peer")


def test_rank_report_is_the_first_meaningful_line():
    """BaseExceptions are reported too; DCP's CheckpointException by the exception it wraps;
    lines of punctuation only (rules of '=') are skipped."""
    from torch.distributed.checkpoint.api import CheckpointException
    from autopar.runtime.worker import report
    wrapped = CheckpointException("load", {0: (FileNotFoundError("no __0.metadata"), None)})
    assert report(wrapped, 3) == "rank 3: CheckpointException: FileNotFoundError: no __0.metadata"
    assert report(RuntimeError("\n=====\n  --- \nthe cause\nmore"), 0) == "rank 0: RuntimeError: the cause"
    assert report(KeyboardInterrupt(), 1) == "rank 1: KeyboardInterrupt: KeyboardInterrupt"


@pytest.mark.slow
def test_resume_on_other_plans(tmp_path, references):
    """Train 4 steps on dp2 x tp2, save; resume on pp2 x dp2 and on one process: the weights
    after load equal the saved ones bit for bit, and step 5's loss is the uninterrupted run's."""
    ckpt = tmp_path / "ckpt"
    saver = make_plan(GPT_TIED, dp=2, tp=2, mbs=2, m=2)
    [saved] = run_job([RunSpec(plan=saver, steps=4, save=ckpt, dump=True),
                       RunSpec(plan=make_plan(GPT_TIED, pp=2, dp=2, zero=3, mbs=2, m=2, layers=(3, 1)),
                               steps=1, resume=ckpt, dump=True)], workdir=tmp_path, timeout_s=900)[:1]
    [single] = run_job([RunSpec(plan=make_plan(GPT_TIED, mbs=8, m=1), steps=1, resume=ckpt, dump=True)],
                       workdir=tmp_path / "one", timeout_s=300)
    uninterrupted = reference(GPT_TIED, steps=5)[0].losses
    assert saved.losses == pytest.approx(uninterrupted[:4], abs=LOSS_TOL)
    before = dumped(tmp_path, "run0.final")
    for where, name in ((tmp_path, "run1.loaded"), (tmp_path / "one", "run0.loaded")):
        after = dumped(where, name)
        assert after.keys() == before.keys()
        for key, value in before.items():
            assert torch.equal(after[key], value), f"{name}: {key} changed in save/load"
    resumed = json.loads((tmp_path / "result.json").read_text())["runs"][1]
    assert resumed["start_step"] == 4 and single.start_step == 4
    assert abs(resumed["losses"][0] - uninterrupted[4]) <= LOSS_TOL
    assert abs(single.losses[0] - uninterrupted[4]) <= LOSS_TOL


def test_refusals_name_the_fix():
    """What the runtime cannot run is refused before any process starts, naming the fix."""
    from autopar.runtime.context import check_plan
    with pytest.raises(ValueError, match="--zero 2"):
        check_plan(make_plan(GPT, pp=2, dp=2, zero=3, mbs=1, m=2, schedule="zero-bubble"))
    # torch's selective checkpointing raises "Trying to backward an extra time" under the
    # zero-bubble schedule's split backward (measured): refused, and never planned.
    with pytest.raises(ValueError, match="zero-bubble schedule, which backpropagates through a block twice"):
        check_plan(make_plan(GPT, pp=2, dp=2, zero=2, mbs=2, m=2, schedule="zero-bubble", recompute="op"))


@pytest.mark.parametrize("model", [LLAMA, HF_LLAMA, HF_FALCON, HF_GEMMA2, HF_BLOOM])
def test_recompute_keeps_fewer_activations(model):
    """What autograd keeps for backward (one forward, bytes per storage): selective drops the
    attention core's tensors, per-op recompute keeps every second GEMM's output and the
    attention's, full keeps only each block's input. (Per-op and Bloom's selective recompute
    keep their outputs in their own cache, which saved-tensor hooks do not see: the hooks
    count the checkpointed modules' inputs.) Every mode computes the same logits. A fused
    kernel (SDPA) keeps no s x s tensor, so selective keeps about what none does: the
    log-sum-exp less, and under Falcon's fused QKV the whole projection output, of which the
    checkpointed V is a view, more (0.9 %)."""
    ctx = ParallelContext(mesh=None, device=torch.device("cpu"))
    x, _ = synthetic_batch(make_plan(model, mbs=8, m=1), 0, 0)
    kept, logits = {}, {}
    for mode in ("none", "selective", "full", "op"):
        (module,) = build_program(make_plan(model, mbs=8, m=1, recompute=mode), ctx).modules
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits[mode] = module(x)
        kept[mode] = sum(seen.values())
    eager_core = model in (HF_GEMMA2, HF_BLOOM)  # QKᵀ, softmax and AV as ops of their own
    assert kept["full"] < kept["selective"] < (kept["none"] if eager_core else 1.01 * kept["none"])
    assert kept["op"] == kept["full"]
    for mode in ("selective", "full", "op"):
        assert torch.equal(logits[mode], logits["none"]), mode


@pytest.mark.parametrize("model", [LLAMA, GPT, HF_LLAMA])
def test_per_op_recompute_keeps_what_the_cost_model_prices(model, monkeypatch):
    """The outputs the per-op policy keeps in one forward (every second GEMM's, the attention
    kernel's and its log-sum-exp), counted per storage, are what ``cost_models.memory`` prices
    for ``op`` beyond a block's input (fp32: 4 bytes per element)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from autopar.runtime import parallelize
    from autopar.spec import parse_model_spec
    from autopar.trace import profile_spec
    from cost_models import Strategy
    from cost_models.memory import block_act_bytes
    from cost_models.recipe import load_recipe
    kept: dict[int, int] = {}
    inner = parallelize._per_op_policy

    def recording():
        policy = inner()

        def record(ctx, func, *args, **kwargs):
            decision = policy(ctx, func, *args, **kwargs)
            if decision == CheckpointPolicy.MUST_SAVE:
                for t in torch.utils._pytree.tree_leaves(ctx.op_output):
                    if isinstance(t, torch.Tensor):
                        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return decision
        return record

    monkeypatch.setattr(parallelize, "_per_op_policy", recording)
    plan = make_plan(model, mbs=8, m=1, recompute="op")
    ctx = ParallelContext(mesh=None, device=torch.device("cpu"))
    (module,) = build_program(plan, ctx).modules
    x, _ = synthetic_batch(plan, 0, 0)
    module(x)
    profile = profile_spec(parse_model_spec(model))
    strat = Strategy(micro_batch=8, recompute="op", dtype="fp32", recipe=load_recipe("autopar"))
    priced = profile.layers * (block_act_bytes(profile, strat, "op") - block_act_bytes(profile, strat, "full"))
    assert sum(kept.values()) == pytest.approx(priced, rel=0.02)


def test_single_device_benchmark_runs_on_cpu():
    """benchmarks/single_device.py (the GPU MFU and peak-memory check) runs the same path here."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "single_device.py"), "--cluster", "cpu-local",
                           "--model", "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16", "--global-batch", "8",
                           "--dtype", "fp32", "--steps", "3"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "measured/predicted" in proc.stdout and "MFU: predicted" in proc.stdout


def test_partial_gradients_are_summed_once_per_group_before_the_optimizer(monkeypatch):
    """Sequence parallelism leaves replicated parameters' gradients ``Partial`` where no
    data-parallel wrapper reduces them; AdamW would then all-reduce each one twice a step.
    ``_reduce_partial_grads`` sums them in one all-reduce per (mesh, placements, dtype) group
    and hands the optimizer replicated gradients of the same values; other gradients are left
    as they are."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from autopar.runtime import train as train_mod

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        module = torch.nn.Module()
        values = {}
        for name, shape, dtype, grad_placement in (("norm_w", (8,), torch.float32, Partial()),
                                                    ("norm_b", (8,), torch.float32, Partial()),
                                                    ("bias64", (4,), torch.float64, Partial()),
                                                    ("col", (6, 8), torch.float32, Shard(0))):
            param = torch.nn.Parameter(DTensor.from_local(torch.zeros(shape, dtype=dtype), mesh,
                                                          [Shard(0) if name == "col" else Replicate()]))
            values[name] = torch.arange(param.numel(), dtype=dtype).reshape(shape) + 1
            param.grad = DTensor.from_local(values[name].clone(), mesh, [grad_placement])
            module.register_parameter(name, param)
        calls = []
        real = dist.all_reduce
        monkeypatch.setattr(train_mod.dist, "all_reduce", lambda t, **kw: calls.append(t.numel()) or real(t, **kw))
        train_mod._reduce_partial_grads(SimpleNamespace(modules=[module]))
        assert sorted(calls) == [4, 16]  # the two fp32 norms' 16 elements in one call, the fp64 bias in another
        for name, param in module.named_parameters():
            grad = param.grad
            assert isinstance(grad, DTensor)
            assert list(grad.placements) == ([Shard(0)] if name == "col" else [Replicate()])
            assert torch.equal(grad.to_local(), values[name]) and grad.dtype == values[name].dtype
    finally:
        dist.destroy_process_group()
