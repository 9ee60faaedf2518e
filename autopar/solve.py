"""solve: the best plan the cost model knows, for a model, a cluster and a global batch.

Search = an outer enumeration of the discrete strategy (``candidates``) and, for each outer
candidate, an exact CP-SAT model of the pipeline placement (``place_layers``).

Outer space (``candidates``): tp | gpus with tp dividing the devices per node (a tp group never
straddles nodes) and the attention and kv heads; pp | gpus/tp with pp ≤ layers; dp = gpus/(tp·pp) dividing the global batch B;
micro-batch b | B/dp, m = B/(dp·b) micro-batches (m ≥ pp when pp > 1); ZeRO 0-3 (0 when dp = 1);
schedule GPipe or 1F1B (when pp > 1); sequence parallelism (when tp > 1); recompute none,
selective or full. Any dimension may be pinned.

Placement (per outer candidate, cost coefficients from ``cost_models.stage_costs``; see
``cost_models.stages`` for T_s, D_s and M_s):

    variables   n_s ∈ [1, L]                      blocks on stage s          (_add_layer_vars)
                T ≥ T_s(n_s), D ≥ D_s(n_s)        slowest stage, worst tail  (_add_max_vars)
    constraints Σ_s n_s = L                                                  (_add_layer_vars)
                M_s(n_s) ≤ device memory, an upper bound on n_s            (_stage_upper_bounds)
                n_1 ≤ … ≤ n_{p-2} where the middle stages are interchangeable (_add_symmetry_breaking)
    objective   min  max_weight · T + D   (Σ_s T_s is constant: L·t + first + last + p·p2p)

Coefficients are scaled to integer nanoseconds; the returned objective is re-evaluated in float
with ``StageCosts.step_time_s``. Outer candidates are visited in order of a lower bound
(``_lower_bound``: max ≥ mean over stages) and pruned once the bound reaches the incumbent, so
only a handful of CP-SAT models are solved. CP-SAT runs with one worker and a fixed seed, and
ties keep the first candidate in a fixed order, so identical inputs give an identical plan.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Iterator

from ortools.sat.python import cp_model

from autopar.errors import UserError
from cost_models import HardwareProfile, ModelProfile, StageCosts, Strategy, estimate, stage_costs
from cost_models.strategy import Estimate

NS = 1e9  # integer objective unit: nanoseconds


@dataclass(frozen=True, kw_only=True, slots=True)
class Pins:
    """Strategy dimensions fixed by the user; ``None`` means searched."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    zero: int | None = None
    micro_batch: int | None = None
    schedule: str | None = None
    sequence_parallel: bool | None = None
    recompute: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Solution:
    """The best strategy found, its estimate, and how the search went."""

    strategy: Strategy
    estimate: Estimate
    time_s: float
    candidates: int
    """Outer candidates considered (after the divisibility rules)."""
    solved: int
    """Outer candidates whose placement was solved with CP-SAT (the rest were pruned)."""
    optimal: bool
    gap: float
    """Relative gap between the plan and the best proven bound (0 when optimal)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(pinned, default: list) -> list:
    return default if pinned is None else [pinned]


def candidates(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int,
               dtype: str, pins: Pins = Pins()) -> Iterator[Strategy]:
    """Every outer strategy the runtime can run, in a fixed order (stage_layers left empty)."""
    for tp in _choices(pins.tp, _divisors(gpus)):
        if hw.devices_per_node % tp or model.heads % tp or model.kv_heads % tp or gpus % tp:
            continue
        for pp in _choices(pins.pp, _divisors(gpus // tp)):
            if pp > model.layers or (gpus // tp) % pp:
                continue
            dp = gpus // (tp * pp)
            if (pins.dp is not None and dp != pins.dp) or global_batch % dp:
                continue
            for b in _choices(pins.micro_batch, _divisors(global_batch // dp)):
                m, rem = divmod(global_batch // dp, b)
                if rem or (pp > 1 and m < pp):
                    continue
                for zero in _choices(pins.zero, [0, 1, 2, 3] if dp > 1 else [0]):
                    for sched in _choices(pins.schedule, ["1f1b", "gpipe"] if pp > 1 else ["1f1b"]):
                        for sp in _choices(pins.sequence_parallel, [False, True] if tp > 1 else [False]):
                            for rc in _choices(pins.recompute, ["none", "selective", "full"]):
                                yield Strategy(dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=b,
                                               num_microbatches=m, schedule=sched,
                                               sequence_parallel=sp, recompute=rc, dtype=dtype)


def _stage_upper_bounds(c: StageCosts, layers: int, cap: float) -> list[int]:
    """Most blocks each stage can hold within ``cap`` bytes (M_s is linear in n_s)."""
    bounds = []
    for s in range(c.pp):
        spare = cap - c.stage_memory_bytes(s, 0)
        per_layer = c.stage_memory_bytes(s, 1) - c.stage_memory_bytes(s, 0)
        bounds.append(min(layers, math.floor(spare / per_layer)) if per_layer > 0 else layers)
    return bounds


def _lower_bound(c: StageCosts, layers: int) -> float:
    """A bound on ``step_time_s`` over all placements: max over stages ≥ their mean."""
    times = sum(c.stage_time_s(s, 0) for s in range(c.pp)) + layers * c.layer_time_s
    dp = sum(c.stage_dp_time_s(s, 0) for s in range(c.pp)) + layers * c.layer_dp_time_s
    return c.sum_weight * times + c.max_weight * times / c.pp + dp / c.pp


def _add_layer_vars(model: cp_model.CpModel, layers: int, upper: list[int]) -> list:
    n = [model.NewIntVar(1, ub, f"n{s}") for s, ub in enumerate(upper)]
    model.Add(sum(n) == layers)
    return n


def _add_max_vars(model: cp_model.CpModel, c: StageCosts, n: list, horizon: int):
    """T ≥ T_s and D ≥ D_s for every stage, in integer nanoseconds."""
    t_max, d_max = model.NewIntVar(0, horizon, "T"), model.NewIntVar(0, horizon, "D")
    for s, ns in enumerate(n):
        t0, d0 = c.stage_time_s(s, 0), c.stage_dp_time_s(s, 0)
        model.Add(t_max >= round(c.layer_time_s * NS) * ns + round(t0 * NS))
        model.Add(d_max >= round(c.layer_dp_time_s * NS) * ns + round(d0 * NS))
    return t_max, d_max


def _add_symmetry_breaking(model: cp_model.CpModel, n: list, upper: list[int]) -> None:
    """Middle stages have equal time coefficients; where their memory bounds do not shrink
    along the pipeline, any placement can be re-sorted ascending, so require n_1 ≤ … ≤ n_{p-2}."""
    middle = list(zip(n[1:-1], upper[1:-1]))
    if all(u0 <= u1 for (_, u0), (_, u1) in zip(middle, middle[1:])):
        for (a, _), (b, _) in zip(middle, middle[1:]):
            model.Add(a <= b)


def place_layers(c: StageCosts, layers: int, cap: float,
                 time_limit_s: float = 10.0) -> tuple[tuple[int, ...], bool] | None:
    """Blocks per stage minimising the step time under the memory cap; ``None`` if none fits.
    Returns the placement and whether CP-SAT proved it optimal."""
    upper = _stage_upper_bounds(c, layers, cap)
    if min(upper) < 1 or sum(upper) < layers:
        return None
    if c.pp == 1:
        return (layers,), True
    model = cp_model.CpModel()
    n = _add_layer_vars(model, layers, upper)
    horizon = round((layers * max(c.layer_time_s, c.layer_dp_time_s)
                     + max(c.stage_time_s(c.pp - 1, 0), c.stage_time_s(0, 0))
                     + c.first_dp_time_s + c.last_dp_time_s) * NS) + 1
    t_max, d_max = _add_max_vars(model, c, n, horizon)
    model.Minimize(round(c.max_weight * 1000) * t_max + 1000 * d_max)
    _add_symmetry_breaking(model, n, upper)
    # CP-SAT's default single-worker search stalled on the nanosecond-scaled max terms (a
    # 2-stage instance stayed FEASIBLE for 60 s); the lower-bound tree search proves these
    # placements optimal in milliseconds, with one worker so the result is deterministic.
    solver = cp_model.CpSolver()
    solver.parameters.optimize_with_lb_tree_search = True
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_time_in_seconds = time_limit_s
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return tuple(solver.Value(v) for v in n), status == cp_model.OPTIMAL


def search(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int, dtype: str,
           pins: Pins = Pins(), time_limit_s: float = 60.0) -> Solution:
    """Best strategy under the cost model; raises ``UserError`` saying what would fit."""
    start = time.perf_counter()
    cap = hw.memory_bytes
    scored = []
    for strat in candidates(model, hw, gpus, global_batch, dtype, pins):
        c = stage_costs(model, hw, strat)
        scored.append((_lower_bound(c, model.layers), len(scored), strat, c))
    if not scored:
        raise UserError(_no_candidate_reason(model, hw, gpus, global_batch, pins))
    scored.sort(key=lambda x: (x[0], x[1]))
    best: tuple[float, int, Strategy] | None = None
    solved, optimal, bound = 0, True, scored[0][0]
    for lb, order, strat, c in scored:
        if best is not None and lb >= best[0] * (1 - 1e-12):
            break
        remaining = time_limit_s - (time.perf_counter() - start)
        if remaining <= 0:
            optimal, bound = False, lb
            break
        placed = place_layers(c, model.layers, cap, remaining)
        solved += 1
        if placed is None:
            continue
        layers, proven = placed
        optimal &= proven
        step = c.step_time_s(layers)
        # A tie within float noise keeps the earlier candidate (lower ZeRO stage, less recompute).
        if best is None or step < best[0] * (1 - 1e-12) or (step <= best[0] and order < best[1]):
            best = (step, order, replace(strat, stage_layers=layers))
    if best is None:
        raise UserError(_does_not_fit(model, hw, gpus, global_batch, dtype, pins))
    est = estimate(model, hw, best[2], global_batch=global_batch)
    gap = 0.0 if optimal else max(0.0, (best[0] - bound) / best[0])
    return Solution(strategy=best[2], estimate=est, time_s=time.perf_counter() - start,
                    candidates=len(scored), solved=solved, optimal=optimal and gap == 0.0, gap=gap)


def _no_candidate_reason(model: ModelProfile, hw: HardwareProfile, gpus: int,
                         global_batch: int, pins: Pins) -> str:
    if pins.tp and (model.heads % pins.tp or model.kv_heads % pins.tp):
        return f"--tp {pins.tp} does not divide the {model.heads} heads / {model.kv_heads} kv heads"
    if pins.tp and hw.devices_per_node % pins.tp:
        return (f"--tp {pins.tp} does not divide the {hw.devices_per_node} devices per node of "
                f"{hw.name}; tensor parallelism stays inside a node")
    if any(v is not None for v in (pins.dp, pins.tp, pins.pp, pins.micro_batch)):
        return (f"no strategy with the pinned degrees splits {gpus} devices and global batch "
                f"{global_batch}; check that dp x tp x pp = --gpus and that dp x mbs divides the batch")
    return (f"no way to split global batch {global_batch} over {gpus} devices; use a global "
            f"batch divisible by the data-parallel degree (e.g. a multiple of {gpus})")


def _fits_anywhere(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int,
                   dtype: str, pins: Pins) -> bool:
    for strat in candidates(model, hw, gpus, global_batch, dtype, pins):
        c = stage_costs(model, hw, strat)
        upper = _stage_upper_bounds(c, model.layers, hw.memory_bytes)
        if min(upper) >= 1 and sum(upper) >= model.layers:
            return True
    return False


def _does_not_fit(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int,
                  dtype: str, pins: Pins) -> str:
    """Why nothing fits, and what would: fewer pins, or more devices."""
    head = (f"{model.name} does not fit on {gpus} x {hw.device} ({hw.memory_gib:g} GiB) at "
            f"global batch {global_batch}")
    if pins != Pins() and _fits_anywhere(model, hw, gpus, global_batch, dtype, Pins()):
        return head + " with the pinned options; drop the pins (--tp/--pp/--zero/--recompute/...) to let the planner choose"
    more = gpus
    for _ in range(24):
        more *= 2
        if _fits_anywhere(model, hw, more, global_batch, dtype, Pins()):
            return head + f": needs >= {more} devices of this kind"
    return head + ": no device count up to 2^24 fits; use a device with more memory"
