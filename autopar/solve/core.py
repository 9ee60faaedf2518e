"""The inner CP-SAT model: blocks per stage and recompute mode for one outer candidate.

See the formulation in ``autopar.solve``'s docstring; each constraint family is added by one
function below. Times are integer nanoseconds (``NS``), bytes integer bytes rounded so that an
integer-feasible placement is feasible in float too (coefficients up, the cap down); the caller
re-evaluates the chosen placement in float with ``StageCosts``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cost_models import StageCosts, Strategy
from cost_models.pipeline import chunk_sizes, chunks, partition_uniform
from autopar.solve.tables import StageTables
from cost_models.strategy import RECOMPUTE

if TYPE_CHECKING:  # imported when a placement needs CP-SAT (ortools takes ~0.3 s to import)
    from ortools.sat.python import cp_model

NS = 1e9
"""Integer time unit: nanoseconds."""
WEIGHT = 1000
"""Schedule weights are scaled by this to integers."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """A solved placement: per stage, blocks per recompute mode (``RECOMPUTE`` order)."""

    loads: tuple[tuple[int, ...], ...]
    optimal: bool
    bound_s: float
    """A proven lower bound on the step time of any placement of this candidate, seconds."""


def stage_upper_bounds(c: StageCosts, layers: int, cap: float, modes: tuple[int, ...]) -> list[int]:
    """Most blocks each stage can hold within ``cap`` using one mode alone, its leanest (M_s
    is linear in the counts, and a stage mixing modes holds no more than one of its modes
    alone), and within the host-memory row of offloaded state (``StageCosts.host_upper_bound``);
    -1 where even an empty stage overflows."""
    bounds, work = [], [c.mode_workspace_bytes[r] for r in modes]
    # the host row reads of s only whether it is the first or the last; without offload
    # (no host cap) it holds every block
    host = [c.host_upper_bound(s, layers) for s in range(min(c.pp, 2))] \
        if c.host_cap_bytes != math.inf else []
    last = c.pp - 1
    for s, (fixed, per) in enumerate(c.memory_rows(modes)):
        room, best = cap - fixed, -1
        for w, b in zip(work, per):
            spare = room - w
            if spare >= 0:
                most = math.floor(spare / b) if b > 0 else layers
                if most > best:
                    best = most
        best = min(best, layers)
        if host:
            best = min(best, c.host_upper_bound(s, layers) if s == last else host[min(s, 1)])
        bounds.append(best)
    return bounds


def _add_count_vars(m: cp_model.CpModel, pp: int, layers: int, upper: list[int],
                    modes: tuple[int, ...], min_layers: int) -> list[dict[int, cp_model.IntVar]]:
    """n[s][r] ≥ 0, min_layers ≤ Σ_r n[s][r] ≤ upper[s], Σ_s Σ_r n[s][r] = L."""
    n = [{r: m.new_int_var(0, upper[s], f"n{s}_{r}") for r in modes} for s in range(pp)]
    for s in range(pp):
        total = sum(n[s].values())
        m.add(total >= min_layers)
        m.add(total <= upper[s])
    m.add(sum(v for ns in n for v in ns.values()) == layers)
    return n


def _add_memory(m: cp_model.CpModel, c: StageCosts, n: list[dict], cap: float, layers: int) -> None:
    """M_s ≤ cap: the workspace term max_{r used} W_r through one Boolean per used mode."""
    cap_i = math.floor(cap)
    for s, ns in enumerate(n):
        fixed = c.stage_fixed_bytes(s)
        expr = sum(math.ceil(c.block_bytes(s, r)) * v for r, v in ns.items())
        for r, v in ns.items():
            w = c.mode_workspace_bytes[r]
            if w <= 0:
                continue
            used = m.new_bool_var(f"u{s}_{r}")
            m.add(v == 0).only_enforce_if(used.Not())
            m.add(expr + math.ceil(fixed + w) <= cap_i).only_enforce_if(used)
        m.add(expr + math.ceil(fixed) <= cap_i)


def _add_time_terms(m: cp_model.CpModel, c: StageCosts, n: list[dict], horizon: int):
    """T ≥ T_s and D ≥ D_s for every stage; returns (T, D, [T_s])."""
    t_max, d_max = m.new_int_var(0, horizon, "T"), m.new_int_var(0, horizon, "D")
    stage_t = []
    for s, ns in enumerate(n):
        t_s = (sum(round(c.mode_time_s[r] * NS) * v for r, v in ns.items())
               + round(c.stage_time_s(s, 0) * NS))
        d_s = (sum(round(c.mode_dp_time_s[r] * NS) * v for r, v in ns.items())
               + round(c.stage_dp_time_s(s, 0) * NS))
        m.add(t_max >= t_s)
        m.add(d_max >= d_s)
        stage_t.append(t_s)
    return t_max, d_max, stage_t


def _add_symmetry_breaking(m: cp_model.CpModel, c: StageCosts, n: list[dict], layers: int) -> None:
    """Middle stages share every coefficient but their memory rows (``StageCosts.memory_key``:
    in-flight micro-batches k_s, deferred weight passes, fixed bytes).

    Where the rows are equal over the middle stages (GPipe) their loads are interchangeable:
    order them lexicographically (a linear key with base L + 1). Where no term grows along the
    pipeline (1F1B: k_s = p - s) and every block uses one mode, a larger load fits wherever a
    smaller one did further up, so order the middle stages by block count. Mixed modes under a
    falling k_s get no ordering (a stage with fewer but heavier blocks may not move up), nor
    do rows that grow (torch's zero-bubble defers more weight passes further down)."""
    middle = list(range(1, c.pp - 1))
    keys = [c.memory_key(s) for s in middle]
    if all(k == keys[0] for k in keys):
        base = layers + 1
        key = lambda ns: sum(v * base ** i for i, (_, v) in enumerate(sorted(ns.items())))  # noqa: E731
        for a, b in zip(middle, middle[1:]):
            m.add(key(n[a]) <= key(n[b]))
    elif len(n[0]) == 1 and all(x >= y for ka, kb in zip(keys, keys[1:]) for x, y in zip(ka, kb)):
        for a, b in zip(middle, middle[1:]):
            m.add(sum(n[a].values()) <= sum(n[b].values()))


def _add_table_cuts(m: cp_model.CpModel, c: StageCosts, n: list[dict], tables: StageTables,
                    tau: float, t_max) -> None:
    """Valid cuts from ``tables``: T ≥ τ* and, per stage, block time ≥ g_s(N_s) through an
    element constraint on the stage's block count. Integer times differ from NS × float by
    at most half a nanosecond per block, and the integer memory row is stricter than the
    float one, so each cut is lowered by that rounding (plus one)."""
    layers_max = max(len(g) for g in tables.time)
    if math.isfinite(tau):
        m.add(t_max >= math.floor(tau * NS - 0.5 * (layers_max + 1)) - 1)
    for s, ns in enumerate(n):
        g = tables.time[s]
        finite = [i for i in range(len(g)) if math.isfinite(g[i])]
        if not finite:
            continue
        top = finite[-1]
        values = [max(0, math.floor(float(g[i]) * NS - 0.5 * i) - 1) if i <= top else 0
                  for i in range(top + 1)]
        total = m.new_int_var(0, top, f"N{s}")
        m.add(total == sum(ns.values()))
        low = m.new_int_var(0, max(values), f"g{s}")
        m.add_element(total, values, low)
        m.add(sum(round(c.mode_time_s[r] * NS) * v for r, v in ns.items()) >= low)


def solve_placement(c: StageCosts, layers: int, cap: float, modes: tuple[int, ...],
                    min_layers: int = 1, time_limit_s: float = 10.0,
                    tables: StageTables | None = None, tau: float = float("nan"),
                    hint: tuple[tuple[int, ...], ...] | None = None,
                    effort: float | None = None) -> Placement | None:
    """The placement minimising the step time under the memory cap; ``None`` if none fits
    (or none was found in time). ``tables``/``tau`` (``autopar.solve.tables``) add valid cuts,
    ``hint`` seeds the search, ``effort`` caps it in CP-SAT's deterministic time (so a
    capped result is still reproducible); an unproven result carries its bound."""
    upper = stage_upper_bounds(c, layers, cap, modes)
    if min(upper) < min_layers or sum(upper) < layers:
        return None
    if c.pp == 1 and len(modes) == 1:
        load = tuple(layers if i == modes[0] else 0 for i in range(len(RECOMPUTE)))
        step = c.step_time_s((load,))
        return Placement(loads=(load,), optimal=True, bound_s=step)
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    n = _add_count_vars(m, c.pp, layers, upper, modes, min_layers)
    _add_memory(m, c, n, cap, layers)
    horizon = round((layers * max(max(c.mode_time_s), max(c.mode_dp_time_s))
                     + max(c.stage_time_s(s, 0) + c.stage_dp_time_s(s, 0) for s in range(c.pp)))
                    * NS) + 1
    t_max, d_max, stage_t = _add_time_terms(m, c, n, horizon)
    _add_symmetry_breaking(m, c, n, layers)
    if tables is not None:
        _add_table_cuts(m, c, n, tables, tau, t_max)
    if hint is not None:
        for s, ns in enumerate(n):
            for r, v in ns.items():
                m.add_hint(v, hint[s][r])
    sum_w, max_w = round(c.sum_weight * WEIGHT), round(c.max_weight * WEIGHT)
    m.minimize(sum_w * sum(stage_t) + max_w * t_max + WEIGHT * d_max)
    solver = cp_model.CpSolver()
    # One worker and a fixed seed: the result is deterministic. The lower-bound tree search
    # closes these max-of-linear objectives far faster than the default single-worker search.
    solver.parameters.optimize_with_lb_tree_search = True
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_time_in_seconds = max(time_limit_s, 0.01)
    if effort is not None:
        solver.parameters.max_deterministic_time = effort
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    loads = tuple(tuple(solver.Value(n[s][i]) if i in n[s] else 0 for i in range(len(RECOMPUTE)))
                  for s in range(c.pp))
    scale = WEIGHT * NS
    bound = solver.BestObjectiveBound() / scale
    return Placement(loads=loads, optimal=status == cp_model.OPTIMAL,
                     bound_s=min(bound, c.step_time_s(loads)))


def uniform_loads(c: StageCosts, modes: tuple[int, ...], min_layers: int, layers: int,
                  cap: float) -> tuple[tuple[int, ...], ...] | None:
    """The placement of a program that splits the blocks evenly over its stages
    (``ExecutionRecipe.uniform_stages``: ``pipeline.partition_uniform``), every block in the
    candidate's one mode of ``modes``; None where a stage gets fewer than ``min_layers`` or
    overflows ``cap``."""
    (mode,) = modes  # such a recipe recomputes every block alike (``uniform_recompute``)
    counts = partition_uniform(layers, c.pp)
    loads = tuple(tuple(n if r == mode else 0 for r in range(len(RECOMPUTE))) for n in counts)
    if min(counts) < min_layers or any(c.stage_memory_bytes(s, ld) > cap for s, ld in enumerate(loads)):
        return None
    return loads


def block_loads(c: StageCosts, modes: tuple[int, ...], min_layers: int, layers: int, cap: float,
                chunks: int) -> tuple[tuple[tuple[int, ...], ...], float] | None:
    """(loads, step) of the best plan of Megatron's block method over the even split of the
    blocks (``pipeline.partition_uniform``; ``ExecutionRecipe.recompute_block``): each of a
    stage's ``chunks`` model chunks (``pipeline.chunk_sizes``) recomputes
    (full) its first k blocks and none of the rest, k the same everywhere, at the k with the
    least step within ``cap``; None where a stage gets fewer than ``min_layers`` or no k fits."""
    none, full = modes
    counts = partition_uniform(layers, c.pp)
    if min(counts) < min_layers:
        return None
    sizes = [chunk_sizes(n, chunks) for n in counts]
    best = None
    for k in range(max(map(max, sizes)) + 1):
        loads = []
        for n, split in zip(counts, sizes):
            f = sum(min(k, size) for size in split)
            loads.append(tuple(n - f if r == none else f if r == full else 0 for r in range(len(RECOMPUTE))))
        if any(c.stage_memory_bytes(s, ld) > cap for s, ld in enumerate(loads)):
            continue
        step = c.step_time_s(tuple(loads))
        if best is None or step < best[1]:
            best = (tuple(loads), step)
    return best


def by_rule(strat: Strategy, modes: tuple[int, ...]) -> bool:
    """Whether the program places the blocks by a rule rather than by the search's choice:
    DeepSpeed's even split (``recipe.uniform_stages``), or Megatron's block method where the
    candidate mixes modes under one policy for all blocks (``recipe.recompute_block``)."""
    return strat.recipe.uniform_stages or (len(modes) > 1 and strat.recipe.uniform_recompute)


def rule_loads(c: StageCosts, strat: Strategy, modes: tuple[int, ...], min_layers: int, layers: int,
               cap: float) -> tuple[tuple[tuple[int, ...], ...], float] | None:
    """(loads, step) of a program that places by a rule (``by_rule``): its placement, or the
    block method's best; None where it fits nothing. Exact by definition."""
    if strat.recipe.uniform_stages:
        loads = uniform_loads(c, modes, min_layers, layers, cap)
        return None if loads is None else (loads, c.step_time_s(loads))
    return block_loads(c, modes, min_layers, layers, cap, chunks(strat))


def full_loads(loads):
    """Loads with a count for every mode of ``RECOMPUTE``."""
    return tuple(tuple(ld) + (0,) * (len(RECOMPUTE) - len(ld)) for ld in loads)
