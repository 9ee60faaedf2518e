"""Expert parallelism (EP): each MoE layer's experts spread over the ep ranks, every token sent
to the ranks owning its experts and back by all-to-all (GShard, Lepikhin et al. 2021; the
layout of Megatron-Core and torchtitan).

Mesh. EP adds no devices: the expert layers regroup the dp ranks into ep x edp, ep dividing
dp, with dp index = edp index x ep + ep index (an ep group is ep consecutive dp ranks, the
likeliest to share a node). ``expert_mesh`` unflattens the context's dp axis
(``DeviceMesh._unflatten``), so the ep and edp meshes share their root with the tp mesh, as
FSDP2 needs for parameters that are DTensors on another axis.

Weights. Each [experts, ...] parameter of an experts module (HF transformers 5 stacks them:
``MixtralExperts.gate_up_proj`` [E, 2F, h]) becomes a DTensor ``Shard(0)`` over ep: ep rank i
keeps experts [i E/ep, (i+1) E/ep), sliced from the single-process values (no communication).
``full_tensor()`` gives the stacked whole and DCP reshards them like any DTensor.

Forward (dropless, as HF's): the replicated router has chosen top-k experts for each of this
rank's tokens; the (token, expert) copies are sorted by expert, hence by owning rank; their
counts, then their rows, go out by all-to-all; the owner runs them through the model's own
experts function (HF's grouped-GEMM or eager kernel, whichever the config names) on its local
experts, each copy with routing weight 1; the rows come back by the reverse all-to-all and are
combined in HF's order (output x routing weight, summed over the k copies). The all-to-all is
torch's autograd-aware functional collective (``all_to_all_single_autograd``, which runs on
gloo): the backward sends output gradients to the owners and input gradients back.

Gradients. An expert's gradient on its owner already sums every token of the ep group; its edp
replicas then reduce over edp, divided by dp (the loss is the mean over dp ranks): FSDP2
(``fully_shard``, or ``replicate`` for ZeRO 0) on the edp mesh with gradient divide factor dp,
as torchtitan does (``runtime.parallelize.apply_data_parallel``). The rest of the model reduces
over dp as before.

With tp > 1 the router and the experts are replicated over tp (no expert-tensor parallelism):
every tp rank routes and computes the same tokens, or under sequence parallelism (ep = 1)
its own sequence shard (``runtime.tp_families.experts_on_own_tokens``); an ep group holds the
dp ranks of one tp coordinate. What cannot be proved equal to one process is refused
(``autopar.layout.expert_parallel_unsupported``). The load-balancing auxiliary loss is not
trained, in one process as in any layout: the runtime's loss is the LM cross-entropy (HF adds
its aux loss only with ``output_router_logits``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from autopar.layout import Anatomy
from autopar.runtime.context import ParallelContext
from cost_models.axes import Axis

EP = "ep"
"""The DeviceMesh dimension of an ep group (consecutive dp indices)."""
EDP = "edp"
"""The DeviceMesh dimension of an expert's replicas (dp indices ep apart)."""
_ARGUMENTS = ("hidden_states", "top_k_index", "top_k_weights")
"""What an experts module's forward takes after ``self`` (transformers 5's experts contract):
[tokens, h], [tokens, k] expert ids, [tokens, k] routing weights; it returns [tokens, h]."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertMesh:
    """The dp axis regrouped for the expert layers (``expert_mesh``)."""

    ep: DeviceMesh
    """This rank's ep group: the ranks its experts' tokens come from."""
    edp: DeviceMesh
    """This rank's expert replicas (size dp / ep; 1 when ep = dp)."""
    dp: int
    """The dp degree: expert gradients are divided by it, as every other gradient is."""


