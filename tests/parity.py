"""Helpers of the gloo parity tests: the single-process reference and the weights a
multi-process run dumped (``RunSpec(dump=True)``)."""

from __future__ import annotations

from pathlib import Path

import torch

from autopar.plan import Plan
from autopar.runtime import TrainConfig
from autopar.runtime.context import ParallelContext
from autopar.runtime.state import full_state
from autopar.runtime.train import build_program, train


# GLM-4.5: one dense block, then mixture-of-experts blocks with a shared expert (two block kinds).
HF_GLM4_MOE = ("hf:Glm4MoeConfig:num_hidden_layers=4,first_k_dense_replace=1,hidden_size=64,num_attention_heads=4,"
               "num_key_value_heads=2,intermediate_size=96,moe_intermediate_size=32,n_routed_experts=4,"
               "num_experts_per_tok=2,n_group=1,topk_group=1,vocab_size=128,seq=16")


def hf_deepseek_v3(layers: int, lead: int) -> str:
    """A toy DeepSeek-V3: latent attention (low-rank ``q_a_proj``, ``kv_a_proj_with_mqa``),
    ``lead`` dense blocks, then mixture-of-experts blocks with a shared expert."""
    return (f"hf:DeepseekV3Config:num_hidden_layers={layers},first_k_dense_replace={lead},hidden_size=64,"
            "num_attention_heads=4,num_key_value_heads=4,intermediate_size=96,kv_lora_rank=8,q_lora_rank=12,"
            "qk_nope_head_dim=16,qk_rope_head_dim=8,v_head_dim=16,n_routed_experts=4,n_group=1,topk_group=1,"
            "num_experts_per_tok=2,moe_intermediate_size=32,vocab_size=128,seq=16")


def single_process(plan: Plan, steps: int, cfg: TrainConfig) -> tuple[list[float], dict[str, torch.Tensor],
                                                                      dict[str, torch.Tensor]]:
    """``plan`` (one device) trained ``steps`` steps in this process: its losses, and the full
    weights before and after."""
    ctx = ParallelContext(mesh=None, device=torch.device("cpu"))
    prog = build_program(plan, ctx, cfg)
    initial = full_state(prog)
    result = train(plan, steps, ctx, cfg, program=prog)
    return result.losses, initial, full_state(prog)


def dumped(tmp: Path, name: str) -> dict[str, torch.Tensor]:
    """The full weights a run dumped, merged over the ranks that wrote a share."""
    state: dict[str, torch.Tensor] = {}
    for f in sorted(tmp.glob(f"{name}.rank*.pt")):
        state.update(torch.load(f))
    return state
