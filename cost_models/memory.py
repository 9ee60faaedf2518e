"""Bytes on one device: activations, buffers and the recompute workspace, with the model
states of ``cost_models.states``.

Activations follow Korthikanti et al. Table 2 from the ModelProfile's three per-token fields in
the recipe's attention accounting (unfused: scores, softmax and dropout kept; fused: a float32
log-sum-exp per head), 16-bit activations and 1-byte masks, doubled for fp32 training.
Context parallelism of degree c divides every activation by c (each rank keeps seq/c tokens
of every sequence, ``Strategy.tokens``; ring attention re-sends the K,V blocks in backward
instead of keeping them). Sizes in bytes.
"""

from __future__ import annotations

from cost_models.pipeline import chunks, grads_absent as grads_absent_zero_bubble, torch_pipelining
from cost_models.hardware import HardwareProfile
from cost_models.model_profile import ModelProfile
from cost_models.states import (DDP_BUCKET_BYTES, fsdp_replicate, gather_bytes, holds_unsharded, layer_params, state_layout, torch_ddp)
from cost_models.strategy import Strategy

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
    traced accounting keeps them at 1 / tp (``Strategy.etp``: replicated experts keep them whole,
    or 1 / tp of them on a sequence shard: ``Strategy.moe_rows``)."""
    if not model.moe:
        return 0.0
    extra = moe_load(model, strat) * strat.moe_rows / strat.etp - 1.0 / strat.mesh.tp
    if extra <= 0:
        return 0.0
    return act_scale(strat) * strat.tokens(model.seq) * extra * model.expert_act_bytes_per_token()



def act_scale(strat: Strategy) -> float:
    """Activation bytes relative to the profile's 16-bit figures."""
    return 2.0 if strat.dtype == "fp32" else 1.0


def fused_attention(strat: Strategy) -> bool:
    return strat.fused_attention


def act_bytes_per_token(model: ModelProfile, strat: Strategy) -> tuple[float, float, float]:
    """``model``'s (replicated, sharded, attention core) bytes per token in ``strat``'s
    accounting: its recipe's attention, a core or norms written out by hand kept as written
    only by a program that runs the module itself (``recipe.runs_module_as_written``)."""
    return model.act_bytes_per_token(fused_attention(strat), own_blocks=not strat.recipe.runs_module_as_written,
                                     kv_repeated=strat.recipe.kv_repeated)


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
    repl, sharded, attn = act_bytes_per_token(model, strat)
    if autocast:
        repl += model.autocast_act_bytes_per_token
    per_token = repl / sp + sharded / strat.mesh.tp
    # The two sub-layers' GEMM inputs (16-bit norm outputs, 2 h bytes each per token), kept
    # gathered where the program saves SP's all-gather output (``recipe.sp_saves_gathered_inputs``).
    gathered = 1 if strat.recipe.sp_saves_gathered_inputs else sp
    per_token += 2 * 2 * model.hidden * (1 / gathered - 1 / sp)
    if strat.fp8 and strat.recipe.fp8_saves_fp8_inputs:
        # The weight GEMMs' saved inputs (two norm outputs, the attention output, the MLP's
        # down-projection input) kept as 1-byte casts instead of 16-bit tensors.
        per_token -= 2 * model.hidden / gathered + (model.hidden + model.ffn) / strat.mesh.tp
    if recompute == "none":
        per_token += attn / strat.mesh.tp
        if strat.recipe.runs_module_as_written and fused_attention(strat):
            per_token += model.masked_bias_bytes_per_token()  # whole on every tp rank
    if model.expert_act_bytes_traced_per_token and not strat.recipe.runs_module_as_written:
        # a framework's own grouped MLP (fused activation) keeps less than the model's code
        per_token += (model.expert_act_bytes_per_token() - model.expert_act_bytes_traced_per_token) / strat.mesh.tp
    return act_scale(strat) * tokens * per_token + expert_extra_act_bytes(model, strat)


def block_attn_act_bytes(model: ModelProfile, strat: Strategy) -> float:
    """The attention-core part of ``block_act_bytes`` (what selective recompute drops)."""
    tokens = strat.tokens(model.seq)
    attn = act_bytes_per_token(model, strat)[2]
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


