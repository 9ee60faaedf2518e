"""The search: outer candidates ordered by a lower bound, CP-SAT placement for each until the
bound reaches the incumbent (or the ``keep``-th best, to report alternatives)."""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, replace

from autopar.errors import UserError
from autopar.solve.core import solve_placement, stage_upper_bounds
from autopar.solve.infeasible import does_not_fit, no_candidate_reason
from autopar.solve.space import (Block, Candidate, Family, Pins, axis_orders, block_families,
                                family_signature, order_free_hardware, outer_blocks, outer_candidates)
from autopar.solve.tables import (StageTables, bottleneck, greedy, least_total,
                                  single_mode_least_step, stage_tables)
from cost_models import Degrees, HardwareProfile, ModelProfile, StageCosts, Strategy, estimate, stage_costs
from cost_models.bounds import least_memory_costs
from cost_models.estimate import parts_key, pass_floor, time_floor
from cost_models.pipeline import chunks, weights
from cost_models.axes import DEFAULT_ORDER
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
    in Megatron's order), keyed by a bound valid for every order (``_order_free_blind``)."""

    twin: int
    orders: tuple[tuple[str, ...], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Members:
    """A heap item standing for the members of a family (``space.Family``) in every kept axis
    order, keyed by a bound valid for each (``_family_bound``); costed only when popped."""

    orders: tuple[tuple[str, ...], ...]
    """The other kept axis orders of the family's degrees."""
    bounded: bool = False
    """Keyed by ``_family_bound`` (after its memory check); before, by ``_floor_bound``."""


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


def _stage_segments(c: StageCosts, s: int, modes: tuple[int, ...], cap: float,
                    upper: int) -> list[tuple[float, float]]:
    """(slope, blocks) pieces of g_s(N), the least T_s block time of N blocks on stage s in
    the LP relaxation of its memory row (workspace dropped, counts fractional): the lower
    convex envelope of the rays from the origin to "stage full in mode r", cut at ``upper``."""
    k = c.inflight[s]
    room = cap - c.stage_fixed_bytes(s)
    if room <= 0 or upper <= 0:
        return []
    pts = sorted({(room / (c.layer_static_bytes + k * c.mode_act_bytes[r]),
                   room / (c.layer_static_bytes + k * c.mode_act_bytes[r]) * c.mode_time_s[r])
                  for r in modes})
    hull = [(0.0, 0.0)]
    for x, y in pts:  # lower hull, x increasing; a point with a lower y further right dominates
        while hull and hull[-1][1] >= y:
            hull.pop()
        while len(hull) >= 2 and ((hull[-1][1] - hull[-2][1]) * (x - hull[-2][0])
                                  >= (y - hull[-2][1]) * (hull[-1][0] - hull[-2][0])):
            hull.pop()
        hull.append((x, y))
    if hull[0] != (0.0, 0.0):
        hull.insert(0, (0.0, 0.0))
    segs, left = [], float(upper)
    for (x0, y0), (x1, y1) in zip(hull, hull[1:]):
        width = min(x1 - x0, left)
        if width > 0:
            segs.append(((y1 - y0) / (x1 - x0), width))
            left -= width
    return segs


def lower_bound(c: StageCosts, layers: int, modes: tuple[int, ...], cap: float = float("inf"),
                upper: list[int] | None = None, tau: float = 0.0, total: float = 0.0,
                min_layers: int = 1) -> float:
    """A bound on ``step_time_s`` over all placements within ``cap``: Σ_s T_s is at least
    the fixed parts plus the cheapest L block-units over every stage's LP envelope g_s (for
    an infinite cap: every block at its fastest mode) and at least ``total`` (the exact least
    Σ_s T_s of the tables, ``tables.least_total``), the slowest stage at least the mean and
    at least ``tau`` (the exact bottleneck τ*, ``tables.bottleneck``), and D at least the mean
    of the fastest-mode tails and at least every stage's own fixed tail plus its fewest blocks
    (``min_layers``, or what the other stages cannot hold) in the fastest-tail mode.
    ``inf`` when nothing fits."""
    # Σ_s T_s(empty) and Σ_s D_s(empty) in closed form (every stage has p2p, one first, one last)
    fixed = c.pp * c.p2p_time_s + c.first_time_s + c.last_time_s
    d = min(c.mode_dp_time_s[r] for r in modes)
    dp = c.first_dp_time_s + c.last_dp_time_s + layers * d
    if cap == float("inf"):
        blocks = layers * min(c.mode_time_s[r] for r in modes)
    else:
        upper = upper or [layers] * c.pp
        segs, seen = [], {}
        for s in range(c.pp):  # stages alike in memory (k_s, fixed bytes, bound) share pieces
            key = (c.inflight[s], c.stage_fixed_bytes(s), upper[s])
            if key not in seen:
                seen[key] = _stage_segments(c, s, modes, cap, upper[s])
            segs.extend(seen[key])
        segs.sort()
        blocks, left = 0.0, float(layers)
        for slope, width in segs:
            take = min(width, left)
            blocks += slope * take
            left -= take
            if left <= 0:
                break
        if left > 1e-9:
            return float("inf")
    times = max(fixed + blocks, total)
    d_max = dp / c.pp
    if upper is not None:
        room = sum(upper)
        for s in range(c.pp):
            fewest = max(min_layers, layers - (room - upper[s]))
            d_max = max(d_max, c.stage_dp_time_s(s, 0) + fewest * d)
    return c.sum_weight * times + c.max_weight * max(times / c.pp, tau) + d_max


def placed_strategy(strat: Strategy, loads: tuple[tuple[int, ...], ...]) -> Strategy:
    """``strat`` with its placement; ``recompute`` becomes the most common mode (kept as is
    for a single-mode placement, which zero-bubble's fill fraction reads)."""
    totals = [sum(c[i] for c in loads) for i in range(len(RECOMPUTE))]
    used = [i for i, t in enumerate(totals) if t]
    nominal = strat.recompute if len(used) == 1 and RECOMPUTE[used[0]] == strat.recompute \
        else RECOMPUTE[max(range(len(RECOMPUTE)), key=lambda i: (totals[i], -i))]
    return replace(strat, recompute=nominal, stage_layers=tuple(map(sum, loads)),
                   stage_recompute=loads)


def _order_free_base(model: ModelProfile, hw: HardwareProfile, strat: Strategy,
                     cache: dict) -> StageCosts:
    """``strat``'s costs as 1F1B with each axis in its best group (``space.order_free_hardware``),
    shared by the strategies with its ``parts_key`` and leading-block mode up to the order
    (``cache`` holds them and their per-piece costs)."""
    # (candidates come in Megatron's order: no copy of the strategy just to name the key)
    key = (parts_key(strat if strat.axis_order == strat.mesh.default_order()
                     else replace(strat, axis_order=DEFAULT_ORDER)), strat.lead_mode)
    base = cache.get(key)
    if base is None:
        hw_b, order = order_free_hardware(hw, strat.mesh)
        base = stage_costs(model, hw_b, replace(strat, axis_order=order, schedule="1f1b",
                                                virtual_stages=1), cache)
        cache[key] = base
    return base


def _order_free_blind(base: StageCosts, strat: Strategy, c: StageCosts, layers: int,
                      modes: tuple[int, ...]) -> float:
    """``lower_bound`` with no cap of ``_order_free_costs`` (the same closed form: every
    block at its fastest mode, the slowest stage at least the mean, D at least the mean)."""
    times = (c.pp * base.p2p_time_s * chunks(strat) + base.first_time_s + base.last_time_s
             + layers * min(base.mode_time_s[r] for r in modes))
    dp = base.first_dp_time_s + base.last_dp_time_s + layers * min(base.mode_dp_time_s[r]
                                                                   for r in modes)
    return c.sum_weight * times + c.max_weight * times / c.pp + dp / c.pp


def _order_free_costs(model: ModelProfile, hw: HardwareProfile, strat: Strategy, c: StageCosts,
                      cache: dict) -> StageCosts:
    """``c`` (the costs of ``strat``) with the time coefficients of ``strat`` under every axis
    order at once: each axis in its best group (``space.order_free_hardware``; costs are
    monotone in the groups), so every bound computed from them holds for every order. Memory
    and the schedule weights read no order (the weights read compute only) and stay. The
    coefficients are shared by the strategies with the same ``parts_key`` up to the order."""
    base = _order_free_base(model, hw, strat, cache)
    return replace(c, mode_time_s=base.mode_time_s, first_time_s=base.first_time_s,
                   last_time_s=base.last_time_s, p2p_time_s=base.p2p_time_s * chunks(strat),
                   mode_dp_time_s=base.mode_dp_time_s, first_dp_time_s=base.first_dp_time_s,
                   last_dp_time_s=base.last_dp_time_s)


def _family_bound(model: ModelProfile, hw: HardwareProfile, fam: Family, space: "_Space",
                  free: bool) -> float:
    """A bound on the step of every member of ``fam`` at once (``inf`` when none fits): its
    time coefficients at their least over the leading blocks' modes (``estimate.TimeFloor``;
    an offload member is never slower to bound than its twin without: its coefficients are
    no lower), under ``free`` (the degrees have other kept axis orders) the order-free ones,
    so the bound holds in every order. The larger of the memory-blind ``lower_bound`` at
    its least over the members' chunks, and ``lower_bound`` within device memory of the
    schedule groups' least-memory relaxation (``_relaxed``) with the schedule weights and p2p
    each at their least over the members."""
    st = fam.base
    if not free:
        f = time_floor(model, hw, st, space.cache)
    else:
        hw_b, order = _free_hw(space, hw, st.mesh)
        f = time_floor(model, hw_b, replace(st, axis_order=order, schedule="1f1b", virtual_stages=1),
                       space.free_cache)
    pp, m, layers = st.mesh.pp, st.num_microbatches, model.layers
    times = f.first_time_s + f.last_time_s + layers * min(f.mode_time_s[r] for r in fam.modes)
    dp = (f.first_dp_time_s + f.last_dp_time_s + layers * min(f.mode_dp_time_s[r] for r in fam.modes)) / pp
    zb = f.zb_fill[RECOMPUTE.index(st.recompute)]
    chunk_counts = sorted({v if st.schedule == "interleaved" else 1 for v, _, _ in fam.members})
    ws = [weights(st.schedule, pp, m, k, zb) for k in chunk_counts]
    blind = min(sw * (times + pp * f.p2p_chunk_s * k) + mw * (times + pp * f.p2p_chunk_s * k) / pp + dp
                for k, (sw, mw) in zip(chunk_counts, ws))
    v_min = min(v for v, _, _ in fam.members)
    bounds = []
    for off in sorted({off for _, _, off in fam.members}):
        lc = _relaxed(model, hw, space, fam, off)
        if lc is None:
            continue
        c = replace(lc, mode_time_s=f.mode_time_s, first_time_s=f.first_time_s, last_time_s=f.last_time_s,
                    p2p_time_s=f.p2p_chunk_s * chunk_counts[0], mode_dp_time_s=f.mode_dp_time_s,
                    first_dp_time_s=f.first_dp_time_s, last_dp_time_s=f.last_dp_time_s,
                    sum_weight=min(w[0] for w in ws), max_weight=min(w[1] for w in ws))
        upper = stage_upper_bounds(c, layers, space.cap, fam.modes)
        if min(upper) >= v_min and sum(upper) >= layers:
            bounds.append(lower_bound(c, layers, fam.modes, space.cap, upper, min_layers=v_min))
    return max(blind, min(bounds, default=float("inf")))


@dataclass(kw_only=True, slots=True)
class _Space:
    """What the search learns about the candidates as it opens families: the cost caches,
    by schedule group whether its memory relaxation fits (``_group_fits``), each candidate's
    memory-blind bound by strategy (an offload candidate borrows its twin's), its order-free
    one, and the other kept axis orders of each degrees."""

    cache: dict
    free_cache: dict
    fits: dict
    """By schedule group, its least-memory relaxation where it fits (with ``modes`` under
    ``cap``), else None (``_relaxed``)."""
    modes: tuple[int, ...]
    cap: float
    twins: dict
    free: dict
    orders_of: dict
    free_hw: dict
    memo: dict
    """The runtime predicate's answers (``space.block_families``)."""
    pins: Pins
    dtype: str


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
             deadline: float = float("inf")) -> tuple[list[tuple[float, int, Block, _Pending]], int, _Space]:
    """Every block of outer candidates (``space.outer_blocks``) with a bound valid for its
    candidates in every axis order (``_Pending``) and its fixed order, and how many candidates
    there are (other axis orders included; counted once per ``space.family_signature``).
    When its bound comes up a block is made into families (``_expand_block``), each bounded by
    ``_floor_bound``; when that comes up a family is checked for memory and bounded
    (``_bound_family``), and when that bound comes up, opened (``_open``)."""
    modes = tuple(range(len(RECOMPUTE))) if pins.recompute is None \
        else (RECOMPUTE.index(pins.recompute),)
    space = _Space(cache={}, free_cache={}, fits={}, twins={}, free={}, orders_of={}, free_hw={},
                   modes=modes, cap=cap, memo={}, pins=pins, dtype=dtype)
    recipe = pins.recipe or load_recipe()
    scored, counts = [], {}
    total = 0
    for i, block in enumerate(outer_blocks(model, hw, gpus, global_batch, pins)):
        if i % 64 == 63 and time.perf_counter() > deadline:
            raise UserError(f"the strategy space has over {total:,} candidates, more than can be enumerated "
                            f"in --time-limit (at least {ENUMERATION_S:g} s); pin some dimensions (--tp, --pp, "
                            "--vpp, --mbs, --zero) or raise --time-limit")
        mesh, others = block.mesh, ()
        if pins.axis_order is None:
            if mesh not in space.orders_of:
                space.orders_of[mesh] = tuple(axis_orders(hw, mesh)[1:])
            others = space.orders_of[mesh]
        sig = family_signature(block)
        if sig not in counts:
            counts[sig] = sum(len(f.members) for f in block_families(model, hw, block, dtype, pins, space.memo))
        if not counts[sig]:
            continue
        total += counts[sig] * (1 + len(others))
        hw_b, order = _free_hw(space, hw, mesh)
        floors = tuple((sp, pass_floor(model, hw_b, Strategy(
            mesh=mesh, micro_batch=block.micro_batch, num_microbatches=block.num_microbatches,
            sequence_parallel=sp, dtype=dtype, axis_order=order, recipe=recipe), space.free_cache))
            for sp in ((pins.sequence_parallel,) if pins.sequence_parallel is not None
                       else (False, True) if mesh.tp > 1 else (False,)))
        bound = block.num_microbatches / mesh.pp * min(f for _, (f, _) in floors)
        scored.append((bound, i << BLOCK_BITS, block, _Pending(orders=others, floors=floors)))
    return scored, total, space


