"""The per-rank parallel context: one DeviceMesh for every axis, and this rank's coordinates.

Vocabulary (as torchtitan's): an *axis* is a DeviceMesh dimension, a *dim* a tensor dimension.
Rank order is the plan's ``axis_order`` (``cost_models.axes``), outermost first: by default
Megatron's, tp innermost (consecutive ranks share a node), then dp, then pp — the mesh is
``arange(world).view(pp, dp, tp)``; the cost model prices the same order (``cost_models.comm``).

Only the axes of size > 1 are mesh dimensions: a size-1 axis would be a process group of one
rank per axis, and every gloo group runs a transport thread that wakes about 100 times a
second even when idle (measured: its voluntary context switches), which costs a job of
oversubscribed CPU ranks several per cent of its step time (``benchmarks/runtime_overhead.py``). With one parallel axis the mesh is the default
process group, as in a hand-written program.

Nothing here is global: the context is built once per run and passed to every function that
needs a process group.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.layout import context_parallel_unsupported, tp_splits_heads
from autopar.plan import Plan, op_unsupported, runtime_unsupported
from autopar.spec import parse_model_spec
from cost_models.axes import Axis

if TYPE_CHECKING:
    from autopar.runtime.usermodule import Traced

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Training dtypes by the plan's name."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelContext:
    """This rank's place in the plan's mesh; ``mesh`` is None for a single process."""

    mesh: DeviceMesh | None
    """Over the plan's axes of size > 1 only, in its axis order."""
    device: torch.device

    def rank(self, axis: Axis) -> int:
        """This rank's coordinate along ``axis`` (0 where the mesh does not split it)."""
        if self.mesh is None or axis.value not in (self.mesh.mesh_dim_names or ()):
            return 0
        return self.mesh.get_local_rank(axis.value)

    def group(self, axis: Axis) -> dist.ProcessGroup | None:
        return None if self.mesh is None else self.submesh(axis).get_group()

    def submesh(self, axis: Axis) -> DeviceMesh:
        assert self.mesh is not None, "a single process has no mesh"
        if axis.value not in (self.mesh.mesh_dim_names or ()):
            raise ValueError(f"the {axis.value} axis has size 1 in this plan: it has no mesh dimension")
        return self.mesh[axis.value]

    def replica_mesh(self) -> DeviceMesh | None:
        """The ranks over which the weights are replicated for data: dp, and cp (context
        parallelism replicates the weights over its ranks too), flattened into one dimension
        when both are split (torchtitan's ``dp_shard_cp``); None when neither is. Gradients
        reduce, and ZeRO shards, over it."""
        names = [a.value for a in (Axis.DP, Axis.CP) if a.value in self.mesh_names()]
        if not names:
            return None
        assert self.mesh is not None
        if len(names) == 1:
            return self.mesh[names[0]]
        names.sort(key=self.mesh_names().index)
        return self.mesh[tuple(names)]._flatten()

    def mesh_names(self) -> tuple[str, ...]:
        """The mesh's dimension names (the plan's axes of size > 1), outermost first."""
        return () if self.mesh is None else tuple(self.mesh.mesh_dim_names or ())


def init_distributed(timeout_s: float = 300.0) -> torch.device:
    """Join the job torchrun started (gloo on CPU, NCCL on GPU); return this rank's device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return device


def check_plan(plan: Plan, traced: Traced | None = None) -> None:
    """Refuse, naming the fix, what this runtime cannot run. A user module's shape and anatomy
    come from its trace (``traced``; a factory file's is traced here, once per process)."""
    spec = traced.spec if traced is not None else parse_model_spec(plan.model)
    if traced is None and spec.arch == "module":
        from autopar.runtime.usermodule import traced_file
        traced = traced_file(plan.model, plan.seq_len)
        spec = traced.spec
    m = plan.mesh
    moe = bool(spec.experts) or (plan.layout is not None and plan.layout.any_experts())
    reason = runtime_unsupported(dp=m.dp * m.cp, pp=m.pp, zero=plan.zero_stage, schedule=plan.schedule,
                                 virtual_stages=plan.virtual_stages, cp=m.cp, ep=m.ep, offload=plan.offload,
                                 moe=moe, sequence_parallel=plan.sequence_parallel)
    if reason:
        raise ValueError(reason)
    reason = context_parallel_unsupported(builtin=spec.builtin, cp=m.cp, pp=m.pp, seq=plan.seq_len, tp=m.tp,
                            sequence_parallel=plan.sequence_parallel) or \
        op_unsupported(plan.recompute, plan.schedule, m.pp, m.cp)
    if reason:
        raise ValueError(reason)
    if not tp_splits_heads(spec.heads, spec.num_kv_heads, plan.mesh.tp):
        raise ValueError(f"tp={plan.mesh.tp} does not divide the model's {spec.heads} heads and "
                         f"{spec.num_kv_heads} kv heads")
    if plan.dtype not in DTYPES:
        raise ValueError(f"dtype {plan.dtype!r} is not one of {', '.join(DTYPES)}")
    if traced is not None:
        from autopar.runtime.usermodule import unsupported
        reason = unsupported(plan, traced)
        if reason:
            raise ValueError(reason)


def build_context(plan: Plan, device: torch.device, traced: Traced | None = None) -> ParallelContext:
    """The mesh of ``plan`` over the running job (one process: no mesh, no process group);
    ``traced``: the user module the plan is for, when not its ``model`` (``check_plan``)."""
    check_plan(plan, traced)
    m = plan.mesh
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != m.size:
        raise ValueError(f"plan needs {m.size} processes (dp={m.dp} x tp={m.tp} x pp={m.pp} x cp={m.cp}) "
                         f"but the job has {world}")
    if world == 1:
        return ParallelContext(mesh=None, device=device)
    axes = m.active(plan.axis_order)  # no process group per size-1 axis
    mesh = init_device_mesh(device.type, tuple(m[a] for a in axes), mesh_dim_names=tuple(a.value for a in axes))
    return ParallelContext(mesh=mesh, device=device)
