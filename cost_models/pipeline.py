"""Pipeline schedules: the StageCosts weights and the micro-batches in flight per stage.

With m micro-batches and per-micro-batch stage times T_s the step is
``sum_weight * Σ_s T_s + max_weight * max_s T_s`` (see ``cost_models.stages``). Write
``sum_weight = f`` and ``max_weight = m - f``: for uniform stages the step is ``(m + (p-1) f) T``,
a bubble fraction of ``(p-1) f / m``, where f is the fraction of a stage's per-micro-batch time
spent once per stage in the fill and drain.

- gpipe, 1f1b: f = 1, bubble (p-1)/m (Narayanan et al. 2021).
- interleaved with v chunks per stage: f = 1/v, bubble (p-1)/(v m) (Narayanan et al. 2021);
  the fill and drain pass each device once per chunk, i.e. T_s / v. Megatron needs m % p == 0.
- zero-bubble: ZB-H1 of Qi et al. 2023 (same peak memory as 1F1B). The backward splits into B
  (input gradients) and W (weight gradients); W fills the drain, leaving a bubble of
  (p-1)(T_F + T_B - T_W). With B = W = half the backward and any recompute on the F side, f is
  ``zb_fill_fraction`` = (F + R) / (F + R + backward) (1/3 without recompute). An approximation:
  it ignores the communication inside T_s and the optimizer-step synchronisation ZB-V removes.

Ranks sharing compute units (``HardwareProfile.ranks_per_core`` = o > 1: CPU ranks over fewer
cores, their rates measured with every rank busy): a rank idle in the fill or drain lends its
share to the busy ranks, which then run up to o times faster. The step is then about the
larger of the busy time m T (work-conserving: the ranks' work over the cores) and the whole
schedule run o times faster, (m + (p-1) f) T / o. Both are linear in T, so the weights keep
their form with an effective fill fraction f' = max(0, ((m + (p-1) f) / o - m) / (p-1)):
exact for uniform stages, and the bubble is not charged where the busy time covers it.
"""

from __future__ import annotations

from cost_models.hardware import HardwareProfile
from cost_models.strategy import Strategy


def partition_uniform(layers: int, parts: int) -> tuple[int, ...]:
    """Blocks per stage of DeepSpeed's ``partition_method="uniform"`` over the blocks
    (``deepspeed.runtime.utils.partition_uniform``: the first stages take the remainder)."""
    if layers <= parts:
        return tuple(1 if p < layers else 0 for p in range(parts))
    q, rem = divmod(layers, parts)
    return tuple(q + (1 if p < rem else 0) for p in range(parts))


def chunk_sizes(blocks: int, chunks: int) -> list[int]:
    """Blocks per model chunk of a stage of ``blocks`` blocks in ``chunks`` chunks, as evenly as
    possible, the first chunks taking the remainder (``workflow.layer_layout``)."""
    q, rem = divmod(blocks, chunks)
    return [q + (1 if j < rem else 0) for j in range(chunks)]


def block_method_k(sizes: list[list[int]], full: list[int]) -> int | None:
    """The k of Megatron's block method (``--recompute-method block``: full recompute on the
    first k blocks of every model chunk, none on the rest) under which each stage, its chunks
    of ``sizes[s]`` blocks, recomputes ``full[s]`` blocks; the least such k >= 1, or None."""
    top = max((n for ns in sizes for n in ns), default=0)
    return next((k for k in range(1, top + 1)
                 if all(sum(min(k, n) for n in ns) == f for ns, f in zip(sizes, full))), None)


def chunks(strat: Strategy) -> int:
    """Model chunks per device: ``virtual_stages`` under the interleaved schedule, else 1."""
    return strat.virtual_stages if strat.schedule == "interleaved" else 1


def zb_fill_fraction(forward_s: float, recompute_s: float, backward_s: float) -> float:
    """f of the zero-bubble (ZB-H1) schedule from one block's pass times."""
    total = forward_s + recompute_s + backward_s
    return (forward_s + recompute_s) / total if total > 0 else 1.0


def schedule_weights(strat: Strategy, zb_fill: float = 1 / 3,
                     ranks_per_core: float = 1.0) -> tuple[float, float]:
    """(sum_weight, max_weight) of StageCosts for the strategy's schedule."""
    return weights(strat.schedule, strat.mesh.pp, strat.num_microbatches, chunks(strat), zb_fill,
                   ranks_per_core)