def _expand_block(model: ModelProfile, hw: HardwareProfile, block: Block, item: _Pending, lb: float,
                  order: int, space: _Space, scored: list, heap: list) -> None:
    """Push the families of ``block`` (popped with bound ``lb`` at fixed order ``order``), each
    with its ``_floor_bound``."""
    floors = dict(item.floors)
    members = _Members(orders=item.orders)
    for j, fam in enumerate(block_families(model, hw, block, space.dtype, space.pins, space.memo)):
        scored.append((_floor_bound(fam, *floors[fam.sequence_parallel]), order + (j << MEMBER_BITS), fam, members))
        heapq.heappush(heap, (max(lb, scored[-1][0]), scored[-1][1], None, len(scored) - 1))


def _floor_bound(fam: Family, passes_s: float, zb_fill: float) -> float:
    """A bound on every member of ``fam`` from ``estimate.pass_floor``: the step is at least
    (sum_weight + max_weight / pp) Σ_s T_s, the weights at their least over the members'
    chunks (interleaved: the most) and the fill fraction (zero-bubble: no recompute)."""
    k = fam.members[-1][0] if fam.schedule == "interleaved" else 1  # members go by v
    sum_w, max_w = weights(fam.schedule, fam.mesh.pp, fam.num_microbatches, k, zb_fill)
    return (sum_w + max_w / fam.mesh.pp) * passes_s


