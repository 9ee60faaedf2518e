"""StageCosts for a strategy, and the Estimate that evaluates exactly them.

Per micro-batch and stage, T_s = compute (forward + recompute + backward, ``compute``)
+ tensor-parallel collectives (``tp_comm``; the recipe's ``tp_overlap`` hides the backward's
column-parallel ones behind weight-gradient GEMMs) + pipeline sends (``p2p``) + the exposed
part of ZeRO-2/3's per-micro-batch collectives (ZeRO-2 reduce-scatters the gradients in every
backward since it keeps only a shard; ZeRO-3 also all-gathers the weights in the forward and
again in the backward: 1.5x the all-reduce volume, ZeRO paper). Once per step, D_s = the
data-parallel gradient reduction (ZeRO 0: all-reduce; ZeRO 1: reduce-scatter + all-gather of
the updated weights; ZeRO 2: that all-gather), plus the optimizer step (memory-bound), plus,
with a tied head on pp > 1, the all-reduce of the embedding gradient between the first and
last stage.

Each piece's costs (a block, the embedding, the head), and what of its data-parallel
collectives overlaps, are ``cost_models.pieces``'.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models import blockcomm, comm, compute, memory, pieces, pipeline, states
from cost_models.axes import Axis
from cost_models.hardware import HardwareProfile
from cost_models.model_profile import ModelProfile
from cost_models.stages import StageCosts
from cost_models.strategy import RECOMPUTE, Estimate, MemoryBreakdown, Strategy, TimeBreakdown


def even_stage_layers(layers: int, pp: int) -> tuple[int, ...]:
    """Blocks per stage as even as possible, the earlier stages taking the remainder."""
    if pp < 1 or layers < pp:
        raise ValueError(f"cannot split {layers} layers over {pp} pipeline stages")
    q, r = divmod(layers, pp)
    return tuple(q + (1 if s < r else 0) for s in range(pp))


def model_flops_per_step(model: ModelProfile, global_batch: int) -> float:
    """Model FLOPs of one step (no recompute): 3x the forward GEMMs, attention included;
    for a GPT profile this is Narayanan et al.'s 72 B s L h² (1 + s/(6h) + V/(12hL))."""
    return model.model_flops_per_token() * model.seq * global_batch


@dataclass(frozen=True, kw_only=True, slots=True)
class _Parts:
    layers: tuple[pieces.Piece, ...]
    """One block in each recompute mode (``RECOMPUTE`` order)."""
    passes: tuple[compute.PassTimes, ...]
    """One block's compute per mode (no communication)."""
    first: pieces.Piece
    last: pieces.Piece
    p2p_s: float
    """Pipeline sends per micro-batch on a stage's critical path (one chunk), with the
    schedule's host time per chunk (``pipeline.host_s``)."""
    lead: tuple[pieces.Piece, ...] = ()
    """One leading block of another kind in each recompute mode (``ModelProfile.lead``;
    empty without them): the first stage runs ``lead_layers`` of them."""


def _first_with_lead(model: ModelProfile, parts: _Parts, strat: Strategy) -> pieces.Piece:
    """The first stage's fixed piece: the embedding and, in ``strat.lead_mode``, the model's
    leading blocks of another kind."""
    if not parts.lead:
        return parts.first
    return pieces.plus(parts.first, parts.lead[RECOMPUTE.index(strat.lead_mode)], model.lead_layers)


def _block_times(model: ModelProfile, hw: HardwareProfile, strat: Strategy, cache: dict | None,
                 lead: bool = False) -> compute.PassTimes:
    """``compute.block_times`` of ``model`` (``lead``: the model's leading blocks), shared
    through ``cache`` by ``compute.pass_key``."""
    if cache is None:
        return compute.block_times(model, hw, strat)
    key = ("passes", lead, compute.pass_key(strat))
    if key not in cache:
        cache[key] = compute.block_times(model, hw, strat)
    return cache[key]


