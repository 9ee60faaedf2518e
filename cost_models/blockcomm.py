"""Communication inside one block per micro-batch, by the axis that splits it: tensor
parallelism's all-reduces (or SP's all-gathers and reduce-scatters) with the vocab-parallel
loss, context parallelism's KV exchange, expert parallelism's all-to-alls (``moe_terms``), and
the pipeline's sends between stages. Each returns forward, recompute and backward times
(``compute.PassTimes``) that ``cost_models.estimate`` adds to the passes they ride on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from cost_models import comm, compute, memory, pipeline, states
from cost_models.ring import cp_heads
from cost_models.axes import Axis
from cost_models.hardware import HardwareProfile
from cost_models.model_profile import ModelProfile
from cost_models.recipe import ContextParallel, SpCopy
from cost_models.strategy import Strategy


def vocab_parallel_loss_s(model: ModelProfile, strat: Strategy, g: comm.Group) -> float:
    """The vocab-parallel cross-entropy's forward exchanges under tp > 1: three all-reduces of
    one fp32 value per token (the logits' maximum, the sum of their exponentials, the target
    logit: Megatron's ``_VocabParallelCrossEntropy``, torch's ``loss_parallel``); latency-bound."""
    if strat.mesh.tp == 1:
        return 0.0
    return 3 * comm.all_reduce_s(strat.tokens(model.seq) * 4.0, g)


def tp_unit_s(model: ModelProfile, strat: Strategy, g: comm.Group) -> float:
    """One tensor-parallel exchange of a micro-batch's hidden states (b s h elements): an
    all-reduce, or with SP an all-gather plus a reduce-scatter (the same bus volume)."""
    vol = strat.tokens(model.seq) * model.hidden * compute.elem_bytes(strat)
    if strat.sequence_parallel:
        return comm.all_gather_s(vol, g) + comm.reduce_scatter_s(vol, g)
    return comm.all_reduce_s(vol, g)


def gather_elem_bytes(strat: Strategy) -> float:
    """Bytes per element of SP's all-gathers: 1 where Float8 linears gather fp8 casts
    (``recipe.fp8_tp_gather``: the column-parallel layers' inputs in the forward, the
    row-parallel layers' output gradients in the backward), else the activations'."""
    return 1.0 if compute.fp8_sp_gather(strat) else compute.elem_bytes(strat)


def scatter_copy_s(model: ModelProfile, hw: HardwareProfile, strat: Strategy) -> float:
    """The copy that rearranges a batch-first program's full hidden states (b s h elements,
    read and written) before an unpipelined reduce-scatter of SP, s."""
    return compute.memory_s(2 * strat.tokens(model.seq) * model.hidden * compute.elem_bytes(strat), hw)


def sp_copy_s(model: ModelProfile, hw: HardwareProfile, strat: Strategy) -> tuple[float, float]:
    """(after an all-gather, before a reduce-scatter) time of the copy that rearranges the
    full hidden states (b s h elements, read and written) around one of SP's collectives in a
    batch-first program (``recipe.sp_copy``), s; zeros where there is none."""
    copy = strat.recipe.sp_copy
    if not strat.sequence_parallel or strat.mesh.tp == 1 or copy == SpCopy.NONE:
        return 0.0, 0.0
    scatter = scatter_copy_s(model, hw, strat)
    if copy == SpCopy.BATCH_FIRST and strat.micro_batch == 1:  # torch's view
        return 0.0, scatter
    full = strat.tokens(model.seq) * model.hidden
    return compute.memory_s(2 * full * gather_elem_bytes(strat), hw), scatter


def block_tp_s(model: ModelProfile, hw: HardwareProfile, strat: Strategy,
               g: comm.Group) -> compute.PassTimes:
    """Exposed tensor-parallel communication of one block per micro-batch, by pass.

    Forward: two exchanges (before the column-parallel and after the row-parallel layers of
    attention and MLP); full recompute repeats them, per-op recompute the all-gathers (SP) or
    the all-reduces. Backward: their two conjugates. Pipelined with their GEMMs
    (``recipe.tp_comm_overlap``): ``pipelined_tp_s``. Otherwise, with
    ``tp_overlap`` (Megatron's async communication) the column-parallel layers' all-reduce
    of the input gradient (SP: its reduce-scatter) hides behind their weight-gradient GEMMs.
    With SP two all-gathers per sublayer stay exposed: the conjugate of the forward
    reduce-scatter, and the one that rebuilds the saved input shard for the weight gradient
    (queued before the input-gradient GEMM on Megatron's single connection; Korthikanti et
    al. Table 4 shows SP saving 0.1 of 11.9 ms of backward). Each SP collective of a
    batch-first program adds its rearranging copy (``sp_copy_s``).
    """
    if strat.mesh.tp == 1:
        return compute.PassTimes(forward_s=0.0, recompute_s=0.0, backward_s=0.0)
    if strat.recipe.tp_comm_overlap:
        fwd, bwd = pipelined_tp_s(model, hw, strat, g)
    else:
        unit = tp_unit_s(model, strat, g)
        bwd = 2 * unit
        if strat.recipe.tp_overlap:
            window = compute.wgrad_window_s(model, hw, strat)
            if strat.sequence_parallel:
                vol = strat.tokens(model.seq) * model.hidden * compute.elem_bytes(strat)
                gather = comm.all_gather_s(vol, g)
                bwd = 4 * gather + comm.exposed_s(2 * unit - 2 * gather, window, hw)
            else:
                bwd = comm.exposed_s(bwd, window, hw)
        fwd = 2 * unit
        if strat.sequence_parallel:  # two all-gathers a pass are fp8 under Float8's gather
            vol = strat.tokens(model.seq) * model.hidden
            low = 2 * (comm.all_gather_s(vol * compute.elem_bytes(strat), g)
                       - comm.all_gather_s(vol * gather_elem_bytes(strat), g))
            fwd, bwd = fwd - low, bwd - low
        gather, scatter = sp_copy_s(model, hw, strat)
        fwd, bwd = fwd + 2 * (gather + scatter), bwd + 2 * (gather + scatter)
    mode = strat.recompute_run()
    # Per-op recompute keeps the reduce-scatters' outputs (SP) and repeats the all-gathers, half
    # of the forward's exchanges; without SP it repeats the all-reduces, all of them.
    again = {"full": fwd, "op": fwd / 2 if strat.sequence_parallel else fwd}.get(mode, 0.0)
    return compute.PassTimes(forward_s=fwd, recompute_s=again, backward_s=bwd)


def pipelined_tp_s(model: ModelProfile, hw: HardwareProfile, strat: Strategy,
                   g: comm.Group) -> tuple[float, float]:
    """(forward, backward) exposed tensor-parallel communication of one block per micro-batch
    where each collective is pipelined with the one GEMM it feeds or follows
    (``recipe.tp_comm_overlap``: Transformer Engine's userbuffers, torch's async TP): with SP
    the all-gather into QKV and into the MLP's up projection, the reduce-scatter out of the
    attention output and the MLP's down projection; in the backward their conjugates (a
    reduce-scatter out of each column-parallel layer's input gradient, an all-gather into each
    row-parallel one's). An exchange longer than its GEMM shows the difference
    (``comm.exposed_s``, with the overlap penalty on the rest): a narrow GEMM (a small model
    at wide TP) cannot hide its exchange, however long the pass's other GEMMs. Without SP the
    two all-reduces follow the row-parallel GEMMs (backward: the column-parallel ones). Where
    the pipelined reduce-scatter exchanges partial sums and reduces them in a kernel of its
    own (``recipe.tp_overlap_reduces_partials``), that kernel follows the GEMM, exposed. Where
    the backward's column-parallel reduce-scatters are not pipelined
    (``recipe.tp_overlap_backward_scatter`` false) they run whole, with their copy."""
    vol = strat.tokens(model.seq) * model.hidden * compute.elem_bytes(strat)
    sp = strat.sequence_parallel
    if sp:
        scatter = comm.reduce_scatter_s(vol, g)
        into = comm.all_gather_s(vol / compute.elem_bytes(strat) * gather_elem_bytes(strat), g)
        fwd_ex, bwd_ex = (into, scatter, into, scatter), (scatter, into, scatter, into)
    else:
        reduce = comm.all_reduce_s(vol, g)
        fwd_ex, bwd_ex = (0.0, reduce, 0.0, reduce), (reduce, 0.0, reduce, 0.0)
    piped = (True, True, True, True)
    if sp and not strat.recipe.tp_overlap_backward_scatter:
        piped = (False, True, False, True)
    fwd = sum(comm.exposed_s(x, w, hw) for x, w in zip(fwd_ex, compute.tp_windows_s(model, hw, strat)))
    bwd = sum(comm.exposed_s(x, w, hw) if p else x
              for x, w, p in zip(bwd_ex, compute.tp_windows_s(model, hw, strat, True), piped))
    if sp and not all(piped):
        bwd += 2 * scatter_copy_s(model, hw, strat)
    if sp and strat.recipe.tp_overlap_reduces_partials:
        # Each pipelined reduce-scatter sums the tp stacked partials after its last chunk: the
        # full b s h partials read, the shard written.
        reduce = compute.memory_s(vol * (1 + 1 / strat.mesh.tp), hw)
        fwd, bwd = fwd + 2 * reduce, bwd + (2 * reduce if piped[0] else 0.0)
    return fwd, bwd


def block_cp_s(model: ModelProfile, hw: HardwareProfile, strat: Strategy,
               g: comm.Group) -> compute.PassTimes:
    """Exposed context-parallel communication of one block per micro-batch, by pass (the
    estimate counts it in ``tp_comm_s``).

    Each of the c = cp ranks holds a K,V block of seq/c tokens, 2 x ``ring.cp_heads`` x d
    elements per token. Ring attention (``ContextParallel.RING``; Liu et al. 2023,
    Megatron-Core / Transformer Engine's P2P CP) runs c steps: in each of the c-1 sends, the
    block moves to the next rank while attention runs on the block received last, so a step
    exposes max(0, send - attention of one step) (``comm.exposed_s``, with the profile's
    overlap penalty) plus the step's latency α; the attention of one step is 1/c of the
    rank's core time. The backward sends K,V and the accumulated dK,dV (twice the bytes)
    behind 1/c of the core's backward each step. All-gather CP (``ALL_GATHER``; autopar's
    runtime) gathers the c blocks before the forward's attention and again in the backward,
    then reduce-scatters dK,dV, none of it overlapped. torch's (``GATHER_RING``) gathers them
    behind its first kernel (1/c of the core) in each pass, and in the backward passes the
    fp32 dK,dV accumulators to the next rank after each kernel, waiting for them after the
    next: c sends, c-1 of them behind a kernel's backward, the last exposed. Recompute of
    the block (full) or of its attention core (selective; also none under a recipe with
    ``cp_recomputes_attention``) repeats the forward's exchange."""
    c = strat.mesh.cp
    if c == 1:
        return compute.PassTimes(forward_s=0.0, recompute_s=0.0, backward_s=0.0)
    d = model.hidden / model.heads
    block = strat.tokens(model.seq) * 2 * cp_heads(model, strat) * d * compute.elem_bytes(strat)
    method = strat.recipe.context_parallel
    if method in (ContextParallel.RING, ContextParallel.GATHER_RING):
        _, core_s = compute.block_gemm_s(model, hw, strat)
        _, core_b = compute.block_gemm_s(model, hw, strat, backward=True)
    if method == ContextParallel.RING:
        step = lambda nbytes, window_s: (comm.exposed_s(nbytes / g.p2p_bytes_s, window_s, hw)  # noqa: E731
                                         + g.latency_s)
        fwd = (c - 1) * step(block, core_s / c)
        bwd = (c - 1) * step(2 * block, core_b / c)
    elif method == ContextParallel.GATHER_RING:
        gather = comm.all_gather_s(c * block, g)
        send = block * 4 / compute.elem_bytes(strat) / g.p2p_bytes_s + g.latency_s
        fwd = comm.exposed_s(gather, core_s / c, hw)
        bwd = (comm.exposed_s(gather, core_b / c, hw) + (c - 1) * comm.exposed_s(send, core_b / c, hw)
               + send)
    else:
        fwd = comm.all_gather_s(c * block, g)
        bwd = fwd + comm.reduce_scatter_s(c * block, g)
    return compute.PassTimes(forward_s=fwd, recompute_s=fwd if strat.recompute_run() != "none" else 0.0,
                             backward_s=bwd)


def block_ep_s(model: ModelProfile, strat: Strategy, g: comm.Group) -> compute.PassTimes:
    """Exposed expert-parallel communication of one MoE block per micro-batch, by pass (the
    estimate counts it in ``tp_comm_s``, which keeps the estimate JSON as it was).

    The forward all-to-alls the top-k copies of the rank's tokens to their experts' ranks
    (dispatch) and the outputs back (combine): two all-to-alls of tokens x topk x h elements
    per rank over the ep group (with expert TP = tp every tp rank sends its tokens: with SP
    Megatron all-gathers them over tp first), the busiest rank's share grown by the load
    (``memory.moe_load``). The backward runs their two conjugates, full recompute repeats the
    forward's. Nothing overlaps them (Megatron-Core's and torchtitan's default dispatchers;
    DeepSeek's DualPipe overlap is not priced)."""
    ep = strat.mesh.ep
    if not model.moe or ep == 1:
        return compute.PassTimes(forward_s=0.0, recompute_s=0.0, backward_s=0.0)
    vol = (strat.tokens(model.seq) * model.topk * model.hidden * compute.elem_bytes(strat)
           * memory.moe_load(model, strat))
    two = 2 * comm.all_to_all_s(vol, g)
    return compute.PassTimes(forward_s=two, recompute_s=two if strat.recompute == "full" else 0.0,
                             backward_s=two)


@dataclass(frozen=True, kw_only=True, slots=True)
class MoeTerms:
    """What expert parallelism changes in a placed strategy, on its slowest pipeline stage:
    why ep was (or was not) chosen."""

    all_to_all_s: float
    """Dispatch + combine all-to-alls of one step, forward, recompute and backward, seconds."""
    expert_gemm_s: float
    """Routed-expert GEMMs of one step (forward, recompute, backward), seconds."""
    expert_state_bytes: float
    """Routed-expert weights, gradients and optimizer states on one device, bytes."""
    ep_inter_node: bool
    """The ep group crosses nodes (its all-to-all runs at the inter-node tier)."""


def moe_terms(model: ModelProfile, hw: HardwareProfile, strat: Strategy) -> MoeTerms:
    """``MoeTerms`` of ``strat`` (its placement as ``estimate`` reads it)."""
    loads = strat.stage_loads(model.layers)
    counts = [sum(x) if isinstance(x, tuple) else x for x in loads]
    n = max(counts)
    a2a = block_ep_s(model, strat, comm.axis_groups(hw, strat)[Axis.EP])
    rc = 2.0 if strat.recompute == "full" else 1.0
    gemm = compute.expert_gemm_s(model, hw, strat) * rc + compute.expert_gemm_s(model, hw, strat, backward=True)
    e = states.state_bytes(states.expert_layer_params(model, strat), states.expert_strategy(strat))
    m = strat.num_microbatches
    return MoeTerms(all_to_all_s=m * n * (a2a.forward_s + a2a.recompute_s + a2a.backward_s),
                    expert_gemm_s=m * n * gemm, expert_state_bytes=n * e.total,
                    ep_inter_node=comm.axis_groups(hw, strat)[Axis.EP].inter_node)



def comm_sum(a: compute.PassTimes, b: compute.PassTimes) -> compute.PassTimes:
    return compute.PassTimes(forward_s=a.forward_s + b.forward_s, recompute_s=a.recompute_s + b.recompute_s,
                             backward_s=a.backward_s + b.backward_s)


def block_comm(model: ModelProfile, hw: HardwareProfile, strat: Strategy, groups: Mapping[Axis, comm.Group], *,
               experts: bool = True) -> compute.PassTimes:
    """One block's tensor- and context-parallel communication per micro-batch, plus its
    experts' all-to-alls unless ``experts`` is false (a leading dense block)."""
    x = comm_sum(block_tp_s(model, hw, strat, groups[Axis.TP]), block_cp_s(model, hw, strat, groups[Axis.CP]))
    return comm_sum(x, block_ep_s(model, strat, groups[Axis.EP])) if experts else x


def layer_pass_times(model: ModelProfile, hw: HardwareProfile, strat: Strategy) -> compute.PassTimes:
    """One block's forward, recompute and backward per micro-batch with its exposed
    tensor-parallel communication: what Korthikanti et al. Table 4 times per layer."""
    passes = compute.block_times(model, hw, strat)
    groups = comm.axis_groups(hw, strat)
    tp = block_comm(model, hw, strat, groups)
    return compute.PassTimes(forward_s=passes.forward_s + tp.forward_s,
                             recompute_s=passes.recompute_s + tp.recompute_s,
                             backward_s=passes.backward_s + tp.backward_s)


def p2p_s(model: ModelProfile, strat: Strategy, groups: Mapping[Axis, comm.Group]) -> float:
    """Pipeline sends per micro-batch on a stage's critical path: an activation forward and
    a gradient backward per model chunk. With scatter/gather (Narayanan et al.; the recipe's
    ``pp_scatter_gather``) each of the tp ranks sends b s h / tp over its own link, and the
    receiver all-gathers the pieces inside its tp group; without it every tp rank sends the
    whole b s h (DeepSpeed's pipeline engine)."""
    if strat.mesh.pp == 1:
        return 0.0
    vol = strat.tokens(model.seq) * model.hidden * compute.elem_bytes(strat)
    if strat.recipe.pp_scatter_gather:
        one = comm.p2p_s(vol / strat.mesh.tp, groups[Axis.PP]) + comm.all_gather_s(vol, groups[Axis.TP])
    else:
        one = comm.p2p_s(vol, groups[Axis.PP])
    return pipeline.chunks(strat) * 2 * one