def stage_output_bytes(model: ModelProfile, strat: Strategy) -> float:
    """The logits that torch's pipelining keeps on the last stage at its peak, bytes: each
    forward's output stays in ``PipelineStage.fwd_cache`` until that micro-batch's backward
    (without a pipeline nothing holds it once the loss has its log-probabilities), s b V / tp
    in the compute dtype, of m micro-batches under GPipe and of one under 1F1B and interleaved
    1F1B, whose last stage runs each backward right after its forward (censuses on CPU ranks:
    long-seq's 4-stage GPipe keeps 2.0 MiB a micro-batch beside the loss's, 4 bytes a logit in
    fp32; its 1F1B's last stage peaks 2.0 MiB above the price without them). None under
    torch's zero-bubble, whose last stage peaks inside an input pass: the censuses of the live
    tensors there that ``zero_bubble_held_bytes`` prices do not show it."""
    if not torch_pipelining(strat) or strat.schedule == "zero-bubble":
        return 0.0
    held = strat.num_microbatches if strat.schedule == "gpipe" else 1
    return held * 2 * act_scale(strat) * strat.tokens(model.seq) * model.vocab / strat.mesh.tp


def loss_backward_bytes(model: ModelProfile, strat: Strategy) -> float:
    """What the loss's backward allocates beyond its kept bytes while it runs, once per stage
    peak (one micro-batch's loss runs backward at a time), s b V / tp, bytes; under tp > 1 as
    ``loss_parallel`` does where the recipe says (``loss_parallel_backward_bytes``)."""
    rec = strat.recipe
    per = rec.loss_parallel_backward_bytes if strat.mesh.tp > 1 and rec.loss_parallel_backward_bytes is not None \
        else rec.loss_backward_bytes
    return strat.tokens(model.seq) * per * model.vocab / strat.mesh.tp


def backward_start_bytes(model: ModelProfile, strat: Strategy) -> float:
    """What a block's backward allocates beyond its kept bytes as it starts, at its first
    operator with weights (the dense MLP's down projection, its forward's last GEMM; a MoE
    block's shared expert): that GEMM's input gradient, b s ffn / tp, and its weight's
    gradient, ffn h / tp, in the compute dtype (before it is accumulated), bytes. A pipeline
    stage that is not the last peaks with it (``benchmarks/memory_census.py`` on CPU ranks:
    wide's tp 2 x pp 2 stage 0 and long-seq's pp 4 stages 0-2 peak in ``AddmmBackward0`` of
    their first backward; on long-seq's stage 0 that GEMM's two ``mm`` outputs, 2.0 and 0.25
    MiB, are all it allocates beyond its last forward's end); the last stage's loss backward
    comes first and is larger on every model with a real vocabulary (``loss_backward_bytes``)."""
    tp = strat.mesh.tp
    return 2 * act_scale(strat) * model.ffn * (strat.tokens(model.seq) + model.hidden) / tp


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


def forward_first(strat: Strategy) -> tuple[bool, ...]:
    """Per pipeline stage, whether its every forward comes before its first backward, which
    makes its gradients (``StageCosts.forward_first``): torch's pipelining under a recipe whose
    FSDP2 (or ``replicate``, or no wrapper) makes each gradient in the backward,
    ``zero_grad(set_to_none=True)`` having freed the last step's; GPipe's every stage, 1F1B's
    with m <= p - s. Such a stage peaks either at its last forward's end, with no gradient yet,
    or after its first backward, one micro-batch's activations gone (a 2-block GPT at pp 2,
    m 2 on CPU ranks: GPipe's stages peak within 0.4 MiB of 1F1B's, whose last stage holds one
    micro-batch). ``()`` where no stage does, or where ``grads_absent`` prices the peak."""
    if not (torch_pipelining(strat) and strat.recipe.fsdp_copies) or grads_absent(strat) or chunks(strat) > 1:
        return ()
    p, m = strat.mesh.pp, strat.num_microbatches
    if strat.schedule == "gpipe":
        return (True,) * p
    if strat.schedule == "1f1b" and m <= p:
        return tuple(m <= p - s for s in range(p))
    return ()


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