def _bound_family(model: ModelProfile, hw: HardwareProfile, fam: Family, item: _Members,
                  space: _Space) -> float:
    """``_family_bound`` of ``fam``; ``inf`` when none of its schedule groups fits
    (``_group_fits``: in no axis order)."""
    if not any(_fits(model, hw, space, fam, off) for off in {off for _, _, off in fam.members}):
        return float("inf")
    return _family_bound(model, hw, fam, space, bool(item.orders))


def _free_hw(space: _Space, hw: HardwareProfile, mesh: Degrees) -> tuple[HardwareProfile, tuple]:
    """``space.order_free_hardware`` of ``mesh``, once per degrees."""
    if mesh not in space.free_hw:
        space.free_hw[mesh] = order_free_hardware(hw, mesh)
    return space.free_hw[mesh]


def _relaxed(model: ModelProfile, hw: HardwareProfile, space: _Space, fam: Family,
             offload: bool) -> StageCosts | None:
    """The least-memory relaxation of the schedule group of ``fam``'s members with ``offload``
    (``bounds.least_memory_costs``), once per group; None when it does not fit (``_group_fits``)."""
    group = (fam.mesh, fam.micro_batch, fam.zero, fam.sequence_parallel, offload)
    if group not in space.fits:
        lc = least_memory_costs(model, hw, fam.strategy(1, "", offload))
        space.fits[group] = lc if _group_fits(lc, model.layers, space.modes, space.cap) else None
    return space.fits[group]


