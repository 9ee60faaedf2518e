"""The models torchtitan builds for a plan's model (``autopar.export.torchtitan``'s model half).

torchtitan trains its own model definitions (``torchtitan/models/*`` at ``torchtitan.COMMIT``), each
built from a config function: its Llama 3 decoder, its Qwen3 decoder (dense or MoE), its
DeepSeek-V3 and its GPT-OSS. This module reads what those builders take off the plan's model
(an HF config, or the shape of autopar's own specs) and writes the config module's imports and
``_model()``; ``torchtitan.adapt`` decides which one a plan gets, or the gap to a twin.

- Llama 3 (``_build_llama3_layers``): an HF Llama or Mistral keeps its RoPE base and Llama 3
  frequency scaling; autopar's ``llama:`` presets and twins get Llama 3.1's.
- Qwen3 (``_build_qwen3_layers``, ``_build_qwen3_moe_layers``): per-head q/k RMSNorm, a head width
  of its own, RMSNorm epsilon 1e-6 in every block, the MoE's softmax router renormalised over the
  top-k with experts in every block.
- DeepSeek-V3 (``build_mla_moe_layers``): multi-latent attention, the leading dense blocks, shared
  and routed experts, the sigmoid group-limited router; plain RoPE or YaRN as torchtitan builds it
  (no factor on cos and sin: ``mscale`` = ``mscale_all_dim``, which both fold into the softmax
  scale).
- GPT-OSS (``_build_gptoss_layers``): only its own attention (``GPT_OSS_FIXED``); its YaRN factor,
  which HF puts on cos and sin, is torchtitan's softmax-scale mscale squared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.errors import UserError
from autopar.export.common import Family, Shape, model_spec
from autopar.plan import Plan

QWEN3, QWEN3_MOE = "Qwen3Config", "Qwen3MoeConfig"
DEEPSEEK_V3, GPT_OSS = "DeepseekV3Config", "GptOssConfig"


def hf_config(plan: Plan) -> Any:
    """The plan's HF model's config (an ``hf:`` spec)."""
    from autopar.hf import make_config
    from autopar.spec import hf_option_values
    spec = model_spec(plan)
    return make_config(spec.source, hf_option_values(spec.options))


# ---- Qwen3 -----------------------------------------------------------------------------------

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


def qwen3(plan: Plan, shape: Shape) -> Qwen3:
    """torchtitan's Qwen3 decoder fields for ``plan``'s model: off its HF config for an
    ``hf:Qwen3Config`` or ``hf:Qwen3MoeConfig`` (as built: no attention biases or sliding
    windows, RMSNorm epsilon 1e-6 as torchtitan's blocks fix it, experts in every block with
    the top-k renormalised), else off ``shape`` (Llama-style experts: heads hidden / heads wide,
    each expert ``ffn`` wide)."""
    if shape.source not in (QWEN3, QWEN3_MOE):
        return Qwen3(head_dim=shape.hidden // shape.heads, width=shape.ffn, theta=1e6, eps=1e-6, as_built=False)
    c = hf_config(plan)
    rope = dict(getattr(c, "rope_parameters", None) or {})
    plain = (not c.attention_bias and not getattr(c, "use_sliding_window", False) and c.rms_norm_eps == 1e-6
             and rope.get("rope_type", "default") == "default")
    if shape.source == QWEN3_MOE:
        plain = plain and bool(c.norm_topk_prob) and c.decoder_sparse_step == 1 and not c.mlp_only_layers
    width = c.moe_intermediate_size if shape.source == QWEN3_MOE else c.intermediate_size
    return Qwen3(head_dim=c.head_dim, width=width, theta=float(rope.get("rope_theta", 1e6)), eps=c.rms_norm_eps,
                 as_built=plain)


# ---- Llama 3 ---------------------------------------------------------------------------------

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
    c = hf_config(plan)
    rope = dict(getattr(c, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    windows = tuple(sorted({w for w in attention_windows(c) if 0 < w < plan.seq_len}))
    theta = float(rope.get("rope_theta", 10000.0))
    if kind == "llama3":
        scaling: dict[str, float | int] = {
            "scaling_factor": float(rope.get("factor", 8.0)),
            "low_freq_factor": float(rope.get("low_freq_factor", 1.0)),
            "high_freq_factor": float(rope.get("high_freq_factor", 4.0)),
            "original_max_position_embeddings": int(rope.get("original_max_position_embeddings", 8192))}
        return Rope(theta=theta, scaling=scaling, windows=windows)
    return Rope(theta=theta, windows=windows, other="" if kind == "default" else kind)


# ---- DeepSeek-V3 and GPT-OSS: a model package's own layer builder ------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class Built:
    """A torchtitan model package whose layer builder takes the model's every field."""

    name: str
    package: str
    """``torchtitan.models.<package>``."""
    model_class: str
    builder: str
    recipe: str
    """The package's config function the export starts from (optimizer, data, checkpointing)."""
    flavor: str
    layers: dict[str, object]
    """The layer builder's keyword arguments but inits, backends and RoPE."""
    backends: str
    """The builder's further keyword arguments, as written."""
    rope_class: str
    rope: dict[str, object]
    """The RoPE config's fields but ``dim`` and ``max_context_length``."""
    rope_dim: int
    vocab: int
    eps: float


def _yarn(rope: dict, c: Any) -> dict[str, object]:
    """torchtitan's YaRN fields for HF's ``rope_parameters`` of type yarn."""
    return dict(theta=float(rope.get("rope_theta", 10000.0)), scaling="yarn", rope_factor=float(rope["factor"]),
                beta_fast=float(rope.get("beta_fast", 32)), beta_slow=float(rope.get("beta_slow", 1)),
                truncate=bool(rope.get("truncate", True)),
                original_seq_len=int(rope.get("original_max_position_embeddings") or c.max_position_embeddings))