def _parts(model: ModelProfile, hw: HardwareProfile, strat: Strategy, cache: dict | None = None) -> _Parts:
    groups = comm.axis_groups(hw, strat)
    rep = comm.replica_group(hw, strat)
    unit = blockcomm.tp_unit_s(model, strat, groups[Axis.TP]) if strat.mesh.tp > 1 else 0.0
    layers, passes = [], []
    for mode in RECOMPUTE:
        s = replace(strat, recompute=mode)
        passes.append(_block_times(model, hw, s, cache))
        layers.append(pieces.block_piece(model, passes[-1],
                                   blockcomm.block_comm(model, hw, s, groups), hw, s, rep))
    # Embedding: 1 forward exchange (vocab-parallel lookup); head: 1 backward (gradient of
    # the projection's input).
    first = pieces.piece(states.first_params(model, strat), compute.first_times(model, hw, strat),
                   compute.PassTimes(forward_s=unit, recompute_s=0.0, backward_s=0.0),
                   memory.first_act_bytes(model, strat), hw, strat, rep,
                   reduced_last=True, tensors=model.embed_param_tensors)
    last = pieces.piece(states.last_params(model, strat), compute.last_times(model, hw, strat),
                  compute.PassTimes(forward_s=blockcomm.vocab_parallel_loss_s(model, strat, groups[Axis.TP]),
                                    recompute_s=0.0, backward_s=unit),
                  memory.last_act_bytes(model, strat), hw, strat, rep, tensors=model.head_param_tensors)
    if gathered := states.head_gather_bytes(model, strat):
        last = replace(last, state=replace(last.state, params=last.state.params + gathered))
    if strat.mesh.pp > 1 and model.tied:
        # The tied embedding and its copy on the last stage sum their gradients after the
        # flush (Megatron's embedding all-reduce), exposed on both stages.
        pair = replace(groups[Axis.PP], size=2)
        sync = comm.all_reduce_s(model.vocab * model.hidden / strat.mesh.tp
                                 * states.state_layout(strat).grad, pair)
        first = replace(first, dp_tail_s=first.dp_tail_s + sync)
        last = replace(last, dp_tail_s=last.dp_tail_s + sync)
    if per_block := fsdp_partial_grads_s(model, strat, groups[Axis.TP], rep):
        each = strat.zero >= 2 and not pipeline.torch_pipelining(strat)  # reduced every micro-batch
        layers = [replace(p, dp_exposed_s=p.dp_exposed_s + per_block) if each
                  else replace(p, dp_tail_s=p.dp_tail_s + per_block) for p in layers]
    if sync := partial_grads_sync_s(model, strat, groups[Axis.TP], rep):
        first = replace(first, dp_tail_s=first.dp_tail_s + sync)
        if strat.mesh.pp > 1:
            last = replace(last, dp_tail_s=last.dp_tail_s + sync)
    lead = []
    if model.lead is not None:  # dense blocks: their own tp and cp exchanges, no experts
        for mode in RECOMPUTE:
            s = replace(strat, recompute=mode)
            lead.append(pieces.block_piece(model.lead, _block_times(model.lead, hw, s, cache, lead=True),
                                     blockcomm.block_comm(model.lead, hw, s, groups, experts=False), hw, s, rep))
    if states.torch_ddp(strat) and pieces.dp_hides(strat, hw):
        layers, lead, first, last = _ddp_tails(model, hw, strat, rep, layers, lead, first, last)
    return _Parts(layers=tuple(layers), passes=tuple(passes), first=first, last=last,
                  p2p_s=blockcomm.p2p_s(model, strat, groups) + pipeline.host_s(hw, strat)[0], lead=tuple(lead))


SP_REPLICATED_PER_BLOCK = 4
"""Hidden-size vectors of a block whose gradients sequence parallelism leaves partial: GPT's
two LayerNorms' weights and biases (4, as the FSDP2 census in ``fsdp_partial_grads_s``
counts; in the coalesced collective its two row-parallel biases ride along, a few kB);
Llama's two RMSNorm weights (2) are priced as 4, latency-bound collectives either way."""


