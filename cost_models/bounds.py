"""Relaxations the solver prunes with: costs that bound a whole group of strategies at once.

A *schedule group* is the set of strategies that differ only in ``schedule``,
``virtual_stages`` and the nominal ``recompute`` (everything else equal: degrees, micro-batch
and so the micro-batch count, ZeRO, offload, SP, axis order, dtype, recipe). Their
``StageCosts`` memory rows differ only in ``inflight`` (``cost_models.stages``): the per-block
bytes, per-mode activations and workspaces, the embedding/head bytes, the buffers and the host
row come from the per-piece costs (``estimate.parts_key`` leaves the schedule, the chunks and
the nominal mode out) and from ``memory.base_buffer_bytes``/``workspace_bytes`` (per mode).
"""

from __future__ import annotations

from dataclasses import replace

from cost_models import memory, pipeline, states
from cost_models.estimate import pending_fields
from cost_models.hardware import HardwareProfile
from cost_models.model_profile import ModelProfile
from cost_models.stages import StageCosts
from cost_models.strategy import RECOMPUTE, Strategy


def least_memory_costs(model: ModelProfile, hw: HardwareProfile, strat: Strategy) -> StageCosts:
    """``StageCosts`` whose memory and host rows are, stage by stage, nowhere above those of
    any strategy in ``strat``'s schedule group (module docstring) with its ``memory.grads_absent``:
    those of its 1F1B member with one chunk, built from ``memory`` alone (the time coefficients
    are 0: not a time bound).

    1F1B keeps the fewest micro-batches in flight on every stage (``pipeline.inflight``):
    GPipe keeps m ≥ min(p - s, m); zero-bubble (ZB-H1) keeps 1F1B's (torch's keeps min(p, m)
    and defers weight passes, ``pipeline.pending``: more); interleaved with v ≥ 2
    chunks keeps min(m, p + (p - 2s - 1)/v), and p + (p - 2s - 1)/v - (p - s) =
    s + (p - 2s - 1)/v, which is ≥ s ≥ 0 when p - 2s - 1 ≥ 0 and else (v ≥ 2) at least
    s + (p - 2s - 1)/2 = (p - 1)/2 ≥ 0. Every memory term is non-decreasing in the in-flight
    count, so a block count that does not fit a stage of this relaxation fits that stage of
    no member, whatever its recompute modes. Where ``strat`` peaks before any gradient exists
    (``memory.grads_absent``: torch's zero-bubble with m <= p, or one micro-batch on FSDP2
    without a pipeline, where every member does), so does the relaxation (max(a, g) - g is
    at most a and non-decreasing in a): it is then below the members that share ``strat``'s
    zero-bubble-or-not, which is how the search keys it (``autopar.solve.bounds.relaxed``).
    Otherwise the 1F1B member's stages with m <= p - s peak with one micro-batch's activations
    or gradients less (``memory.forward_first``), as GPipe's do with the same count; a GPipe
    stage holding more (m > p - s) holds m a - min(a, g) >= (p - s) a, and interleaving and
    torch's zero-bubble save none: the relaxation stays below every member. The logits torch's
    pipelining keeps on the last stage (``memory.stage_output_bytes``: one micro-batch's under
    1F1B, none under its zero-bubble) are left out.

    The rows are assembled as ``estimate.stage_costs`` assembles them (tests/test_solver.py
    checks they are equal), without its time model: a fraction of its cost. The model's
    leading blocks (``ModelProfile.lead``, on the first stage in one mode the group may vary)
    add their states, their least activations (full recompute keeps the least) and no
    workspace: each term at its least over the modes."""
    s = replace(strat, schedule="1f1b", virtual_stages=1, recompute="none", stage_layers=(),
                stage_recompute=())
    absent = memory.grads_absent(strat)
    return _memory_costs(model, hw, s, pipeline.inflight(s), absent, () if absent else memory.forward_first(s), {})


def state_floor_bytes(model: ModelProfile, strat: Strategy) -> tuple[float, float, float]:
    """(first stage's, last stage's, each block's) device bytes of weights and optimizer
    states alone, nowhere above the memory rows (``StageCosts.memory_rows``) of any strategy
    with ``strat``'s degrees, ZeRO stage, offload, dtype and recipe, whatever its micro-batches,
    SP, schedule, chunks and recompute: those read only the gradients (``states.grads_sharded``),
    and the gradients, activations, workspaces, buffers and gathered head count 0 here, while a
    stage's peak frees no weight or optimizer state (``memory.forward_first`` and
    ``memory.grads_absent`` take gradients and activations off only). Bytes."""
    def kept(st: states.StateBytes) -> float:
        return st.params + st.optimizer

    lead = model.lead_layers * kept(states.layer_state_bytes(model.lead, strat)) if model.lead is not None else 0.0
    return (kept(states.state_bytes(states.first_params(model, strat), strat)) + lead,
            kept(states.state_bytes(states.last_params(model, strat), strat)),
            kept(states.layer_state_bytes(model, strat)))


