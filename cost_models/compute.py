"""Compute time of one micro-batch through a block, the embedding and the head (seconds).

A pass costs ``FLOPs / (peak(dtype) · matmul_efficiency) + bytes / (hbm_bw · memory_efficiency)``:
a roofline sum of the GEMMs and of the memory-bound element-wise kernels (norms, GeLU/SwiGLU,
dropout, softmax, residual adds, bias adds). The element-wise traffic of a block's forward is
taken equal to the bytes it saves for backward (``memory.block_act_bytes`` without
recompute): each saved tensor is written once by the kernel that makes it. The part tensor
parallelism leaves replicated is computed redundantly on every tp rank unless sequence
parallelism splits it, which is why SP shortens the forward (Korthikanti et al. Table 4).

Backward costs twice the forward (input and weight gradients). Recompute adds, per block,
one forward (full), or the attention core's FLOPs and element-wise bytes (selective).
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models import memory
from cost_models.hardware import HardwareProfile
from cost_models.model_profile import ModelProfile
from cost_models.strategy import Strategy


@dataclass(frozen=True, kw_only=True, slots=True)
class PassTimes:
    """Seconds of one micro-batch's forward, recompute and backward."""

    forward_s: float
    recompute_s: float
    backward_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.recompute_s + self.backward_s


def matmul_s(flops: float, hw: HardwareProfile, dtype: str) -> float:
    """GEMM time of ``flops`` at the calibrated fraction of the dtype's dense peak."""
    return flops / (hw.peak_flops(dtype) * hw.matmul_efficiency)


def memory_s(nbytes: float, hw: HardwareProfile) -> float:
    """Element-wise time of ``nbytes`` of device-memory traffic."""
    return nbytes / (hw.hbm_bw_gbps * 1e9 * hw.memory_efficiency)


def block_times(model: ModelProfile, hw: HardwareProfile, strat: Strategy) -> PassTimes:
    """One block, one micro-batch, on one tp rank."""
    tokens = strat.micro_batch * model.seq
    mm = tokens * model.block_matmul_flops_per_token / strat.tp
    attn = tokens * model.block_attn_flops_per_token / strat.tp
    fwd = matmul_s(mm + attn, hw, strat.dtype) + memory_s(
        memory.block_act_bytes(model, strat, "none"), hw)
    if strat.recompute == "full":
        rc = fwd
    elif strat.recompute == "selective":
        rc = matmul_s(attn, hw, strat.dtype) + memory_s(memory.block_attn_act_bytes(model, strat), hw)
    else:
        rc = 0.0
    return PassTimes(forward_s=fwd, recompute_s=rc, backward_s=2 * fwd)


def first_times(model: ModelProfile, hw: HardwareProfile, strat: Strategy) -> PassTimes:
    """Embedding lookup (a gather: memory-bound), its dropout, and the gradient scatter-add:
    forward traffic = embedding output (elem bytes) + mask, per micro-batch."""
    tokens = strat.micro_batch * model.seq
    elem = 4 if strat.dtype == "fp32" else 2
    fwd = memory_s(tokens * model.hidden * (elem + 1), hw)
    return PassTimes(forward_s=fwd, recompute_s=0.0, backward_s=2 * fwd)


def last_times(model: ModelProfile, hw: HardwareProfile, strat: Strategy) -> PassTimes:
    """Final norm, output projection and cross-entropy: projection FLOPs / tp plus the fp32
    logits written, read by the softmax and written back as probabilities (3 x 4 s b V / tp)."""
    tokens = strat.micro_batch * model.seq
    flops = tokens * model.head_flops_per_token / strat.tp
    logits = tokens * model.vocab / strat.tp * 4
    fwd = matmul_s(flops, hw, strat.dtype) + memory_s(3 * logits, hw)
    return PassTimes(forward_s=fwd, recompute_s=0.0, backward_s=2 * fwd)