def partial_grads_sync_s(model: ModelProfile, strat: Strategy, tp: comm.Group, rep: comm.Group) -> float:
    """Once a step, the all-reduce over the tp group of the gradients sequence parallelism
    leaves partial (replicated parameters whose inputs are sequence-sharded: norms,
    row-parallel biases), coalesced into one collective per stage: Megatron-LM's
    ``finalize_model_grads`` (its layer-norm all-reduce), autopar's runtime
    (``runtime.train._reduce_partial_grads``) where no data-parallel wrapper reduces them.
    Priced on the first and the last stage (``dp_tail_s``), whose reductions the step waits
    for; a middle stage's, as short, is taken to hide behind theirs. Multi-query TP's whole QKV
    projection (``states.whole_qkv_params``) is reduced with them. 0 without either, and where
    FSDP2 reduces them (``fsdp_partial_grads_s``)."""
    per_block = (SP_REPLICATED_PER_BLOCK * model.hidden if strat.sequence_parallel else 0.0) \
        + states.whole_qkv_params(model, strat)  # multi-query TP's whole QKV: partial too
    if not per_block or strat.mesh.tp == 1 or fsdp_reduces_partials(strat, rep):
        return 0.0
    blocks = -(-model.layers // strat.mesh.pp)  # the most blocks a stage holds
    return comm.all_reduce_s(per_block * blocks * states.state_layout(strat).grad, tp)


def fsdp_reduces_partials(strat: Strategy, rep: comm.Group) -> bool:
    """Whether FSDP2 (its ``fully_shard`` or ``replicate``, over dp x cp > 1) reduces the
    partial SP gradients of DTensor parameters itself: before its own reduction it
    redistributes each gradient to its parameter's tp placement, one all-reduce per
    parameter (``FSDPParam._get_grad_inner_tensor``, torch 2.13)."""
    return strat.recipe.dtensor_parameters and rep.size > 1


def fsdp_partial_grads_s(model: ModelProfile, strat: Strategy, tp: comm.Group, rep: comm.Group) -> float:
    """Time of one block's partial SP gradients reduced by FSDP2 (``fsdp_reduces_partials``),
    per reduction: one all-reduce of h elements per replicated vector
    (``SP_REPLICATED_PER_BLOCK``) over the tp group. FSDP2 reduces at every micro-batch under
    ZeRO-2/3 and once a step under ZeRO 0/1 and torch's pipelining (``estimate._parts``). A
    census of long-seq's dp 2 x tp 2 SP plan at 4 micro-batches (4 GPT blocks) counted 72 such
    all-reduces a step under ZeRO-2 and 18 under ZeRO 0 and 1: 4 a block and the final norm's
    2 (not priced) at each reduction; plus multi-query TP's whole QKV projection, one
    all-reduce of it. 0 without SP and multi-query TP, or without FSDP2."""
    if strat.mesh.tp == 1 or not fsdp_reduces_partials(strat, rep):
        return 0.0
    grad = states.state_layout(strat).grad
    whole = states.whole_qkv_params(model, strat)  # multi-query TP's whole QKV: partial too
    return (SP_REPLICATED_PER_BLOCK * comm.all_reduce_s(model.hidden * grad, tp) if strat.sequence_parallel else 0.0) \
        + (comm.all_reduce_s(whole * grad, tp) if whole else 0.0)


def _ddp_tails(model: ModelProfile, hw: HardwareProfile, strat: Strategy, rep: comm.Group,
               layers: list[pieces.Piece], lead: list[pieces.Piece], first: pieces.Piece, last: pieces.Piece
               ) -> tuple[list[pieces.Piece], list[pieces.Piece], pieces.Piece, pieces.Piece]:
    """The pieces with torch DDP's reduction in place of each piece's own all-reduce: per
    recompute mode, what its buckets add to the step in a model whose blocks all run in that
    mode (``pieces.ddp_exposed_s``: what runs past the backward, and ``overlap_penalty`` of
    what runs beside it), spread evenly over the blocks (so a stage's tail stays linear in its
    blocks per mode, as the solver prices it); the embedding and the head add none of their
    own."""
    grad = states.state_layout(strat).grad
    bwd = lambda p: p.compute_s + p.tp_s - p.forward_s  # noqa: E731  (recompute and accumulation included)
    blocks = model.layers + (model.lead_layers if lead else 0)
    out, out_lead = [], []
    for i, block in enumerate(layers):
        order = [(states.last_params(model, strat) * grad, bwd(last))]
        order += [(model.block_params * grad, bwd(block))] * model.layers
        if lead and model.lead is not None:
            order += [(model.lead.block_params * grad, bwd(lead[i]))] * model.lead_layers
        order.append((states.first_params(model, strat) * grad, bwd(first)))
        share = pieces.ddp_exposed_s(order, rep, hw) / blocks
        out.append(replace(block, dp_tail_s=share))
        if lead:
            out_lead.append(replace(lead[i], dp_tail_s=share))
    return out, out_lead, replace(first, dp_tail_s=0.0), replace(last, dp_tail_s=0.0)


def parts_key(strat: Strategy) -> tuple:
    """What ``_parts`` depends on: strategies with equal keys share their per-piece costs
    (schedule, chunks and the nominal recompute mode enter only ``stage_costs``)."""
    return (strat.mesh, strat.zero, strat.micro_batch, strat.sequence_parallel,
            strat.dtype, strat.fp8, strat.recipe, strat.offload, strat.axis_order)


def _cached_parts(model: ModelProfile, hw: HardwareProfile, strat: Strategy, cache: dict | None) -> _Parts:
    """``_parts`` of ``strat`` as 1F1B with one chunk, shared through ``cache`` by ``parts_key``."""
    key = parts_key(strat)
    parts = cache.get(key) if cache is not None else None
    if parts is None:
        parts = _parts(model, hw, replace(strat, schedule="1f1b", virtual_stages=1), cache)
        if cache is not None:
            cache[key] = parts
    return parts


@dataclass(frozen=True, kw_only=True, slots=True)
class TimeFloor:
    """The time coefficients of ``StageCosts`` shared by the strategies with one ``parts_key``
    (any schedule, chunks, nominal and leading-block recompute), each at its least over the
    leading blocks' modes: what a lower bound on all of their step times reads. Seconds."""

    mode_time_s: tuple[float, ...]
    mode_dp_time_s: tuple[float, ...]
    first_time_s: float
    first_dp_time_s: float
    last_time_s: float
    last_dp_time_s: float
    p2p_chunk_s: float
    """Pipeline sends and the schedule's host time per micro-batch and model chunk."""
    zb_fill: tuple[float, ...]
    """The zero-bubble fill fraction with each nominal recompute mode (``RECOMPUTE`` order)."""


def time_floor(model: ModelProfile, hw: HardwareProfile, strat: Strategy,
               cache: dict | None = None) -> TimeFloor:
    """``TimeFloor`` of ``strat``'s ``parts_key`` (``cache`` as in ``stage_costs``)."""
    parts = _cached_parts(model, hw, strat, cache)
    first_t, first_d = parts.first.time_s, parts.first.tail_s
    if parts.lead:  # the first stage adds lead_layers leading blocks, linearly (``pieces.plus``)
        first_t += model.lead_layers * min(p.time_s for p in parts.lead)
        first_d += model.lead_layers * min(p.tail_s for p in parts.lead)
    return TimeFloor(mode_time_s=tuple(p.time_s for p in parts.layers),
                     mode_dp_time_s=tuple(p.tail_s for p in parts.layers),
                     first_time_s=first_t, first_dp_time_s=first_d, last_time_s=parts.last.time_s,
                     last_dp_time_s=parts.last.tail_s, p2p_chunk_s=parts.p2p_s,
                     zb_fill=tuple(pipeline.zb_fill_fraction(p.forward_s, p.recompute_s, p.backward_s)
                                   for p in parts.passes))


def pass_floor(model: ModelProfile, hw: HardwareProfile, strat: Strategy,
               cache: dict | None = None) -> tuple[float, float]:
    """(Σ_s T_s at its least over what it does not read, the zero-bubble fill fraction at its
    least): Σ_s T_s over every block's, the embedding's, the head's and the leading blocks'
    forward and backward compute per micro-batch with their tp, cp and ep exchanges (seconds;
    ``T_s`` adds recompute, gradient accumulation and ZeRO's exposed collectives to these,
    never less, ``pieces.piece``); the fill fraction without recompute. Neither reads ZeRO,
    offload, dp, pp, the schedule, the placement or the recompute modes (the passes' forward
    and backward do not); the exchanges read ``strat``'s axis order on ``hw``. ``cache`` as in
    ``stage_costs``."""
    groups = comm.axis_groups(hw, strat)

    def block_s(m: ModelProfile) -> tuple[float, compute.PassTimes]:
        p = _block_times(m, hw, strat, cache, lead=m is not model)
        x = blockcomm.block_comm(m, hw, strat, groups, experts=m is model)
        return p.forward_s + p.backward_s + x.forward_s + x.backward_s, p

    block, passes = block_s(model)
    unit = blockcomm.tp_unit_s(model, strat, groups[Axis.TP]) if strat.mesh.tp > 1 else 0.0
    first, last = compute.first_times(model, hw, strat), compute.last_times(model, hw, strat)
    total = (model.layers * block + first.forward_s + first.backward_s + unit
             + last.forward_s + last.backward_s + unit
             + blockcomm.vocab_parallel_loss_s(model, strat, groups[Axis.TP]))
    if model.lead is not None:
        total += model.lead_layers * block_s(model.lead)[0]
    return total, pipeline.zb_fill_fraction(passes.forward_s, 0.0, passes.backward_s)


def stage_costs(model: ModelProfile, hw: HardwareProfile, strat: Strategy,
                cache: dict | None = None) -> StageCosts:
    """All coefficients of the fixed outer strategy (the placement in ``strat`` is ignored).

    Block coefficients come per recompute mode; the zero-bubble fill fraction uses the
    strategy's own ``recompute`` (the solver plans zero-bubble with one mode on every block).
    ``cache`` (a dict the caller owns) shares the per-piece costs between strategies that
    differ only in schedule, chunks or nominal recompute (``parts_key``).
    """
    parts = _cached_parts(model, hw, strat, cache)
    if pipeline.chunks(strat) > 1:
        parts = replace(parts, p2p_s=parts.p2p_s * pipeline.chunks(strat))
    passes = parts.passes[RECOMPUTE.index(strat.recompute)]
    sum_w, max_w = pipeline.schedule_weights(strat, pipeline.zb_fill_fraction(
        passes.forward_s, passes.recompute_s, passes.backward_s), hw.ranks_per_core)
    first = _first_with_lead(model, parts, strat)
    zb = pipeline.host_s(hw, strat)[1]
    return StageCosts(
        pp=strat.mesh.pp, nominal=RECOMPUTE.index(strat.recompute),
        mode_time_s=tuple(p.time_s + zb for p in parts.layers), first_time_s=first.time_s,
        last_time_s=parts.last.time_s, p2p_time_s=parts.p2p_s,
        mode_dp_time_s=tuple(p.tail_s for p in parts.layers), first_dp_time_s=first.tail_s,
        last_dp_time_s=parts.last.tail_s,
        layer_static_bytes=parts.layers[0].state.total,
        mode_act_bytes=tuple(p.act_bytes for p in parts.layers),
        mode_workspace_bytes=tuple(memory.workspace_bytes(model, strat, r) for r in RECOMPUTE),
        first_static_bytes=first.state.total, first_act_bytes=first.act_bytes,
        last_static_bytes=parts.last.state.total, last_act_bytes=parts.last.act_bytes,
        last_transient_bytes=memory.loss_backward_bytes(model, strat) + memory.stage_output_bytes(model, strat),
        backward_start_bytes=memory.backward_start_bytes(model, strat),
        inflight=pipeline.inflight(strat), buffer_bytes=memory.base_buffer_bytes(model, hw, strat),
        sum_weight=sum_w, max_weight=max_w,
        layer_host_bytes=parts.layers[0].host_bytes, first_host_bytes=first.host_bytes,
        last_host_bytes=parts.last.host_bytes,
        host_cap_bytes=hw.host_memory_bytes if strat.offload else float("inf"),
        first_workspace_bytes=lead_workspace_bytes(model, strat), **grad_fields(parts, first, strat),
        **pending_fields(model, hw, strat))


def grad_fields(parts: _Parts, first: pieces.Piece, strat: Strategy) -> dict:
    """The ``StageCosts`` fields of gradients absent at the peak (``memory.grads_absent``) or
    made after some stages' forwards (``memory.forward_first``); empty where they are there."""
    grads = dict(layer_grad_bytes=parts.layers[0].state.grads, first_grad_bytes=first.state.grads,
                 last_grad_bytes=parts.last.state.grads)
    if memory.grads_absent(strat):
        return dict(grads_absent=True, **grads)
    ahead = memory.forward_first(strat)
    return dict(forward_first=ahead, **grads) if ahead else {}


def pending_fields(model: ModelProfile, hw: HardwareProfile, strat: Strategy) -> dict:
    """The ``StageCosts`` fields of the deferred weight passes (``pipeline.pending``) and what
    their schedule holds with them (``memory.zero_bubble_held_bytes``); empty where no stage
    defers one."""
    pending = pipeline.pending(strat)
    if not pending:
        return {}
    return dict(pending=pending, layer_wgrad_bytes=memory.block_wgrad_bytes(model, strat),
                held_bytes=memory.zero_bubble_held_bytes(model, hw, strat, pending),
                last_freed_bytes=memory.zero_bubble_freed_bytes(model, strat))


def lead_workspace_bytes(model: ModelProfile, strat: Strategy) -> float:
    """Recompute workspace of the leading blocks (one block's, in ``strat.lead_mode``) on the
    first stage, bytes; 0 without them."""
    if model.lead is None:
        return 0.0
    return memory.workspace_bytes(model.lead, strat, strat.lead_mode)


def _stage_pieces(parts: _Parts, s: int, counts: tuple[int, ...], pp: int,
                  first: pieces.Piece | None = None) -> list[tuple[float, pieces.Piece]]:
    """(count, piece) of what stage s holding ``counts`` blocks per recompute mode runs
    (``first``: the first stage's fixed piece, leading blocks included; default the embedding)."""
    out = [(float(n), piece) for n, piece in zip(counts, parts.layers) if n]
    if s == 0:
        out.append((1.0, first or parts.first))
    if s == pp - 1:
        out.append((1.0, parts.last))
    return out


def _stage_memory(parts: _Parts, c: StageCosts, s: int, counts: tuple[int, ...],
                  first: pieces.Piece | None = None) -> MemoryBreakdown:
    """Stage s's peak bytes by kind (they add up to ``StageCosts.stage_memory_bytes``)."""
    pieces = _stage_pieces(parts, s, counts, c.pp, first)
    k = c.inflight[s]
    freed, unmade = c.forward_first_savings(s, counts)
    return MemoryBreakdown(
        peak_bytes=c.stage_memory_bytes(s, counts),
        params_bytes=sum(n * p.state.params for n, p in pieces),
        grads_bytes=(c.stage_grad_bytes(s, counts) if c.grads_absent
                     else sum(n * p.state.grads for n, p in pieces) - unmade),
        optimizer_bytes=sum(n * p.state.optimizer for n, p in pieces),
        activations_bytes=(k * sum(n * p.act_bytes for n, p in pieces) + c.stage_pending_bytes(s, counts)
                           + (c.last_transient_bytes if s == c.pp - 1 else c.backward_start_bytes) - freed),
        buffers_bytes=c.buffer_bytes + c.stage_workspace_bytes(counts) + (c.first_workspace_bytes if s == 0 else 0.0),
        host_bytes=c.stage_host_bytes(s, counts))


@dataclass(frozen=True, kw_only=True, slots=True)
class StageDetail:
    """One pipeline rank of a placed strategy as ``estimate`` prices it: its per-micro-batch
    T_s (seconds, over all its model chunks) split by pass and by kind, its once-per-step
    D_s, and its peak memory (bytes)."""

    forward_s: float
    """Forward compute, its tp exchanges and exposed ZeRO-3 gathers."""
    recompute_s: float
    backward_s: float
    """The rest of T_s: backward compute, its tp exchanges, exposed ZeRO collectives, gradient
    accumulation; forward + recompute + backward + p2p = ``StageCosts.stage_time_s``."""
    p2p_s: float
    compute_s: float
    tp_comm_s: float
    """Exposed tensor-parallel communication."""
    dp_comm_s: float
    """Exposed per-micro-batch ZeRO-2/3 collectives; compute + tp + dp + p2p = T_s too."""
    dp_tail_s: float
    """Exposed once-per-step gradient reduction (and weight all-gather) of D_s."""
    optimizer_s: float
    """Optimizer step; dp_tail + optimizer = ``StageCosts.stage_dp_time_s``."""
    memory: MemoryBreakdown
    workspace_bytes: float
    """Recompute workspace, inside ``memory.buffers_bytes``."""


def stage_details(model: ModelProfile, hw: HardwareProfile, strat: Strategy) -> tuple[StageDetail, ...]:
    """Every pipeline rank of ``strat`` (its placement as ``estimate`` reads it), first to last."""
    c = stage_costs(model, hw, strat)
    parts = _parts(model, hw, strat)
    first = _first_with_lead(model, parts, strat)
    zb, out = pipeline.host_s(hw, strat)[1], []
    for s, load in enumerate(strat.stage_loads(model.layers)):
        counts = c.counts(load)
        pieces = _stage_pieces(parts, s, counts, strat.mesh.pp, first)
        fwd = sum(k * p.forward_s for k, p in pieces)
        rc = sum(k * p.recompute_s for k, p in pieces)
        out.append(StageDetail(
            forward_s=fwd, recompute_s=rc,
            backward_s=c.stage_time_s(s, counts) - c.p2p_time_s - fwd - rc, p2p_s=c.p2p_time_s,
            compute_s=sum(k * p.compute_s for k, p in pieces) + sum(counts) * zb,
            tp_comm_s=sum(k * p.tp_s for k, p in pieces),
            dp_comm_s=sum(k * p.dp_exposed_s for k, p in pieces),
            dp_tail_s=sum(k * p.dp_tail_s for k, p in pieces),
            optimizer_s=sum(k * p.optimizer_s for k, p in pieces),
            memory=_stage_memory(parts, c, s, counts, first),
            workspace_bytes=c.stage_workspace_bytes(counts) + (c.first_workspace_bytes if s == 0 else 0.0)))
    return tuple(out)


def estimate(model: ModelProfile, hw: HardwareProfile, strat: Strategy, *,
             global_batch: int) -> Estimate:
    """Evaluate ``stage_costs`` on ``strat.stage_layers`` (even when empty).

    The time breakdown adds up to ``step_time_s``: compute, tp, pp and the exposed part of
    ZeRO-2/3's per-micro-batch collectives are the slowest stage's m micro-batches split by
    kind; ``bubble_s`` is the rest of the pipeline term (fill and drain); the stage with the
    longest D_s adds its data-parallel reduction (to ``dp_comm_s``) and ``optimizer_s``.
    The memory breakdown is that of the stage with the highest peak.
    """
    if strat.uses_mode("op") and not (model.op_priced and strat.mesh.cp == 1):
        raise ValueError(f"per-op recompute is priced for dense blocks without context parallelism; "
                         f"{model.name} at cp={strat.mesh.cp} is not one: use none, selective or full")
    tokens_per_rank = strat.micro_batch * strat.num_microbatches
    if global_batch != strat.mesh.dp * tokens_per_rank:
        raise ValueError(f"global batch {global_batch} is not dp x micro_batch x "
                         f"num_microbatches = {strat.mesh.dp} x {strat.micro_batch} x "
                         f"{strat.num_microbatches}; set num_microbatches = B / (dp x mbs)")
    c = stage_costs(model, hw, strat)
    layers = tuple(c.counts(x) for x in strat.stage_loads(model.layers))
    parts = _parts(model, hw, strat)
    first = _first_with_lead(model, parts, strat)
    step = c.step_time_s(layers)
    m = strat.num_microbatches

    times = [c.stage_time_s(s, n) for s, n in enumerate(layers)]
    tails = [c.stage_dp_time_s(s, n) for s, n in enumerate(layers)]
    st = max(range(strat.mesh.pp), key=times.__getitem__)
    sd = max(range(strat.mesh.pp), key=tails.__getitem__)
    crit = _stage_pieces(parts, st, layers[st], strat.mesh.pp, first)
    tail = _stage_pieces(parts, sd, layers[sd], strat.mesh.pp, first)
    compute_s = m * (sum(k * p.compute_s for k, p in crit) + sum(layers[st]) * pipeline.host_s(hw, strat)[1])
    tp_s = m * sum(k * p.tp_s for k, p in crit)
    pp_s = m * c.p2p_time_s
    dp_s = m * sum(k * p.dp_exposed_s for k, p in crit) + sum(k * p.dp_tail_s for k, p in tail)
    opt_s = sum(k * p.optimizer_s for k, p in tail)
    bubble_s = step - tails[sd] - m * times[st]

    peaks = [c.stage_memory_bytes(s, n) for s, n in enumerate(layers)]
    hosts = [c.stage_host_bytes(s, n) for s, n in enumerate(layers)]
    sm = max(range(strat.mesh.pp), key=peaks.__getitem__)
    memory_bd = replace(_stage_memory(parts, c, sm, layers[sm], first), host_bytes=max(hosts))

    flops = model_flops_per_step(model, global_batch)
    per_gpu = flops / (step * strat.devices)
    return Estimate(
        step_time_s=step, tokens_per_s=global_batch * model.seq / step,
        tflops_per_gpu=per_gpu / 1e12, mfu=per_gpu / hw.peak_flops(strat.dtype),
        fits=max(peaks) <= hw.memory_bytes and max(hosts) <= c.host_cap_bytes, memory=memory_bd,
        time=TimeBreakdown(compute_s=compute_s, tp_comm_s=tp_s, dp_comm_s=dp_s, pp_comm_s=pp_s,
                           bubble_s=bubble_s, optimizer_s=opt_s),
        stage_peak_bytes=tuple(peaks))
