"""The search: outer candidates ordered by a lower bound, CP-SAT placement for each until the
bound reaches the incumbent (or the ``keep``-th best, to report alternatives)."""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, replace

from autopar.errors import UserError
from autopar.solve.bounds import (SearchMemo, block_units, bound_family, fits, floor_bound, free_hw, lower_bound,
                                  order_free_base, order_free_blind, order_free_costs)
from autopar.solve.core import by_rule, full_loads, rule_loads, solve_placement, stage_upper_bounds
from autopar.solve.exact import least_step
from autopar.solve.infeasible import does_not_fit, no_candidate_reason
from autopar.solve.space import (Block, Candidate, Family, Pins, axis_orders, block_families,
                                family_signature, outer_blocks, recompute_modes)
from autopar.solve.tables import (StageTables, bottleneck, greedy, least_total,
                                  single_mode_least_step, stage_tables)
from cost_models import Degrees, HardwareProfile, ModelProfile, StageCosts, Strategy, estimate, stage_costs
from cost_models.axes import Axis
from cost_models.comm import mesh_groups
from cost_models.estimate import pass_floor
from cost_models.strategy import RECOMPUTE, Estimate
from cost_models.recipe import load_recipe

TIE = 1e-12
"""Relative difference below which two step times tie (the earlier candidate wins)."""
EFFORT = 2.0
"""CP-SAT deterministic-time cap per candidate; past it the candidate keeps its bound."""
EXACT = 1e-13
"""Relative margin taken off a bound that is a candidate's exact optimum computed in another
float order than ``StageCosts.step_time_s`` (well inside ``TIE``)."""
ENUMERATION_S = 60.0
"""Least time the outer candidates may take to enumerate and bound, whatever the time limit
(a search cut by its limit still bounds every candidate, for its gap); past it and the time
limit the space is refused, naming the pins that shrink it."""
LATER = 1 << 62
"""Added to the fixed order of a candidate in a non-default axis order: ties keep Megatron's."""
MEMBER_BITS = 20
"""A family's members take the fixed orders ``family's order + 1 + j``."""
BLOCK_BITS = MEMBER_BITS + 12
"""A block's families take the fixed orders ``(index << BLOCK_BITS) + (j << MEMBER_BITS)``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _OtherOrders:
    """A heap item standing for the other kept axis orders of candidate ``twin`` (its index
    in Megatron's order), keyed by a bound valid for every order (``order_free_blind``)."""

    twin: int
    orders: tuple[tuple[str, ...], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Members:
    """A heap item standing for the members of a family (``space.Family``) in every kept axis
    order, keyed by a bound valid for each (``family_bound``); costed only when popped."""

    orders: tuple[tuple[str, ...], ...]
    """The other kept axis orders of the family's degrees."""
    bounded: int = 0
    """Keyed by ``floor_bound`` (0), by ``family_bound`` with its schedule group's memory
    relaxation (1: one per group, shared by many families), then with its own schedule's (2;
    a 1F1B family's is its group's)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Alternative:
    """A solved outer candidate with its best placement."""

    strategy: Strategy
    step_time_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Solution:
    """The best strategy found, its estimate, and how the search went."""

    strategy: Strategy
    estimate: Estimate
    time_s: float
    candidates: int
    """Outer candidates considered (after the divisibility and runtime rules)."""
    solved: int
    """Outer candidates whose placement was solved with CP-SAT (the rest were pruned)."""
    optimal: bool
    gap: float
    """Relative gap between the plan and the best proven bound (0 when optimal)."""
    alternatives: tuple[Alternative, ...] = ()
    """The best solved candidates, best first (the plan included), when asked for."""


def placed_strategy(strat: Strategy, loads: tuple[tuple[int, ...], ...]) -> Strategy:
    """``strat`` with its placement; ``recompute`` becomes the most common mode (kept as is
    for a single-mode placement, which zero-bubble's fill fraction reads)."""
    totals = [sum(c[i] for c in loads) for i in range(len(RECOMPUTE))]
    used = [i for i, t in enumerate(totals) if t]
    nominal = strat.recompute if len(used) == 1 and RECOMPUTE[used[0]] == strat.recompute \
        else RECOMPUTE[max(range(len(RECOMPUTE)), key=lambda i: (totals[i], -i))]
    return replace(strat, recompute=nominal, stage_layers=tuple(map(sum, loads)),
                   stage_recompute=loads)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Pending:
    """A heap item standing for the families of a block (``space.Block``) not made yet, keyed
    by ``pass_floor`` at its least over SP times m / pp (every schedule's weights are at least
    that), valid for all of them in every axis order; opened by ``_expand_block``."""

    orders: tuple[tuple[str, ...], ...]
    floors: tuple[tuple[bool, tuple[float, float]], ...]
    """(SP, ``pass_floor``) for each SP its families may have."""


def _ordered(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int,
             dtype: str, pins: Pins, cap: float,
             deadline: float = float("inf")) -> tuple[list[tuple[float, int, Block, _Pending]], int, SearchMemo]:
    """Every block of outer candidates (``space.outer_blocks``) with a bound valid for its
    candidates in every axis order (``_Pending``) and its fixed order, and how many candidates
    there are (other axis orders included; counted once per ``space.family_signature``).
    When its bound comes up a block is made into families (``_expand_block``), each bounded by
    ``floor_bound``; when that comes up a family is checked for memory and bounded
    (``bound_family``), and when that bound comes up, opened (``_open``)."""
    modes = recompute_modes(pins)
    space = SearchMemo(cache={}, free_cache={}, fits={}, twins={}, free={}, orders_of={}, free_hw={},
                   modes=modes, cap=cap, memo={}, pins=pins, dtype=dtype)
    recipe = pins.recipe or load_recipe()
    scored, counts = [], {}
    groups_of: dict[Degrees, tuple] = {}  # tp, cp, ep and their order-free groups, by degrees
    floor_of: dict[tuple, tuple[float, float]] = {}  # pass_floor by what it reads
    total = 0
    for i, block in enumerate(outer_blocks(model, hw, gpus, global_batch, pins)):
        if total and time.perf_counter() > deadline:
            raise UserError(f"the strategy space has over {total:,} candidates, more than can be enumerated "
                            f"in --time-limit (at least {ENUMERATION_S:g} s); pin some dimensions (--tp, --pp, "
                            "--vpp, --mbs, --zero) or raise --time-limit")
        mesh, others = block.mesh, ()
        if pins.axis_order is None:
            if mesh not in space.orders_of:
                space.orders_of[mesh] = tuple(axis_orders(hw, mesh, Pins(recipe=recipe))[1:])
            others = space.orders_of[mesh]
        sig = family_signature(block)
        if sig not in counts:
            counts[sig] = sum(len(f.members) for f in block_families(model, hw, block, dtype, pins, space.memo))
        if not counts[sig]:
            continue
        total += counts[sig] * (1 + len(others))
        hw_b, order = free_hw(space, hw, mesh)
        if mesh not in groups_of:
            g = mesh_groups(hw_b, mesh, order)
            groups_of[mesh] = (mesh.tp, mesh.cp, mesh.ep, g[Axis.TP], g[Axis.CP], g[Axis.EP])
        found_floors = []
        for sp in ((pins.sequence_parallel,) if pins.sequence_parallel is not None
                   else (False, True) if mesh.tp > 1 else (False,)):
            # pass_floor reads of the degrees and the topology only tp, cp, ep and their groups
            key = (groups_of[mesh], block.micro_batch, sp)
            if key not in floor_of:
                floor_of[key] = pass_floor(model, hw_b, Strategy(
                    mesh=mesh, micro_batch=block.micro_batch, num_microbatches=block.num_microbatches,
                    sequence_parallel=sp, dtype=dtype, axis_order=order, recipe=recipe), space.free_cache)
            found_floors.append((sp, floor_of[key]))
        floors = tuple(found_floors)
        bound = block.num_microbatches / mesh.pp * min(f for _, (f, _) in floors)
        scored.append((bound, i << BLOCK_BITS, block, _Pending(orders=others, floors=floors)))
    return scored, total, space


def _expand_block(model: ModelProfile, hw: HardwareProfile, block: Block, item: _Pending, lb: float,
                  order: int, space: SearchMemo, scored: list, heap: list) -> None:
    """Push the families of ``block`` (popped with bound ``lb`` at fixed order ``order``), each
    with its ``floor_bound``."""
    floors = dict(item.floors)
    members = _Members(orders=item.orders)
    for j, fam in enumerate(block_families(model, hw, block, space.dtype, space.pins, space.memo)):
        scored.append((floor_bound(fam, hw.ranks_per_core, *floors[fam.sequence_parallel]),
                       order + (j << MEMBER_BITS), fam, members))
        heapq.heappush(heap, (max(lb, scored[-1][0]), scored[-1][1], None, len(scored) - 1))


def _open(model: ModelProfile, hw: HardwareProfile, fam: Family, item: _Members, lb: float,
          order: int, space: SearchMemo, scored: list, heap: list) -> None:
    """Push the members of ``fam`` (popped with bound ``lb`` at fixed order ``order``), each
    with its memory-blind bound (an offload member its twin's, costed only when popped) and,
    when its degrees have other kept axis orders, one ``_OtherOrders`` item behind their
    order-free bound."""
    for j, cand in enumerate(fam.candidates()):
        st = cand.strategy
        if not fits(model, hw, space, fam, st.offload):
            continue  # no member of its schedule group fits, in any axis order
        twin = replace(st, offload=False) if st.offload else st
        if st.offload and twin in space.twins:
            # Offload is never faster than its twin without it (CPU optimizer step, PCIe
            # copies on top), so the twin's bound holds; its own costs wait until popped.
            scored.append((space.twins[twin], order + 1 + j, cand, None))
            key = twin
        else:
            c = stage_costs(model, hw, st, space.cache)
            scored.append((lower_bound(c, model.layers, cand.modes), order + 1 + j, cand, c))
            space.twins[st] = scored[-1][0]
            key = st
        heapq.heappush(heap, (max(lb, scored[-1][0]), order + 1 + j, None, len(scored) - 1))
        if item.orders:
            if key not in space.free:
                kc = c if key is st else stage_costs(model, hw, key, space.cache)
                space.free[key] = min(space.twins[key], order_free_blind(
                    order_free_base(model, hw, key, space.free_cache), key, kc, model.layers, cand.modes))
            scored.append((space.free[key], LATER + 8 * (order + 1 + j), cand,
                           _OtherOrders(twin=len(scored) - 1, orders=item.orders)))
            heapq.heappush(heap, (max(lb, space.free[key]), LATER + 8 * (order + 1 + j), None,
                                  len(scored) - 1))


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class _Refined:
    """A candidate's memory-aware bound and what its placement solve reuses."""

    bound: float
    modes: tuple[int, ...] = ()
    """The modes the placement needs (``_alone``: one where it dominates the others)."""
    tables: StageTables | None = None
    tau: float = float("inf")
    units: float | None = None
    """``bounds.block_units`` of the candidate's costs within memory (the LP bound's; the
    table bound reads it again)."""


def _refine(c: StageCosts, cand: Candidate, layers: int, cap: float,
            ref: _Refined | None, upper: list[int] | None = None) -> _Refined:
    """The next memory-aware bound of a candidate (``inf`` when no placement fits): first the
    LP bound (no tables), then with the per-stage tables and the exact bottleneck τ*, and for
    a candidate with one recompute mode its exact optimum (``tables.single_mode_least_step``).
    ``upper``: ``stage_upper_bounds`` of ``c`` when known (memory reads no axis order)."""
    if upper is None:
        upper = stage_upper_bounds(c, layers, cap, cand.modes)
    if min(upper) < cand.min_layers or sum(upper) < layers:
        return _Refined(bound=float("inf"))
    if ref is None:
        lp = block_units(c, layers, cand.modes, cap, upper)
        return _Refined(bound=lower_bound(c, layers, cand.modes, cap, upper, min_layers=cand.min_layers,
                                          units=lp), modes=cand.modes, units=lp)
    units = ref.units
    tabs = stage_tables(c, cand.modes, cap, upper)
    tau = bottleneck(tabs, layers, cand.min_layers)
    if tau == float("inf"):
        return _Refined(bound=float("inf"))
    total = least_total(tabs, layers, cand.min_layers)
    bound = lower_bound(c, layers, cand.modes, cap, upper, tau, total, cand.min_layers, units)
    if len(cand.modes) == 1:  # one mode: the candidate's exact optimum (float noise aside)
        bound = max(bound, single_mode_least_step(c, tabs, layers, cand.min_layers,
                                                  cand.modes[0], tau) * (1 - EXACT))
        return _Refined(bound=bound, modes=cand.modes, tables=tabs, tau=tau)
    alone = _alone(c, cand, layers, cap, upper, tabs, tau, total, units)
    if alone is not None:
        return replace(alone, bound=max(bound, alone.bound))
    return _Refined(bound=bound, modes=cand.modes, tables=tabs, tau=tau)


def _alone(c: StageCosts, cand: Candidate, layers: int, cap: float, upper: list[int],
           tabs: StageTables, tau: float, total: float, units: float | None) -> _Refined | None:
    """The candidate as a problem in one mode f where that has its optimum, else None. Let f
    be no slower than the candidate's other modes in T and in D: a placement's blocks all
    moved to f cost no more, and fit wherever each stage s holds at most f's most,
    ``upper_f[s]``. So the optimum is f's own unless a placement loading some stage beyond
    ``upper_f[s]`` (with leaner modes) beats it; such a stage's T_s is at least its table
    time there, which raises the slowest stage's bound τ. Where that bound is no lower than
    a placement in f alone (greedy's), memory only cuts off loads no optimum wants (placement
    is balance alone: the usual case with room to spare), and f's tables bound and place the
    candidate (``tables.single_mode_least_step``: no CP-SAT)."""
    t, d = c.mode_time_s, c.mode_dp_time_s
    f = min(cand.modes, key=lambda r: (t[r], d[r]))
    if any(t[f] > t[r] or d[f] > d[r] for r in cand.modes):
        return None
    upper_f = stage_upper_bounds(c, layers, cap, (f,))
    if min(upper_f) < cand.min_layers or sum(upper_f) < layers:
        return None
    tabs_f = stage_tables(c, (f,), cap, upper_f)
    tau_f = bottleneck(tabs_f, layers, cand.min_layers)
    if tau_f == float("inf"):
        return None
    loads = greedy(c, tabs_f, layers, cand.min_layers, cap, tau_f)
    if loads is None:
        return None
    over = min((float(tabs.time[s][n + 1]) + tabs.fixed[s]
                for s, n in enumerate(upper_f) if n < upper[s]), default=float("inf"))
    if (lower_bound(c, layers, cand.modes, cap, upper, max(tau, over), total, cand.min_layers, units)
            < c.step_time_s(full_loads(loads))):
        return None
    best = single_mode_least_step(c, tabs_f, layers, cand.min_layers, f, tau_f)
    return _Refined(bound=best * (1 - EXACT), modes=(f,), tables=tabs_f, tau=tau_f)


def _place(c: StageCosts, cand: Candidate, layers: int, cap: float, ref: _Refined,
           time_limit_s: float) -> tuple[tuple[tuple[int, ...], ...], float] | None:
    """(loads, proven bound on this candidate's step) of the best placement found: the greedy
    one with the optimal bottleneck when it meets the bound, else the exact scan's
    (``exact.least_step``), else, where that gives up, CP-SAT seeded with greedy's (capped at
    ``EFFORT``); the better of the two in float. A program that places by a rule gets the
    rule's placement (``core.rule_loads``)."""
    if by_rule(cand.strategy, ref.modes):
        return rule_loads(c, cand.strategy, ref.modes, cand.min_layers, layers, cap)
    assert ref.tables is not None  # a candidate is placed after its table bound
    loads = greedy(c, ref.tables, layers, cand.min_layers, cap, ref.tau)
    step = float("inf")
    if loads is not None:
        loads = full_loads(loads)
        step = c.step_time_s(loads)
        if step <= ref.bound * (1 + TIE):  # meets the bound: optimal
            return loads, step
    scan = least_step(c, ref.tables, ref.modes, cap, layers, cand.min_layers, ref.tau, step)
    if scan is not None:  # the exact scan settled it, unless its placement fits only within SLACK
        least, better = scan
        if better is not None and all(c.stage_memory_bytes(s, ld) <= cap
                                      for s, ld in enumerate(better)):
            if loads is None or c.step_time_s(better) < step:
                loads, step = better, c.step_time_s(better)
            return loads, min(step, least * (1 - EXACT))
        if better is None:  # nothing beats greedy's (or no placement fits)
            return None if loads is None else (loads, min(step, least * (1 - EXACT)))
    placed = solve_placement(c, layers, cap, ref.modes, cand.min_layers, time_limit_s,
                             tables=ref.tables, tau=ref.tau, hint=loads, effort=EFFORT)
    if placed is None:
        return None if loads is None else (loads, ref.bound)
    bound = c.step_time_s(placed.loads) if placed.optimal else max(ref.bound, placed.bound_s)
    if loads is None or c.step_time_s(placed.loads) <= c.step_time_s(loads):
        return placed.loads, min(bound, c.step_time_s(placed.loads))
    return loads, min(bound, c.step_time_s(loads))


def search(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int, dtype: str,
           pins: Pins = Pins(), time_limit_s: float = 60.0, keep: int = 1) -> Solution:
    """Best strategy under the cost model; raises ``UserError`` saying what would fit.
    ``keep`` > 1 also proves the ``keep`` best outer candidates (``Solution.alternatives``)."""
    start = time.perf_counter()
    cap = hw.memory_bytes
    scored, total, space = _ordered(model, hw, gpus, global_batch, dtype, pins,
                                    cap, start + max(time_limit_s, ENUMERATION_S))
    cache, free_cache = space.cache, space.free_cache
    if total == 0:
        raise UserError(no_candidate_reason(model, hw, gpus, global_batch, pins))
    found: list[tuple[float, int, Strategy]] = []  # sorted best first, at most ``keep``
    solved, cut, open_bounds = 0, False, []
    uppers: dict[int, list[int]] = {}  # stage_upper_bounds by candidate in Megatron's order
    twin_of: dict[int, int] = {}  # a scored index in another order -> its index in Megatron's
    # Candidates with equal costs pose the same placement problem (ZeRO 1 and 2 often do: the
    # gradients stay whole under accumulation): their table bound and placement are computed once.
    tabled: dict[tuple, _Refined] = {}
    placements: dict[tuple, tuple[tuple[tuple[int, ...], ...], float] | None] = {}
    # Best-first over (bound, order): a family is popped with its bound and opened into its
    # members (``_open``); a candidate is first popped with its memory-blind bound,
    # pushed back with its LP memory-aware one, then with its table bound (τ*), and solved
    # when popped a third time.
    heap = [(lb, order, None, i) for i, (lb, order, _, _) in enumerate(scored)]
    heapq.heapify(heap)
    while heap:
        lb, order, ref, i = heap[0]
        if lb == float("inf"):
            break
        if len(found) == keep and lb >= found[-1][0] * (1 - TIE):
            open_bounds.append(lb)
            break
        remaining = time_limit_s - (time.perf_counter() - start)
        if remaining <= 0 and found:
            cut = True
            open_bounds.append(lb)
            break
        heapq.heappop(heap)
        _, _, cand, c = scored[i]
        if isinstance(c, _Pending):
            _expand_block(model, hw, cand, c, lb, order, space, scored, heap)
            continue
        if isinstance(c, _Members):
            if c.bounded == 2:
                _open(model, hw, cand, c, lb, order, space, scored, heap)
            else:
                step = 2 if c.bounded or cand.schedule == "1f1b" else 1
                scored[i] = (lb, order, cand, replace(c, bounded=step))
                heapq.heappush(heap, (max(lb, bound_family(model, hw, cand, bool(c.orders), space, step == 2)),
                                      order, None, i))
            continue
        if isinstance(c, _OtherOrders):
            # The other axis orders of a candidate, as one candidate costed under the order-free
            # profile: refined like the others (memory reads no order), then expanded.
            if ref is None:
                tlb, tord, _, twin_c = scored[c.twin]
                if twin_c is None:
                    twin_c = stage_costs(model, hw, cand.strategy, cache)
                    scored[c.twin] = (tlb, tord, cand, twin_c)
                upper = _upper(uppers, c.twin, twin_c, cand, model.layers, cap)
                if min(upper) < cand.min_layers or sum(upper) < model.layers:
                    continue  # fits in no order
                ref = _refine(order_free_costs(model, hw, cand.strategy, twin_c, free_cache),
                              cand, model.layers, cap, ref, upper)
                heapq.heappush(heap, (max(lb, ref.bound), order, ref, i))
                continue
            for k in _expand_orders(model, hw, scored, heap, c, lb, order, cache):
                twin_of[k] = c.twin
            continue
        if c is None:  # an offload candidate bounded by its twin: cost it now
            c = stage_costs(model, hw, cand.strategy, cache)
            scored[i] = (lb, order, cand, c)
            heapq.heappush(heap, (max(lb, lower_bound(c, model.layers, cand.modes)), order,
                                  None, i))
            continue
        problem = (c, cand.modes, cand.min_layers)
        if ref is None or ref.tables is None:
            if ref is not None and problem in tabled:
                ref = tabled[problem]
            else:
                ref = _refine(c, cand, model.layers, cap, ref,
                              _upper(uppers, twin_of.get(i, i), c, cand, model.layers, cap))
                if ref.tables is not None:
                    tabled[problem] = ref
            heapq.heappush(heap, (max(lb, ref.bound), order, ref, i))
            continue
        if remaining <= 0:  # out of time with no plan yet: greedy placements only, no CP-SAT
            cut = True
            open_bounds.append(lb)
            if by_rule(cand.strategy, cand.modes):
                placed = rule_loads(c, cand.strategy, cand.modes, cand.min_layers, model.layers, cap)
                loads = None if placed is None else placed[0]
            else:
                loads = greedy(c, ref.tables, model.layers, cand.min_layers, cap, ref.tau)
            if loads is not None:
                loads = full_loads(loads)
                found.append((c.step_time_s(loads), order, placed_strategy(cand.strategy, loads)))
            continue
        if problem in placements:
            placed = placements[problem]
        else:
            placed = _place(c, cand, model.layers, cap, ref, remaining)
            solved += 1
            if placed is not None or time_limit_s - (time.perf_counter() - start) > 0:
                placements[problem] = placed  # a cut-short solve is not kept: unknown, not infeasible
        if placed is None:
            if time_limit_s - (time.perf_counter() - start) <= 0:
                cut = True
                open_bounds.append(lb)  # cut short: unknown, not infeasible
            continue
        loads, cand_bound = placed
        step = c.step_time_s(loads)
        if cand_bound < step * (1 - TIE):
            open_bounds.append(cand_bound)
        found.append((step, order, placed_strategy(cand.strategy, loads)))
        # A tie within float noise keeps the earlier candidate (lower ZeRO stage, fewer chunks).
        found = _dedupe_ties(found)[:keep]
    if not found:
        if cut:
            raise UserError(f"no plan found within --time-limit {time_limit_s:g} s; "
                            "raise the time limit or pin more dimensions")
        raise UserError(does_not_fit(model, hw, gpus, global_batch, dtype, pins))
    best_step, _, best = found[0]
    est = estimate(model, hw, best, global_batch=global_batch)
    bound = min(open_bounds, default=best_step)
    proven = bound >= best_step * (1 - TIE)
    gap = 0.0 if proven else max(0.0, (best_step - bound) / best_step)
    alts = tuple(Alternative(strategy=s, step_time_s=t) for t, _, s in found) if keep > 1 else ()
    return Solution(strategy=best, estimate=est, time_s=time.perf_counter() - start,
                    candidates=total, solved=solved, optimal=proven, gap=gap,
                    alternatives=alts)


def _upper(uppers: dict, key: int, c: StageCosts, cand: Candidate, layers: int,
           cap: float) -> list[int]:
    """``stage_upper_bounds``, once per candidate in Megatron's order (``key``, its index):
    memory reads no axis order, so its other orders share them."""
    if key not in uppers:
        uppers[key] = stage_upper_bounds(c, layers, cap, cand.modes)
    return uppers[key]


def _expand_orders(model: ModelProfile, hw: HardwareProfile, scored: list, heap: list,
                   item: _OtherOrders, lb: float, order: int, cache: dict) -> list[int]:
    """Push the candidate ``item.twin`` in each of ``item.orders``, keyed by its own bound
    and ``lb`` (the order-free bound, valid for each); their indices in ``scored``."""
    twin = scored[item.twin][2]
    for k, axes in enumerate(item.orders):
        cand = replace(twin, strategy=replace(twin.strategy, axis_order=axes))
        co = stage_costs(model, hw, cand.strategy, cache)
        scored.append((lb, order + 1 + k, cand, co))
        heapq.heappush(heap, (max(lb, lower_bound(co, model.layers, cand.modes)), order + 1 + k,
                              None, len(scored) - 1))
    return list(range(len(scored) - len(item.orders), len(scored)))


def _dedupe_ties(found: list) -> list:
    """Order by step time, candidates within ``TIE`` of each other by their fixed order."""
    out = sorted(found, key=lambda x: (x[0], x[1]))
    changed = True
    while changed:
        changed = False
        for i in range(len(out) - 1):
            a, b = out[i], out[i + 1]
            if b[0] <= a[0] * (1 + TIE) and b[1] < a[1]:
                out[i], out[i + 1] = b, a
                changed = True
    return out
