"""Where a rank's step time goes, measured with ``torch.profiler`` (``autopar calibrate``).

Every microsecond a rank's training thread spends inside an operator is the self time of
exactly one profiler event, so summing self times by operator kind splits the step:

- ``gemm``: weight and batched matrix products (``aten::mm``, ``addmm``, ``bmm`` ...), with the
  FLOPs the profiler counts for them (``with_flops``; a DTensor's GEMM once, on its shard): their
  rate is the GEMM throughput the rank reached inside the real program, at its shapes, with its
  neighbours running;
- ``attention``: the fused attention kernels (``scaled_dot_product_*``);
- ``optimizer``: the optimizer step, its children included (``Optimizer.step#…``);
- ``comm``: collective calls on the training thread (``c10d::…``: enqueue, or the whole
  collective where it is synchronous), DTensor's functional collectives and their waits
  (``_c10d_functional::…``: tensor parallelism's all-reduces, 0.57 s of a 0.91 s step of a tp 4
  long-sequence GPT on 4 CPU ranks in ``wait_tensor``; they counted as other operators before,
  and ``calibrate`` fitted the element-wise rate to them), and the self time of FSDP2's scopes
  around its all-gathers and reduce-scatters (``FSDP_COMM``: on CPU ranks their synchronous
  waits; they counted as other operators before, 0.66 s of the 0.91 s a ZeRO-3 step of a
  2-block GPT at hidden 512 spent in them on 4 ranks);
- ``other``: every other operator: element-wise, norms, losses, copies, and the host time of
  dispatching each op (its self time is where that time lands).

What no operator covers (Python between ops, waiting for another rank's data, barriers) is
``step - (sum of the above)``: the exposed communication and imbalance. On CUDA the operator
times are device times: each kernel counted once, under the operator that launched it (the
profiler also lists every kernel as an event of its own, which is skipped). Times are seconds
per optimizer step (the median over the profiled steps, whose ends the worker marks: one step
slowed by the machine moves none); FLOPs per step.

Peak memory on CPU, which has no allocator statistics: what was live when profiling began
(``live_bytes``: weights, gradients, optimizer state and every other tensor Python holds, such as
the pipeline's receive buffers) plus the most bytes allocated at once beyond it
(``peak_delta_bytes``). The profiler's own accounting (``profile_memory``) sees only the frees
on its thread of blocks allocated under it: it misses a gloo worker thread dropping the last
reference to a collective's buffer (FSDP2's all-gather and reduce-scatter buffers, measured
2-3x the real peak for ZeRO-3) and the frees of blocks older than the profile (the last step's
gradients). So ``recording`` turns on c10's ``FLAGS_caffe2_report_cpu_memory_usage``, under
which the CPU allocator sizes every block and free on every thread, and ``summary`` reads its
running total off the profiler's allocation events, from the second profiled step on (its start
is steady state: the same bytes live as when profiling began). On CUDA: the caching
allocator's ``max_memory_allocated``.
"""

from __future__ import annotations

import bisect
import ctypes
import gc
import statistics
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch._C._profiler import _EventType
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation",
                      "aten::addbmm"})
PHASES = ("gemm", "attention", "optimizer", "comm", "other")
FSDP_COMM = ("FSDP::all_gather", "FSDP::post_backward_reduce", "FSDP::post_backward_rs_wait")
"""FSDP2's ``record_function`` scopes around its collectives
(``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``): their self time is the
collective's call and, where it runs synchronously (gloo on CPU ranks), its wait."""
STEP_END = "autopar.step_end"
"""The profiler mark ``step_ended`` leaves after each profiled step."""