def _fits(model: ModelProfile, hw: HardwareProfile, space: _Space, fam: Family, offload: bool) -> bool:
    """``_group_fits`` of the schedule group of ``fam``'s members with ``offload``, once per group."""
    return _relaxed(model, hw, space, fam, offload) is not None


def _open(model: ModelProfile, hw: HardwareProfile, fam: Family, item: _Members, lb: float,
          order: int, space: _Space, scored: list, heap: list) -> None:
    """Push the members of ``fam`` (popped with bound ``lb`` at fixed order ``order``), each
    with its memory-blind bound (an offload member its twin's, costed only when popped) and,
    when its degrees have other kept axis orders, one ``_OtherOrders`` item behind their
    order-free bound."""
    for j, cand in enumerate(fam.candidates()):
        st = cand.strategy
        if not _fits(model, hw, space, fam, st.offload):
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
                space.free[key] = min(space.twins[key], _order_free_blind(
                    _order_free_base(model, hw, key, space.free_cache), key, kc, model.layers, cand.modes))
            scored.append((space.free[key], LATER + 8 * (order + 1 + j), cand,
                           _OtherOrders(twin=len(scored) - 1, orders=item.orders)))
            heapq.heappush(heap, (max(lb, space.free[key]), LATER + 8 * (order + 1 + j), None,
                                  len(scored) - 1))


