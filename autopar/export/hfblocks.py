"""HF decoder blocks that Megatron-Core's GPT builder makes with further flags: Qwen2 and Qwen3
(dense and MoE), GLM-4.5 (``Glm4MoeConfig``) and DeepSeek-V2/V3 (``DeepseekV2Config``,
``DeepseekV3Config``: Kimi-K2's too); of Llama, Mistral and Mixtral (Megatron's Llama-style
block as it is), their RoPE (base, Llama 3.1 scaling), norm epsilon and biases.

Each is read off its HF config (transformers 5, as ``autopar.hf`` builds it) into Megatron-LM's
flags (``megatron/training/arguments.py`` and the ``TransformerConfig`` / ``MLATransformerConfig``
fields it generates flags from, main of 2026-11), as Megatron-LM's own scripts write them
(``examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh``,
``examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-V2-Lite.sh``):

- attention: q/k/v biases (``--add-qkv-bias``: Qwen2, Qwen2-MoE, GLM-4.5), per-head q/k RMSNorm
  (``--qk-layernorm``: Qwen3, GLM-4.5 with ``use_qk_norm``), a head width other than hidden/heads
  (``--kv-channels``), partial rotary (``--rotary-percent``: GLM-4.5), the RoPE base; DeepSeek's
  multi-latent attention (``--multi-latent-attention``, its ranks and head widths, its q/kv
  low-rank norms as ``--qk-layernorm``, ``--rope-type``);
- experts: each expert's width (``--moe-ffn-hidden-size``), shared experts
  (``--moe-shared-expert-intermediate-size``, Qwen2-MoE's sigmoid gate ``--moe-shared-expert-gate``),
  leading dense blocks (``--moe-layer-freq '([0]*k+[1]*n)'``, the count the trace found);
- routers, as ``topk_routing_with_score_function`` (megatron/core/transformer/moe/moe_utils.py)
  computes them: softmax over the chosen logits is HF's softmax renormalised over the top-k
  (Mixtral, Qwen with ``norm_topk_prob``: Megatron's default); softmax before the top-k, not
  renormalised, is ``--moe-router-pre-softmax`` (Qwen without it, DeepSeek-V2); DeepSeek-V3's
  and GLM-4.5's sigmoid with the per-expert choice bias is ``--moe-router-score-function sigmoid
  --moe-router-enable-expert-bias`` (always renormalised), with its groups
  (``--moe-router-num-groups``/``--moe-router-group-topk``: Megatron ranks a group by its top
  top-k/group-topk scores, HF's V3 and GLM by their top 2) and ``routed_scaling_factor``
  (``--moe-router-topk-scaling-factor``), in fp32 as HF casts it (``--moe-router-dtype fp32``).

What Megatron builds otherwise is a ``note`` (written into the script's header): the parallel
layout is the plan's either way, and no note changes a price.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.spec import ModelSpec, hf_option_values

LLAMA = ("LlamaConfig", "MistralConfig", "MixtralConfig")
"""Llama-style configs (``Family.LLAMA``): only their RoPE, norm epsilon and biases are read."""
QWEN = ("Qwen2Config", "Qwen3Config", "Qwen2MoeConfig", "Qwen3MoeConfig")
SIGMOID = ("Glm4MoeConfig", "DeepseekV3Config")
"""Configs whose router scores experts by a sigmoid with a per-expert choice bias."""
LATENT = ("DeepseekV2Config", "DeepseekV3Config")
"""Configs with multi-latent attention."""
CONFIGS = (*QWEN, "Glm4MoeConfig", *LATENT)
"""The HF config classes whose block only these flags make Megatron's (``Family.MCORE``)."""
READ = (*LLAMA, *CONFIGS)
"""The HF config classes this module reads."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Block:
    """An HF model's block as Megatron-Core's GPT builder makes it, beyond ``Shape``'s Llama-style
    block (RMSNorm, SwiGLU, RoPE, no biases) and its experts' count and top-k."""

    args: tuple[str, ...]
    """``pretrain_gpt.py``'s further model arguments."""
    notes: tuple[str, ...]
    """What Megatron builds differently from the HF model, one line each."""
    latent: bool
    """Multi-latent attention (no kv heads: Megatron refuses ``--group-query-attention`` with it)."""