def expert_mesh(ctx: ParallelContext, ep: int) -> ExpertMesh | None:
    """The ep x edp regrouping of the dp axis of ``ctx`` (None when ep = 1). Collective: every
    rank calls it (it creates the groups)."""
    if ep == 1:
        return None
    dp = ctx.submesh(Axis.DP).size() if ctx.mesh is not None and Axis.DP.value in (ctx.mesh.mesh_dim_names or ()) \
        else 1
    if ep < 1 or dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp}: the expert layers regroup the dp ranks into ep x dp/ep")
    assert ctx.mesh is not None
    mesh = ctx.mesh._unflatten(Axis.DP.value, (dp // ep, ep), (EDP, EP))
    return ExpertMesh(ep=mesh[EP], edp=mesh[EDP], dp=dp)


def experts_unsupported(module: nn.Module, ep: int) -> str | None:
    """Why ``module`` cannot be sharded by experts over ``ep`` ranks, or None."""
    name = type(module).__name__
    count = getattr(module, "num_experts", None)
    own = dict(module.named_parameters(recurse=False))
    if not isinstance(count, int) or count < 1 or not own:
        return f"{name} holds no stacked expert weights with a num_experts count"
    if any(p.dim() < 2 or p.shape[0] != count for p in own.values()) or \
            len(list(module.parameters())) != len(own):
        return f"{name} holds weights that are not stacked by its {count} experts"
    try:
        args = tuple(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        args = ()
    if args != _ARGUMENTS:
        return f"{name}.forward takes {args}, not transformers' experts arguments {_ARGUMENTS}"
    if count % ep:
        return f"ep={ep} does not divide the {count} experts of {name}"
    return None


def apply_expert_parallel(model: nn.Module, anat: Anatomy, mesh: ExpertMesh) -> None:
    """Shard every experts module of ``model``'s blocks (``anat.experts``) over ``mesh.ep``
    and route its tokens by all-to-all, in place. Before recompute and data parallelism
    (torchtitan's order: TP, EP, recompute, FSDP)."""
    names = {n for n, _ in model.named_modules()}
    for block in (b for b in anat.blocks if b in names):
        for rel in anat.kind(block).experts:
            _shard_experts(model.get_submodule(f"{block}.{rel}"), mesh.ep)


def is_expert_sharded(module: nn.Module, mesh: ExpertMesh) -> bool:
    """Whether ``module`` holds weights ``apply_expert_parallel`` sharded over ``mesh.ep``."""
    return any(isinstance(p, DTensor) and p.device_mesh == mesh.ep for p in module.parameters(recurse=False))


@torch.no_grad()
def _shard_experts(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    reason = experts_unsupported(module, ep)
    if reason:
        raise ValueError(f"expert parallelism: {reason}")
    count: int = module.num_experts  # type: ignore[assignment]
    local = count // ep
    for name, p in list(module.named_parameters(recurse=False)):
        shard = p[rank * local:(rank + 1) * local].clone()
        setattr(module, name, nn.Parameter(DTensor.from_local(shard, ep_mesh, (Shard(0),), run_check=False,
                                                              shape=p.shape, stride=p.stride()),
                                           requires_grad=p.requires_grad))
    module.forward = functools.partial(_dispatch, module, type(module).forward, ep_mesh.get_group(), ep, count)


class _LocalExperts:
    """``module`` as its experts function sees it on this rank: only the local experts' weights
    (local tensors) and their count; every other attribute is the module's."""

    def __init__(self, module: nn.Module, weights: dict[str, torch.Tensor], count: int) -> None:
        self.__dict__.update(weights, _module=module, num_experts=count)

    def __getattr__(self, name: str) -> object:
        return getattr(self.__dict__["_module"], name)


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    """Rows of ``x`` (``in_splits`` to each rank of ``group``) exchanged; differentiable."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x, out_splits, in_splits, group))


def _dispatch(module: nn.Module, compute: Callable[..., torch.Tensor], group: dist.ProcessGroup, ep: int,
              count: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' forward under EP: [tokens, h] hidden states, [tokens, k] expert ids and
    routing weights -> [tokens, h], equal to the unsharded module's output."""
    tokens, k = top_k_index.shape
    local = count // ep
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # copies by expert, so by owning rank
    per_expert = torch.bincount(flat, minlength=count)
    got = torch.empty_like(per_expert)
    dist.all_to_all_single(got, per_expert, group=group)  # [source rank, local expert] counts
    got = got.view(ep, local)
    send, recv = per_expert.view(ep, local).sum(1).tolist(), got.sum(1).tolist()
    rows = _all_to_all(hidden_states[order // k], recv, send, group)
    ids = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(got.reshape(-1))
    weights = {n: p.to_local() if isinstance(p, DTensor) else p for n, p in module.named_parameters(recurse=False)}
    if rows.shape[0]:
        out = compute(_LocalExperts(module, weights, local), rows, ids[:, None],
                      torch.ones((rows.shape[0], 1), dtype=top_k_weights.dtype, device=rows.device))
    else:  # no token for this rank's experts: their gradients are zero (not missing, which FSDP2 cannot reduce)
        out = rows + sum(w.sum() for w in weights.values()) * 0
    back = _all_to_all(out, send, recv, group)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    weighted = back[inverse] * top_k_weights.reshape(-1, 1)
    return weighted.view(tokens, k, hidden_states.shape[-1]).sum(dim=1).to(hidden_states.dtype)