def schedule_memory_costs(model: ModelProfile, hw: HardwareProfile, strat: Strategy,
                          chunk_counts: tuple[int, ...]) -> StageCosts:
    """``least_memory_costs`` of the members of ``strat``'s schedule group that run its
    schedule with one of ``chunk_counts`` chunks (a ``space.Family``'s members), nowhere above
    any of them: in flight on each stage the least over those members (interleaved keeps
    min(m, p + (p - 2s - 1)/v), monotone in v on every stage, so the least is at the fewest or
    the most chunks), with the schedule's own deferred weight passes and what they hold
    (torch's zero-bubble, ``estimate.pending_fields``) and its forward-first stages. Far
    tighter than 1F1B's rows for an interleaved or torch zero-bubble family: their last stages
    hold about p micro-batches, 1F1B's one (ZB-H1 keeps 1F1B's counts: no gain there). Where the fewest- and most-chunk members differ in
    anything but the in-flight counts, the group's relaxation (``least_memory_costs``)."""
    ends = [replace(strat, virtual_stages=v, recompute="none", stage_layers=(), stage_recompute=())
            for v in (min(chunk_counts), max(chunk_counts))]
    kinds = {(memory.grads_absent(e), memory.forward_first(e), pipeline.pending(e)) for e in ends}
    if len(kinds) > 1:
        return least_memory_costs(model, hw, strat)
    ((absent, ahead, _),) = kinds
    inflight = tuple(map(min, zip(*(pipeline.inflight(e) for e in ends))))
    return _memory_costs(model, hw, ends[0], inflight, absent, ahead, pending_fields(model, hw, ends[0]))


def _memory_costs(model: ModelProfile, hw: HardwareProfile, s: Strategy, inflight: tuple[float, ...],
                  absent: bool, ahead: tuple[bool, ...], pending: dict) -> StageCosts:
    """The memory and host rows of ``s`` assembled as ``estimate.stage_costs`` assembles them,
    with ``inflight``, ``absent`` (``memory.grads_absent``), ``ahead``
    (``memory.forward_first``) and ``pending`` (``estimate.pending_fields``) as given, the
    leading blocks at their least over the modes, no time coefficients and no last-stage
    logits (``memory.stage_output_bytes``)."""
    first, last = states.first_params(model, s), states.last_params(model, s)
    lead_static = lead_act = lead_host = lead_grads = 0.0
    if model.lead is not None:
        n = model.lead_layers
        lead_state = states.layer_state_bytes(model.lead, s)
        lead_static, lead_grads = n * lead_state.total, n * lead_state.grads
        lead_act = n * min(memory.block_act_bytes(model.lead, s, r) for r in RECOMPUTE)
        lead_host = n * states.layer_host_bytes(model.lead, s)
    layer, first_state, last_state = (states.layer_state_bytes(model, s), states.state_bytes(first, s),
                                      states.state_bytes(last, s))
    return StageCosts(
        pp=s.mesh.pp, nominal=0, mode_time_s=(0.0,) * len(RECOMPUTE), first_time_s=0.0,
        last_time_s=0.0, p2p_time_s=0.0, mode_dp_time_s=(0.0,) * len(RECOMPUTE),
        first_dp_time_s=0.0, last_dp_time_s=0.0,
        layer_static_bytes=layer.total,
        mode_act_bytes=tuple(memory.block_act_bytes(model, s, r) for r in RECOMPUTE),
        mode_workspace_bytes=tuple(memory.workspace_bytes(model, s, r) for r in RECOMPUTE),
        first_static_bytes=first_state.total + lead_static,
        first_act_bytes=memory.first_act_bytes(model, s) + lead_act,
        last_static_bytes=last_state.total + states.head_gather_bytes(model, s),
        last_act_bytes=memory.last_act_bytes(model, s), last_transient_bytes=memory.loss_backward_bytes(model, s),
        backward_start_bytes=memory.backward_start_bytes(model, s),
        inflight=inflight, buffer_bytes=memory.base_buffer_bytes(model, hw, s),
        sum_weight=0.0, max_weight=0.0,
        layer_host_bytes=states.layer_host_bytes(model, s),
        first_host_bytes=states.host_state_bytes(first, s) + lead_host,
        last_host_bytes=states.host_state_bytes(last, s),
        host_cap_bytes=hw.host_memory_bytes if s.offload else float("inf"),
        grads_absent=absent, forward_first=ahead, layer_grad_bytes=layer.grads if absent or ahead else 0.0,
        first_grad_bytes=first_state.grads + lead_grads if absent or ahead else 0.0,
        last_grad_bytes=last_state.grads if absent or ahead else 0.0, **pending)