def _int(config: Any, name: str, default: int = 0) -> int:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _num(value: float) -> str:
    return f"{float(value):g}"


def _layer_pattern(dense: int, layers: int) -> str:
    """``--moe-layer-freq``'s pattern: 0 for each leading dense block, 1 for each MoE one."""
    return f"([0]*{dense}+[1]*{layers - dense})"


def _attention(cls: str, config: Any, spec: ModelSpec, seq: int, notes: list[str]) -> list[str]:
    """The attention's flags but RoPE's (``_rope``)."""
    if cls in LATENT:
        if getattr(config, "attention_bias", False):
            notes.append("attention_bias=True: Megatron's multi-latent attention is written without biases "
                         "(--disable-bias-linear)")
        q_rank = _int(config, "q_lora_rank")
        return ["--multi-latent-attention", "--qk-layernorm", *(["--q-lora-rank", str(q_rank)] if q_rank else []),
                "--kv-lora-rank", str(_int(config, "kv_lora_rank")),
                "--qk-head-dim", str(_int(config, "qk_nope_head_dim")),
                "--qk-pos-emb-head-dim", str(_int(config, "qk_rope_head_dim")),
                "--v-head-dim", str(_int(config, "v_head_dim"))]
    args = []
    bias = (cls == "Qwen2Config" or (cls == "Qwen2MoeConfig" and getattr(config, "qkv_bias", True))
            or bool(getattr(config, "attention_bias", False)))
    if bias:
        args.append("--add-qkv-bias")
        if cls in ("Qwen3Config", "Qwen3MoeConfig", *LLAMA):
            notes.append("attention_bias=True biases o_proj too; Megatron's --add-qkv-bias biases q, k and v only")
    if cls in ("Qwen3Config", "Qwen3MoeConfig") or getattr(config, "use_qk_norm", False):
        args.append("--qk-layernorm")
    if cls in LLAMA and getattr(config, "mlp_bias", False):
        notes.append("mlp_bias=True: Megatron's --disable-bias-linear builds the MLP without biases")
    head = _int(config, "head_dim") or spec.hidden // spec.heads
    if head != spec.hidden // spec.heads or cls in ("Qwen3Config", "Qwen3MoeConfig", "Glm4MoeConfig"):
        args += ["--kv-channels", str(head)]
    return args + _windows(config, seq, notes)


def _windows(config: Any, seq: int, notes: list[str]) -> list[str]:
    """``--window-size`` for HF's sliding windows shorter than the sequence (HF lets a query see
    the keys less than ``sliding_window`` behind it: Transformer Engine's left size is one
    less) and, where some layers attend in full, ``--window-attn-skip-freq``'s pattern (1: a
    windowed layer; megatron/core/transformer/utils.py ``is_layer_window_attention``)."""
    from autopar.hf import attention_windows
    windows = attention_windows(config)
    live = sorted({w for w in windows if w < seq} - {0})
    if not live:
        return []
    if "chunked_attention" in (getattr(config, "layer_types", None) or ()) or len(live) > 1:
        notes.append(f"local attention of {', '.join(map(str, live))} tokens (chunks or several windows): "
                     f"written with causal attention over all {seq}")
        return []
    args = ["--window-size", f"({live[0] - 1},0)"]
    if any(w == 0 or w >= seq for w in windows):
        args += ["--window-attn-skip-freq", "[" + ",".join("1" if 0 < w < seq else "0" for w in windows) + "]"]
    return args


