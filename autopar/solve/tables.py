"""Per-stage best-time tables, the exact bottleneck bound and a greedy placement.

For stage s and a block count N, ``g_s(N)`` is the least block time Σ_r n_r t_r over the mixes
of N blocks that fit the stage's memory row (workspace included). With one memory row and a
count row, a mix of two modes is solved in closed form (as many blocks in the faster mode as
the memory allows), and a third mode by enumerating its count, for every subset of modes (the
subset fixes the workspace term): exact, vectorised over (N, count) with numpy.

From the tables:

- ``bottleneck``: τ* = the least max_s T_s of any placement (T_s = g_s(N_s) + fixed_s, g_s
  non-decreasing in N), found by a search over the table values: Σ_s N_s^max(τ) ≥ L with
  every N_s^max(τ) ≥ the minimum per stage. The step is ≥ max_weight · τ*.
- ``greedy``: stages filled to N_s^max(τ*), blocks taken off where the marginal time is
  largest until L remain, each stage in its fastest mix: a placement with the optimal
  bottleneck, used as the CP-SAT hint and as the fallback when CP-SAT finds nothing in time.

Feasibility in the tables is tested with a relative slack of ``SLACK`` so that they never
exclude a float-feasible mix (they serve as lower bounds); the greedy placement is checked
exactly with ``StageCosts.stage_memory_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Callable

import numpy as np

from cost_models import StageCosts
from cost_models.strategy import RECOMPUTE

SLACK = 1e-9
"""Relative memory slack of the tables (a relaxation: bounds stay valid)."""


SCAN = 64
"""Most slowest-stage times ``single_mode_least_step`` tries."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class StageTables:
    """Per stage: least block time per N (inf where nothing fits) and the mix attaining it."""

    time: tuple[np.ndarray, ...]
    """time[s][N]: g_s(N) made non-decreasing from the right (a valid lower envelope)."""
    mix: tuple[np.ndarray, ...]
    """mix[s][N]: counts per mode in ``RECOMPUTE`` order attaining the raw g_s(N)."""
    fixed: tuple[float, ...]
    """T_s of the empty stage (first/last pieces and p2p)."""


