"""The ops whose meta/CPU implementation keeps other tensors than the GPU kernel training runs
(``autopar.trace.measure``'s list): run on meta as that kernel would, each output attached to
its inputs by an autograd node that saves what the kernel saves. Nothing is computed."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.flop_counter import sdpa_flop_count


class _Saves(torch.autograd.Function):
    """An op whose forward already ran (on meta) and keeps ``saved`` for backward, as a GPU
    kernel does. Never differentiated: the tracer only counts."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, *inputs_and_saved: Any) -> torch.Tensor:
        n = inputs_and_saved[0]
        ctx.save_for_backward(*inputs_and_saved[1 + n:])
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *grads):  # pragma: no cover - the tracer never runs backward
        raise RuntimeError("autopar's measuring ops have no backward")


def _kernel(out: torch.Tensor, inputs: list[torch.Tensor | None], saved: list[torch.Tensor]) -> torch.Tensor:
    """``out`` (computed without autograd) attached to ``inputs`` in the autograd graph."""
    grad_inputs = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not grad_inputs:
        return out
    return _Saves.apply(out, len(grad_inputs), *grad_inputs, *saved)


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout keeping a 1-byte mask (values are irrelevant on meta)."""
    if p <= 0:
        return x
    mask = torch.empty(x.shape, dtype=torch.bool, device=x.device)
    return x * mask * (1.0 / (1.0 - p))


def rms_norm(x: torch.Tensor, shape: list[int], weight: torch.Tensor | None, eps: float | None) -> torch.Tensor:
    """RMSNorm keeping its input and a float32 rstd, as the fused CUDA kernel does."""
    with torch.no_grad():
        out = torch.empty_like(x)
        rstd = torch.empty(*x.shape[: x.dim() - len(shape)], *([1] * len(shape)), dtype=torch.float32,
                           device=x.device)
    return _kernel(out, [x, weight], [x, rstd])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False, *, mode: str = "fused") -> tuple[torch.Tensor, float]:
    """Attention as ``mode`` keeps it; returns (output, FLOPs not seen by FlopCounterMode)."""
    b, heads, s_q, d = q.shape
    s_k = k.shape[-2]
    if mode == "fused":
        with torch.no_grad():
            out = torch.empty(b, s_q, heads, v.shape[-1], dtype=q.dtype, device=q.device).transpose(1, 2)
            lse = torch.empty(b, heads, s_q, dtype=torch.float32, device=q.device)
        saved = [q, k, v, out, lse] + ([attn_mask] if attn_mask is not None else [])
        flops = sdpa_flop_count((b, heads, s_q, d), (b, heads, s_k, d), (b, heads, s_k, v.shape[-1]))
        return _kernel(out, [q, k, v], saved), float(flops)
    if k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scores = (q * (scale or 1.0 / math.sqrt(d))) @ k.transpose(-2, -1)
    if is_causal:  # a constant additive mask: nothing to save, as in Megatron's fused softmax
        scores = scores + torch.empty(s_q, s_k, dtype=scores.dtype, device=scores.device)
    elif attn_mask is not None:
        bias = attn_mask if attn_mask.dtype != torch.bool else torch.empty(
            attn_mask.shape, dtype=scores.dtype, device=scores.device)
        scores = scores + bias
    probs = dropout(torch.softmax(scores, dim=-1), dropout_p)
    return probs @ v, 0.0
