"""Bytes on one device: model states (state layout, ZeRO sharding), activations, buffers.

Model states per parameter (``STATE_LAYOUTS``, chosen by the execution recipe; weights +
gradients + optimizer):
- ``megatron`` 2 + 4 + 12 = 18: 16-bit weights, fp32 gradients, fp32 master weights and Adam's
  two moments (Korthikanti et al. Fig. 1: 45.56 GiB for the 22B model at TP 8);
- ``zero`` 2 + 2 + 12 = 16: the ZeRO paper's fp16 gradients (Rajbhandari et al., Table 1);
- ``fp32`` 4 + 4 + 8 = 16: fp32 weights are the master weights, plus the two moments; 16-bit
  training computes on 16-bit copies (FSDP2's gathered ``param_dtype`` weights, autocast's
  cast cache: 2 more bytes per parameter while held, ``compute_copy_bytes``).
ZeRO stage 1 shards the optimizer states (master included) over dp, 2 also the gradients,
3 also the weights (``state_bytes`` has the exact rule, including the pipeline's unsharded
accumulation under FSDP2). Tensor parallelism divides all block, embedding (vocab-parallel) and head
parameters by tp; the few norm and bias parameters Megatron replicates (4h of 12h² + 13h per
block) are divided too, an error below 0.1 % for h ≥ 1024.

CPU offload (``Strategy.offload``, FSDP2's ``CPUOffloadPolicy``) keeps ZeRO's shards in host
memory: the weight, gradient and optimizer shards (fp32 master included) leave the device
(``host_state_bytes``); the device keeps the unsharded 16-bit weights between all-gathers under
ZeRO 1/2 (ZeRO 3: only the buffers' two gathered blocks) and the unsharded accumulated
gradients under ZeRO 1 (ZeRO 2: one block's before its reduce-scatter, in the buffers).

Activations follow Korthikanti et al. Table 2 from the ModelProfile's three per-token fields in
the recipe's attention accounting (unfused: scores, softmax and dropout kept; fused: a float32
log-sum-exp per head), 16-bit activations and 1-byte masks, doubled for fp32 training.
Context parallelism of degree c divides every activation by c (each rank keeps seq/c tokens
of every sequence, ``Strategy.tokens``; ring attention re-sends the K,V blocks in backward
instead of keeping them), and ZeRO shards over dp x cp (``Strategy.replicas``: the weights are
replicated over cp, Megatron's "dp-cp" group). Sizes in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models.axes import Degrees
from cost_models.pipeline import grads_absent as grads_absent_zero_bubble, torch_pipelining
from cost_models.hardware import HardwareProfile
from cost_models.model_profile import ModelProfile
from cost_models.strategy import Strategy

DDP_BUCKET_BYTES = 25e6
"""PyTorch DDP's default gradient bucket size: under ZeRO 1-2 two are live (one reducing, one
filling). Under ZeRO-0 the gradients themselves live in the buckets (Megatron's contiguous
gradient buffer; torch DDP with ``gradient_as_bucket_view``, as autopar's runtime builds it),
so the buckets add nothing to the states."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StateLayout:
    """Bytes per parameter of each part of the training state, before ZeRO sharding."""

    weight: float
    grad: float
    optimizer: float
    """Optimizer states, fp32 master weights included when kept apart from the weights."""
    master_copy: bool
    """The optimizer keeps fp32 master weights apart from the (16-bit) model weights; False:
    the weights are the master (fp32), and 16-bit training computes on gathered or cast
    copies."""


STATE_LAYOUTS = {
    "megatron": StateLayout(weight=2, grad=4, optimizer=12, master_copy=True),
    "zero": StateLayout(weight=2, grad=2, optimizer=12, master_copy=True),
    "fp32": StateLayout(weight=4, grad=4, optimizer=8, master_copy=False),
}


def state_layout(strat: Strategy) -> StateLayout:
    """The recipe's layout; fp32 training keeps ``fp32`` whatever the recipe."""
    return STATE_LAYOUTS["fp32" if strat.dtype == "fp32" else strat.recipe.state]


def compute_copy_bytes(strat: Strategy) -> float:
    """Bytes per parameter of the 16-bit copy a layout whose weights are the fp32 master
    computes on (FSDP2's gathered ``param_dtype`` weights, autocast's cast cache); 0 when the
    weights are used as stored."""
    lay = state_layout(strat)
    elem = 4 if strat.dtype == "fp32" else 2
    return 0.0 if lay.master_copy or lay.weight <= elem else float(elem)


def gather_bytes(strat: Strategy) -> float:
    """Bytes per parameter a ZeRO all-gather moves: the weights in their compute dtype, or 1
    under ``recipe.fp8_all_gather`` (the 16-bit embedding and head priced so too)."""
    if strat.fp8 and strat.recipe.fp8_all_gather:
        return 1.0
    return compute_copy_bytes(strat) or state_layout(strat).weight


def holds_unsharded(strat: Strategy) -> bool:
    """ZeRO-2/3 under a pipeline keep the stage's weights gathered and gradients unsharded
    until the last backward (``ExecutionRecipe.pp_unsharded_accumulation``)."""
    return strat.recipe.pp_unsharded_accumulation and strat.mesh.pp > 1 and strat.zero >= 2 \
        and strat.replicas > 1


@dataclass(frozen=True, kw_only=True, slots=True)
class StateBytes:
    """Model-state bytes on one device."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def grads_sharded(strat: Strategy) -> bool:
    """The gradients live sharded over the replicas (``state_bytes``)."""
    if holds_unsharded(strat):
        return False
    return strat.zero >= 2 or (strat.zero == 1 and strat.num_microbatches == 1 and strat.recipe.fsdp_copies)


def head_gather_bytes(model: ModelProfile, strat: Strategy) -> float:
    """The head's weights gathered under ZeRO-3 at the last stage's peak: the loss comes right
    after their forward and their backward right after it, so every implementation holds them
    gathered then (FSDP2 groups the final norm and the head and keeps them gathered in between,
    ``runtime.parallelize``), bytes. 0 where the weights are not sharded or stay gathered."""
    if strat.zero < 3 or strat.replicas == 1 or holds_unsharded(strat):
        return 0.0
    return last_params(model, strat) * gather_bytes(strat)


def state_bytes(params: float, strat: Strategy) -> StateBytes:
    """Model states of ``params`` parameters (already divided by tp) on one of the
    ``strat.replicas`` (dp x cp) ranks, in device memory (with ``offload``, what stays on the device).

    The weights are sharded by ZeRO-3, or by ZeRO >= 1 where they are the fp32 master; the
    weights computed on are held unsharded under ZeRO 0-2 (and ZeRO-3 when the pipeline keeps
    them gathered): a layout's 16-bit copy, or where FSDP gathers them (ZeRO >= 1 with the
    master sharded, ``reshard_after_forward=False``; FSDP2's ``replicate``, ``fsdp_replicate``)
    a whole copy in the compute dtype, fp32 in fp32 training. The gradients are sharded by
    ZeRO >= 2 unless the pipeline accumulates them unsharded, and by ZeRO-1 on FSDP with one
    micro-batch (its once-per-step reduce-scatter runs in that backward, a block at a time:
    ``fsdp_copies``; Megatron's distributed optimizer keeps its whole gradient buffer), the
    optimizer states by ZeRO >= 1.
    """
    lay, zero, dp = state_layout(strat), strat.zero, strat.replicas
    copy = compute_copy_bytes(strat)
    hold = holds_unsharded(strat)
    master_sharded = not lay.master_copy and zero >= 1
    gathered = master_sharded or fsdp_replicate(strat)
    copy_held = (gather_bytes(strat) if gathered else copy) if (zero < 3 or hold) else 0.0
    if strat.offload:
        return StateBytes(params=(0.0 if zero >= 3 and not hold else params * (copy or lay.weight)),
                          grads=params * lay.grad if zero == 1 or hold else 0.0, optimizer=0.0)
    weight = lay.weight / (dp if zero >= 3 or master_sharded else 1)
    if lay.master_copy and hold:
        weight = lay.weight
    return StateBytes(params=params * (weight + copy_held),
                      grads=params * lay.grad / (dp if grads_sharded(strat) else 1),
                      optimizer=params * lay.optimizer / (dp if zero >= 1 else 1))


def torch_ddp(strat: Strategy) -> bool:
    """The data-parallel wrapper is torch's DDP with the gradients as views of its buckets:
    ZeRO 0 over replicas with tp = pp = ep = 1 in a recipe whose program makes every split
    weight a DTensor and keeps DDP's plain tensors there (``ExecutionRecipe.dtensor_parameters``)."""
    m = strat.mesh
    return (strat.recipe.dtensor_parameters and strat.zero == 0 and strat.replicas > 1
            and m.tp == 1 and m.pp == 1 and m.ep == 1)


def fsdp_replicate(strat: Strategy) -> bool:
    """ZeRO 0 on FSDP2's ``replicate`` (the DTensor recipes where DDP is not run: tp, pp or
    ep > 1): its unshard copies every weight into a new unsharded parameter (a world of one
    gathers by copy, ``FSDPParamGroup.wait_for_unshard``), kept until the backward."""
    return (strat.recipe.dtensor_parameters and strat.zero == 0 and strat.replicas > 1
            and not torch_ddp(strat))


def host_state_bytes(params: float, strat: Strategy) -> float:
    """Bytes of host memory the offloaded shards of ``params`` parameters take on one of
    ``strat.replicas`` (dp x cp) ranks: weight, gradient and optimizer shards (0 without ``offload``)."""
    if not strat.offload:
        return 0.0
    lay = state_layout(strat)
    return params * (lay.weight + lay.grad + lay.optimizer) / strat.replicas


def layer_params(model: ModelProfile, strat: Strategy) -> float:
    """Parameters of one block on one device: the dense part over tp, the routed experts over
    ep x etp (``Strategy.etp``: tp where each expert's GEMMs split like the dense MLP's, 1
    where the recipe replicates the experts over tp)."""
    return dense_layer_params(model, strat) + expert_layer_params(model, strat)


def dense_layer_params(model: ModelProfile, strat: Strategy) -> float:
    """Parameters of one block outside its routed experts on one device."""
    return model.dense_block_params / strat.mesh.tp


def expert_layer_params(model: ModelProfile, strat: Strategy) -> float:
    """Routed-expert parameters of one block on one device: experts / ep of them, each over etp."""
    return model.expert_params / (strat.etp * strat.mesh.ep)


def expert_strategy(strat: Strategy) -> Strategy:
    """``strat`` as the expert weights see it: their replicas are the edp = dp x cp / ep
    ranks holding the same experts (ZeRO shards and gradients reduce over them)."""
    m = strat.mesh
    if m.ep == 1 and m.cp == 1:
        return strat
    return replace(strat, mesh=Degrees(pp=m.pp, dp=m.edp, tp=m.tp), axis_order=strat.axis_order)


def layer_state_bytes(model: ModelProfile, strat: Strategy) -> StateBytes:
    """Model states of one block on one device: the dense part sharded over dp x cp, the
    routed experts (1/ep of them) over edp."""
    dense = state_bytes(dense_layer_params(model, strat), strat)
    if not model.moe:
        return dense
    e = state_bytes(expert_layer_params(model, strat), expert_strategy(strat))
    return StateBytes(params=dense.params + e.params, grads=dense.grads + e.grads,
                      optimizer=dense.optimizer + e.optimizer)


def layer_host_bytes(model: ModelProfile, strat: Strategy) -> float:
    """``host_state_bytes`` of one block (experts sharded over edp)."""
    return (host_state_bytes(dense_layer_params(model, strat), strat)
            + host_state_bytes(expert_layer_params(model, strat), expert_strategy(strat)))


def moe_load(model: ModelProfile, strat: Strategy) -> float:
    """Routed tokens on the busiest expert-parallel rank over the mean: the recipe's
    ``moe_load_imbalance``, capped by the model's capacity factor (tokens past it dropped);
    1 for a dense model or ep = 1 with every expert local (the rank computes all routed
    tokens whatever their spread)."""
    if not model.moe or strat.mesh.ep == 1:
        return 1.0
    load = strat.recipe.moe_load_imbalance
    return min(load, model.capacity_factor) if model.capacity_factor > 0 else load


def expert_extra_act_bytes(model: ModelProfile, strat: Strategy) -> float:
    """Saved bytes per micro-batch one block keeps beyond the traced (balanced) routing on the
    busiest rank: the routed copies' activations (``ModelProfile``) at load / etp where the
    traced accounting keeps them at 1 / tp (``Strategy.etp``: replicated experts keep them whole)."""
    if not model.moe:
        return 0.0
    extra = moe_load(model, strat) / strat.etp - 1.0 / strat.mesh.tp
    if extra <= 0:
        return 0.0
    return act_scale(strat) * strat.tokens(model.seq) * extra * model.expert_act_bytes_per_token()


def first_params(model: ModelProfile, strat: Strategy) -> float:
    """Embedding parameters on one device of the first stage (vocab-parallel over tp)."""
    return model.embed_params / strat.mesh.tp


def last_params(model: ModelProfile, strat: Strategy) -> float:
    """Head parameters on one device of the last stage; a tied projection is the embedding's
    own weight when pp = 1, and a copy (counted) when pp > 1."""
    shared = model.vocab * model.hidden if model.tied and strat.mesh.pp == 1 else 0
    return (model.head_params - shared) / strat.mesh.tp


def act_scale(strat: Strategy) -> float:
    """Activation bytes relative to the profile's 16-bit figures."""
    return 2.0 if strat.dtype == "fp32" else 1.0


def fused_attention(strat: Strategy) -> bool:
    return strat.fused_attention


def runs_autocast(strat: Strategy) -> bool:
    """Whether ``strat``'s blocks run under ``torch.autocast`` (``ExecutionRecipe.autocast``):
    16-bit training, except ZeRO 2/3 over dp > 1 (autopar/runtime/train.py ``_autocast``)."""
    return strat.recipe.autocast and strat.dtype != "fp32" and not (strat.zero >= 2 and strat.mesh.dp > 1)


def block_act_bytes(model: ModelProfile, strat: Strategy, recompute: str | None = None) -> float:
    """Bytes one block keeps for backward per micro-batch (Korthikanti et al. Table 2, in the
    recipe's attention accounting).

    none: s b (repl / (tp if SP else 1) + sharded / tp + attn / tp); selective: without attn;
    full: the block input only, 2 s b h (/ tp with SP); op: the block input and what per-op
    recompute keeps (``ModelProfile.op_*``). ``recompute`` is the planned mode; the mode run is
    priced (``Strategy.recompute_run``).
    """
    recompute = strat.recompute_run(recompute)
    tokens = strat.tokens(model.seq)
    sp = strat.mesh.tp if strat.sequence_parallel else 1
    autocast = runs_autocast(strat)
    # The block input: under autocast the fp32 residual stream.
    block_input = act_scale(strat) * tokens * (4 if autocast else 2) * model.hidden / sp
    if recompute == "full":
        return block_input
    if recompute == "op":
        tp = strat.mesh.tp
        kept = (model.op_kept_sharded_bytes_per_token / tp + model.op_kept_partial_bytes_per_token
                + (model.op_reduced_bytes_per_token / tp if sp > 1 else 0.0))
        return block_input + act_scale(strat) * tokens * kept
    repl, sharded, attn = model.act_bytes_per_token(fused_attention(strat))
    if autocast:
        repl += model.autocast_act_bytes_per_token
    per_token = repl / sp + sharded / strat.mesh.tp
    if strat.fp8 and strat.recipe.fp8_saves_fp8_inputs:
        # The weight GEMMs' saved inputs (two norm outputs, the attention output, the MLP's
        # down-projection input) kept as 1-byte casts instead of 16-bit tensors.
        per_token -= 2 * model.hidden / sp + (model.hidden + model.ffn) / strat.mesh.tp
    if recompute == "none":
        per_token += attn / strat.mesh.tp
    return act_scale(strat) * tokens * per_token + expert_extra_act_bytes(model, strat)


def block_attn_act_bytes(model: ModelProfile, strat: Strategy) -> float:
    """The attention-core part of ``block_act_bytes`` (what selective recompute drops)."""
    tokens = strat.tokens(model.seq)
    attn = model.act_bytes_per_token(fused_attention(strat))[2]
    return act_scale(strat) * tokens * attn / strat.mesh.tp


def first_act_bytes(model: ModelProfile, strat: Strategy) -> float:
    """Embedding: the 1-byte dropout mask of its output, s b h (/ tp with SP)."""
    sp = strat.mesh.tp if strat.sequence_parallel else 1
    return strat.tokens(model.seq) * model.hidden / sp


def last_act_bytes(model: ModelProfile, strat: Strategy) -> float:
    """Head: inputs of the final norm and of the projection, 4 s b h (/ tp with SP), and what
    the loss keeps per logit (``ExecutionRecipe.logits_bytes``: Megatron's fp32 logits, 4,
    Korthikanti et al. Sec. 4.3; eager fp32 cross-entropy's log-probabilities, 4), s b V / tp.
    What its backward allocates beyond that is ``loss_backward_bytes`` (once, not per
    micro-batch in flight)."""
    sp = strat.mesh.tp if strat.sequence_parallel else 1
    return act_scale(strat) * strat.tokens(model.seq) * 4 * model.hidden / sp + loss_act_bytes(model, strat)


def loss_backward_bytes(model: ModelProfile, strat: Strategy) -> float:
    """What the loss's backward allocates beyond its kept bytes while it runs, once per stage
    peak (one micro-batch's loss runs backward at a time), s b V / tp, bytes; under tp > 1 as
    ``loss_parallel`` does where the recipe says (``loss_parallel_backward_bytes``)."""
    rec = strat.recipe
    per = rec.loss_parallel_backward_bytes if strat.mesh.tp > 1 and rec.loss_parallel_backward_bytes is not None \
        else rec.loss_backward_bytes
    return strat.tokens(model.seq) * per * model.vocab / strat.mesh.tp


def loss_act_bytes(model: ModelProfile, strat: Strategy) -> float:
    """The loss's part of ``last_act_bytes``: what it keeps per logit, s b V / tp, bytes."""
    return strat.tokens(model.seq) * strat.recipe.logits_bytes * model.vocab / strat.mesh.tp


def block_wgrad_bytes(model: ModelProfile, strat: Strategy) -> float:
    """Output gradients of one block's operators with weights for one micro-batch: what a
    deferred weight pass keeps (``pipeline.pending``), bytes."""
    sp = strat.mesh.tp if strat.sequence_parallel else 1
    return act_scale(strat) * strat.tokens(model.seq) * (
        model.wgrad_bytes_replicated_per_token / sp + model.wgrad_bytes_sharded_per_token / strat.mesh.tp)


def head_wgrad_bytes(model: ModelProfile, strat: Strategy) -> float:
    """The same for the head: the final norm's output gradient, b s h (/ tp with SP), and the
    logits', b s V / tp, 16-bit."""
    sp = strat.mesh.tp if strat.sequence_parallel else 1
    return act_scale(strat) * 2 * strat.tokens(model.seq) * (model.hidden / sp + model.vocab / strat.mesh.tp)


def boundary_bytes(model: ModelProfile, strat: Strategy) -> float:
    """One stage-boundary activation (or its gradient) of one micro-batch, b s h (/ tp with
    SP), bytes."""
    sp = strat.mesh.tp if strat.sequence_parallel else 1
    return act_scale(strat) * 2 * strat.tokens(model.seq) * model.hidden / sp


def zero_bubble_held_bytes(model: ModelProfile, hw: HardwareProfile, strat: Strategy,
                           pending: tuple[float, ...]) -> tuple[float, ...]:
    """What stage s of torch's zero-bubble schedule holds at its peak beyond its blocks' terms
    and ``pending``'s output gradients, bytes (B: ``boundary_bytes``):

    - per deferred weight pass its output (all stages but the last) and its input's gradient
      (all but the first), and on the last stage the head's output gradients;
    - of the max(0, m - p) micro-batches whose weight pass already ran, the input gradients,
      kept as the receive buffers' ``.grad`` until the step ends, and over gloo the outputs,
      held by the sends the schedule waits for only then (``_PipelineScheduleRuntime``'s
      ``send_ops``; NCCL's watchdog releases a completed send's tensors before that);
    - on a middle stage, its gradient receive buffers, m B (``recv_buffer_bytes`` prices an
      end stage, which receives in one direction).

    (The last stage also frees the loss's saved logits at each input pass:
    ``zero_bubble_freed_bytes``.)"""
    p, m = strat.mesh.pp, strat.num_microbatches
    b, done, gloo = boundary_bytes(model, strat), max(0, m - p), hw.launcher == "gloo"
    out = []
    for s, q in enumerate(pending):
        first, last = s == 0, s == p - 1
        held = (q * ((not first) + (not last)) + done * ((not first) + (not last and gloo))) * b
        if not first and not last:
            held += m * b
        if last:
            held += q * head_wgrad_bytes(model, strat)
        out.append(held)
    return tuple(out)


def zero_bubble_freed_bytes(model: ModelProfile, strat: Strategy) -> float:
    """What the last stage of torch's zero-bubble schedule has freed of its ``inflight``
    micro-batches' ``last_act_bytes`` at its peak: the loss's saved logits, which each input
    pass frees (``stage_backward_input`` detaches the loss), of all but one, bytes."""
    return (min(strat.mesh.pp, strat.num_microbatches) - 1) * loss_act_bytes(model, strat)


def grads_absent(strat: Strategy) -> bool:
    """No gradient exists at any stage's peak (``StageCosts.grads_absent``): FSDP2 makes them
    in the backward, ``zero_grad(set_to_none=True)`` having freed the last step's, and the
    peak comes first: with one micro-batch and no pipeline (the forward's end, or the last
    block's all-gather at the backward's start: a census of the live tensors on CPU ranks),
    or under torch's zero-bubble schedule with m <= p (``pipeline.grads_absent``). Likewise one
    replica (no wrapper: autograd makes each gradient in the backward; the peak is the loss's
    backward, measured on an H100 for a 1B GPT: 64.34 GiB, the cost model 65.5). Not under
    DDP or Megatron, whose gradient buffers live all step."""
    if grads_absent_zero_bubble(strat):
        return True
    torch_native = strat.recipe.fsdp_copies
    fsdp = torch_native and strat.replicas > 1 and (strat.zero > 0 or fsdp_replicate(strat))
    alone = torch_native and strat.replicas == 1
    return (fsdp or alone) and strat.mesh.pp == 1 and strat.num_microbatches == 1


def communicators(strat: Strategy) -> int:
    """Collective communicators a rank holds: one per mesh axis of degree > 1, the default
    group, and with ep > 1 the ep and edp groups."""
    return 1 + len(strat.mesh.active()) + (2 if strat.mesh.ep > 1 else 0)


def recv_buffer_bytes(model: ModelProfile, strat: Strategy) -> float:
    """``torch.distributed.pipelining``'s receive buffers on one device: every local stage
    allocates, once, one buffer per micro-batch for the activation it receives and one for
    the gradient it receives (``PipelineStage._setup_forward_recv_info`` and
    ``_create_grad_recv_info``), each the stage boundary's b s h (/ tp with SP) activation.
    Priced for a rank holding the first or the last stage, whose ``2 v - 1`` local stages
    (``v``: model chunks) receive in both directions but for the end (a middle rank's one more
    is under what its fewer in-flight micro-batches leave). 0 for other pipelines, which
    receive into the next activation (Megatron's p2p)."""
    if not torch_pipelining(strat):
        return 0.0
    act = boundary_bytes(model, strat)
    local = strat.virtual_stages if strat.schedule == "interleaved" else 1
    return (2 * local - 1) * strat.num_microbatches * act


def base_buffer_bytes(model: ModelProfile, hw: HardwareProfile, strat: Strategy) -> float:
    """Bytes every device needs besides states, saved activations and recompute workspace:

    - hw.reserve_gib (CUDA context, library workspaces) and hw.nccl_gib_per_group per
      communicator;
    - data-parallel buffers (``widest``: the wider of a repeated and a leading block):
      ZeRO-3 gathers the compute-dtype weights of two blocks (current and prefetched) and
      holds one block's unsharded gradients before its reduce-scatter, except where the
      stage holds its weights gathered anyway (``holds_unsharded``: torch's pipelining keeps
      them from the first backward to the last; measured on CPU ranks, ZeRO-3 then peaks
      within 1-7 MiB of ZeRO-1 with 12.6 MiB blocks): that is priced as ZeRO 1-2's. Below ZeRO-3, a
      recipe reducing through flat buffers (``fsdp_copies``: FSDP's reduce-scatter, FSDP2's
      ``replicate`` all-reduce) makes one block's unsharded gradients (gathered weights'
      dtype) in its backward while freeing that block's activations of the micro-batch
      (stored or recomputed): what they exceed those by (the copy into the flat buffer, in
      the reduce dtype, comes once the activations are gone); without a pipeline, FSDP2
      under ZeRO 1-2 keeps instead the last group's flat all-gather output (one block's
      weights) until the next all-gather (a census of the live tensors on CPU ranks; the
      pipelined stages, unsharded once per step by the schedule, measure without it). torch's
      DDP (``torch_ddp``) keeps the gradients in its buckets, but with more than one
      micro-batch the accumulating ones (``no_sync`` after ``zero_grad(set_to_none=True)``)
      are separate tensors until the last backward copies them in: one more copy of them;
      otherwise two 25 MB buckets (ZeRO 1-2; under ZeRO-0 the gradients are the buckets);
    - with offload under ZeRO 2, the unsharded gradients of one block before their
      reduce-scatter and copy to the host;
    - the pipeline's receive buffers (``recv_buffer_bytes``).
    """
    lay = state_layout(strat)
    total = (hw.reserve_gib + hw.nccl_gib_per_group * communicators(strat)) * 2**30
    if strat.replicas > 1:
        widest = max(layer_params(model, strat), layer_params(model.lead, strat) if model.lead else 0.0)
        if strat.zero >= 3 and not holds_unsharded(strat):
            total += widest * (2 * gather_bytes(strat) + lay.grad)
        elif torch_ddp(strat):
            if strat.num_microbatches > 1:
                total += model.params * lay.grad
        elif strat.recipe.fsdp_copies and strat.zero > 0 and strat.mesh.pp == 1:
            # FSDP2 keeps a group's flat all-gather output until the next group's all-gather
            total += widest * gather_bytes(strat)
        elif strat.recipe.fsdp_copies and (strat.zero > 0 or fsdp_replicate(strat)):
            total += max(0.0, widest * gather_bytes(strat) - block_act_bytes(model, strat, "none"))
        elif strat.zero > 0:
            total += 2 * DDP_BUCKET_BYTES
            if strat.offload and strat.zero == 2:
                total += layer_params(model, strat) * lay.grad
    return total + recv_buffer_bytes(model, strat)


def workspace_bytes(model: ModelProfile, strat: Strategy, recompute: str | None = None) -> float:
    """Recompute workspace: full recompute rebuilds one block's activations of one
    micro-batch during its backward, per-op recompute those it did not keep; selective
    rebuilds one block's attention core (as none
    does under cp with ``cp_recomputes_attention``: ``Strategy.recompute_run``)."""
    recompute = strat.recompute_run(recompute)
    if recompute == "full":
        return block_act_bytes(model, strat, "none")
    if recompute == "op":  # the forward runs again; what it does not keep is rebuilt
        return max(0.0, block_act_bytes(model, strat, "none") - block_act_bytes(model, strat, "op"))
    if recompute == "selective":
        return block_attn_act_bytes(model, strat)
    return 0.0


def buffer_bytes(model: ModelProfile, hw: HardwareProfile, strat: Strategy) -> float:
    """``base_buffer_bytes`` plus the workspace of the strategy's recompute mode."""
    return base_buffer_bytes(model, hw, strat) + workspace_bytes(model, strat)
