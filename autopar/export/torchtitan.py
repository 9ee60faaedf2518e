"""torchtitan: a config module for torchtitan's main branch (``COMMIT``).

torchtitan's main branch (no release since 0.2.2 has it) describes a job as a Python function
returning ``Trainer.Config`` (selected with ``--module <module> --config <function>``;
``--section.key`` flags override it). The export is such a module: the model (torchtitan's
Llama 3 decoder at the plan's shape) and ``TrainingConfig``/``ParallelismConfig``/activation
checkpointing written as literal keyword arguments, so that ``parse`` reads them back with
``ast``.

Mapping: ZeRO 0 is ``data_parallel_replicate_degree`` (FSDP2 over a one-rank shard mesh: DDP),
ZeRO 2/3 ``data_parallel_shard_degree`` with ``fsdp_reshard_after_forward`` never/always;
stages are explicit ``module_fqns_per_model_part``. torchtitan counts tokens, not sequences
(its batch dimension folded into the tokens since pytorch/torchtitan#4121, 2026-08-20): a
micro-batch of b sequences is ``num_tokens_per_microbatch_per_dp_rank`` = b x seq tokens with
``max_context_length`` = seq (positions restart there, and attention with them: the same
b causal sequences), a step ``num_tokens_per_train_step`` = global batch x seq tokens; with a
pipeline the micro-batches are ``num_pp_microbatches``, without it gradient-accumulation
steps, which torchtitan derives from the step's tokens.

Per-op recompute (``op``) is torchtitan's ``SelectiveAC`` (every second matmul's output and
the attention's kept). What it cannot express: ZeRO-1 (FSDP2 always shards gradients), fp16,
autopar's selective recompute (the attention core only; torchtitan's selective AC is per-op),
per-block recompute mixes, mesh orders other than pp > dp > cp > tp, and
blocks other than Llama's (RMSNorm, SwiGLU, RoPE) and Qwen3's (its q/k norms and head width:
``_build_qwen3_layers``). An HF Llama or Mistral keeps its RoPE base and Llama 3 scaling (autopar's
own ``llama:`` presets get Llama 3.1's); its sliding windows are a gap priced as the same model
without them (torchtitan's Llama 3 attends causally over the whole sequence).

A mixture of experts is torchtitan's Qwen3 MoE decoder (``torchtitan.models.qwen3``: per-head
q/k RMSNorm, softmax router renormalised over the top-k, every block sparse, SwiGLU experts):
an ``hf:Qwen3MoeConfig`` built so is written as it is; a Llama-style one (Mixtral,
``moe:``) and a Qwen3-MoE with other routing or dense blocks become that decoder at the same
shape, a priced gap (the twin is an ``hf:Qwen3MoeConfig`` spec, so the cost model prices the
model torchtitan builds). Expert parallelism is ``expert_parallel_degree``: torchtitan takes
the ep ranks from dp_shard x cp x tp, autopar's ep regroups dp x cp, the same ranks when tp = 1
and the dp ranks shard (ZeRO 2/3); under tp > 1 torchtitan's experts also span the tp ranks,
which autopar does not price, and the export refuses. An ``hf:DeepseekV3Config`` is torchtitan's
DeepSeek-V3 (``build_mla_moe_layers``: multi-latent attention, the leading dense blocks, shared
and routed experts, the sigmoid group-limited router) at the config's every width, with plain
RoPE or YaRN as torchtitan builds it (no factor on cos/sin, ``mscale_all_dim`` in the softmax
scale: DeepSeek-V3's own, where ``mscale`` and ``mscale_all_dim`` agree). An ``hf:GptOssConfig``
is torchtitan's GPT-OSS where its config has the attention that model fixes (64 heads of 64, 8 kv
heads, 128-token windows on every second layer from the first, biases, SwiGLU limit 7); its YaRN
factor, which HF puts on cos and sin, is torchtitan's softmax-scale mscale squared. Other
mixtures (DeepSeek-V2, GLM, Qwen2-MoE) are refused, naming the Megatron export.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from autopar.errors import UserError
from autopar.export.common import (Adapter, Family, Nodes, Option, Settings, Shape, derive_batch, describe_recompute,
                                   mode_counts, model_spec, order_gap, replace_plan, twin_options, uniform_recompute)
from autopar.plan import Plan
from cost_models.axes import Degrees

COMMIT = "b5bcd76c6"
"""The torchtitan commit the config module is written for (main, 2026-08-21)."""
FRAMEWORK = f"torchtitan main at {COMMIT} (torchtitan.config.ConfigManager, Trainer.Config)"
DEFAULT_FILE = "autopar_torchtitan.py"
FUNCTION = "autopar_plan"
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B",
             "zero-bubble": "InterleavedZeroBubble"}
"""autopar's schedules and the torch.distributed.pipelining schedules torchtitan names (all
place stages looped: rank r runs stages r, r + pp, ...)."""
_MULTI = {"Interleaved1F1B", "InterleavedZeroBubble"}
AC = {"none": "None", "full": "FullAC.Config()", "op": "SelectiveAC.Config()"}
"""How the config module writes each recompute mode torchtitan has (``activation_checkpoint``:
``torchtitan/distributed/activation_checkpoint.py``; SelectiveAC keeps every second matmul's
output and the attention's, as autopar's ``op``)."""


QWEN3, QWEN3_MOE = "Qwen3Config", "Qwen3MoeConfig"
DEEPSEEK_V3, GPT_OSS = "DeepseekV3Config", "GptOssConfig"


@dataclass(frozen=True, kw_only=True, slots=True)
class Qwen3:
    """What torchtitan's Qwen3 decoder (dense or MoE) takes beyond ``Shape``."""

    head_dim: int
    width: int
    """The MLP's hidden width (each expert's, in a mixture of experts)."""
    theta: float
    """RoPE base."""
    eps: float
    """RMSNorm epsilon."""
    as_built: bool
    """The plan's model is the decoder torchtitan builds (else a twin replaces it)."""

    def twin(self, shape: Shape) -> str:
        """The ``hf:Qwen3MoeConfig`` spec of the MoE decoder torchtitan builds at ``shape``."""
        return (f"hf:{QWEN3_MOE}:hidden_size={shape.hidden},num_hidden_layers={shape.layers},"
                f"num_attention_heads={shape.heads},num_key_value_heads={shape.kv_heads},head_dim={self.head_dim},"
                f"moe_intermediate_size={self.width},num_experts={shape.experts},num_experts_per_tok={shape.topk},"
                f"norm_topk_prob=True,vocab_size={shape.vocab},tie_word_embeddings={shape.tied},"
                f"seq={shape.max_positions}")


