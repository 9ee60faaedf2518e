"""Build this rank's program from a Plan and train it on synthetic tokens.

``build_program`` is the codegen: spec → model on ``meta``, traced once for its anatomy →
this rank's pipeline stages (pruned, materialised, every parameter seeded by its name so any
layout holds the single-process values; ``runtime.models``, or ``runtime.usermodule`` for a
user's own module, whose shape also comes from the trace) → TP/SP → EP (``runtime.experts``,
MoE layers only) → CP (``runtime.context_parallel``) → recompute → DP (over dp x cp) →
pipeline schedule. ``train`` runs optimizer steps and returns one global-batch loss per step.

The global batch is the same for every plan of a model: synthetic tokens of the step
(``synthetic_batch``), or samples of a token file (``TrainConfig.data``; ``autopar.data`` says
which); dp rank r takes rows ``[r B/dp, (r+1) B/dp)`` and cuts them into ``num_microbatches``
micro-batches; with context parallelism each cp rank keeps its tokens of every row. The loss
is the mean next-token cross-entropy over the global batch, reduced over dp and cp (and taken from
the last pipeline stage), so any two plans of one model and batch print comparable losses.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel

from autopar.data import Corpus, batch_tokens, open_corpus
from autopar.model import cross_entropy
from autopar.plan import Plan
from autopar.runtime import experts, parallelize
from autopar.runtime.context import DTYPES, ParallelContext, check_plan
from autopar.layout import Anatomy, expert_parallel_unsupported
from autopar.trace.anatomy import anatomy
from autopar.runtime.context_parallel import apply_context_parallel, shard_sequence
from autopar.runtime.models import build_stage, stage_blocks
from autopar.runtime.pipeline import build_schedule, stage_ids
from autopar.runtime.usermodule import (
    UserModule,
    build_user_stage,
    localize_inputs,
    recompute_attention_calls,
    traced_file,
)
from autopar.trace import build_spec_model, trace_module
from autopar.spec import ModelSpec, parse_model_spec, with_seq
from cost_models.axes import Axis


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Optimizer and data settings shared by every plan of a comparison."""

    lr: float = 1e-3
    """AdamW learning rate (constant)."""
    weight_decay: float = 0.0
    optimizer: str = "adamw"
    """``adamw``, or ``sgd`` (plain steps ``-lr·g``: weights then compare gradients, as
    ``autopar verify`` does)."""
    seed: int = 0
    """Seeds the weights (per parameter name) and the synthetic tokens (per step)."""
    data: Path | None = None
    """A token file to train on (``autopar.data``: nanoGPT's flat uint16 ``train.bin``, or
    uint32 named ``*.u32``); None: synthetic tokens."""


