"""The search's bounds: a lower bound on a candidate's step over its placements
(``lower_bound``), and bounds valid for many candidates at once, so that the search makes and
costs them only when such a bound comes up: every axis order of a candidate (order-free
coefficients, ``space.order_free_hardware``), a family (``space.Family``: ``family_bound``,
time floors and the schedule groups' least-memory relaxation) and a block of families
(``floor_bound`` from ``estimate.pass_floor``). Each is checked against enumerated optima in
tests/test_solver.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from autopar.solve.core import stage_upper_bounds
from autopar.solve.space import Family, Pins, order_free_hardware
from cost_models import Degrees, HardwareProfile, ModelProfile, StageCosts, Strategy, stage_costs
from cost_models.axes import DEFAULT_ORDER
from cost_models.bounds import least_memory_costs, schedule_memory_costs, state_floor_bytes
from cost_models.estimate import parts_key, time_floor
from cost_models.pipeline import chunks, weights
from cost_models.strategy import RECOMPUTE


def _stage_segments(room: float, per: tuple[float, ...], times: tuple[float, ...],
                    upper: int) -> list[tuple[float, float]]:
    """(slope, blocks) pieces of g_s(N), the least T_s block time of N blocks on a stage with
    ``room`` bytes beyond its fixed ones, ``per`` bytes and ``times`` seconds a block in each
    mode, in the LP relaxation of its memory row (workspace dropped, counts fractional): the
    lower convex envelope of the rays from the origin to "stage full in mode r", cut at
    ``upper``."""
    if room <= 0 or upper <= 0:
        return []
    if len(per) == 1:  # one mode: one ray (the general case's arithmetic, half the calls)
        x = room / per[0]
        return [((x * times[0] - 0.0) / (x - 0.0), min(x - 0.0, float(upper)))]
    pts = sorted({(room / b, room / b * t) for b, t in zip(per, times)})
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
                min_layers: int = 1, units: float | None = None) -> float:
    """A bound on ``step_time_s`` over all placements within ``cap``: Σ_s T_s is at least
    the fixed parts plus the cheapest L block-units over every stage's LP envelope g_s
    (``block_units``; ``units`` when the caller has it) and at least ``total`` (the exact least
    Σ_s T_s of the tables, ``tables.least_total``), the slowest stage at least the mean and
    at least ``tau`` (the exact bottleneck τ*, ``tables.bottleneck``), and D at least the mean
    of the fastest-mode tails and at least every stage's own fixed tail plus its fewest blocks
    (``min_layers``, or what the other stages cannot hold) in the fastest-tail mode.
    ``inf`` when nothing fits."""
    # Σ_s T_s(empty) and Σ_s D_s(empty) in closed form (every stage has p2p, one first, one last)
    fixed = c.pp * c.p2p_time_s + c.first_time_s + c.last_time_s
    d = min(c.mode_dp_time_s[r] for r in modes)
    dp = c.first_dp_time_s + c.last_dp_time_s + layers * d
    if cap != float("inf"):
        upper = upper or [layers] * c.pp
    blocks = block_units(c, layers, modes, cap, upper) if units is None else units
    if blocks == float("inf"):
        return blocks
    times = max(fixed + blocks, total)
    d_max = dp / c.pp
    if upper is not None:
        # stage s holds at least what the others cannot; its empty tail is the first's
        # and the last's pieces (``StageCosts.stage_dp_time_s`` of no blocks)
        short, last = layers - sum(upper), c.pp - 1
        for s, u in enumerate(upper):
            tail = ((c.first_dp_time_s if s == 0 else 0.0) + (c.last_dp_time_s if s == last else 0.0)
                    + max(min_layers, short + u) * d)
            if tail > d_max:
                d_max = tail
    return c.sum_weight * times + c.max_weight * max(times / c.pp, tau) + d_max


def block_units(c: StageCosts, layers: int, modes: tuple[int, ...], cap: float = float("inf"),
                upper: list[int] | None = None) -> float:
    """The least Σ_s of the stages' block times over placements of ``layers`` blocks in the
    LP relaxation: the cheapest L block-units over every stage's envelope g_s
    (``_stage_segments``, each cut at ``upper``); for an infinite cap every block at its
    fastest mode. ``inf`` when the stages cannot hold them. Reads of ``c`` its memory rows
    and ``mode_time_s`` only."""
    if cap == float("inf"):
        return layers * min(c.mode_time_s[r] for r in modes)
    upper = upper or [layers] * c.pp
    segs, seen = [], {}
    times = tuple(c.mode_time_s[r] for r in modes)
    for (fixed, per), u in zip(c.memory_rows(modes), upper):  # stages alike in memory share pieces
        key = (fixed, per, u)
        if key not in seen:
            seen[key] = _stage_segments(cap - fixed, per, times, u)
        segs.extend(seen[key])
    segs.sort()
    blocks, left = 0.0, float(layers)
    for slope, width in segs:
        take = min(width, left)
        blocks += slope * take
        left -= take
        if left <= 0:
            break
    return float("inf") if left > 1e-9 else blocks


def order_free_base(model: ModelProfile, hw: HardwareProfile, strat: Strategy,
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


def order_free_blind(base: StageCosts, strat: Strategy, c: StageCosts, layers: int,
                      modes: tuple[int, ...]) -> float:
    """``lower_bound`` with no cap of ``order_free_costs`` (the same closed form: every
    block at its fastest mode, the slowest stage at least the mean, D at least the mean)."""
    times = (c.pp * base.p2p_time_s * chunks(strat) + base.first_time_s + base.last_time_s
             + layers * min(base.mode_time_s[r] for r in modes))
    dp = base.first_dp_time_s + base.last_dp_time_s + layers * min(base.mode_dp_time_s[r]
                                                                   for r in modes)
    return c.sum_weight * times + c.max_weight * times / c.pp + dp / c.pp


def order_free_costs(model: ModelProfile, hw: HardwareProfile, strat: Strategy, c: StageCosts,
                      cache: dict) -> StageCosts:
    """``c`` (the costs of ``strat``) with the time coefficients of ``strat`` under every axis
    order at once: each axis in its best group (``space.order_free_hardware``; costs are
    monotone in the groups), so every bound computed from them holds for every order. Memory
    and the schedule weights read no order (the weights read compute only) and stay. The
    coefficients are shared by the strategies with the same ``parts_key`` up to the order."""
    base = order_free_base(model, hw, strat, cache)
    return replace(c, mode_time_s=base.mode_time_s, first_time_s=base.first_time_s,
                   last_time_s=base.last_time_s, p2p_time_s=base.p2p_time_s * chunks(strat),
                   mode_dp_time_s=base.mode_dp_time_s, first_dp_time_s=base.first_dp_time_s,
                   last_dp_time_s=base.last_dp_time_s)


def family_bound(model: ModelProfile, hw: HardwareProfile, fam: Family, space: SearchMemo,
                  free: bool, tight: bool = True) -> float:
    """A bound on the step of every member of ``fam`` at once (``inf`` when none fits): its
    time coefficients at their least over the leading blocks' modes (``estimate.TimeFloor``;
    an offload member is never slower to bound than its twin without: its coefficients are
    no lower), under ``free`` (the degrees have other kept axis orders) the order-free ones,
    so the bound holds in every order. The larger of the memory-blind ``lower_bound`` at
    its least over the members' chunks, and ``lower_bound`` within device memory of the
    schedule groups' least-memory relaxation (``relaxed``) with the schedule weights and p2p
    each at their least over the members; under ``tight``, of the members' own schedule
    (``family_relaxed``) rather than their group's."""
    st = fam.base
    if not free:
        f = time_floor(model, hw, st, space.cache)
    else:
        hw_b, order = free_hw(space, hw, st.mesh)
        f = time_floor(model, hw_b, replace(st, axis_order=order, schedule="1f1b", virtual_stages=1),
                       space.free_cache)
    pp, m, layers = st.mesh.pp, st.num_microbatches, model.layers
    times = f.first_time_s + f.last_time_s + layers * min(f.mode_time_s[r] for r in fam.modes)
    dp = (f.first_dp_time_s + f.last_dp_time_s + layers * min(f.mode_dp_time_s[r] for r in fam.modes)) / pp
    zb = f.zb_fill[RECOMPUTE.index(st.recompute)]
    chunk_counts = sorted({v if st.schedule == "interleaved" else 1 for v, _, _ in fam.members})
    ws = [weights(st.schedule, pp, m, k, zb, hw.ranks_per_core) for k in chunk_counts]
    blind = min(sw * (times + pp * f.p2p_chunk_s * k) + mw * (times + pp * f.p2p_chunk_s * k) / pp + dp
                for k, (sw, mw) in zip(chunk_counts, ws))
    v_min = min(v for v, _, _ in fam.members)
    bounds = []
    for off in sorted({off for _, _, off in fam.members}):
        group = (family_relaxed if tight else relaxed)(model, hw, space, fam, off)
        if group is None:
            continue
        c = replace(group.costs, mode_time_s=f.mode_time_s, first_time_s=f.first_time_s, last_time_s=f.last_time_s,
                    p2p_time_s=f.p2p_chunk_s * chunk_counts[0], mode_dp_time_s=f.mode_dp_time_s,
                    first_dp_time_s=f.first_dp_time_s, last_dp_time_s=f.last_dp_time_s,
                    sum_weight=min(w[0] for w in ws), max_weight=min(w[1] for w in ws))
        # memory reads no time: the group's bounds hold at its own modes
        upper = group.upper if fam.modes == space.modes else stage_upper_bounds(c, layers, space.cap, fam.modes)
        if min(upper) >= v_min and sum(upper) >= layers:
            key = (f.mode_time_s, fam.modes)  # what ``block_units`` reads besides the group's memory
            if key not in group.units:
                group.units[key] = block_units(c, layers, fam.modes, space.cap, upper)
            bounds.append(lower_bound(c, layers, fam.modes, space.cap, upper, min_layers=v_min,
                                      units=group.units[key]))
    return max(blind, min(bounds, default=float("inf")))