def _two_modes(total: np.ndarray, room: np.ndarray, a: int, b: int, c: StageCosts,
               per: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Fastest split of ``total`` blocks over modes a, b within ``room`` bytes, per stage
    (axis 0; ``per[u, r]``: block bytes): (time, blocks in the faster mode, faster mode per
    stage, other mode per stage)."""
    t = np.asarray(c.mode_time_s, dtype=float)
    swap = (t[a] > t[b]) | ((t[a] == t[b]) & (per[:, a] > per[:, b]))
    fast, slow = np.where(swap, b, a), np.where(swap, a, b)
    rows = np.arange(len(per))
    pa, pb = per[rows, fast][:, None, None], per[rows, slow][:, None, None]
    ta, tb = t[fast][:, None, None], t[slow][:, None, None]
    tol = SLACK * np.abs(room) + 1.0
    lighter = pa <= pb  # the faster mode is no heavier: every block in it, if they all fit
    with np.errstate(divide="ignore", invalid="ignore"):
        n_b = np.floor((room + tol - total * pb) / (pa - pb))
    n_a = np.where(lighter, total.astype(float), np.clip(n_b, 0, total))
    ok = np.where(lighter, total * pa <= room + tol, n_b >= 0)
    time = n_a * ta + (total - n_a) * tb
    return np.where(ok, time, np.inf), n_a.astype(np.int64), fast, slow


def _raw_tables(c: StageCosts, stages: list[int], modes: tuple[int, ...], cap: float,
                uppers: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(g_s(N), argmin mix) for N = 0 … upper, for each of ``stages`` at once (raw, not yet
    made monotone): every stage's arrays in one pass of numpy calls per mode subset."""
    per = np.array([[c.block_bytes(s, r) for r in range(len(RECOMPUTE))] for s in stages],
                   dtype=float)
    base = np.array([cap - c.stage_fixed_bytes(s) for s in stages], dtype=float)
    size = max(max(uppers), 0) + 1
    u, n = np.arange(len(stages)), np.arange(size)
    best = np.full((len(stages), size), np.inf)
    mix = np.zeros((len(stages), size, len(RECOMPUTE)), dtype=np.int64)
    best[base >= 0, 0] = 0.0  # an empty stage uses no recompute workspace
    for width in (1, 2, 3):
        for subset in combinations(modes, width):
            room = base - max(c.mode_workspace_bytes[r] for r in subset)
            skip = room < -SLACK * np.abs(base)
            if skip.all():
                continue
            counts = np.zeros((len(stages), size, len(RECOMPUTE)), dtype=np.int64)
            if width == 1:
                r = subset[0]
                room1 = room[:, None]
                ok = n * per[:, r:r + 1] <= room1 + SLACK * np.abs(room1) + 1.0
                time = np.where(ok, n * c.mode_time_s[r], np.inf)
                counts[:, :, r] = n
            else:
                z, (a, b) = (subset[2], subset[:2]) if width == 3 else (None, subset)
                # axes: stage, N, blocks in mode z (0 when two modes)
                nz = np.arange(size)[None, None, :] if z is not None else np.zeros((1, 1, 1), np.int64)
                rest = n[None, :, None] - nz
                left = room[:, None, None] - (nz * per[:, z][:, None, None] if z is not None else 0.0)
                total = np.maximum(rest, 0)
                t2, n_a, fa, fb = _two_modes(total, np.broadcast_to(left, (len(stages),) + rest.shape[1:]),
                                             a, b, c, per)
                t2 = np.where(rest >= 0, t2 + (nz * c.mode_time_s[z] if z is not None else 0.0),
                              np.inf)
                j = np.argmin(t2, axis=2)[:, :, None]
                time = np.take_along_axis(t2, j, axis=2)[:, :, 0]
                in_a = np.take_along_axis(n_a, j, axis=2)[:, :, 0]
                counts[u[:, None], n[None, :], fa[:, None]] = in_a
                counts[u[:, None], n[None, :], fb[:, None]] = \
                    np.take_along_axis(np.broadcast_to(total, t2.shape), j, axis=2)[:, :, 0] - in_a
                if z is not None:
                    counts[:, :, z] = j[:, :, 0]
            time = np.where(skip[:, None], np.inf, time)
            better = time < best
            best = np.where(better, time, best)
            mix[better] = counts[better]
    return [(best[i, :max(up, 0) + 1], mix[i, :max(up, 0) + 1]) for i, up in enumerate(uppers)]


def stage_table(c: StageCosts, s: int, modes: tuple[int, ...], cap: float,
                upper: int) -> tuple[np.ndarray, np.ndarray]:
    """(g_s(N), argmin mix) for N = 0 … upper (raw, not yet made monotone)."""
    return _raw_tables(c, [s], modes, cap, [upper])[0]


def stage_tables(c: StageCosts, modes: tuple[int, ...], cap: float,
                 upper: list[int]) -> StageTables:
    # stages alike in memory (in-flight micro-batches, fixed bytes, bound) share a table
    keys = [(c.memory_key(s), upper[s]) for s in range(c.pp)]
    first: dict[tuple, int] = {}  # each key's first stage
    for s, k in enumerate(keys):
        first.setdefault(k, s)
    reps = list(first.values())
    raw = dict(zip(reps, _raw_tables(c, reps, modes, cap, [upper[s] for s in reps])))
    built = {k: (np.minimum.accumulate(raw[s][0][::-1])[::-1], raw[s][1]) for k, s in first.items()}
    return StageTables(time=tuple(built[k][0] for k in keys), mix=tuple(built[k][1] for k in keys),
                       fixed=tuple(c.stage_time_s(s, 0) for s in range(c.pp)))


def stage_caps(t: StageTables, tau: float) -> list[int]:
    """N_s^max(τ): the most blocks stage s runs within τ (-1 if not even none)."""
    return [int(np.searchsorted(g + f, tau, side="right")) - 1 for g, f in zip(t.time, t.fixed)]


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """The distinct values, ascending (``np.unique`` without the ``numpy.ma`` import its
    first call costs a fresh ``autopar plan`` process, 10 ms)."""
    v = np.sort(values, axis=None)
    return v[np.concatenate(([True], v[1:] != v[:-1]))] if v.size else v


def least_feasible(values: np.ndarray, ok: Callable[[float], bool]) -> float:
    """The smallest of the sorted ``values`` where the monotone ``ok`` holds (binary
    search); inf when it holds at none."""
    if values.size == 0 or not ok(values[-1]):
        return float("inf")
    lo, hi = 0, values.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(values[mid]):
            hi = mid
        else:
            lo = mid + 1
    return float(values[lo])


def bottleneck(t: StageTables, layers: int, min_layers: int) -> float:
    """τ*: the least max_s T_s over placements (inf when none exists)."""
    size = max(len(g) for g in t.time)
    stacked = np.full((len(t.time), size), np.inf)  # T_s per N, padded with inf
    for s, (g, f) in enumerate(zip(t.time, t.fixed)):
        stacked[s, :len(g)] = g + f
    values = sorted_unique(stacked[np.isfinite(stacked)])

    def ok(tau: float) -> bool:
        # N_s^max(τ) = (entries ≤ τ) - 1: each row is non-decreasing, as in ``stage_caps``
        caps = (stacked <= tau).sum(axis=1) - 1
        return bool(caps.min() >= min_layers and caps.sum() >= layers)
    return least_feasible(values, ok)


def greedy(c: StageCosts, t: StageTables, layers: int, min_layers: int, cap: float,
           tau: float) -> tuple[tuple[int, ...], ...] | None:
    """A placement with max_s T_s = τ (the stages' fastest mixes), or None if the raw
    mixes do not fit exactly (float boundary) or τ admits none."""
    if not np.isfinite(tau):
        return None
    sizes = stage_caps(t, tau)
    excess = sum(sizes) - layers
    while excess > 0:  # take a block off where it saves the most time (first stage on ties)
        gains = [(t.time[s][n] - t.time[s][n - 1] if n > min_layers else -1.0, -s)
                 for s, n in enumerate(sizes)]
        gain, neg_s = max(gains)
        if gain < 0:
            return None
        sizes[-neg_s] -= 1
        excess -= 1
    loads = tuple(tuple(int(x) for x in t.mix[s][n]) for s, n in enumerate(sizes))
    if any(sum(ld) != n for ld, n in zip(loads, sizes)):
        return None
    if any(c.stage_memory_bytes(s, ld) > cap for s, ld in enumerate(loads)):
        return None
    return loads


def least_total(t: StageTables, layers: int, min_layers: int) -> float:
    """min Σ_s T_s over block counts N_s ≥ ``min_layers`` summing to L (each stage at its
    table time g_s(N_s) + fixed_s): a min-plus convolution of the tables, exact for Σ T_s."""
    cur = np.full(layers + 1, np.inf)
    cur[0] = 0.0
    j = np.arange(layers + 1)[:, None]
    for g, f in zip(t.time, t.fixed):
        top = min(len(g) - 1, layers)
        if top < min_layers:
            return float("inf")
        k = np.arange(min_layers, top + 1)[None, :]  # blocks on this stage
        prev = j - k  # blocks on the stages before it
        # nxt[n] = min_k cur[n - k] + g[k] + f: the same sums as pair by pair, so the same floats
        cur = np.where(prev >= 0, cur[np.maximum(prev, 0)] + (g[min_layers:top + 1] + f)[None, :],
                       np.inf).min(axis=1)
    return float(cur[layers])


def single_mode_least_step(c: StageCosts, t: StageTables, layers: int, min_layers: int,
                           mode: int, tau: float) -> float:
    """The least ``step_time_s`` over placements with every block in ``mode`` (``t`` built for
    that mode alone), within the tables' memory rows: exact up to their ``SLACK``, so a valid
    lower bound (an infeasible candidate gives inf).

    With one mode Σ_s T_s = L t + Σ_s fixed_s whatever the placement, and T_s, D_s grow with
    the stage's block count, so the step is a constant plus max_weight · max T_s + max D_s.
    For each possible slowest stage time τ ≥ τ* (the table values, ascending) the least max D_s
    is a bottleneck search like ``bottleneck``'s, each stage holding at most min(N_s^max(τ),
    the most blocks within δ); the scan stops once max_weight · τ plus the least max D_s of
    any placement cannot beat the best pair found (or after ``SCAN`` values, with that as
    the bound for the rest: then only a lower bound)."""
    pp = len(t.time)
    size = max(len(g) for g in t.time)
    times = np.full((pp, size), np.inf)
    for s, (g, f) in enumerate(zip(t.time, t.fixed)):
        times[s, :len(g)] = g + f
    n = np.arange(size)
    first = np.zeros((pp, 1))
    last = np.zeros((pp, 1))
    first[0, 0], last[-1, 0] = c.first_dp_time_s, c.last_dp_time_s
    tails = (n[None, :] * c.mode_dp_time_s[mode] + first) + last  # D_s per block count
    deltas = sorted_unique(tails)

    def least_tail(caps: np.ndarray) -> float:
        def ok(delta: float) -> bool:
            most = np.minimum(caps, (tails <= delta).sum(axis=1) - 1)
            return bool(most.min() >= min_layers and most.sum() >= layers)
        return least_feasible(deltas, ok)

    values = sorted_unique(times[np.isfinite(times)])
    values = values[values >= tau]
    if not np.isfinite(tau) or values.size == 0:
        return float("inf")
    floor = least_tail((times <= values[-1]).sum(axis=1) - 1)
    best = float("inf")
    for i, x in enumerate(values):
        if c.max_weight * x + floor >= best:
            break
        if i == SCAN:  # stop early: every τ from here on gives at least this (still a bound)
            best = min(best, float(c.max_weight * x) + floor)
            break
        best = min(best, float(c.max_weight * x) + least_tail((times <= x).sum(axis=1) - 1))
    total = layers * c.mode_time_s[mode] + sum(t.fixed)
    return float(c.sum_weight * total + best)
