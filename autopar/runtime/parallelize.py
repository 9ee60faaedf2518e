"""Rewrite one rank's module for the plan: tensor/sequence parallelism, recompute, data parallelism.

Applied in torchtitan's order — TP, then activation checkpointing, then the data-parallel
wrapper — each with stock torch.distributed:

- TP/SP: ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` on the projections
  (Megatron's split: q, k, v and the MLP's up/gate by output columns, o and down by input rows,
  so each sub-layer needs one all-reduce, or with SP one all-gather + one reduce-scatter),
  a vocab-parallel embedding (``RowwiseParallel`` over the vocabulary) and a column-parallel head
  whose logits are gathered; with SP the norms run on sequence shards (``SequenceParallel``).
- Recompute: non-reentrant ``checkpoint_wrapper`` around a whole block (full) or its attention
  core (selective, Korthikanti et al. 2022); reentrant checkpointing breaks pipelining.
- DP by ZeRO stage over the mesh's dp axis. ZeRO 0 with pure data parallelism (tp = pp = 1)
  is DDP; with tp or pp > 1 it is FSDP2's ``replicate`` (DDP's all-reduce on FSDP2's
  machinery: DDP's reducer in torch 2.13 takes neither DTensor parameters nor pipelining's split
  backward). ZeRO 1-3 are FSDP2 ``fully_shard``: 1 = ``reshard_after_forward=False`` reducing
  once per step (gradients whole until the last micro-batch, then reduce-scattered; optimizer
  states and master weights sharded), 2 = the same reducing every micro-batch, 3 =
  ``reshard_after_forward=True``. Under pipelining the schedule itself defers the reduction to
  the last micro-batch, so ZeRO 1 and 2 coincide there. (``ZeroRedundancyOptimizer`` is not
  used for ZeRO-1: its state is keyed by position and unsharded per rank, so
  ``torch.distributed.checkpoint`` cannot save it or reshard it onto another plan.)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from autopar.model import Attention, Block, Transformer
from autopar.plan import Plan
from autopar.runtime.context import DTYPES, Axis, ParallelContext



def _block_tp_plan(block: Block, sp: bool) -> dict:
    """Column-parallel projections into each sub-layer, row-parallel out of it."""
    plan: dict = {"attn.o": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
                  "mlp.down": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())}
    for name in ("attn.q", "attn.k", "attn.v", "mlp.up") + (("mlp.gate",) if block.mlp.gate is not None else ()):
        plan[name] = ColwiseParallel()
    if sp:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                     "attn": gather, "mlp": gather})
    return plan


def apply_tensor_parallel(model: Transformer, ctx: ParallelContext, sp: bool) -> None:
    """Shard ``model`` (one pipeline stage of it) over the tp axis, in place."""
    mesh = ctx.submesh(Axis.TP)
    top: dict = {}
    if model.embed is not None:
        top["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if sp:  # positions are added on whole sequences; the blocks then see sequence shards
            top["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                               use_local_output=True)
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                        output_layouts=Replicate())
    if top:
        parallelize_module(model, mesh, top)
    for block in model.layers.values():
        parallelize_module(block, mesh, _block_tp_plan(block, sp))
    if model.spec.tied and model.embed is not None and model.output is not None:
        model.output.weight = model.embed.tok.weight  # both Shard(0) over the vocabulary


def apply_recompute(model: Transformer, recompute: tuple[str, ...]) -> None:
    """Wrap each block by its mode (``recompute`` is indexed by global block number)."""
    for key in list(model.layers.keys()):
        mode = recompute[int(key)]
        if mode == "full":
            model.layers[key] = checkpoint_wrapper(model.layers[key], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        elif mode == "selective":
            attn: Attention = model.layers[key].attn
            attn.core = checkpoint_wrapper(attn.core, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def uses_ddp(plan: Plan) -> bool:
    """ZeRO-0 over whole, unsharded models runs on DDP; everything else on FSDP2."""
    return plan.mesh.dp > 1 and plan.mesh.tp == 1 and plan.mesh.pp == 1 and plan.zero_stage == 0


def apply_data_parallel(model: Transformer, plan: Plan, ctx: ParallelContext) -> nn.Module:
    """Wrap ``model`` for the plan's ZeRO stage over the dp axis; returns the module to run."""
    if plan.mesh.dp == 1:
        return model
    if uses_ddp(plan):
        return DistributedDataParallel(model, process_group=ctx.group(Axis.DP),
                                       device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    dtype = DTYPES[plan.dtype]
    kw: dict = dict(mesh=ctx.submesh(Axis.DP),
                    mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
                    if dtype != torch.float32 else MixedPrecisionPolicy())
    if plan.zero_stage == 0:
        wrap = replicate
    else:
        wrap = fully_shard
        kw.update(reshard_after_forward=plan.zero_stage == 3,
                  offload_policy=CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if plan.offload
                  else OffloadPolicy())
    for block in model.layers.values():
        wrap(block, **kw)
    wrap(model, **kw)
    return model


def sync_every_microbatch(plan: Plan) -> bool:
    """ZeRO-2/3 reduce-scatter each micro-batch's gradients (they keep only a shard); ZeRO 0/1
    reduce once per step, after the last micro-batch."""
    return plan.zero_stage >= 2


def make_optimizer(module: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over one stage module's parameters (sharded alike when FSDP2 shards them)."""
    return torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=lr,
                             weight_decay=weight_decay)
