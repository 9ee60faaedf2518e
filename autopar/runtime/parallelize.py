"""Rewrite one rank's module for the plan: tensor/sequence parallelism, recompute, data parallelism.

Applied in torchtitan's order — TP, (expert parallelism: ``runtime.experts``,) then activation
checkpointing, then the data-parallel wrapper — each with stock torch.distributed:

- TP/SP: ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` on the GEMMs the
  tracer labelled column/row (``trace.anatomy``: Megatron's split, so each sub-layer needs one
  all-reduce, or with SP one all-gather + one reduce-scatter), a vocab-parallel embedding
  (``RowwiseParallel`` over the vocabulary) and a column-parallel head whose logits stay
  sharded for a vocab-parallel cross-entropy (``loss_parallel``: no [b, s, V] gather); with SP
  the norms run on sequence shards (``SequenceParallel``).
- Recompute: non-reentrant ``checkpoint_wrapper`` around a whole block (full), around it with
  torch's selective checkpointing policy (op: every second matmul's output and the attention
  kernel's kept, torchtitan's per-op AC) or around its attention core (selective, Korthikanti
  et al. 2022); reentrant checkpointing breaks pipelining.
- DP by ZeRO stage over the ranks that replicate the weights: the mesh's dp axis, flattened
  with cp under context parallelism (``ParallelContext.replica_mesh``; ``runtime.context_parallel``
  runs before recompute, so selective recompute wraps its attention core). ZeRO 0 with pure data parallelism (tp = pp = 1)
  is DDP; with tp or pp > 1 it is FSDP2's ``replicate`` (DDP's all-reduce on FSDP2's
  machinery: DDP's reducer in torch 2.13 takes neither DTensor parameters nor pipelining's split
  backward). ZeRO 1-3 are FSDP2 ``fully_shard``: 1 = ``reshard_after_forward=False`` reducing
  once per step (gradients whole until the last micro-batch, then reduce-scattered; optimizer
  states and master weights sharded), 2 = the same reducing every micro-batch, 3 =
  ``reshard_after_forward=True``; each block is a group, and so are the embedding and the
  final norm with the head (torchtitan's grouping, not for a tied head). Under pipelining the schedule itself defers the reduction to
  the last micro-batch, so ZeRO 1 and 2 coincide there. With expert parallelism the experts
  modules are wrapped first on the edp mesh (their gradients divided by dp), and ZeRO 0 runs on
  FSDP2's ``replicate`` (DDP takes no DTensor parameters). (``ZeroRedundancyOptimizer`` is not
  used for ZeRO-1: its state is keyed by position and unsharded per rank, so
  ``torch.distributed.checkpoint`` cannot save it or reshard it onto another plan.)
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
from typing import TYPE_CHECKING, Any, Callable, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from autopar.model import CoreAttention
from autopar.plan import Plan
from autopar.layout import Anatomy
from autopar.runtime.context import DTYPES, ParallelContext
from autopar.runtime.experts import ExpertMesh, is_expert_sharded
from autopar.runtime.tp_families import (experts_on_own_tokens, gather_output, gather_sequence, local_alibi, local_head_params,
                                         localize_block, own_output, replicate_single_kv, scatter_sequence,
                                         single_kv_gemms, sum_partial_outputs)
from cost_models.axes import Axis

if TYPE_CHECKING:
    from autopar.runtime.train import TrainConfig



def _block_tp_plans(anat: Anatomy, sp: bool, whole: frozenset[str] = frozenset()) -> list[dict]:
    """Column-parallel GEMMs into each sub-layer, row-parallel out of it. With SP the row
    GEMMs reduce-scatter onto sequence shards, the norms run on them, and each pre-norm's
    output is all-gathered for its sub-layer — one all-gather per sub-layer however the
    sub-layer is called (HF attention takes ``hidden_states=`` by keyword); a post-norm (on a
    row GEMM's output, before the residual add) stays on its shard. Returned as passes applied
    in turn (a pre-norm gets two styles). The sequence shards are of the tokens' dimension,
    -2: dim 1 of [b, s, h], dim 0 of a block that flattens its tokens to [b·s, h] around a
    sub-layer (OPT's MLP), where each rank's shard is its own b·s/tp tokens, gathered and
    scattered back in the same order."""
    plan: dict = {name: ColwiseParallel() for name in anat.column if name not in whole}
    plan.update({name: RowwiseParallel(output_layouts=Shard(-2) if sp else Replicate()) for name in anat.row})
    # a per-head norm on this rank's heads ([b, s, heads, head_dim]: heads at -2), its
    # replicated weight's gradient a partial sum over the ranks (torch's SequenceParallel
    # style, with the heads as its sharded dimension)
    plan.update({name: SequenceParallel(sequence_dim=-2, use_local_output=True) for name in anat.head_norms})
    # a norm across a column GEMM's whole output: the rank's slice of that width enters as a
    # DTensor sharded on its last dimension, so the mean over it is reduced over the tp ranks
    # (an all-reduce of one number per token); the replicated weight is sliced for the product
    plan.update({name: SequenceParallel(sequence_dim=-1, use_local_output=True) for name in anat.width_norms})
    pre = [name for name in anat.norms if name not in anat.post_norms]
    if not sp:
        # The pre-norm's output enters its sub-layer as a replicated DTensor, so the column
        # GEMMs reading it (q, k, v; gate, up) sum their input gradients as one partial
        # DTensor: one all-reduce per sub-layer in the backward, not one per GEMM. Not in a
        # mixture-of-experts block, whose router and experts take plain tensors, nor where
        # low-rank GEMMs kept whole (plain modules) read it.
        if anat.experts or anat.replicated:
            return [plan]
        return [plan, {name: PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate(),
                                                 use_local_output=False) for name in pre}]
    plan.update({name: SequenceParallel(sequence_dim=-2, use_local_output=True) for name in anat.post_norms})
    if anat.experts or anat.replicated:
        # a mixture of experts runs on the rank's own tokens (the norm before it hands them
        # on as they are); the sub-layers with column GEMMs gather where they are called (as
        # plain tensors, which low-rank GEMMs kept whole take)
        plan.update({name: SequenceParallel(sequence_dim=-2, use_local_output=True) for name in pre})
        return [plan]
    plan.update({name: SequenceParallel(sequence_dim=-2) for name in pre})
    gather = {name: PrepareModuleOutput(output_layouts=Shard(-2), desired_output_layouts=Replicate(),
                                        use_local_output=False) for name in pre}
    return [plan, gather]


def apply_tensor_parallel(model: nn.Module, ctx: ParallelContext, sp: bool, anat: Anatomy,
                          heads: tuple[int, int], whole_sequences_between_stages: bool = False) -> None:
    """Shard one pipeline stage of ``model`` over the tp axis, in place: a vocab-parallel
    embedding, the blocks' GEMMs as the tracer labelled them, a column-parallel head whose
    logits stay sharded over the vocabulary. With SP the first block after the embedding
    scatters the sequence and stages pass sequence shards (Megatron's scatter/gather: b·s·h/tp
    per boundary) — unless ``whole_sequences_between_stages`` (HF base models derive positions
    from their input's length), when each stage gathers its output and scatters its input.
    ``heads``: the model's (query heads, kv heads), which modules holding them as attributes
    see divided by tp."""
    blocks = [b for b in anat.blocks if b in {n for n, _ in model.named_modules()}]
    mesh = ctx.submesh(Axis.TP)
    single_kv: dict[Anatomy, dict] = {}
    for kind in anat.kinds():
        mine = [b for b in blocks if anat.kind(b) is kind]
        if not mine:
            continue
        for name in kind.column + kind.row:
            cls = type(model.get_submodule(f"{mine[0]}.{name}"))
            if not issubclass(cls, nn.Linear):
                raise ValueError(f"tensor parallelism needs nn.Linear projections; {name} is a {cls.__name__}; "
                                 "use tp=1 for this model")
        # multi-query attention: the K,V GEMMs stay whole on every rank (single_kv_gemms)
        single_kv[kind] = single_kv_gemms(model.get_submodule(mine[0]), kind, heads[0]) if heads[1] == 1 else {}
    for name in blocks:
        kind = anat.kind(name)
        localize_block(model.get_submodule(name), kind, mesh.size(), set(heads), single_kv[kind])
        local_alibi(model.get_submodule(name), kind, heads[0], mesh.size(), mesh.get_local_rank())
        local_head_params(model.get_submodule(name), kind, heads[0], mesh)
    here = {n for n, m in model.named_modules() if next(m.parameters(), None) is not None}  # not stand-ins
    top: dict = {}
    if anat.embed in here:
        top[anat.embed] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if anat.head in here:
        if sp and anat.final_norm:
            top[anat.final_norm] = SequenceParallel()
        # Logits stay sharded over the vocabulary; the loss runs under ``loss_parallel``.
        top[anat.head] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1),
                                         use_local_output=False)
    tied = anat.embed in here and anat.head in here and \
        model.get_submodule(anat.head).weight is model.get_submodule(anat.embed).weight
    parallelize_module(model, mesh, top)
    if sp and (anat.embed in here or whole_sequences_between_stages):
        model.get_submodule(blocks[0]).register_forward_pre_hook(scatter_sequence(mesh))
    if tied:  # both sharded Shard(0) over the vocabulary: share the one DTensor again
        model.get_submodule(anat.head).weight = model.get_submodule(anat.embed).weight
    if sp and whole_sequences_between_stages and anat.head not in here:
        model.get_submodule(blocks[-1]).register_forward_hook(gather_output(mesh))
    # a block without pre-norms (OLMo 2 norms its sub-layers' outputs only), with experts or
    # with low-rank GEMMs kept whole (DeepSeek's) gathers each sub-layer's input where the
    # sub-layer is called: the module owning its column GEMMs (not the experts, which run on
    # the rank's tokens)
    for name in blocks:
        kind = anat.kind(name)
        owners = {c.rpartition(".")[0] for c in kind.column} \
            if sp and (kind.experts or kind.replicated or not [n for n in kind.norms if n not in kind.post_norms]) \
            else set()
        for plan in _block_tp_plans(kind, sp, frozenset(single_kv[kind])):
            parallelize_module(model.get_submodule(name), mesh, plan)
        replicate_single_kv(model.get_submodule(name), single_kv[kind], mesh)
        sum_partial_outputs(model.get_submodule(name), kind, mesh)
        for owner in owners:
            model.get_submodule(f"{name}.{owner}" if owner else name).register_forward_pre_hook(
                gather_sequence(mesh, local=bool(kind.replicated)), with_kwargs=True)
        if sp and kind.experts:
            experts_on_own_tokens(model.get_submodule(name), kind, mesh)
        for row in kind.row:  # after the styles' own hooks
            model.get_submodule(f"{name}.{row}").register_forward_hook(own_output)


def apply_recompute(model: nn.Module, recompute: tuple[str, ...], anat: Anatomy) -> None:
    """Wrap each local block by its mode (``recompute`` is indexed by global block number):
    full = the whole block; op = the whole block under the per-op policy (``_per_op_policy``);
    selective = its attention core (Korthikanti et al. 2022): the
    built-in ``CoreAttention`` module, or for HF models the attention function, swapped for a
    checkpointed copy of the function it calls (SDPA, or its module's eager one) registered
    with transformers' ``AttentionInterface`` (an attention that calls SDPA itself: its calls,
    ``CheckpointedSDPA``; one that computes its core op by op: the module, under
    ``_core_policy``)."""
    container = model.get_submodule(anat.container)
    for index, name in enumerate(anat.blocks):
        key = name.rpartition(".")[2]
        if key not in container._modules:
            continue
        mode = recompute[index]
        block = container._modules[key]
        assert block is not None  # blocks are modules (only a removed attribute is None)
        if mode == "full":
            container._modules[key] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        elif mode == "op":
            container._modules[key] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                         context_fn=_per_op_contexts)
        elif mode == "selective":
            _recompute_attention_core(block, anat.kind(name))


_MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.linear.default})
"""A weight GEMM as the selective-checkpoint policy sees it (a 3-d ``nn.Linear`` runs as ``mm``,
with a bias as ``addmm``; under TP the op on the DTensors, once per GEMM)."""
_KEPT = frozenset(op for op in (
    getattr(torch.ops.aten, name).default for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"))) | \
    {torch.ops._c10d_functional.reduce_scatter_tensor.default}
"""Ops whose outputs per-op recompute always keeps: the attention kernels and sequence
parallelism's reduce-scatter (torchtitan's save list; an all-gather is repeated instead)."""


def _per_op_policy() -> Callable[..., CheckpointPolicy]:
    """torchtitan's per-op selective checkpointing policy for one block's forward: keep the
    output of the 1st, 3rd, ... weight GEMM and of the ops in ``_KEPT``, recompute the rest.
    torch calls it in the forward only and replays its decisions in the recompute."""
    count = [0]

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in _MATMULS:
            count[0] += 1
            return CheckpointPolicy.MUST_SAVE if count[0] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in _KEPT else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def _per_op_contexts():
    """A fresh policy per checkpointed call (its GEMM count starts at the block's first)."""
    return create_selective_checkpoint_contexts(_per_op_policy())


def _core_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:  # type: ignore[no-untyped-def]
    """Selective recompute of an attention module whose core is written op by op: keep its
    weight GEMMs' outputs (Q, K, V; the output projection's) and its collectives' (TP's), recompute
    the rest (QKᵀ, softmax, dropout, AV and the reshapes)."""
    keep = func in _MATMULS or getattr(func, "namespace", "") == "_c10d_functional"
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _core_contexts():
    return create_selective_checkpoint_contexts(_core_policy)


class CheckpointedSDPA(TorchFunctionMode):
    """``scaled_dot_product_attention`` calls run under non-reentrant checkpointing (the
    selective recompute of attention that is not a module of its own)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)


def _checkpointed(function: Callable[..., Any], module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """An HF attention function (``AttentionInterface``'s signature), its activations
    recomputed in the backward, reading the module's parameters as this forward showed them:
    a parameter the function reads off its module (GPT-OSS's ``sinks``) is under TP this rank's
    slice only inside the module's forward (``tp_families.show_local``), and the recompute
    runs after it."""
    shown = dict(module._parameters)

    def run(*a: Any, **k: Any) -> Any:
        after = dict(module._parameters)
        module._parameters.update(shown)
        try:
            return function(module, *a, **k)
        finally:
            module._parameters.update(after)
    return checkpoint(run, *args, use_reentrant=False, **kwargs)


def _recompute_attention_core(block: nn.Module, anat: Anatomy) -> None:
    cores = [n for n, m in block.named_modules() if isinstance(m, CoreAttention)]
    if cores:
        parent, _, attr = cores[0].rpartition(".")
        owner = block.get_submodule(parent)
        setattr(owner, attr, checkpoint_wrapper(getattr(owner, attr), checkpoint_impl=CheckpointImpl.NO_REENTRANT))
        return
    attention = block.get_submodule(anat.column[0].rpartition(".")[0])
    config = getattr(attention, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    interface = "ALL_ATTENTION_FUNCTIONS" in inspect.unwrap(type(attention).forward).__code__.co_names
    if impl == "sdpa" and not interface:
        # calls torch's SDPA itself under ``_attn_implementation == "sdpa"`` (Falcon): another
        # name there would take its eager path, so its SDPA calls are checkpointed where made
        inner = attention.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            with CheckpointedSDPA():
                return _inner(*args, **kwargs)
        attention.forward = forward  # type: ignore[method-assign]
        return
    # the function the attention would call, by the implementation it names: HF's SDPA, or its
    # own module's eager one (Gemma 2: soft-capped logits, which SDPA has not)
    eager = getattr(sys.modules[type(attention).__module__], "eager_attention_forward", None)
    if config is None or not interface or impl not in ("sdpa", "eager") or \
            (impl == "eager" and not callable(eager)):
        # a core written op by op in the module's forward (Bloom: baddbmm with ALiBi, softmax,
        # bmm): the module checkpointed under a policy keeping its weight GEMMs' outputs and
        # its collectives, so the backward repeats the core only
        path = anat.column[0].rpartition(".")[0]
        if not path:  # the block holds its GEMMs itself: no attention module to checkpoint
            raise ValueError("selective recompute needs the attention core as a module of its own; "
                             "use recompute none or full for this model")
        parent, _, attr = path.rpartition(".")
        owner = block.get_submodule(parent) if parent else block
        owner._modules[attr] = checkpoint_wrapper(attention, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                  context_fn=_core_contexts)
        return
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    function: Callable[..., Any] = ALL_ATTENTION_FUNCTIONS["sdpa"] if impl == "sdpa" else cast(Callable[..., Any], eager)
    name = f"autopar_selective_{impl}:{type(attention).__module__}"
    AttentionInterface.register(name, functools.partial(_checkpointed, function))  # one name per function
    local = copy.copy(config)  # this layer only
    setattr(attention, "config", local)
    local._attn_implementation = name


def uses_ddp(plan: Plan, experts: ExpertMesh | None = None) -> bool:
    """ZeRO-0 over whole, unsharded models runs on DDP; everything else on FSDP2 (expert
    parallelism too: its weights are DTensors, which DDP does not take)."""
    return plan.mesh.dp * plan.mesh.cp > 1 and plan.mesh.tp == 1 and plan.mesh.pp == 1 and plan.zero_stage == 0 \
        and experts is None


def apply_data_parallel(model: nn.Module, plan: Plan, ctx: ParallelContext, anat: Anatomy,
                        replicas: DeviceMesh | None, experts: ExpertMesh | None = None) -> nn.Module:
    """Wrap ``model`` for the plan's ZeRO stage over the replicas of its weights, ``replicas``
    (``ParallelContext.replica_mesh``: the dp axis, flattened with cp under context
    parallelism, whose ranks hold the same weights; None: nothing to wrap); returns the module
    to run. Gradients are averaged over it: each rank's loss is the mean of its tokens, so the
    mean over dp x cp ranks is the global-batch mean. With expert parallelism (``experts``)
    each experts module is wrapped alike on the edp mesh first, its gradients divided by dp
    (torchtitan's layout; ``runtime.experts``)."""
    if replicas is None:
        return model
    if uses_ddp(plan, experts):
        # Gradients as views of DDP's buckets: no second copy of them (the cost model keeps none).
        return DistributedDataParallel(model, process_group=replicas.get_group(), gradient_as_bucket_view=True,
                                       device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    dtype = DTYPES[plan.dtype]
    kw: dict = dict(mesh=replicas,
                    mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
                    if dtype != torch.float32 else MixedPrecisionPolicy())
    wrap: Callable[..., object]
    if plan.zero_stage == 0:
        wrap = replicate
    else:
        wrap = fully_shard
        kw.update(reshard_after_forward=plan.zero_stage == 3,
                  offload_policy=CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if plan.offload
                  else OffloadPolicy())
    for block in model.get_submodule(anat.container).children():
        if experts is not None:
            _wrap_experts(block, experts, wrap, kw)
        wrap(block, **kw)
    if plan.zero_stage > 0:
        _shard_ends(model, anat, kw)
    wrap(model, **kw)
    return model


def _shard_ends(model: nn.Module, anat: Anatomy, kw: dict) -> None:
    """The embedding, and the final norm with the head, in FSDP groups of their own
    (torchtitan's layout): the root group's weights stay gathered from the first forward to
    the end of the backward, which would keep both vocabulary tables unsharded all step. The
    embedding reshards after its forward as the blocks do; the head, whose backward comes
    right after its forward, keeps its gathered weight in between. A tied head shares the
    embedding's weight: both stay in the root group."""
    here = {n: m for n, m in model.named_modules() if n and next(m.parameters(), None) is not None}
    embed, head = here.get(anat.embed), here.get(anat.head)
    if embed is not None and head is not None and \
            {id(w) for w in head.parameters()} & {id(w) for w in embed.parameters()}:
        return
    if embed is not None:
        fully_shard(embed, **kw)
    ends = [m for m in (here.get(anat.final_norm), head) if m is not None and m is not embed]
    if ends:
        fully_shard(ends, **{**kw, "reshard_after_forward": False})


def _wrap_experts(block: nn.Module, experts: ExpertMesh, wrap: Callable[..., object], kw: dict) -> None:
    """``wrap`` (FSDP2's ``fully_shard`` or ``replicate``, with ``kw``) each expert-sharded
    module of ``block`` over the edp mesh, its gradients divided by dp (torchtitan's layout)."""
    for module in block.modules():
        if is_expert_sharded(module, experts):
            fsdp = cast(FSDPModule, wrap(module, **{**kw, "mesh": experts.edp}))
            fsdp.set_gradient_divide_factor(float(experts.dp))
            # gloo has no PREMUL_SUM: sum, then divide. Not over one rank: torch 2.13 divides the
            # gradient there, then again after its skipped collective (measured: 1/dp² of it).
            fsdp.set_force_sum_reduction_for_comms(experts.edp.size() > 1)


def sync_every_microbatch(plan: Plan) -> bool:
    """ZeRO-2/3 reduce-scatter each micro-batch's gradients (they keep only a shard); ZeRO 0/1
    reduce once per step, after the last micro-batch."""
    return plan.zero_stage >= 2


def make_optimizer(module: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """``cfg.optimizer`` (AdamW or SGD) over one stage module's parameters (sharded alike when
    FSDP2 shards them)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer != "adamw":
        raise ValueError(f"unknown optimizer {cfg.optimizer!r}; use adamw or sgd")
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