@dataclass(kw_only=True, slots=True)
class SearchMemo:
    """What the search learns about the candidates as it opens families: the cost caches,
    by schedule group whether its memory relaxation fits (``group_fits``), each candidate's
    memory-blind bound by strategy (an offload candidate borrows its twin's), its order-free
    one, and the other kept axis orders of each degrees."""

    cache: dict
    free_cache: dict
    fits: dict
    """By schedule group (``relaxed``), and by group, schedule and chunk range
    (``family_relaxed``), its memory relaxation and its stages' most blocks where it fits
    (with ``modes`` under ``cap``), else None; by degrees, ZeRO stage and offload, whether
    the weights and optimizer states alone fit (``_states_hold``)."""
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


def floor_bound(fam: Family, ranks_per_core: float, passes_s: float, zb_fill: float) -> float:
    """A bound on every member of ``fam`` from ``estimate.pass_floor``: the step is at least
    (sum_weight + max_weight / pp) Σ_s T_s, the weights at their least over the members'
    chunks (interleaved: the most) and the fill fraction (zero-bubble: no recompute)."""
    k = fam.members[-1][0] if fam.schedule == "interleaved" else 1  # members go by v
    sum_w, max_w = weights(fam.schedule, fam.mesh.pp, fam.num_microbatches, k, zb_fill, ranks_per_core)
    return (sum_w + max_w / fam.mesh.pp) * passes_s


