"""Where a rank's step time goes, measured with ``torch.profiler`` (``autopar calibrate``).

Every microsecond a rank's training thread spends inside an operator is the self time of
exactly one profiler event, so summing self times by operator kind splits the step:

- ``gemm``: weight and batched matrix products (``aten::mm``, ``addmm``, ``bmm`` ...), with the
  FLOPs the profiler counts for them (``with_flops``): their rate is the GEMM throughput the
  rank reached inside the real program, at its shapes, with its neighbours running;
- ``attention``: the fused attention kernels (``scaled_dot_product_*``);
- ``optimizer``: the optimizer step, its children included (``Optimizer.step#…``);
- ``comm``: collective calls on the training thread (``c10d::…``: enqueue, or the whole
  collective where it is synchronous);
- ``other``: every other operator: element-wise, norms, losses, copies, and the host time of
  dispatching each op (its self time is where that time lands).

What no operator covers (Python between ops, waiting for another rank's data, barriers) is
``step - (sum of the above)``: the exposed communication and imbalance. On CUDA the operator
times are device times. Times are seconds per optimizer step; FLOPs per step.

Peak memory on CPU, which has no allocator statistics: the profiler's per-operator allocation
accounting (``profile_memory``), accumulated in time order, gives the most bytes allocated at
once beyond what was live when profiling began (``live_bytes``: weights, gradients, optimizer
state), at operator granularity. On CUDA: the caching allocator's ``max_memory_allocated``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity, profile

GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation",
                      "aten::addbmm"})
PHASES = ("gemm", "attention", "optimizer", "comm", "other")


def _kind(name: str) -> str:
    if name in GEMM_OPS:
        return "gemm"
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        return "attention"
    if name.startswith(("c10d::", "gloo:", "nccl:", "record_param_comms")):
        return "comm"
    return "other"


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself."""
    return getattr(t, "_local_tensor", t)


def live_bytes(modules: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> float:
    """Bytes of this rank's weights, buffers, gradients and optimizer state (each storage once)."""
    seen: dict[int, int] = {}
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    tensors += [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    tensors += [v for opt in optimizers for state in opt.state.values() for v in state.values()
                if isinstance(v, torch.Tensor)]
    for t in tensors:
        storage = _local(t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return float(sum(seen.values()))


@contextmanager
def recording(device: torch.device) -> Iterator[profile]:
    """Profile the steps run inside (CPU operators; on CUDA, their kernels too), counting FLOPs."""
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, with_flops=True, profile_memory=not cuda) as prof:
        yield prof


def summary(prof: profile, steps: int, device: torch.device) -> dict[str, float]:
    """Seconds per step of each phase (``PHASES``), the GEMM FLOPs per step (``gemm_flops``)
    and, on CPU, the most bytes allocated at once beyond the live ones (``peak_delta_bytes``)."""
    cuda = device.type == "cuda"
    out = dict.fromkeys(PHASES, 0.0)
    out["gemm_flops"] = 0.0
    nested = 0.0  # operator time inside the optimizer step, counted there
    for evt in prof.events():
        if evt.name.startswith("Optimizer.step#"):
            inclusive = evt.device_time_total if cuda else evt.cpu_time_total
            out["optimizer"] += inclusive * 1e-6
            nested += (inclusive - (evt.self_device_time_total if cuda else evt.self_cpu_time_total)) * 1e-6
            continue
        kind = _kind(evt.name)
        out[kind] += (evt.self_device_time_total if cuda else evt.self_cpu_time_total) * 1e-6
        if kind == "gemm":
            out["gemm_flops"] += float(evt.flops or 0)
    out["other"] = max(0.0, out["other"] - nested)
    per_step = {k: v / steps for k, v in out.items()}
    held = peak = 0.0
    if not cuda:
        for evt in sorted(prof.events(), key=lambda e: e.time_range.start):
            held += evt.cpu_memory_usage if evt.name == "[memory]" else evt.self_cpu_memory_usage
            peak = max(peak, held)
    return {**per_step, "peak_delta_bytes": peak}