def weights(schedule: str, pp: int, m: int, chunks: int, zb_fill: float = 1 / 3,
            ranks_per_core: float = 1.0) -> tuple[float, float]:
    """(sum_weight, max_weight) of ``schedule`` over ``pp`` stages with ``m`` micro-batches
    and ``chunks`` model chunks per stage (``schedule_weights`` without a Strategy), on
    ``ranks_per_core`` ranks per compute unit (the effective fill fraction above). Never
    larger than with fewer ranks per core, nor with fewer chunks or a smaller ``zb_fill``."""
    if pp == 1:
        return 1.0, m - 1.0  # no pipeline: m micro-batches back to back, whatever f
    if schedule == "interleaved":
        f = 1.0 / chunks
    elif schedule == "zero-bubble":
        f = zb_fill
    else:
        f = 1.0
    if ranks_per_core > 1.0:
        f = max(0.0, ((m + (pp - 1) * f) / ranks_per_core - m) / (pp - 1))
    return f, m - f


def torch_pipelining(strat: Strategy) -> bool:
    """The pipeline runs on ``torch.distributed.pipelining`` (the recipes whose FSDP stages
    accumulate unsharded through it, ``ExecutionRecipe.pp_unsharded_accumulation``)."""
    return strat.mesh.pp > 1 and strat.recipe.pp_unsharded_accumulation


def host_s(hw: HardwareProfile, strat: Strategy) -> tuple[float, float]:
    """(per model chunk, per block) host time per micro-batch that ``torch.distributed.pipelining``
    adds to a stage's forward and backward where the host runs the operators
    (``host_overlaps_device`` false), s: the schedule's bookkeeping of each chunk
    (``HardwareProfile.pp_chunk_us``), and under the zero-bubble schedule the split backward's
    walk of each block's autograd graph (``zb_block_us``). (0, 0) without a torch pipeline."""
    if not torch_pipelining(strat) or hw.host_overlaps_device:
        return 0.0, 0.0
    block = hw.zb_block_us * 1e-6 if strat.schedule == "zero-bubble" else 0.0
    return hw.pp_chunk_us * 1e-6, block


def inflight(strat: Strategy) -> tuple[float, ...]:
    """Micro-batches (in units of a whole stage's activations) stage s holds at its peak.

    gpipe: all m (pp > 1); 1f1b and zero-bubble: min(p - s, m), but torch's zero-bubble
    (``ScheduleInterleavedZeroBubble``, ``torch_pipelining``) keeps min(p, m) on every stage:
    p - s in flight and s whose weight pass is pending, their graphs retained by
    ``stage_backward_input`` (measured on CPU ranks: tests/test_memory_measured.py). interleaved with v chunks:
    Megatron's warm-up runs 2(p-s-1) + (v-1)p chunk forwards before the first backward, so
    (2(p-s-1) + (v-1)p + 1) chunks of n/v blocks are live: stage 0 holds
    p (1 + (p-1)/(p v)) micro-batches, Korthikanti et al.'s factor (their "m" is v).
    Capped at m. Without a pipeline (pp = 1) one micro-batch is live at a time.
    """
    p, m, v = strat.mesh.pp, strat.num_microbatches, chunks(strat)
    if p == 1:
        return (1.0,)
    if strat.schedule == "gpipe":
        return tuple(float(m) for _ in range(p))
    if strat.schedule == "zero-bubble" and torch_pipelining(strat):
        return tuple(float(min(p, m)) for _ in range(p))
    if v > 1:
        return tuple(min(float(m), (2 * (p - s - 1) + (v - 1) * p + 1) / v) for s in range(p))
    return tuple(float(min(p - s, m)) for s in range(p))


def pending(strat: Strategy) -> tuple[float, ...]:
    """Micro-batches whose weight pass stage s has deferred at its peak (``()``: none on any).

    torch's zero-bubble schedule (``torch_pipelining``) runs each backward as an input pass
    (``stage_backward_input``) and a later weight pass; in between, the stage keeps for that
    micro-batch (``PipelineStage.backward_state``) the output gradient of every operator with
    weights (the ``param_groups`` hooks), the gradient of its input and its detached output.
    A stage peaks at the end of its last steady-state input pass, with min(p, m) - min(p - s, m)
    passes deferred before it and that micro-batch's own (measured on CPU ranks by
    ``tests/test_memory_measured.py``); the first stage, whose input needs no gradient, runs
    each weight pass at once. Other schedules run each backward whole."""
    p, m = strat.mesh.pp, strat.num_microbatches
    if p == 1 or strat.schedule != "zero-bubble" or not torch_pipelining(strat):
        return ()
    return tuple(float(min(p, m) - min(p - s, m) + (s > 0)) for s in range(p))


def grads_absent(strat: Strategy) -> bool:
    """No stage has made a gradient by its peak: torch's zero-bubble schedule with m <= p
    peaks at the end of its input passes, before any weight pass (measured on CPU ranks), and
    its recipes' FSDP2 makes the gradients in the weight passes, ``zero_grad(set_to_none=True)``
    having freed the last step's."""
    return bool(pending(strat)) and strat.num_microbatches <= strat.mesh.pp
