"""An exact placement by scanning the slowest stage time τ and the worst tail δ.

The step of a placement is ``sum_weight · Σ_s T_s + max_weight · max_s T_s + max_s D_s``
(``StageCosts.step_time_s``). Fix τ ≥ max_s T_s and δ ≥ max_s D_s: what is left is the least
Σ_s T_s over placements whose every stage keeps T_s ≤ τ and D_s ≤ δ, a min-plus convolution
of per-stage tables h_s(N) = the least block time of N blocks within memory, τ and δ. So

    F(τ, δ) = sum_weight · (least Σ_s T_s within τ, δ) + max_weight · τ + δ

is at least the step of some placement, and at the optimal placement's own (max T, max D) it
is at most its step: min F over the stages' T and D values is the optimum. The scan walks τ
up from the bottleneck τ* and, for each, δ up from its least feasible value, and stops where
a lower bound on the rest (the convolution without δ, or without τ and δ) reaches the best
step known. Each stage's mixes are reduced once to their (block time, tail) Pareto front per
block count (removing a block from a fitting mix leaves one that fits, so the feasible counts
of a stage under τ, δ are 0 … some cap, found by a search as in ``tables.bottleneck``).

The scan is a fallback for the candidates whose greedy placement misses their table bound:
it gives up (``None``) past ``BUDGET`` convolutions or ``MIXES`` enumerated mixes, and the
caller then asks CP-SAT. Memory rows carry ``tables.SLACK``, so F is a valid lower bound;
a placement it returns is checked exactly by the caller.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from cost_models import StageCosts
from cost_models.strategy import RECOMPUTE
from autopar.solve.tables import SLACK, StageTables, least_feasible, least_total, sorted_unique, stage_caps

BUDGET = 1000
"""Most convolutions one scan may evaluate before it gives up (each well under a millisecond
at a hundred blocks)."""
MIXES = 200_000
"""Most mixes (block counts per mode over the stages' classes) one scan may enumerate."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class _Front:
    """One stage's Pareto-optimal mixes: blocks, block time, block tail, counts per mode."""

    n: np.ndarray
    time: np.ndarray
    dp: np.ndarray
    counts: np.ndarray
    fixed_t: float
    """T_s of the empty stage."""
    fixed_d: float
    """D_s of the empty stage."""


def _mixes(upper: int, k: int) -> np.ndarray:
    """Every k-tuple of block counts summing to at most ``upper``, C(upper + k, k) rows in
    lexicographic order, built a mode at a time (not filtered from the (upper + 1)^k grid)."""
    grid = np.zeros((1, 0), dtype=np.int64)
    for _ in range(k):
        reps = upper + 1 - grid.sum(axis=1)  # the next mode takes 0 ... what is left
        starts = np.cumsum(reps) - reps
        col = np.arange(int(reps.sum())) - np.repeat(starts, reps)
        grid = np.column_stack([np.repeat(grid, reps, axis=0), col])
    return grid


def _front(c: StageCosts, s: int, modes: tuple[int, ...], cap: float, upper: int) -> _Front:
    """Stage s's mixes of at most ``upper`` blocks that fit ``cap`` (with ``SLACK``), each
    kept only if no mix of as many blocks is as fast with a tail as short."""
    grid = _mixes(upper, len(modes))
    counts = np.zeros((len(grid), len(RECOMPUTE)), dtype=np.int64)
    counts[:, list(modes)] = grid
    per = np.array([c.block_bytes(s, r) for r in range(len(RECOMPUTE))])
    work = np.array(c.mode_workspace_bytes)
    room = cap - c.stage_fixed_bytes(s)
    memory = counts @ per + np.where(counts > 0, work[None, :], 0.0).max(axis=1)
    counts = counts[memory <= room + SLACK * abs(room) + 1.0]
    n = counts.sum(axis=1)
    time = counts @ np.array(c.mode_time_s)
    dp = counts @ np.array(c.mode_dp_time_s)
    order = np.lexsort((dp, time, n))  # per n ascending, by time: keep what shortens the tail
    starts = np.flatnonzero(np.diff(n[order], prepend=-1))
    keep = []
    for lo, hi in zip(starts, [*starts[1:], len(order)]):
        tails = dp[order[lo:hi]]
        shorter = np.ones(hi - lo, dtype=bool)
        shorter[1:] = tails[1:] < np.minimum.accumulate(tails)[:-1]
        keep.append(order[lo:hi][shorter])
    idx = np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)
    return _Front(n=n[idx], time=time[idx], dp=dp[idx], counts=counts[idx],
                  fixed_t=c.stage_time_s(s, 0), fixed_d=c.stage_dp_time_s(s, 0))


def _tables(fronts: list[_Front], tau: float, delta: float, size: int) -> list[np.ndarray]:
    """h_s(N) for N = 0 … size - 1 under τ and δ (inf where no mix of N blocks qualifies)."""
    out, seen = [], {}
    for f in fronts:
        if id(f) not in seen:
            h = np.full(size, np.inf)
            ok = (f.time + f.fixed_t <= tau) & (f.dp + f.fixed_d <= delta)
            np.minimum.at(h, f.n[ok], f.time[ok])
            seen[id(f)] = h
        out.append(seen[id(f)])
    return out


