"""What autopar's built-in blocks keep for backward on a GPU, against the trace the cost model
prices: bytes per token per block (in units of the hidden size h) and what the loss holds per
logit, under the runtime's two precision programs:

- ``autocast``: fp32 weights under ``torch.autocast(bf16)`` (the DDP and single-device paths);
- ``bf16``: 16-bit weights, no autocast (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``).

Per block: the allocator's live bytes after the forward of 4 blocks less those of 2, less the
autocast cache's bf16 weight copies of 2 blocks, over 2 b s h. Loss: the live bytes after the
forward less every block's and the cache's, and the most allocated in the backward beyond the
forward's live bytes, each over b s V. Needs CUDA. Usage: python benchmarks/gpu_memory_probe.py
"""

from __future__ import annotations

import json

import torch
from torch import nn

from autopar.model import build_model, cross_entropy
from autopar.profiles import profile_spec
from autopar.spec import parse_model_spec

SPECS = ("gpt:layers={L},hidden=1024,heads=8,vocab=32000,seq=1024,tied=0",
         "llama:layers={L},hidden=1024,heads=8,kv_heads=8,ffn=2816,vocab=32000,seq=1024,tied=0")
BATCH = 4


def _cache_bytes(model: nn.Module) -> int:
    """Bytes of autocast's bf16 copies of every Linear's parameters."""
    return sum(p.numel() * 2 for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters())


def _run(spec_text: str, mode: str) -> dict[str, float]:
    spec = parse_model_spec(spec_text)
    model = build_model(spec, device="cuda")
    if mode == "bf16":
        model = model.bfloat16()
    x = torch.randint(0, spec.vocab, (BATCH, spec.seq), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "autocast"):
        loss = cross_entropy(model(x), x)
    torch.cuda.synchronize()
    live = torch.cuda.memory_allocated() - base
    fwd_peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    bwd_peak = torch.cuda.max_memory_allocated() - base
    out: dict[str, float] = {"live": live, "fwd_peak": fwd_peak, "bwd_peak": bwd_peak,
                             "cache": _cache_bytes(model) if mode == "autocast" else 0}
    del model, loss
    torch.cuda.empty_cache()
    return out


def main() -> None:
    rows = []
    for template in SPECS:
        spec = parse_model_spec(template.format(L=2))
        tokens, h, vocab = BATCH * spec.seq, spec.hidden, spec.vocab
        traced = sum(profile_spec(spec).act_bytes_per_token(True)) / h
        for mode in ("autocast", "bf16"):
            two, four = _run(template.format(L=2), mode), _run(template.format(L=4), mode)
            block = (four["live"] - two["live"] - (four["cache"] - two["cache"])) / 2
            loss_kept = two["live"] - 2 * block - two["cache"]
            row = {"model": spec.arch, "mode": mode, "block_bytes_per_token_h": round(block / tokens / h, 2),
                   "traced_block_bytes_per_token_h": round(traced, 2),
                   "rest_kept_bytes_per_logit": round(loss_kept / tokens / vocab, 2),
                   "backward_peak_over_live_bytes_per_logit": round((two["bwd_peak"] - two["live"]) / tokens / vocab, 2),
                   "forward_peak_over_live_bytes_per_logit": round((two["fwd_peak"] - two["live"]) / tokens / vocab, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
