"""DeepSeek-V2 and -V3 (transformers' ``DeepseekV2Config``/``DeepseekV3Config``, Kimi-K2's too)
as Megatron-Core builds them: multi-latent attention, routed and shared experts, leading dense
blocks, and the router each family uses.

The flags are Megatron-LM's (``megatron/training/arguments.py`` and the ``TransformerConfig`` /
``MLATransformerConfig`` fields it generates flags from, main of 2026-11), as its own DeepSeek-V3
script writes them (``examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh``). The HF routers:

- V3 (``DeepseekV3TopkRouter``): sigmoid scores, a per-expert bias added for the choice only
  (aux-loss-free balancing), groups ranked by their top-2 scores, the chosen scores renormalised
  (``norm_topk_prob``) and scaled (``routed_scaling_factor``): Megatron's ``sigmoid`` score
  function with ``--moe-router-enable-expert-bias``, which ranks groups by their top
  ``topk / group_topk`` and always renormalises;
- V2 (``DeepseekV2TopkRouter``): softmax over all experts before the top-k, never renormalised,
  scaled: Megatron's ``--moe-router-pre-softmax``; its ``group_limited_greedy`` ranks groups by
  their best score, which Megatron does not (a ``note``).

What Megatron builds otherwise is listed by ``notes`` (written into the script's header): the
program's parallel layout is the plan's either way, and the notes change no price.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.spec import ModelSpec, hf_option_values

CONFIGS = ("DeepseekV2Config", "DeepseekV3Config")
"""The HF config classes this module reads."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepSeek:
    """What of a DeepSeek model Megatron's builder needs beyond ``Shape``."""

    version: int
    """2 or 3: which router (module docstring)."""
    dense_layers: int
    """Leading dense blocks (``first_k_dense_replace``), the rest mixtures of experts."""
    moe_ffn: int
    """Each routed expert's MLP width (``moe_intermediate_size``)."""
    shared_ffn: int
    """All shared experts' MLP width together (``n_shared_experts`` x ``moe_intermediate_size``)."""
    q_lora_rank: int | None
    """Rank of the query's low-rank projection; None: the query is projected at full rank (V2-Lite)."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    groups: int
    """Expert groups of group-limited routing (1: none)."""
    group_topk: int
    topk_method: str
    """V2's ``greedy`` or ``group_limited_greedy``; V3's ``noaux_tc``."""
    renormalise: bool
    """Whether the chosen experts' scores are renormalised to sum to 1 (V3's ``norm_topk_prob``)."""
    scaling: float
    """``routed_scaling_factor``: the routed experts' output weights are multiplied by it."""
    rope: dict
    """``rope_parameters`` (``rope_type``, ``rope_theta``, and YaRN's ``factor``, ``mscale``,
    ``mscale_all_dim``, ``original_max_position_embeddings``)."""
    norm_eps: float
    attention_bias: bool


def _int(config: object, name: str, default: int = 0) -> int:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def read(spec: ModelSpec, dense_layers: int) -> DeepSeek:
    """``spec``'s DeepSeek fields from its HF config (``dense_layers``: the leading dense blocks
    its trace found, ``ModelProfile.lead_layers``)."""
    from autopar.hf import make_config
    config = make_config(spec.source, hf_option_values(spec.options))
    rope = dict(getattr(config, "rope_parameters", None) or {})
    version = 3 if spec.source == "DeepseekV3Config" else 2
    return DeepSeek(
        version=version, dense_layers=dense_layers, moe_ffn=_int(config, "moe_intermediate_size"),
        shared_ffn=_int(config, "n_shared_experts") * _int(config, "moe_intermediate_size"),
        q_lora_rank=_int(config, "q_lora_rank") or None, kv_lora_rank=_int(config, "kv_lora_rank"),
        qk_nope_head_dim=_int(config, "qk_nope_head_dim"), qk_rope_head_dim=_int(config, "qk_rope_head_dim"),
        v_head_dim=_int(config, "v_head_dim"), groups=_int(config, "n_group", 1) or 1,
        group_topk=_int(config, "topk_group", 1) or 1,
        topk_method="noaux_tc" if version == 3 else str(getattr(config, "topk_method", "greedy")),
        renormalise=version == 3 and bool(getattr(config, "norm_topk_prob", True)),
        scaling=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0), rope=rope,
        norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        attention_bias=bool(getattr(config, "attention_bias", False)))