def _convolve(tables: list[np.ndarray], layers: int, min_layers: int,
              trace: bool = False) -> tuple[float, list[int]]:
    """min Σ_s h_s(N_s) over N_s ≥ ``min_layers`` summing to ``layers``, and (``trace``) the
    counts attaining it."""
    cur = np.full(layers + 1, np.inf)
    cur[0] = 0.0
    j = np.arange(layers + 1)[:, None]
    picks = []
    for h in tables:
        k = np.arange(min_layers, min(len(h) - 1, layers) + 1)[None, :]
        if k.size == 0:
            return float("inf"), []
        prev = j - k
        sums = np.where(prev >= 0, cur[np.maximum(prev, 0)] + h[k], np.inf)
        arg = sums.argmin(axis=1)
        cur = sums[np.arange(layers + 1), arg]
        picks.append(k[0, arg])
    if not trace or not np.isfinite(cur[layers]):
        return float(cur[layers]), []
    sizes, left = [], layers
    for pick in reversed(picks):
        sizes.append(int(pick[left]))
        left -= sizes[-1]
    return float(cur[layers]), sizes[::-1]


def least_step(c: StageCosts, tabs: StageTables, modes: tuple[int, ...], cap: float, layers: int,
               min_layers: int, tau: float,
               best: float) -> tuple[float, tuple[tuple[int, ...], ...] | None] | None:
    """(least step over placements, up to ``SLACK`` and float order, and the placement
    attaining it when below ``best``, else None) given the memory tables ``tabs`` (built for
    ``modes``), the bottleneck τ* and a placement of step ``best`` (inf if none); None when
    the scan gives up (``BUDGET``, ``MIXES``). A stage holds no more blocks than its table
    allows within the slowest-stage time that could still beat ``best``."""
    upper = [len(g) - 1 for g in tabs.time]
    if np.isfinite(best) and c.max_weight > 0:
        reach = (best - c.sum_weight * least_total(tabs, layers, min_layers)) / c.max_weight
        upper = [min(u, n) for u, n in zip(upper, stage_caps(tabs, reach * (1 + 1e-9)))]
    if min(upper) < min_layers or sum(upper) < layers:
        return best, None  # no placement beats ``best``
    # stages alike in memory and bound share their mixes (first and last differ in memory_key)
    stage_keys = [(c.memory_key(s), upper[s]) for s in range(c.pp)]
    members = Counter(stage_keys)
    if sum(math.comb(u + len(modes), len(modes)) for _, u in members) > MIXES:
        return None
    keys = {key: _front(c, stage_keys.index(key), modes, cap, key[1]) for key in members}
    fronts = [keys[key] for key in stage_keys]
    size = max(upper) + 1
    fixed = sum(f.fixed_t for f in fronts)
    times = sorted_unique(np.concatenate([f.time + f.fixed_t for f in fronts]))
    tails = sorted_unique(np.concatenate([f.dp + f.fixed_d for f in fronts]))
    times = times[times >= tau - abs(tau) * 1e-12]  # τ* was summed in another float order
    if c.max_weight <= 0:  # the slowest stage costs nothing of its own: let it be as slow as any
        times = times[-1:]

    distinct, counts = list(keys.values()), list(members.values())

    def least_tail(t: float) -> float:
        """The least δ among ``tails`` with a placement within τ = t and δ (inf if none): per
        stage, its mixes within τ by tail, with the most blocks of any up to each."""
        rows = []
        for f in distinct:
            within = f.time + f.fixed_t <= t
            d = f.dp[within] + f.fixed_d
            order = np.argsort(d, kind="stable")
            rows.append((d[order], np.maximum.accumulate(f.n[within][order])))

        def ok(delta: float) -> bool:
            most = [int(n[i - 1]) if (i := int(np.searchsorted(d, delta, side="right"))) else -1
                    for d, n in rows]
            return min(most) >= min_layers and sum(k * x for k, x in zip(counts, most)) >= layers
        return least_feasible(tails, ok)

    inf = float("inf")
    spent = 1
    total_all, _ = _convolve(_tables(fronts, inf, inf, size), layers, min_layers)
    tail_all = least_tail(inf)
    found, at = best, None
    for t in times.tolist():
        if c.sum_weight * (total_all + fixed) + c.max_weight * t + tail_all >= found:
            break
        if spent >= BUDGET:
            return None
        spent += 1
        total_t, _ = _convolve(_tables(fronts, t, inf, size), layers, min_layers)
        head = c.sum_weight * (total_t + fixed) + c.max_weight * t
        if head + tail_all >= found:  # no δ at this τ beats it (or no placement within τ)
            continue
        d_low = least_tail(t)
        for d in tails[np.searchsorted(tails, d_low):].tolist():
            if head + d >= found:
                break
            if spent >= BUDGET:
                return None
            spent += 1
            total, _ = _convolve(_tables(fronts, t, d, size), layers, min_layers)
            step = c.sum_weight * (total + fixed) + c.max_weight * t + d
            if step < found:
                found, at = step, (t, d)
            if total <= total_t:  # δ no longer binds: a larger one only adds to the tail
                break
    if at is None:
        return found, None
    tables = _tables(fronts, at[0], at[1], size)
    _, sizes = _convolve(tables, layers, min_layers, trace=True)
    loads = []
    for f, h, n in zip(fronts, tables, sizes):
        ok = (f.n == n) & (f.time == h[n]) & (f.time + f.fixed_t <= at[0]) & (f.dp + f.fixed_d <= at[1])
        loads.append(tuple(int(x) for x in f.counts[np.flatnonzero(ok)[0]]))
    return found, tuple(loads)
