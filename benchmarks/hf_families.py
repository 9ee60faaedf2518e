"""The HF family matrix: every common decoder-only family's tiny twin through ``autopar verify``
(FSDP, TP, TP+SP, PP, selective and per-op recompute, and the pairs TP with selective, SP with
full and with per-op recompute: 2 gloo ranks against one process), then planned on 64 H100 with
the verdicts; prints what is proved, what is refused and why, and the plan chosen.
``hf_compositions.py`` composes them further on 4 ranks.

    python benchmarks/hf_families.py [family ...] [--json]

The same matrix is the ``families`` test tier: ``pytest -m families tests/test_hf_families.py``.
"""

from __future__ import annotations

import json
import sys
import time

FAMILIES = {
    "llama": "hf:LlamaConfig:num_key_value_heads=8",
    "qwen2": "hf:Qwen2Config",
    "mistral": "hf:MistralConfig",
    "gpt-neox": "hf:GPTNeoXConfig",
    "gpt2": "hf:GPT2Config",
    "opt": "hf:OPTConfig",
    "falcon-mqa": "hf:FalconConfig",
    "falcon-gqa": "hf:FalconConfig:new_decoder_architecture=True,num_attention_heads=128,hidden_size=8192,num_kv_heads=8",
    "bloom": "hf:BloomConfig:seq=2048",
    "stablelm": "hf:StableLmConfig",
    "phi": "hf:PhiConfig",
    "phi3": "hf:Phi3Config:pad_token_id=None",
    "gemma": "hf:GemmaConfig",
    "gemma2": "hf:Gemma2Config",
    "gemma3": "hf:Gemma3TextConfig:seq=8192",  # 131072 by default (glm4 ... llama4 too): no device fits it without cp
    "qwen3": "hf:Qwen3Config",
    "olmo2": "hf:Olmo2Config",
    "starcoder2": "hf:Starcoder2Config",
    "granite": "hf:GraniteConfig",
    "cohere": "hf:CohereConfig",
    "gptj": "hf:GPTJConfig",
    "codegen": "hf:CodeGenConfig",
    "mpt": "hf:MptConfig",
    "gpt-bigcode": "hf:GPTBigCodeConfig",
    "olmo": "hf:OlmoConfig",
    "olmo3": "hf:Olmo3Config",
    "glm4": "hf:Glm4Config:seq=8192",
    "exaone4": "hf:Exaone4Config",
    "ernie4.5": "hf:Ernie4_5Config:seq=8192",
    "seed-oss": "hf:SeedOssConfig:seq=8192",
    "mixtral": "hf:MixtralConfig:seq=8192",
    "gpt-oss": "hf:GptOssConfig:seq=8192",
    "llama4": "hf:Llama4TextConfig:seq=8192",
    "qwen2-moe": "hf:Qwen2MoeConfig:seq=8192",
    "qwen3-moe": "hf:Qwen3MoeConfig:seq=8192",
    "phimoe": "hf:PhimoeConfig:seq=8192",
    "granitemoe": "hf:GraniteMoeConfig",
    "glm4-moe": "hf:Glm4MoeConfig:seq=8192",
    "ernie4.5-moe": "hf:Ernie4_5_MoeConfig:seq=8192",
    "deepseek-v3": "hf:DeepseekV3Config",
    "deepseek-v2-lite": "hf:DeepseekV2Config:num_hidden_layers=27,hidden_size=2048,num_attention_heads=16,"
                        "num_key_value_heads=16,intermediate_size=10944,moe_intermediate_size=1408,n_routed_experts=64,"
                        "n_shared_experts=2,num_experts_per_tok=6,first_k_dense_replace=1,q_lora_rank=None,"
                        "kv_lora_rank=512",  # the default config has no top-k: DeepSeek-V2-Lite's published shape
    "olmoe": "hf:OlmoeConfig",
    "glm4-moe-lite": "hf:Glm4MoeLiteConfig:seq=8192",  # GLM-4.7-Flash: latent attention, one dense block
    "minimax-m2": "hf:MiniMaxM2Config:seq=8192",
    "exaone-moe": "hf:ExaoneMoeConfig",
    "cohere2-moe": "hf:Cohere2MoeConfig",
    "smollm3": "hf:SmolLM3Config",
    "flexolmo": "hf:FlexOlmoConfig",
    "cwm": "hf:CwmConfig:seq=8192",
    "helium": "hf:HeliumConfig",
    "arcee": "hf:ArceeConfig",
    "persimmon": "hf:PersimmonConfig",
    "cohere2": "hf:Cohere2Config",
}
"""Family -> ``--model`` (the config class's defaults: the released base model's shape)."""


def family_row(name: str, use_cache: bool = True) -> dict:
    """Verify ``name``'s twin and plan the family on 64 H100 without what failed."""
    from autopar.verify import verify
    from autopar.workflow import make_plan, read_job
    start = time.perf_counter()
    result = verify(FAMILIES[name], use_cache=use_cache)
    verify_s = time.perf_counter() - start
    plan, _ = make_plan(read_job(FAMILIES[name], "dgx-h100", 64, 512), time_limit_s=30)
    return {"family": name, "verify_s": round(verify_s, 1),
            "checks": {v.check.value: v.reason or "ok" for v in result.verdicts},
            "plan": {"dp": plan.mesh.dp, "tp": plan.mesh.tp, "pp": plan.mesh.pp, "zero": plan.zero_stage,
                     "sp": plan.sequence_parallel, "recompute": sorted(set(plan.recompute))},
            "plan_features": list(plan.features()), "plan_refusal": plan.refusal()}


def main(argv: list[str]) -> None:
    as_json = "--json" in argv
    names = [a for a in argv if not a.startswith("--")] or list(FAMILIES)
    rows = []
    from autopar.errors import UserError
    for name in names:
        try:
            row = family_row(name, use_cache="--no-cache" not in argv)
        except UserError as exc:  # one family cannot be verified or planned: say so, go on
            rows.append({"family": name, "error": str(exc)})
            print(f"{name:11s} error: {exc}", flush=True)
            continue
        rows.append(row)
        if not as_json:
            bad = {c: r for c, r in row["checks"].items() if r != "ok"}
            print(f"{name:11s} {row['verify_s']:5.1f} s  proved: "
                  f"{','.join(c for c, r in row['checks'].items() if r == 'ok'):24s} plan: {row['plan']}", flush=True)
            for check, reason in bad.items():
                print(f"{'':19s}refused {check}: {reason[:140]}", flush=True)
    if as_json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