def layer_pattern(dense: int, layers: int) -> str:
    """``--moe-layer-freq``'s pattern: 0 for each leading dense block, 1 for each MoE one."""
    return f"([0]*{dense}+[1]*{layers - dense})"


def _grouped(ds: DeepSeek) -> bool:
    return ds.groups > 1 and ds.topk_method != "greedy"


def megatron_arguments(ds: DeepSeek, layers: int) -> list[str]:
    """``pretrain_gpt.py``'s model arguments for ``ds`` beyond the Llama-style block's (RMSNorm,
    SwiGLU, no biases) and the experts' count and top-k."""
    args = ["--multi-latent-attention", "--qk-layernorm"]
    if ds.q_lora_rank:
        args += ["--q-lora-rank", str(ds.q_lora_rank)]
    args += ["--kv-lora-rank", str(ds.kv_lora_rank), "--qk-head-dim", str(ds.qk_nope_head_dim),
             "--qk-pos-emb-head-dim", str(ds.qk_rope_head_dim), "--v-head-dim", str(ds.v_head_dim)]
    rope_type = ds.rope.get("rope_type", "default")
    args += ["--rope-type", "yarn" if rope_type == "yarn" else "rope",
             "--rotary-base", f"{int(ds.rope.get('rope_theta', 10000))}"]
    if rope_type == "yarn":
        args += ["--rotary-scaling-factor", f"{float(ds.rope.get('factor', 1.0)):g}",
                 "--mscale", f"{float(ds.rope.get('mscale', 1.0)):g}",
                 "--mscale-all-dim", f"{float(ds.rope.get('mscale_all_dim', 0.0)):g}"]
    args += ["--norm-epsilon", f"{ds.norm_eps:g}"]
    if ds.dense_layers:
        args += ["--moe-layer-freq", layer_pattern(ds.dense_layers, layers)]
    args += ["--moe-ffn-hidden-size", str(ds.moe_ffn)]
    if ds.shared_ffn:
        args += ["--moe-shared-expert-intermediate-size", str(ds.shared_ffn)]
    if ds.version == 3:
        args += ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
    else:
        args += ["--moe-router-score-function", "softmax", "--moe-router-pre-softmax"]
    if _grouped(ds):
        args += ["--moe-router-num-groups", str(ds.groups), "--moe-router-group-topk", str(ds.group_topk)]
    if ds.scaling != 1.0:
        args += ["--moe-router-topk-scaling-factor", f"{ds.scaling:g}"]
    return args + ["--moe-router-dtype", "fp32"]


def notes(ds: DeepSeek, topk: int) -> list[str]:
    """What Megatron-Core builds differently from the HF model, one line each (none change the
    plan's parallel layout or its price)."""
    out = []
    if ds.version == 3 and not ds.renormalise and topk > 1:
        out.append("norm_topk_prob=False: Megatron's sigmoid router always renormalises the chosen experts' scores")
    if _grouped(ds) and ds.version == 2:
        out.append("group_limited_greedy ranks expert groups by their best score; Megatron's "
                   f"--moe-router-group-topk ranks them by the sum of their top {max(1, topk // ds.group_topk)}")
    if _grouped(ds) and ds.version == 3 and topk // ds.group_topk != 2:
        out.append(f"HF ranks expert groups by their top 2 scores; Megatron by their top {topk // ds.group_topk} "
                   "(top-k / --moe-router-group-topk)")
    if ds.version == 3:
        out.append("DeepSeek-V3's multi-token prediction is in neither HF's model nor the plan: "
                   "--mtp-num-layers 1 adds it (unpriced)")
    rope_type = ds.rope.get("rope_type", "default")
    if rope_type not in ("default", "yarn"):
        out.append(f"rope_type={rope_type!r}: written as Megatron's plain RoPE (--rope-type rope)")
    if ds.attention_bias:
        out.append("attention_bias=True: Megatron's multi-latent attention has no projection biases "
                   "(--disable-bias-linear)")
    return out