def bound_family(model: ModelProfile, hw: HardwareProfile, fam: Family, free: bool,
                 space: SearchMemo, tight: bool = True) -> float:
    """``family_bound`` of ``fam``; ``inf`` when none of its schedule groups fits
    (``group_fits``: in no axis order)."""
    if not any(fits(model, hw, space, fam, off) for off in {off for _, _, off in fam.members}):
        return float("inf")
    return family_bound(model, hw, fam, space, free, tight)


def free_hw(space: SearchMemo, hw: HardwareProfile, mesh: Degrees) -> tuple[HardwareProfile, tuple]:
    """``space.order_free_hardware`` of ``mesh``, once per degrees."""
    if mesh not in space.free_hw:
        space.free_hw[mesh] = order_free_hardware(hw, mesh)
    return space.free_hw[mesh]


@dataclass(frozen=True, kw_only=True, slots=True)
class Relaxed:
    """A schedule group's least-memory relaxation where it fits (``relaxed``)."""

    costs: StageCosts
    upper: list[int]
    """``stage_upper_bounds`` of ``costs`` with the search's modes."""
    units: dict
    """``block_units`` of ``costs`` by the time coefficients and modes it was read with."""


def _group(fam: Family, offload: bool) -> tuple:
    """The schedule group of ``fam``'s members with ``offload`` (torch's zero-bubble with
    m <= p apart, whose peak may come before any gradient)."""
    zb_early = fam.schedule == "zero-bubble" and fam.num_microbatches <= fam.mesh.pp  # may peak gradient-free
    return (fam.mesh, fam.micro_batch, fam.zero, fam.sequence_parallel, offload, zb_early)