def _kind(name: str) -> str:
    if name in GEMM_OPS:
        return "gemm"
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        return "attention"
    if name.startswith(("c10d::", "_c10d_functional", "gloo:", "nccl:", "record_param_comms")):
        return "comm"
    if name.startswith(FSDP_COMM) and not name.startswith("FSDP::all_gather_copy_out"):
        return "comm"
    return "other"


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself."""
    return getattr(t, "_local_tensor", t)


def live_bytes(modules: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> float:
    """Bytes of this rank's weights, buffers, gradients and optimizer state, and of every other
    CPU tensor Python holds (pipelining's per-micro-batch receive buffers), each storage once."""
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    tensors += [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    tensors += [v for opt in optimizers for state in opt.state.values() for v in state.values()
                if isinstance(v, torch.Tensor)]
    gc.collect()
    held = [t for t in gc.get_objects() if issubclass(type(t), torch.Tensor) and _local(t).device.type == "cpu"]
    return float(sum(_storages([*tensors, *held]).values()))


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Bytes of each distinct storage (by address) under ``tensors`` (DTensors: their shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        try:  # sparse, meta and other storage-less tensors hold nothing here
            storage = _local(t).untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if storage.data_ptr():
            seen[storage.data_ptr()] = storage.nbytes()
    return seen


def _cpu_accounting() -> ctypes.c_bool | None:
    """c10's ``FLAGS_caffe2_report_cpu_memory_usage`` (``c10/core/CPUAllocator.cpp``): while
    set, the CPU allocator records every block's size and subtracts it at its free on any
    thread; None where this build does not export it."""
    for lib in sorted((Path(torch.__file__).parent / "lib").glob("*c10.*")):
        try:
            return ctypes.c_bool.in_dll(ctypes.CDLL(str(lib)), "FLAGS_caffe2_report_cpu_memory_usage")
        except (OSError, ValueError):
            continue
    return None


@contextmanager
def recording(device: torch.device) -> Iterator[profile]:
    """Profile the steps run inside (CPU operators; on CUDA, their kernels too), counting FLOPs."""
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    flag = None if cuda else _cpu_accounting()
    was = bool(flag and flag.value)
    try:
        with profile(activities=acts, with_flops=True, profile_memory=not cuda) as prof:
            if flag is not None:
                flag.value = True
            yield prof
    finally:
        if flag is not None:
            flag.value = was


def step_ended() -> None:
    """Mark the end of a profiled step (``summary`` splits the profile there)."""
    with record_function(STEP_END):
        pass


def summary(prof: profile, steps: int, device: torch.device) -> dict[str, float]:
    """Seconds per step of each phase (``PHASES``), the GEMM FLOPs per step (``gemm_flops``),
    the profiler events outside the optimizer step per step (``events``: each adds the
    profiler's own time) and, on CPU, the most bytes allocated at once beyond the live ones
    (``peak_delta_bytes``).
    Where each step's end was marked (``step_ended``), each figure is the median over the
    steps (one step slowed by the machine moves none); else the mean."""
    cuda = device.type == "cuda"
    events = [e for e in prof.events() if e.device_type == DeviceType.CPU]  # a kernel's time is its operator's too
    ends = sorted(e.time_range.start for e in events if e.name == STEP_END)
    split = len(ends) == steps
    out = [dict.fromkeys((*PHASES, "gemm_flops", "events"), 0.0) for _ in range(steps if split else 1)]
    nested = [0.0] * len(out)  # operator time inside the optimizer step, counted there
    for evt in events:
        if evt.name == STEP_END:
            continue
        i = min(bisect.bisect_left(ends, evt.time_range.start), steps - 1) if split else 0
        if evt.name.startswith("Optimizer.step#"):
            inclusive = evt.device_time_total if cuda else evt.cpu_time_total
            out[i]["optimizer"] += inclusive * 1e-6
            nested[i] += (inclusive - (evt.self_device_time_total if cuda else evt.self_cpu_time_total)) * 1e-6
            out[i]["events"] -= sum(1 for _ in _beneath(evt))
            continue
        out[i]["events"] += evt.name != "[memory]"  # allocations are records, not operators
        kind = _kind(evt.name)
        out[i][kind] += (evt.self_device_time_total if cuda else evt.self_cpu_time_total) * 1e-6
        if kind == "gemm" and not _wraps_gemm(evt):
            out[i]["gemm_flops"] += float(evt.flops or 0)
    for step, inner in zip(out, nested):
        step["other"] = max(0.0, step["other"] - inner)
    per_step = ({k: statistics.median(s[k] for s in out) for k in out[0]} if split
                else {k: v / steps for k, v in out[0].items()})
    return {**per_step, "peak_delta_bytes": 0.0 if cuda else _peak_delta(prof)}


def _beneath(evt) -> Iterator:
    """Every event beneath ``evt`` in the profiler's tree."""
    stack = list(getattr(evt, "cpu_children", ()))
    while stack:
        child = stack.pop()
        yield child
        stack.extend(getattr(child, "cpu_children", ()))


def _wraps_gemm(evt) -> bool:
    """Whether a GEMM runs beneath ``evt``: a DTensor's ``aten::mm`` dispatches the same
    ``aten::mm`` on its local shard, and the profiler counts the FLOPs of both (the self time
    lands on the inner one)."""
    return any(child.name in GEMM_OPS for child in _beneath(evt))


def _walk(nodes: Iterable) -> Iterator:
    """Every node of the profiler's event tree under ``nodes``, parents first."""
    for n in nodes:
        yield n
        yield from _walk(n.children)


def step_allocations(prof: profile) -> tuple[list, float]:
    """The allocator's records (profiler event nodes, time order) from the start of the second
    profiled step (the first ``Optimizer.zero_grad`` after an ``Optimizer.step``; the first
    allocation when one step was profiled), and the allocator's level just before them, bytes
    (``recording``'s accounting); ``([], 0.0)`` without any."""
    assert prof.profiler is not None and prof.profiler.kineto_results is not None  # a finished profile
    nodes = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    allocs = sorted((n for n in nodes if n.tag == _EventType.Allocation), key=lambda n: n.start_time_ns)
    if not allocs:
        return [], 0.0
    steps = [n.end_time_ns for n in nodes if n.name.startswith("Optimizer.step#")]
    zeros = [n.start_time_ns for n in nodes if n.name.startswith("Optimizer.zero_grad#")]
    start = min((t for t in zeros if steps and t > min(steps)), default=allocs[0].start_time_ns)
    after = [n for n in allocs if n.start_time_ns >= start] or [allocs[-1]]
    return after, float(after[0].extra_fields.total_allocated - after[0].extra_fields.alloc_size)


def _peak_delta(prof: profile) -> float:
    """The most bytes the CPU allocator held beyond its level at the start of the second
    profiled step (``step_allocations``)."""
    after, base = step_allocations(prof)
    return float(max(0.0, max((n.extra_fields.total_allocated for n in after), default=base) - base))