def _rope(cls: str, config: Any, notes: list[str]) -> list[str]:
    rope = dict(getattr(config, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    args = ["--rotary-base", f"{int(rope.get('rope_theta', 10000))}"]
    partial = float(rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        args += ["--rotary-percent", _num(partial)]
    if cls in LATENT:
        args += ["--rope-type", "yarn" if kind == "yarn" else "rope"]
        if kind == "yarn":
            args += ["--rotary-scaling-factor", _num(rope.get("factor", 1.0)), "--mscale", _num(rope.get("mscale", 1.0)),
                     "--mscale-all-dim", _num(rope.get("mscale_all_dim", 0.0))]
    if kind == "llama3":  # Megatron's _apply_scaling fixes the other three at Llama 3.1's values
        args += ["--use-rope-scaling", "--rope-scaling-factor", _num(rope.get("factor", 8.0))]
        fixed = {"low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8192}
        off = {k: rope[k] for k, v in fixed.items() if k in rope and float(rope[k]) != v}
        if off:
            notes.append(f"Llama 3 RoPE scaling with {off}: Megatron's --use-rope-scaling fixes {fixed}")
    elif kind not in ("default", "yarn") or (kind == "yarn" and cls not in LATENT):
        notes.append(f"rope_type={kind!r}: written as plain RoPE")
    return args


def _experts(cls: str, config: Any, spec: ModelSpec, dense_layers: int, notes: list[str]) -> list[str]:
    if not spec.experts:
        return []
    width = _int(config, "moe_intermediate_size")
    args = [*(["--moe-layer-freq", _layer_pattern(dense_layers, spec.layers)] if dense_layers else []),
            "--moe-ffn-hidden-size", str(width)]
    shared = (_int(config, "shared_expert_intermediate_size") if cls == "Qwen2MoeConfig"
              else _int(config, "n_shared_experts") * width)
    if shared:
        args += ["--moe-shared-expert-intermediate-size", str(shared)]
        if cls == "Qwen2MoeConfig":
            args.append("--moe-shared-expert-gate")
    renormalise = bool(getattr(config, "norm_topk_prob", False)) and cls != "DeepseekV2Config"
    if cls in SIGMOID:
        args += ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
        if not renormalise and spec.topk > 1:
            notes.append("norm_topk_prob=False: Megatron's sigmoid router always renormalises the chosen scores")
    elif not renormalise:
        args.append("--moe-router-pre-softmax")
    groups, group_topk = _int(config, "n_group", 1) or 1, _int(config, "topk_group", 1) or 1
    if groups > 1 and (cls in SIGMOID or getattr(config, "topk_method", "") == "group_limited_greedy"):
        args += ["--moe-router-num-groups", str(groups), "--moe-router-group-topk", str(group_topk)]
        per_group = max(1, spec.topk // group_topk)
        if cls == "DeepseekV2Config":
            notes.append(f"group_limited_greedy ranks expert groups by their best score; Megatron by the sum of "
                         f"their top {per_group}")
        elif per_group != 2:
            notes.append(f"HF ranks expert groups by their top 2 scores; Megatron by their top {per_group}")
    scaling = float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)
    if scaling != 1.0 and cls in (*SIGMOID, *LATENT):
        args += ["--moe-router-topk-scaling-factor", _num(scaling)]
    if cls in (*SIGMOID, *LATENT):
        args += ["--moe-router-dtype", "fp32"]  # HF casts these routers' weights to fp32
    return args


def read(spec: ModelSpec, dense_layers: int, seq: int) -> Block:
    """``spec``'s block (an ``hf:`` spec of one of ``READ``) from its HF config;
    ``dense_layers``: the leading dense blocks its trace found (``ModelProfile.lead_layers``);
    ``seq``: the plan's sequence length."""
    from autopar.hf import make_config
    cls = spec.source
    config = make_config(cls, hf_option_values(spec.options))
    notes: list[str] = []
    args = [*_attention(cls, config, spec, seq, notes), *_rope(cls, config, notes),
            "--norm-epsilon", _num(getattr(config, "rms_norm_eps", 1e-6)),
            *([] if cls in LLAMA else _experts(cls, config, spec, dense_layers, notes))]
    if cls == "DeepseekV3Config":
        notes.append("DeepSeek-V3's multi-token prediction is in neither HF's model nor the plan: "
                     "--mtp-num-layers 1 adds it (unpriced)")
    return Block(args=tuple(args), notes=tuple(notes), latent=cls in LATENT)