def relaxed(model: ModelProfile, hw: HardwareProfile, space: SearchMemo, fam: Family,
             offload: bool) -> Relaxed | None:
    """The least-memory relaxation of the schedule group of ``fam``'s members with ``offload``
    (``bounds.least_memory_costs``), once per group; None when it does not fit (``group_fits``)."""
    group = _group(fam, offload)
    if group not in space.fits and not _states_hold(model, space, fam, offload):
        space.fits[group] = None
    if group not in space.fits:
        lc = least_memory_costs(model, hw, fam.strategy(1, "", offload))
        upper = stage_upper_bounds(lc, model.layers, space.cap, space.modes)
        space.fits[group] = Relaxed(costs=lc, upper=upper, units={}) if _holds(upper, model.layers) else None
    return space.fits[group]


def _states_hold(model: ModelProfile, space: SearchMemo, fam: Family, offload: bool) -> bool:
    """Whether the stages can hold the model's weights and optimizer states alone
    (``bounds.state_floor_bytes``, within ``space.cap``, at least one block each), once per
    degrees, ZeRO stage and offload: False rules out every schedule group sharing them, before
    any group's relaxation is made."""
    key = (fam.mesh, fam.zero, offload)
    if key not in space.fits:
        first, last, per = state_floor_bytes(model, fam.strategy(1, "", offload))
        pp, layers = fam.mesh.pp, model.layers
        upper = []
        for s in range(pp):
            room = space.cap - (first if s == 0 else 0.0) - (last if s == pp - 1 else 0.0)
            upper.append(-1 if room < 0 else layers if per <= 0 else min(layers, math.floor(room / per)))
        space.fits[key] = _holds(upper, layers)
    return space.fits[key]


def family_relaxed(model: ModelProfile, hw: HardwareProfile, space: SearchMemo, fam: Family,
                   offload: bool) -> Relaxed | None:
    """The relaxation of ``fam``'s members with ``offload`` alone (``bounds.schedule_memory_costs``:
    their schedule's in-flight counts at their least over their chunks, not 1F1B's), once per
    schedule group, schedule and chunk range; None when it or its group's does not fit. A
    1F1B family's is its group's."""
    group = relaxed(model, hw, space, fam, offload)
    if group is None or fam.schedule == "1f1b":
        return group
    vs = [v for v, _, off in fam.members if off == offload]
    key = (_group(fam, offload), fam.schedule, min(vs), max(vs))
    if key not in space.fits:
        sc = schedule_memory_costs(model, hw, fam.strategy(vs[0], "", offload), (min(vs), max(vs)))
        upper = stage_upper_bounds(sc, model.layers, space.cap, space.modes)
        space.fits[key] = Relaxed(costs=sc, upper=upper, units={}) if _holds(upper, model.layers) else None
    return space.fits[key]


def fits(model: ModelProfile, hw: HardwareProfile, space: SearchMemo, fam: Family, offload: bool) -> bool:
    """``group_fits`` of the schedule group of ``fam``'s members with ``offload``, once per group."""
    return relaxed(model, hw, space, fam, offload) is not None


def group_fits(relaxed: StageCosts, layers: int, modes: tuple[int, ...], cap: float) -> bool:
    """Whether some member of a schedule group (the strategies differing only in schedule,
    chunks and recompute, ``cost_models.bounds``) may fit: its least-memory relaxation
    ``relaxed`` holds the model with blocks in any of ``modes`` and at least one per stage.
    Memory reads no axis order, so False rules the group out in every order."""
    return _holds(stage_upper_bounds(relaxed, layers, cap, modes), layers)


def _holds(upper: list[int], layers: int) -> bool:
    """Stages holding at most ``upper`` blocks each can hold ``layers``, one at least on each."""
    return min(upper) >= 1 and sum(upper) >= layers
