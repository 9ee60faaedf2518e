"""Pipeline stages and schedules with ``torch.distributed.pipelining``.

The model is cut by the plan's ``stage_layers`` (blocks per stage, in stage order). With v
virtual stages per rank the placement is looped, as Megatron's interleaved schedule wants:
rank r holds stages r, r + pp, r + 2 pp, … Stages are built by hand (``PipelineStage`` on the
pruned module): the tracer front end (``pipeline()``) hangs with the zero-bubble schedules on
gloo, manual stages work with all of them (reference/torch-on-cpu.md).

Schedules: gpipe → ``ScheduleGPipe``, 1f1b → ``Schedule1F1B``, interleaved →
``ScheduleInterleaved1F1B``, zero-bubble → ``ScheduleInterleavedZeroBubble`` (backward split
into input and weight gradients, any v ≥ 1). Every schedule scales gradients by 1/m, so with a
per-micro-batch mean loss the step's gradient is that of the global-batch mean.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.pipelining.stage import _PipelineStageBase

from autopar.plan import Plan
from autopar.runtime.context import ParallelContext
from cost_models.axes import Axis


def stage_ids(plan: Plan, pp_rank: int) -> list[int]:
    """Global stage indices this pipeline rank runs, first to last (looped placement)."""
    return [pp_rank + c * plan.mesh.pp for c in range(plan.virtual_stages)]


def build_schedule(plan: Plan, ctx: ParallelContext, modules: list[nn.Module], ids: list[int],
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> _PipelineSchedule:
    """One ``PipelineStage`` per local module and the plan's schedule over them."""
    num_stages = len(plan.stage_layers)
    stages: list[_PipelineStageBase] = [PipelineStage(mod, sid, num_stages, ctx.device, group=ctx.group(Axis.PP))
                                        for mod, sid in zip(modules, ids)]
    m = plan.num_microbatches
    if plan.schedule == "gpipe":
        return ScheduleGPipe(stages[0], m, loss_fn=loss_fn)
    if plan.schedule == "1f1b":
        return Schedule1F1B(stages[0], m, loss_fn=loss_fn)
    if plan.schedule == "interleaved":
        return ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    if plan.schedule == "zero-bubble":
        return ScheduleInterleavedZeroBubble(stages, m, loss_fn=loss_fn)
    raise ValueError(f"unknown pipeline schedule {plan.schedule!r}")
