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

from cost_models.estimate import stage_costs
from cost_models.hardware import HardwareProfile
from cost_models.model_profile import ModelProfile
from cost_models.stages import StageCosts
from cost_models.strategy import Strategy


def least_memory_costs(model: ModelProfile, hw: HardwareProfile, strat: Strategy,
                       cache: dict | None = None) -> StageCosts:
    """``StageCosts`` whose memory rows are, stage by stage, nowhere above those of any
    strategy in ``strat``'s schedule group (module docstring): its 1F1B member with one chunk.

    1F1B keeps the fewest micro-batches in flight on every stage (``pipeline.inflight``):
    GPipe keeps m ≥ min(p - s, m); zero-bubble (ZB-H1) keeps 1F1B's; interleaved with v ≥ 2
    chunks keeps min(m, p + (p - 2s - 1)/v), and p + (p - 2s - 1)/v - (p - s) =
    s + (p - 2s - 1)/v, which is ≥ s ≥ 0 when p - 2s - 1 ≥ 0 and else (v ≥ 2) at least
    s + (p - 2s - 1)/2 = (p - 1)/2 ≥ 0. Every memory term is non-decreasing in the in-flight
    count, so a block count that does not fit a stage of this relaxation fits that stage of
    no member, whatever its recompute modes. ``cache``: ``stage_costs``'s per-piece cache."""
    return stage_costs(model, hw, replace(strat, schedule="1f1b", virtual_stages=1,
                                          recompute="none", stage_layers=(),
                                          stage_recompute=()), cache)