def _group_fits(relaxed: StageCosts, layers: int, modes: tuple[int, ...], cap: float) -> bool:
    """Whether some member of a schedule group (the strategies differing only in schedule,
    chunks and recompute, ``cost_models.bounds``) may fit: its least-memory relaxation
    ``relaxed`` holds the model with blocks in any of ``modes`` and at least one per stage.
    Memory reads no axis order, so False rules the group out in every order."""
    upper = stage_upper_bounds(relaxed, layers, cap, modes)
    return min(upper) >= 1 and sum(upper) >= layers


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class _Refined:
    """A candidate's memory-aware bound and what its placement solve reuses."""

    bound: float
    tables: StageTables | None = None
    tau: float = float("inf")


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
        return _Refined(bound=lower_bound(c, layers, cand.modes, cap, upper,
                                          min_layers=cand.min_layers))
    tabs = stage_tables(c, cand.modes, cap, upper)
    tau = bottleneck(tabs, layers, cand.min_layers)
    if tau == float("inf"):
        return _Refined(bound=float("inf"))
    total = least_total(tabs, layers, cand.min_layers)
    bound = lower_bound(c, layers, cand.modes, cap, upper, tau, total, cand.min_layers)
    if len(cand.modes) == 1:  # one mode: the candidate's exact optimum (float noise aside)
        bound = max(bound, single_mode_least_step(c, tabs, layers, cand.min_layers,
                                                  cand.modes[0], tau) * (1 - EXACT))
    return _Refined(bound=bound, tables=tabs, tau=tau)