def _hf_config(plan: Plan) -> Any:
    """The plan's HF model's config (an ``hf:`` spec)."""
    from autopar.hf import make_config
    from autopar.spec import hf_option_values
    spec = model_spec(plan)
    return make_config(spec.source, hf_option_values(spec.options))


def qwen3(plan: Plan, shape: Shape) -> Qwen3:
    """torchtitan's Qwen3 decoder fields for ``plan``'s model: off its HF config for an
    ``hf:Qwen3Config`` or ``hf:Qwen3MoeConfig`` (as built: no attention biases or sliding
    windows, RMSNorm epsilon 1e-6 as torchtitan's blocks fix it, experts in every block with
    the top-k renormalised), else off ``shape`` (Llama-style experts: heads hidden / heads wide,
    each expert ``ffn`` wide)."""
    if shape.source not in (QWEN3, QWEN3_MOE):
        return Qwen3(head_dim=shape.hidden // shape.heads, width=shape.ffn, theta=1e6, eps=1e-6, as_built=False)
    c = _hf_config(plan)
    rope = dict(getattr(c, "rope_parameters", None) or {})
    plain = (not c.attention_bias and not getattr(c, "use_sliding_window", False) and c.rms_norm_eps == 1e-6
             and rope.get("rope_type", "default") == "default")
    if shape.source == QWEN3_MOE:
        plain = plain and bool(c.norm_topk_prob) and c.decoder_sparse_step == 1 and not c.mlp_only_layers
    width = c.moe_intermediate_size if shape.source == QWEN3_MOE else c.intermediate_size
    return Qwen3(head_dim=c.head_dim, width=width,
                 theta=float(rope.get("rope_theta", 1e6)), eps=c.rms_norm_eps, as_built=plain)


@dataclass(frozen=True, kw_only=True, slots=True)
class Rope:
    """``ComplexRoPE.Config``'s base and scaling for a Llama-style model."""

    theta: float = 500000.0
    scaling: dict[str, float | int] | None = None
    """Llama 3's frequency scaling (``scaling="llama"``'s fields), or None: plain."""
    windows: tuple[int, ...] = ()
    """Sliding windows shorter than the sequence (torchtitan's Llama 3 attends causally over all of it)."""
    other: str = ""
    """A RoPE type torchtitan's Llama 3 does not build (written plain)."""


LLAMA3_ROPE: dict[str, float | int] = {"scaling_factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192}
"""Llama 3.1's RoPE scaling, which the export writes for autopar's own Llama specs (torchtitan's
Llama 3 recipe)."""


def llama_rope(plan: Plan, shape: Shape) -> Rope:
    """The RoPE of ``plan``'s Llama-style model: off its HF config for an ``hf:`` Llama or
    Mistral, else Llama 3.1's (autopar's ``llama:`` presets and twins: the same compute)."""
    if model_spec(plan).arch != "hf" or shape.family != Family.LLAMA:
        return Rope(scaling=LLAMA3_ROPE)
    from autopar.hf import attention_windows
    c = _hf_config(plan)
    rope = dict(getattr(c, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    windows = tuple(sorted({w for w in attention_windows(c) if 0 < w < plan.seq_len}))
    theta = float(rope.get("rope_theta", 10000.0))
    if kind == "llama3":
        scaling = {"scaling_factor": float(rope.get("factor", 8.0)),
                   "low_freq_factor": float(rope.get("low_freq_factor", 1.0)),
                   "high_freq_factor": float(rope.get("high_freq_factor", 4.0)),
                   "original_max_position_embeddings": int(rope.get("original_max_position_embeddings", 8192))}
        return Rope(theta=theta, scaling=scaling, windows=windows)
    return Rope(theta=theta, windows=windows, other="" if kind == "default" else kind)


def _adapt_experts(a: Adapter, shape: Shape) -> None:
    if shape.family != Family.LLAMA and shape.source not in (QWEN3_MOE, DEEPSEEK_V3, GPT_OSS):
        raise UserError(f"{shape.source} has {shape.experts} routed experts: the torchtitan export writes "
                        "torchtitan's Qwen3 MoE decoder, which builds Qwen3-MoE's and Llama-style (Mixtral's) "
                        "experts, or its DeepSeek-V3 or GPT-OSS; export it with --to megatron")
    m = a.plan.mesh
    if m.tp > 1:
        raise UserError(f"the plan runs {shape.experts} routed experts under tp={m.tp}: torchtitan's expert layers "
                        "take their ranks from dp x cp x tp (the experts folded over the tp ranks), a layout autopar "
                        "does not price; re-plan with --tp 1 or export it with --to megatron")
    if shape.source in (DEEPSEEK_V3, GPT_OSS):
        (deepseek_v3 if shape.source == DEEPSEEK_V3 else gpt_oss)(a.plan)  # refuses what torchtitan does not build
        found = None
    else:
        found = qwen3(a.plan, shape)
    if found is not None and not found.as_built:
        twin = found.twin(shape)
        a.gap("model", shape.source, "torchtitan trains its own model definitions; its mixture of experts is the "
              "Qwen3 MoE decoder (per-head q/k RMSNorm, the top-k scores renormalised, every block sparse)",
              [Option(nearest=f"torchtitan's Qwen3 MoE decoder at the same shape ({twin})",
                      plan=replace_plan(a.plan, model=twin))])
    if m.ep > 1 and a.plan.zero_stage == 0:
        a.gap("zero_stage", 0, "torchtitan's experts take their ep ranks from the FSDP shard group, which ZeRO 0 "
              "(data_parallel_replicate_degree) leaves at one rank",
              [Option(nearest="data_parallel_shard_degree with fsdp_reshard_after_forward='never' (ZeRO-2)",
                      plan=replace_plan(a.plan, zero_stage=2)),
               Option(nearest="data_parallel_shard_degree with fsdp_reshard_after_forward='always' (ZeRO-3)",
                      plan=replace_plan(a.plan, zero_stage=3))])


def _adapt_rope(a: Adapter, shape: Shape) -> None:
    """What torchtitan's Llama 3 decoder does not build of a Llama-style HF model's attention:
    gaps that keep the plan (the cost model prices causal attention under torchtitan's recipe)."""
    rope = llama_rope(a.plan, shape)
    if rope.windows:  # priced as the same HF model without its windows
        spec = model_spec(a.plan)
        twin = f"hf:{spec.source}:" + ",".join([*(f"{k}={v}" for k, v in spec.options if k != "sliding_window"),
                                                "sliding_window=None"])
        a.gap("attention", f"sliding windows of {', '.join(map(str, rope.windows))} tokens",
              "torchtitan's Llama 3 decoder has no sliding windows",
              [Option(nearest=f"causal attention over all {a.plan.seq_len} tokens ({twin})",
                      plan=replace_plan(a.plan, model=twin))])
    if rope.other:
        a.gap("rope", rope.other, "torchtitan's RoPE scales frequencies as Llama 3 or YaRN only",
              [Option(nearest=f"plain RoPE of base {rope.theta:g}", plan=a.plan)])


def adapt(a: Adapter, shape: Shape) -> None:
    if shape.experts:
        _adapt_experts(a, shape)
    elif shape.source == QWEN3 and qwen3(a.plan, shape).as_built:
        pass  # torchtitan's Qwen3 decoder as it is
    elif shape.family != Family.LLAMA:
        a.gap("model", shape.source, "torchtitan trains its own model definitions; the nearest is its "
              "Llama 3 decoder", twin_options(a.plan, shape, "torchtitan's Llama 3 decoder at the same shape ({spec})"))
    else:
        _adapt_rope(a, shape)
    if a.plan.zero_stage == 1:
        a.gap("zero_stage", 1, "FSDP2 shards gradients whenever it shards optimizer states",
              [Option(nearest="data_parallel_shard_degree with fsdp_reshard_after_forward='never' (ZeRO-2)",
                      plan=replace_plan(a.plan, zero_stage=2)),
               Option(nearest="data_parallel_shard_degree with fsdp_reshard_after_forward='always' (ZeRO-3)",
                      plan=replace_plan(a.plan, zero_stage=3))])
    if a.plan.offload and a.plan.zero_stage == 0:
        a.gap("offload", True, "enable_cpu_offload offloads FSDP shards", [
            Option(nearest="no CPU offload", plan=replace_plan(a.plan, offload=False))])
    if a.plan.dtype == "fp16":
        a.gap("dtype", "fp16", "torchtitan trains in bfloat16 or float32",
              [Option(nearest="mixed_precision_param='bfloat16'", plan=replace_plan(a.plan, dtype="bf16"))])
    if a.plan.mesh.pp > 1 and a.plan.virtual_stages > 1 and SCHEDULES[a.plan.schedule] not in _MULTI:
        a.gap("schedule", a.plan.schedule, f"{a.plan.virtual_stages} stages per rank need a looped schedule",
              [Option(nearest="Interleaved1F1B", plan=replace_plan(a.plan, schedule="interleaved"))])
    modes = set(a.plan.recompute)
    if "selective" in modes or len(modes) > 1:
        a.gap("recompute", describe_recompute(a.plan),
              "torchtitan applies one activation-checkpointing policy to every block, and its selective "
              "policy is op-level (saves matmul and attention outputs), not autopar's attention-core recompute",
              [Option(nearest=f"activation_checkpoint={AC[m]}", plan=uniform_recompute(a.plan, m))
               for m in ("op", "full", "none")])
    a.refit({m: f"activation_checkpoint={AC[m]}" for m in ("op", "full")})
    order_gap(a, "torchtitan's mesh is pp > dp_replicate > dp_shard > cp > tp", "pp > dp > tp")


def _fqns(plan: Plan) -> list[list[str]]:
    out, at = [], 0
    last = len(plan.stage_layers) - 1
    for i, n in enumerate(plan.stage_layers):
        names = [f"layers.{j}" for j in range(at, at + n)]
        at += n
        out.append((["tok_embeddings"] if i == 0 else []) + names + (["norm", "lm_head"] if i == last else []))
    return out


def settings_kwargs(plan: Plan) -> tuple[dict, dict]:
    """(TrainingConfig, ParallelismConfig) keyword arguments of the (adapted) plan."""
    m = plan.mesh
    pipelined = m.pp > 1
    training = {"num_tokens_per_microbatch_per_dp_rank": plan.micro_batch_size * plan.seq_len,
                "num_tokens_per_train_step": plan.global_batch * plan.seq_len,
                "max_context_length": plan.seq_len,
                "dtype": "float32", "mixed_precision_param": "float32" if plan.dtype == "fp32" else "bfloat16",
                "enable_cpu_offload": plan.offload}
    if pipelined or m.ep > 1:  # torchtitan's CUDA graphs refuse pipelines and the all-to-all dispatcher's host sync
        training["disable_cuda_graphs"] = True
    sharded = plan.zero_stage > 0
    parallelism: dict = {"data_parallel_replicate_degree": 1 if sharded else m.dp,
                         "data_parallel_shard_degree": m.dp if sharded else 1,
                         "fsdp_reshard_after_forward": "always" if plan.zero_stage == 3 else "never",
                         "tensor_parallel_degree": m.tp,
                         "enable_sequence_parallel": plan.sequence_parallel and m.tp > 1,
                         "pipeline_parallel_degree": m.pp,
                         "context_parallel_degree": m.cp}
    if m.ep > 1:
        parallelism["expert_parallel_degree"] = m.ep
    if pipelined:
        parallelism.update(pipeline_parallel_schedule=SCHEDULES[plan.schedule],
                           num_pp_microbatches=plan.num_microbatches,
                           module_fqns_per_model_part=_fqns(plan))
    return training, parallelism


def _kwargs(d: dict, indent: str) -> str:
    return ",\n".join(f"{indent}{k}={v!r}" for k, v in d.items())


def _llama3(shape: Shape, rope: Rope) -> tuple[str, str]:
    """(the imports and model of torchtitan's Llama 3 decoder at ``shape``, its base recipe and
    flavor)."""
    scaling = "" if rope.scaling is None else ", scaling='llama', " + ", ".join(
        f"{k}={v!r}" for k, v in rope.scaling.items())
    return f'''from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init,
                                      model_registry)
from torchtitan.models.llama3.config_registry import llama3_8b as base_recipe
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.trainer import Trainer

LAYERS, DIM, HEADS, KV_HEADS, FFN, VOCAB, TIED = {shape.layers}, {shape.hidden}, {shape.heads}, {shape.kv_heads}, {shape.ffn}, {shape.vocab}, {shape.tied}


def _model() -> Llama3Model.Config:
    """torchtitan's Llama 3 decoder at the plan's shape."""
    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB, enable_weight_tying=TIED,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=FFN, fuse_qkv=True,
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_context_length={max(shape.max_positions, 131072)},
                                    theta={rope.theta!r}{scaling}),
            attn_backend="flex"))''', "8B"


def _qwen3_dense(shape: Shape, q: Qwen3) -> tuple[str, str]:
    """As ``_llama3``, for torchtitan's dense Qwen3 decoder."""
    return f'''from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, _NORM_INIT, _build_qwen3_layers, model_registry
from torchtitan.models.qwen3.config_registry import qwen3_14b as base_recipe
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.trainer import Trainer

LAYERS, DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, TIED = {shape.layers}, {shape.hidden}, {shape.heads}, {shape.kv_heads}, {q.head_dim}, {q.width}, {shape.vocab}, {shape.tied}


def _model() -> Qwen3Model.Config:
    """torchtitan's Qwen3 decoder at the plan's shape."""
    return Qwen3Model.Config(
        dim=DIM, vocab_size=VOCAB, enable_weight_tying=TIED,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, eps={q.eps!r}, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=_build_qwen3_layers(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, hidden_dim=FFN,
            fuse_qkv=True, attn_backend="flex",
            rope=CosSinRoPE.Config(dim=HEAD_DIM, max_context_length={shape.max_positions}, theta={q.theta!r})))''', "14B"


def _qwen3_moe(shape: Shape, e: Qwen3) -> tuple[str, str]:
    """As ``_llama3``, for torchtitan's Qwen3 MoE decoder."""
    return f'''from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.qwen3 import (_EMBEDDING_INIT, _LINEAR_INIT, _NORM_INIT, _build_qwen3_moe_layers,
                                     model_registry)
from torchtitan.models.qwen3.config_registry import qwen3_30b_a3b as base_recipe
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.trainer import Trainer

LAYERS, DIM, HEADS, KV_HEADS, HEAD_DIM, VOCAB, TIED = {shape.layers}, {shape.hidden}, {shape.heads}, {shape.kv_heads}, {e.head_dim}, {shape.vocab}, {shape.tied}
EXPERTS, TOP_K, EXPERT_FFN = {shape.experts}, {shape.topk}, {e.width}


def _model() -> Qwen3Model.Config:
    """torchtitan's Qwen3 MoE decoder at the plan's shape."""
    return Qwen3Model.Config(
        dim=DIM, vocab_size=VOCAB, enable_weight_tying=TIED,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, eps={e.eps!r}, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
            moe_hidden_dim=EXPERT_FFN, num_experts=EXPERTS, top_k=TOP_K, fuse_qkv=True, attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=HEAD_DIM, max_context_length={shape.max_positions}, theta={e.theta!r})))''', "30B-A3B"


@dataclass(frozen=True, kw_only=True, slots=True)
class Built:
    """A torchtitan model builder's arguments for one model (DeepSeek-V3's, GPT-OSS's)."""

    layers: dict[str, object]
    """The layer builder's keyword arguments but inits, backends and RoPE."""
    rope: dict[str, object]
    """The RoPE config's fields but ``dim`` and ``max_context_length``."""
    rope_dim: int
    vocab: int
    eps: float


def deepseek_v3(plan: Plan) -> Built:
    """``build_mla_moe_layers``'s arguments and the RoPE's for ``plan``'s ``hf:DeepseekV3Config``,
    read off its HF config; a ``UserError`` for what torchtitan's DeepSeek-V3 does not build."""
    from autopar.hf import make_config
    from autopar.spec import hf_option_values
    c = make_config(DEEPSEEK_V3, hf_option_values(model_spec(plan).options))
    rope = dict(getattr(c, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    # YaRN as torchtitan builds it: no factor on cos/sin (HF's attention_factor, 1 where mscale and
    # mscale_all_dim agree), mscale_all_dim folded into the softmax scale (its Attention's mscale)
    unit = float(rope.get("attention_factor") or 0.0) == 1.0 or (
        bool(rope.get("mscale")) and float(rope.get("mscale", 0.0)) == float(rope.get("mscale_all_dim") or 0.0))
    if (kind not in ("default", "yarn") or (kind == "yarn" and not unit) or c.attention_bias
            or c.tie_word_embeddings or c.n_shared_experts < 1):
        raise UserError(f"{DEEPSEEK_V3} with rope_type={kind!r}, attention_bias={c.attention_bias}, "
                        f"tie_word_embeddings={c.tie_word_embeddings}, n_shared_experts={c.n_shared_experts}: "
                        "the torchtitan export writes DeepSeek-V3 with plain RoPE or YaRN without a cos/sin factor, "
                        "no attention biases, an untied head and shared experts; export it with --to megatron")
    rope_args: dict[str, object] = {"theta": float(rope.get("rope_theta", 10000.0))}
    if kind == "yarn":
        rope_args.update(scaling="yarn", rope_factor=float(rope["factor"]), beta_fast=float(rope.get("beta_fast", 32)),
                         beta_slow=float(rope.get("beta_slow", 1)), truncate=bool(rope.get("truncate", True)),
                         original_seq_len=int(rope.get("original_max_position_embeddings")
                                              or c.max_position_embeddings))
    layers: dict[str, object] = dict(
        n_layers=c.num_hidden_layers, n_dense_layers=c.first_k_dense_replace, dim=c.hidden_size,
        n_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank or 0, kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
        mscale=float(rope.get("mscale_all_dim") or 0.0) if kind == "yarn" else 1.0,
        dense_hidden_dim=c.intermediate_size, moe_hidden_dim=c.moe_intermediate_size,
        num_experts=c.n_routed_experts, num_shared_experts=c.n_shared_experts, router_top_k=c.num_experts_per_tok,
        router_score_func="sigmoid", router_num_expert_groups=c.n_group if c.n_group > 1 else None,
        router_num_limited_groups=c.topk_group if c.n_group > 1 else None,
        router_route_scale=float(c.routed_scaling_factor), router_route_norm=bool(c.norm_topk_prob))
    return Built(layers=layers, rope=rope_args, rope_dim=c.qk_rope_head_dim, vocab=c.vocab_size,
                    eps=c.rms_norm_eps)


def _deepseek_v3(shape: Shape, plan: Plan) -> tuple[str, str]:
    """As ``_llama3``, for torchtitan's DeepSeek-V3 (multi-latent attention, shared and routed
    experts behind its leading dense blocks)."""
    d = deepseek_v3(plan)
    layers = ",\n            ".join(f"{k}={v!r}" for k, v in d.layers.items())
    rope = ", ".join(f"{k}={v!r}" for k, v in d.rope.items())
    return f'''from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.deepseek_v3 import (_EMBEDDING_INIT, _NORM_INIT, _build_dsv3_layers, _output_linear_init,
                                           model_registry)
from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_671b as base_recipe
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.trainer import Trainer

LAYERS, DIM, VOCAB = {shape.layers}, {shape.hidden}, {d.vocab}


def _model() -> DeepSeekV3Model.Config:
    """torchtitan's DeepSeek-V3 at the plan's shape."""
    return DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, eps={d.eps!r}, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_dsv3_layers(
            {layers},
            attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(dim={d.rope_dim}, max_context_length={shape.max_positions}, {rope})))''', "671B"


GPT_OSS_FIXED = {"num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
                 "swiglu_limit": 7.0, "attention_bias": True, "tie_word_embeddings": False}
"""What torchtitan's GPT-OSS builds whatever its config (``_build_gptoss_layers``: its attention's heads, every
second layer's 128-token window from the first, the clamped SwiGLU's limit, biased projections, an untied head)."""


def gpt_oss(plan: Plan) -> Built:
    """``_build_gptoss_layers``'s arguments and the RoPE's for ``plan``'s ``hf:GptOssConfig``, read
    off its HF config; a ``UserError`` for one torchtitan's GPT-OSS does not build."""
    c = _hf_config(plan)
    off = {k: getattr(c, k, None) for k, v in GPT_OSS_FIXED.items() if getattr(c, k, None) != v}
    alternating = list(c.layer_types) == ["sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(c.num_hidden_layers)]
    rope = dict(getattr(c, "rope_parameters", None) or {})
    if off or not alternating or rope.get("rope_type") != "yarn" or "mscale" in rope or "attention_factor" in rope:
        found = ", ".join(f"{k}={v}" for k, v in off.items()) or "its layer types or RoPE"
        raise UserError(f"{GPT_OSS} with {found}: torchtitan's GPT-OSS builds {GPT_OSS_FIXED}, windows on every "
                        "second layer from the first and YaRN; export it with --to megatron")
    layers: dict[str, object] = dict(dim=c.hidden_size, n_layers=c.num_hidden_layers, hidden_dim=c.intermediate_size,
                                     num_experts=c.num_local_experts, top_k=c.num_experts_per_tok)
    # YaRN's attention factor (0.1 ln factor + 1, on cos and sin in HF) is torchtitan's softmax scale's mscale^2
    rope_args: dict[str, object] = dict(
        theta=float(rope.get("rope_theta", 150000.0)), scaling="yarn", rope_factor=float(rope["factor"]),
        beta_fast=float(rope.get("beta_fast", 32)), beta_slow=float(rope.get("beta_slow", 1)),
        truncate=bool(rope.get("truncate", True)),
        original_seq_len=int(rope.get("original_max_position_embeddings") or c.max_position_embeddings))
    return Built(layers=layers, rope=rope_args, rope_dim=c.head_dim, vocab=c.vocab_size, eps=c.rms_norm_eps)


def _gpt_oss(shape: Shape, plan: Plan) -> tuple[str, str]:
    """As ``_llama3``, for torchtitan's GPT-OSS (attention sinks, windows on every second layer,
    biased experts with a clamped SwiGLU)."""
    d = gpt_oss(plan)
    layers = ",\n            ".join(f"{k}={v!r}" for k, v in d.layers.items())
    rope = ", ".join(f"{k}={v!r}" for k, v in d.rope.items())
    return f'''from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.gpt_oss import (_EMBEDDING_INIT, _NORM_INIT, _build_gptoss_layers, _output_linear_init,
                                      model_registry)
from torchtitan.models.gpt_oss.config_registry import gpt_oss_120b as base_recipe
from torchtitan.models.gpt_oss.model import GptOssModel
from torchtitan.trainer import Trainer

LAYERS, DIM, VOCAB = {shape.layers}, {shape.hidden}, {d.vocab}


def _model() -> GptOssModel.Config:
    """torchtitan's GPT-OSS at the plan's shape."""
    return GptOssModel.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, eps={d.eps!r}, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_gptoss_layers(
            {layers},
            load_balance_coeff=1e-3, fuse_qkv=True, moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim={d.rope_dim}, max_context_length={shape.max_positions}, {rope})))''', "120b"


def render(plan: Plan, shape: Shape, where: Nodes, header: list[str], module: str) -> tuple[str, str]:
    training, parallelism = settings_kwargs(plan)
    ac = AC[plan.recompute[0]]  # one mode on every block (``adapt``)
    launch = (f"PYTHONPATH=<directory of {module}.py> torchrun --nnodes {where.count} --nproc-per-node "
              f"{where.per_node} -m torchtitan.train --module {module} --config {FUNCTION}")
    doc = "\n".join(header + ["", "Launch on every node:", f"    {launch}",
                              "Set hf_assets_path (tokenizer) and the dataloader to your data; any field can "
                              "be overridden with --section.key."])
    if shape.source == DEEPSEEK_V3:
        model, flavor = _deepseek_v3(shape, plan)
    elif shape.source == GPT_OSS:
        model, flavor = _gpt_oss(shape, plan)
    elif shape.experts:
        model, flavor = _qwen3_moe(shape, qwen3(plan, shape))
    elif shape.source == QWEN3:
        model, flavor = _qwen3_dense(shape, qwen3(plan, shape))
    else:
        model, flavor = _llama3(shape, llama_rope(plan, shape))
    text = f'''"""{doc}
"""

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
{model}


def {FUNCTION}() -> Trainer.Config:
    config = base_recipe()  # optimizer, data loader, checkpointing: torchtitan's recipe for its {flavor}
    spec = model_registry("{flavor}")
    spec.model = _model()
    spec.flavor = "autopar"
    config.model_spec = spec
    config.loss = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=VOCAB))
    config.training = TrainingConfig(
{_kwargs(training, "        ")})
    config.parallelism = ParallelismConfig(
{_kwargs(parallelism, "        ")})
    config.activation_checkpoint = {ac}
    return config
'''
    return text, launch


# ---- reading a config module back ---------------------------------------------------------------

def _calls(tree: ast.AST) -> dict[str, dict]:
    """Literal keyword arguments of the ``TrainingConfig(...)`` and ``ParallelismConfig(...)``
    calls, and the module's ``NAME = value`` constants."""
    out: dict[str, dict] = {"constants": {}}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "TrainingConfig", "ParallelismConfig"):
            out[node.func.id] = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple):
            for name, value in zip(node.targets[0].elts, node.value.elts):
                if isinstance(name, ast.Name):
                    out["constants"][name.id] = ast.literal_eval(value)
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute)
                and node.targets[0].attr == "activation_checkpoint"):
            out["ac"] = {"mode": next((m for m, text in AC.items() if text.split(".")[0] in ast.unparse(node.value)),
                                      "none")}
    return out


def literals(text: str) -> dict[str, dict]:
    """The keyword arguments of the module's ``TrainingConfig(...)`` and ``ParallelismConfig(...)``
    (keys ``TrainingConfig``, ``ParallelismConfig``), its constants and whether it sets full AC."""
    try:
        found = _calls(ast.parse(text))
    except (SyntaxError, ValueError) as exc:
        raise UserError(f"torchtitan config is not a module of literal settings: {exc}") from None
    if "TrainingConfig" not in found or "ParallelismConfig" not in found:
        raise UserError("torchtitan config has no TrainingConfig(...) or ParallelismConfig(...) call")
    return found


def parse(text: str) -> Settings:
    found = literals(text)
    t, p = found["TrainingConfig"], found["ParallelismConfig"]
    layers = found["constants"].get("LAYERS")
    rep, shard = p.get("data_parallel_replicate_degree", 1), p.get("data_parallel_shard_degree", -1)
    tp, pp, cp = p.get("tensor_parallel_degree", 1), p.get("pipeline_parallel_degree", 1), p.get("context_parallel_degree", 1)
    dp = rep * shard
    seq = t.get("max_context_length", 2048)
    micro = t.get("num_tokens_per_microbatch_per_dp_rank", 16384) // seq
    chunks = p.get("num_pp_microbatches", 1) if pp > 1 else 1  # a dp rank's micro-batches per accumulation step
    step = t.get("num_tokens_per_train_step", -1)
    global_batch = step // seq if step > 0 else micro * chunks * dp
    n = chunks * (derive_batch(dp, micro * chunks, global_batch) or 0)
    if pp > 1:
        parts = p.get("module_fqns_per_model_part")
        stage_layers = tuple(sum(1 for f in part if f.startswith("layers.")) for part in parts) if parts else None
        v = len(parts) // pp if parts else None
        schedule = {v: k for k, v in SCHEDULES.items()}.get(p.get("pipeline_parallel_schedule", "1F1B"))
    else:
        stage_layers, v, schedule = ((layers,) if layers else None), 1, None
    reshard = p.get("fsdp_reshard_after_forward", "default")
    zero = 0 if shard == 1 else 3 if reshard == "always" or (reshard == "default" and pp == 1) else 2
    ac = found.get("ac", {}).get("mode", "none")
    return Settings(gpus=dp * tp * pp * cp, dp=dp, tp=tp, pp=pp, cp=cp, ep=p.get("expert_parallel_degree", 1),
                    zero=zero,
                    offload=t.get("enable_cpu_offload", False), micro_batch_size=micro, num_microbatches=n or None,
                    global_batch=global_batch, schedule=schedule, virtual_stages=v,
                    sequence_parallel=p.get("enable_sequence_parallel", True) and tp > 1, stage_layers=stage_layers,
                    recompute=tuple(mode_counts(k, ac) for k in stage_layers) if stage_layers else None,
                    dtype="fp32" if t.get("mixed_precision_param") == "float32" else "bf16",
                    axis_order=Degrees(pp=pp, dp=dp, cp=cp, tp=tp).active())