@dataclass(kw_only=True, slots=True)
class Program:
    """This rank's share of the model and how to step it."""

    plan: Plan
    ctx: ParallelContext
    spec: ModelSpec
    anatomy: Anatomy
    modules: list[nn.Module]
    """Local pipeline stages (one without pipelining), DP-wrapped."""
    stage_ids: list[int]
    optimizers: list[torch.optim.Optimizer]
    """One AdamW per local stage module (so its state is keyed by that stage's names)."""
    schedule: _PipelineSchedule | None = None
    """The pipelining schedule when pp > 1."""
    tied_group: dist.ProcessGroup | None = None
    """First and last stage ranks of this (dp, tp) coordinate, when a tied embedding and head
    live on different stages."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunResult:
    """One global-batch loss and one wall time (max over ranks) per optimizer step."""

    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    start_step: int = 0
    """Optimizer steps already taken when this run began (from a checkpoint)."""
    optimizer_times_s: list[float] = field(default_factory=list)
    """This rank's optimizer step per step, wall time on CPU ranks (where the host runs its
    operators; unprofiled, unlike ``phases``), s; empty on CUDA, where it runs behind the host."""
    phases: tuple[dict[str, float], ...] = ()
    """Per rank, where a profiled run's step time went (``runtime.phases.summary``, with
    ``rank`` and ``peak_bytes``); empty unless the run was profiled."""


def synthetic_batch(plan: Plan, step: int, seed: int, vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: uniform random tokens, inputs and next-token targets,
    each [global_batch, seq_len] int64, identical on every rank and for every plan."""
    if not vocab:
        spec = parse_model_spec(plan.model)
        if spec.arch == "module":
            spec = traced_file(plan.model, plan.seq_len).spec
        vocab = spec.vocab
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab, (plan.global_batch, plan.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def corpus_batch(corpus: Corpus, plan: Plan, sample: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of samples ``sample`` .. ``sample + global_batch - 1`` of ``corpus``:
    inputs and next-token targets, each [global_batch, seq_len] int64, the same on every rank."""
    tokens = torch.from_numpy(batch_tokens(corpus, sample, plan.global_batch, plan.seq_len, vocab))
    return tokens[:, :-1], tokens[:, 1:]


def build_program(plan: Plan, ctx: ParallelContext, cfg: TrainConfig = TrainConfig(),
                  source: UserModule | None = None) -> Program:
    """Codegen: the plan's per-rank program on ``ctx``. ``source``: a user module object
    (``autopar.parallelize``) in place of the plan's ``model``. The plan's ``mesh.ep``
    regroups the dp ranks for the experts (``runtime.experts``)."""
    spec = parse_model_spec(plan.model) if source is None else source.base_spec()
    if source is None and spec.arch == "module":
        source = UserModule(spec)
    if source is not None:  # a user module: shape and anatomy off its trace (``runtime.usermodule``)
        traced = source.traced(plan.seq_len)
        check_plan(plan, traced)
        spec, anat = traced.spec, traced.anatomy
    else:
        check_plan(plan)
        spec = with_seq(spec, plan.seq_len)
        anat = plan.layout or _traced_layout(spec)
    if plan.num_layers != len(anat.blocks) or len(plan.recompute) != len(anat.blocks):
        raise ValueError(f"the plan places {plan.num_layers} layers but {spec.name} has {len(anat.blocks)}; "
                         "make the plan for this model with autopar plan")
    ep = plan.mesh.ep
    reason = expert_parallel_unsupported(ep=ep, dp=plan.mesh.dp, sequence_parallel=plan.sequence_parallel,
                                         moe=anat.any_experts(), user_module=source is not None)
    if reason:
        raise ValueError(reason)
    if ep > 1 and plan.mesh.cp > 1:
        raise ValueError(f"expert parallelism (ep={ep}) does not compose with context parallelism "
                         f"(cp={plan.mesh.cp}) in this runtime yet; use ep = 1 or cp = 1")
    groups = experts.expert_mesh(ctx, ep)
    replicas = ctx.replica_mesh()  # once: flattening dp x cp creates its process group
    ids = stage_ids(plan, ctx.rank(Axis.PP)) if plan.mesh.pp > 1 else [0]
    modules: list[nn.Module] = []
    for sid in ids:
        if source is not None:
            model = build_user_stage(source, anat, plan, sid, stage_blocks(plan, sid), ctx.device, cfg.seed,
                                     spec.tied)
        else:
            model = build_stage(spec, anat, plan, sid, ctx.device, cfg.seed)
        if plan.mesh.tp > 1:
            parallelize.apply_tensor_parallel(model, ctx, plan.sequence_parallel, anat,
                                              (spec.heads, spec.num_kv_heads),
                                              whole_sequences_between_stages=not spec.builtin)
            if source is not None:
                localize_inputs(model, anat, plan.mesh.tp)
        if groups is not None:
            experts.apply_expert_parallel(model, anat, groups)
        if plan.mesh.cp > 1:  # check_plan refused what it cannot run (HF and user modules, pipelines)
            cp_group = ctx.group(Axis.CP)
            assert cp_group is not None  # cp > 1: the mesh has a cp axis
            apply_context_parallel(model, cp_group, plan.mesh.cp, ctx.rank(Axis.CP), plan.seq_len)
        recompute = plan.recompute
        if plan.mesh.cp > 1:  # the gathered K,V are never kept (``runtime.context_parallel``)
            recompute = tuple("selective" if r == "none" else r for r in recompute)
        if source is not None:  # selective: the blocks' SDPA calls (check_plan refused other attention)
            recompute_attention_calls(model, recompute, anat)
            recompute = tuple("none" if r == "selective" else r for r in recompute)
        parallelize.apply_recompute(model, recompute, anat)
        modules.append(parallelize.apply_data_parallel(model, plan, ctx, anat, replicas, groups))
    optimizers = [parallelize.make_optimizer(mod, cfg) for mod in modules]
    schedule = build_schedule(plan, ctx, modules, ids, cross_entropy) if plan.mesh.pp > 1 else None
    tied = _tied_group(ctx, plan.mesh.pp) if spec.tied and plan.mesh.pp > 1 else None
    return Program(plan=plan, ctx=ctx, spec=spec, anatomy=anat, modules=modules, stage_ids=ids,
                   optimizers=optimizers, schedule=schedule, tied_group=tied)


def _traced_layout(spec: ModelSpec) -> Anatomy:
    """The layout of a plan that does not record one (made by hand or elsewhere): traced here."""
    whole, example = build_spec_model(spec)
    return anatomy(trace_module(whole, example, spec.name, capture="fx" if spec.builtin else "export"),
                   whole, spec.vocab)


def _tied_group(ctx: ParallelContext, pp: int) -> dist.ProcessGroup | None:
    """Megatron's embedding group: with a tied head on another stage, the first and the last
    stage keep a copy each and sum their gradients. Every rank creates every pair (new_group is
    collective); this rank gets its own pair, or None off the first and last stage."""
    assert ctx.mesh is not None and ctx.mesh.mesh_dim_names is not None, "a tied pair needs a mesh"
    along_pp = ctx.mesh.mesh.movedim(ctx.mesh.mesh_dim_names.index(Axis.PP.value), 0).reshape(pp, -1)
    me, mine = dist.get_rank(), None
    for column in along_pp.T.tolist():  # the pipeline of each coordinate off the pp axis
        group = dist.new_group([column[0], column[-1]])
        if me in column:
            mine = group
    return mine if ctx.rank(Axis.PP) in (0, pp - 1) else None


def _tied_weight(module: nn.Module, anat: Anatomy) -> nn.Parameter | None:
    """This stage's embedding weight, or its copy in the head, or None."""
    for name in (anat.embed, anat.head):
        try:
            return cast(nn.Parameter, module.get_submodule(name).weight)
        except AttributeError:
            continue
    return None


def _sync_tied_grads(prog: Program) -> None:
    """Sum the embedding's and the head copy's gradients (both sharded alike over dp and tp)."""
    for module in prog.modules:
        weight = _tied_weight(module, prog.anatomy)
        if weight is None or weight.grad is None:
            continue
        grad = weight.grad
        if not isinstance(grad, DTensor):
            dist.all_reduce(grad, group=prog.tied_group)
            continue
        # A TP embedding's backward can leave its gradient replicated: take the weight's shard.
        assert isinstance(weight, DTensor)  # as its gradient is
        grad = grad.redistribute(weight.device_mesh, weight.placements)
        local = grad.to_local()
        dist.all_reduce(local, group=prog.tied_group)
        weight.grad = DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False,
                                         shape=weight.shape, stride=weight.stride())


def _reduce_partial_grads(prog: Program) -> None:
    """Sum the gradients DTensor leaves partial, in one all-reduce per mesh group and dtype.

    Under sequence parallelism a replicated parameter (a norm's weight and bias, a
    row-parallel layer's bias) meets sequence-sharded activations, so its gradient is a
    ``Partial`` sum over the tp ranks. Where no data-parallel wrapper reduces it (FSDP2 does,
    one parameter at a time), it reaches the optimizer partial, and every optimizer operator
    that reads it all-reduces it again (AdamW's ``lerp_`` and ``addcmul_``: two all-reduces a
    parameter a step, 54 a step for a 4-block GPT). Megatron-LM all-reduces its layer-norm
    gradients once a step, coalesced (``finalize_model_grads``); so does this, before the
    optimizer step: the gradients of a (mesh, placements, dtype) group are flattened into one
    buffer, all-reduced over each partial mesh dimension's group, and put back replicated."""
    groups: dict[tuple, list[nn.Parameter]] = {}
    for module in prog.modules:
        for param in module.parameters():
            grad = param.grad
            if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
                groups.setdefault((id(grad.device_mesh), tuple(grad.placements), grad.dtype), []).append(param)
    for params in groups.values():
        first = cast(DTensor, params[0].grad)
        mesh, placements = first.device_mesh, first.placements
        if any(pl.is_partial() and getattr(pl, "reduce_op", "sum") != "sum" for pl in placements):
            for param in params:  # not a sum (none of autopar's layers): DTensor's own reduction
                grad = cast(DTensor, param.grad)
                param.grad = grad.redistribute(mesh, [Replicate() if pl.is_partial() else pl for pl in placements])
            continue
        local = [cast(DTensor, param.grad).to_local() for param in params]
        flat = torch.cat([t.reshape(-1) for t in local])
        for dim, pl in enumerate(placements):
            if pl.is_partial():
                dist.all_reduce(flat, group=mesh.get_group(dim))
        whole = [Replicate() if pl.is_partial() else pl for pl in placements]
        offset = 0
        for param, t in zip(params, local):
            grad = cast(DTensor, param.grad)
            param.grad = DTensor.from_local(flat[offset:offset + t.numel()].view_as(t), mesh, whole, run_check=False,
                                            shape=grad.shape, stride=grad.stride())
            offset += t.numel()


def _autocast(plan: Plan, ctx: ParallelContext):
    """bf16/fp16 autocast for the non-FSDP paths (FSDP2 casts through its MixedPrecisionPolicy)."""
    dtype = DTYPES[plan.dtype]
    enabled = dtype != torch.float32 and not (plan.zero_stage >= 2 and plan.mesh.dp > 1)
    return torch.autocast(ctx.device.type, dtype=dtype, enabled=enabled)


def _vocab_parallel(plan: Plan):
    """With tp > 1 the logits are vocabulary shards: cross-entropy and its backward run on them
    (``loss_parallel``, Megatron's vocab-parallel loss)."""
    return loss_parallel() if plan.mesh.tp > 1 else contextlib.nullcontext()


def _local_rows(plan: Plan, ctx: ParallelContext, t: torch.Tensor) -> torch.Tensor:
    """This rank's share of a global batch [B, s]: its dp rank's rows, and with context
    parallelism its cp rank's tokens of each (``context_parallel.zigzag_positions``)."""
    rows = plan.global_batch // plan.mesh.dp
    dp_rank = ctx.rank(Axis.DP)
    t = t[dp_rank * rows:(dp_rank + 1) * rows]
    if plan.mesh.cp > 1:
        t = shard_sequence(t, plan.mesh.cp, ctx.rank(Axis.CP))
    return t.to(ctx.device)


def _step_no_pipeline(prog: Program, x: torch.Tensor, y: torch.Tensor) -> float:
    """Gradient accumulation over the micro-batches; returns the sum of micro-batch losses.
    Under ZeRO 1/2 (FSDP2 without resharding after forward) the gathered weights are kept
    until the last micro-batch's backward: one all-gather per step, as the cost model prices
    it, not one per micro-batch. The losses are read after the last backward: reading each
    micro-batch's would stall the GPU until the host launched the next one's first kernels."""
    plan, (module,) = prog.plan, prog.modules
    m = plan.num_microbatches
    losses: list[torch.Tensor] = []
    ddp = module if isinstance(module, nn.parallel.DistributedDataParallel) else None
    for i, (xb, yb) in enumerate(zip(x.chunk(m), y.chunk(m))):
        last = i == m - 1
        sync = last or parallelize.sync_every_microbatch(plan)
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(sync)
            if plan.zero_stage in (1, 2):  # weights stay gathered until the last backward
                module.set_reshard_after_backward(last)
        with ddp.no_sync() if ddp is not None and not sync else contextlib.nullcontext(), _vocab_parallel(plan):
            with _autocast(plan, prog.ctx):
                loss = cross_entropy(module(xb), yb)
            (loss / m).backward()
        losses.append(loss.detach())
    return sum(loss.item() for loss in losses)  # read after the last backward


def _step_pipeline(prog: Program, x: torch.Tensor, y: torch.Tensor) -> float:
    """One schedule step; the last stage returns the sum of its micro-batch losses. The
    schedule keeps no outputs (``return_outputs=False``): the last stage would otherwise hold
    every micro-batch's logits until the step ends."""
    ctx, sched = prog.ctx, prog.schedule
    assert sched is not None  # called only with one (pp > 1)
    has_first, has_last = 0 in prog.stage_ids, len(prog.plan.stage_layers) - 1 in prog.stage_ids
    losses: list[torch.Tensor] = []
    with _autocast(prog.plan, ctx), _vocab_parallel(prog.plan):
        sched.step(x if has_first else None, target=y if has_last else None,
                   losses=losses if has_last else None, return_outputs=False)
    return float(sum(loss.item() for loss in losses)) if has_last else 0.0


def train_step(prog: Program, step: int, cfg: TrainConfig, corpus: Corpus | None = None,
               sample: int | None = None) -> float:
    """One optimizer step on the global batch of ``step``: synthetic tokens, or ``corpus``'s
    samples from ``sample`` (default ``step`` x global batch); the global-batch mean loss."""
    return step_on_batch(prog, *_step_batch(prog, step, cfg, corpus, sample))


def _step_batch(prog: Program, step: int, cfg: TrainConfig, corpus: Corpus | None,
                sample: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    if corpus is None:
        return synthetic_batch(prog.plan, step, cfg.seed, prog.spec.vocab)
    first = step * prog.plan.global_batch if sample is None else sample
    return corpus_batch(corpus, prog.plan, first, prog.spec.vocab)


def step_on_batch(prog: Program, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """One optimizer step on a global batch (the same [global_batch, seq_len] tokens and
    targets on every rank; each dp rank trains on its rows); returns the global-batch mean
    loss on every rank."""
    return _reduce_step(prog, _local_step(prog, tokens, targets), 0.0)[0]


def _local_step(prog: Program, tokens: torch.Tensor, targets: torch.Tensor,
                optimizer_s: list[float] | None = None) -> float:
    """``step_on_batch`` up to the optimizer step; returns this rank's share of the sum of the
    micro-batch losses, each (dp rank, cp rank, micro-batch) loss counted once: last stage, tp
    rank 0 (a cp rank's loss is the mean over its tokens, as many on every cp rank).
    ``optimizer_s`` gets the optimizer step's wall time, s (its time on CPU ranks, where the
    host runs the operators)."""
    plan, ctx = prog.plan, prog.ctx
    if tuple(tokens.shape) != (plan.global_batch, plan.seq_len) or tokens.shape != targets.shape:
        raise ValueError(f"a step takes tokens and targets of shape [{plan.global_batch}, {plan.seq_len}] "
                         f"(global batch, sequence), got {tuple(tokens.shape)} and {tuple(targets.shape)}")
    x, y = _local_rows(plan, ctx, tokens), _local_rows(plan, ctx, targets)
    for opt in prog.optimizers:
        opt.zero_grad(set_to_none=True)
    local = _step_pipeline(prog, x, y) if prog.schedule is not None else _step_no_pipeline(prog, x, y)
    if prog.tied_group is not None:
        _sync_tied_grads(prog)
    _reduce_partial_grads(prog)
    start = time.perf_counter()
    for opt in prog.optimizers:
        opt.step()
    if optimizer_s is not None:
        optimizer_s.append(time.perf_counter() - start)
    return local if ctx.rank(Axis.TP) == 0 else 0.0


def _reduce_step(prog: Program, counted: float, seconds: float) -> tuple[float, float]:
    """The global-batch mean loss from every rank's ``counted`` share and the step time (the
    most ``seconds`` of any rank), in one all-reduce of [loss share, one slot of seconds per
    rank]: training reports both for the price of the one collective that timing needs."""
    plan, ctx = prog.plan, prog.ctx
    if ctx.mesh is None:
        return counted / plan.num_microbatches, seconds
    both = torch.zeros(1 + dist.get_world_size(), dtype=torch.float64)
    both[0], both[1 + dist.get_rank()] = counted, seconds
    both = both.to(ctx.device)
    dist.all_reduce(both)
    loss, slowest = both[0].item(), both[1:].max().item()
    return loss / (plan.mesh.dp * plan.mesh.cp * plan.num_microbatches), slowest


def train(plan: Plan, steps: int, ctx: ParallelContext, cfg: TrainConfig = TrainConfig(),
          program: Program | None = None, start_step: int = 0, start_sample: int | None = None,
          on_step: Callable[[int, float, float], None] | None = None) -> RunResult:
    """Build the plan's program (unless given) and run optimizer steps ``start_step`` ..
    ``start_step + steps - 1``: the step number picks the synthetic batch; with ``cfg.data``
    the steps read samples from ``start_sample`` on (default ``start_step`` x global batch).
    ``on_step(step, loss, seconds)`` is called after each step."""
    prog = program or build_program(plan, ctx, cfg)
    corpus = open_corpus(cfg.data, plan.seq_len) if cfg.data is not None else None
    first = start_step * plan.global_batch if start_sample is None else start_sample
    losses, times = [], []
    optimizer_s: list[float] | None = [] if ctx.device.type == "cpu" else None
    for i, step in enumerate(range(start_step, start_step + steps)):
        if ctx.mesh is not None:
            dist.barrier()
        start = time.perf_counter()
        counted = _local_step(prog, *_step_batch(prog, step, cfg, corpus, first + i * plan.global_batch), optimizer_s)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)  # the optimizer step's kernels belong to this step
        loss, seconds = _reduce_step(prog, counted, time.perf_counter() - start)
        losses.append(loss)
        times.append(seconds)
        if on_step is not None:
            on_step(step, losses[-1], times[-1])
    return RunResult(losses=losses, step_times_s=times, start_step=start_step, optimizer_times_s=optimizer_s or [])