def deepseek_v3(plan: Plan) -> Built:
    """torchtitan's DeepSeek-V3 for ``plan``'s ``hf:DeepseekV3Config``; a ``UserError`` for one it
    does not build."""
    c = hf_config(plan)
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
    return Built(name="DeepSeek-V3", package="deepseek_v3", model_class="DeepSeekV3Model",
                 builder="_build_dsv3_layers", recipe="deepseek_v3_671b", flavor="671B", layers=layers,
                 backends='attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None',
                 rope_class="ComplexRoPE",
                 rope=_yarn(rope, c) if kind == "yarn" else {"theta": float(rope.get("rope_theta", 10000.0))},
                 rope_dim=c.qk_rope_head_dim, vocab=c.vocab_size, eps=c.rms_norm_eps)


GPT_OSS_FIXED = {"num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
                 "swiglu_limit": 7.0, "attention_bias": True, "tie_word_embeddings": False}
"""What torchtitan's GPT-OSS builds whatever its config (``_build_gptoss_layers``: its attention's
heads, every second layer's 128-token window from the first, the clamped SwiGLU's limit, biased
projections, an untied head)."""


def gpt_oss(plan: Plan) -> Built:
    """torchtitan's GPT-OSS for ``plan``'s ``hf:GptOssConfig``; a ``UserError`` for one it does
    not build."""
    c = hf_config(plan)
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
    return Built(name="GPT-OSS", package="gpt_oss", model_class="GptOssModel", builder="_build_gptoss_layers",
                 recipe="gpt_oss_120b", flavor="120b", layers=layers,
                 backends='load_balance_coeff=1e-3, fuse_qkv=True, moe_comm_backend="standard"',
                 rope_class="CosSinRoPE", rope=_yarn(rope, c), rope_dim=c.head_dim, vocab=c.vocab_size,
                 eps=c.rms_norm_eps)


# ---- the config module's model half ----------------------------------------------------------

def _llama3(shape: Shape, rope: Rope) -> tuple[str, str]:
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


def _qwen3(shape: Shape, q: Qwen3) -> tuple[str, str]:
    moe = bool(shape.experts)
    if moe:
        sizes = (f"EXPERTS, TOP_K, EXPERT_FFN = {shape.experts}, {shape.topk}, {q.width}\n", "_build_qwen3_moe_layers",
                 "moe_hidden_dim=EXPERT_FFN, num_experts=EXPERTS, top_k=TOP_K, fuse_qkv=True, attn_backend=\"flex\",\n"
                 "            moe_comm_backend=\"standard\",")
    else:
        sizes = (f"FFN = {q.width}\n", "_build_qwen3_layers", "hidden_dim=FFN, fuse_qkv=True, attn_backend=\"flex\",")
    constants, builder, args = sizes
    return f'''from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, _NORM_INIT, {builder}, model_registry
from torchtitan.models.qwen3.config_registry import {"qwen3_30b_a3b" if moe else "qwen3_14b"} as base_recipe
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.trainer import Trainer

LAYERS, DIM, HEADS, KV_HEADS, HEAD_DIM, VOCAB, TIED = {shape.layers}, {shape.hidden}, {shape.heads}, {shape.kv_heads}, {q.head_dim}, {shape.vocab}, {shape.tied}
{constants}

def _model() -> Qwen3Model.Config:
    """torchtitan's Qwen3 {"MoE " if moe else ""}decoder at the plan's shape."""
    return Qwen3Model.Config(
        dim=DIM, vocab_size=VOCAB, enable_weight_tying=TIED,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, eps={q.eps!r}, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers={builder}(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
            {args}
            rope=CosSinRoPE.Config(dim=HEAD_DIM, max_context_length={shape.max_positions}, theta={q.theta!r})))''', (
        "30B-A3B" if moe else "14B")


def _built(shape: Shape, b: Built) -> tuple[str, str]:
    layers = ",\n            ".join(f"{k}={v!r}" for k, v in b.layers.items())
    rope = ", ".join(f"{k}={v!r}" for k, v in b.rope.items())
    return f'''from torchtitan.models.common import {b.rope_class}, Embedding, Linear, RMSNorm
from torchtitan.models.{b.package} import (_EMBEDDING_INIT, _NORM_INIT, {b.builder}, _output_linear_init,
                                           model_registry)
from torchtitan.models.{b.package}.config_registry import {b.recipe} as base_recipe
from torchtitan.models.{b.package}.model import {b.model_class}
from torchtitan.trainer import Trainer

LAYERS, DIM, VOCAB = {shape.layers}, {shape.hidden}, {b.vocab}


def _model() -> {b.model_class}.Config:
    """torchtitan's {b.name} at the plan's shape."""
    return {b.model_class}.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, eps={b.eps!r}, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers={b.builder}(
            {layers},
            {b.backends},
            rope={b.rope_class}.Config(dim={b.rope_dim}, max_context_length={shape.max_positions}, {rope})))''', b.flavor


def model_source(plan: Plan, shape: Shape) -> tuple[str, str]:
    """(the config module's model imports, constants and ``_model()``, the torchtitan flavor whose
    model spec and config function it starts from) for the (adapted) plan."""
    if shape.source == DEEPSEEK_V3:
        return _built(shape, deepseek_v3(plan))
    if shape.source == GPT_OSS:
        return _built(shape, gpt_oss(plan))
    if shape.experts or shape.source == QWEN3:
        return _qwen3(shape, qwen3(plan, shape))
    return _llama3(shape, llama_rope(plan, shape))