def _place(c: StageCosts, cand: Candidate, layers: int, cap: float, ref: _Refined,
           time_limit_s: float) -> tuple[tuple[tuple[int, ...], ...], float] | None:
    """(loads, proven bound on this candidate's step) of the best placement found: the greedy
    one with the optimal bottleneck when it meets the bound, else CP-SAT seeded with it
    (capped at ``EFFORT``); the better of the two in float."""
    loads = greedy(c, ref.tables, layers, cand.min_layers, cap, ref.tau)
    if loads is not None:
        loads = _full_loads(loads)
        if c.step_time_s(loads) <= ref.bound * (1 + TIE):  # meets the bound: optimal
            return loads, c.step_time_s(loads)
    placed = solve_placement(c, layers, cap, cand.modes, cand.min_layers, time_limit_s,
                             tables=ref.tables, tau=ref.tau, hint=loads, effort=EFFORT)
    if placed is None:
        return None if loads is None else (loads, ref.bound)
    bound = c.step_time_s(placed.loads) if placed.optimal else max(ref.bound, placed.bound_s)
    if loads is None or c.step_time_s(placed.loads) <= c.step_time_s(loads):
        return placed.loads, min(bound, c.step_time_s(placed.loads))
    return loads, min(bound, c.step_time_s(loads))


def _full_loads(loads):
    return tuple(tuple(ld) + (0,) * (len(RECOMPUTE) - len(ld)) for ld in loads)


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
    uppers, twin_of = {}, {}  # stage_upper_bounds by candidate in Megatron's order; its index
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
            if c.bounded:
                _open(model, hw, cand, c, lb, order, space, scored, heap)
            else:
                scored[i] = (lb, order, cand, replace(c, bounded=True))
                heapq.heappush(heap, (max(lb, _bound_family(model, hw, cand, c, space)), order, None, i))
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
                ref = _refine(_order_free_costs(model, hw, cand.strategy, twin_c, free_cache),
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
            loads = greedy(c, ref.tables, model.layers, cand.min_layers, cap, ref.tau)
            if loads is not None:
                loads = _full_loads(loads)
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


def fits_anywhere(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int,
                  dtype: str, pins: Pins) -> bool:
    """Some outer candidate has a placement within device memory (bounds only, no CP-SAT)."""
    for cand in outer_candidates(model, hw, gpus, global_batch, dtype, pins):
        c = stage_costs(model, hw, cand.strategy)
        upper = stage_upper_bounds(c, model.layers, hw.memory_bytes, cand.modes)
        if min(upper) >= cand.min_layers and sum(upper) >= model.layers:
            return True
    return False
