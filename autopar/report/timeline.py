"""The pipeline schedule as events: a small simulator of the schedules the cost model prices.

The cost model prices a step as ``sum_weight * Σ_s T_s + max_weight * max_s T_s + max_s D_s``
(``cost_models.stages``) and keeps no event list, so this module builds one from the same
per-stage times (``cost_models.estimate.stage_details``): pipeline rank r runs, per
micro-batch, a forward of ``F_r`` seconds, a recompute ``R_r``, a backward ``B_r`` and the
sends ``P_r`` (half after the forward, half after the backward, on the rank's own time as the
cost model counts them), ``F_r + R_r + B_r + P_r = T_r``. Each rank executes a fixed order of
operations (below); an operation starts when the rank is free and its inputs exist:

- forward of micro-batch j on virtual stage k needs the forward of j on stage k - 1 (its send
  included);
- backward of j on stage k needs its own forward and the backward of j on stage k + 1;
  recompute runs first inside it;
- weight gradient (zero-bubble only) of j on stage k needs the backward of j on stage k.

Orders, p ranks, m micro-batches: gpipe, every forward then every backward; 1f1b, p - r - 1
warm-up forwards, then forward/backward pairs, then the remaining backwards (Narayanan et al.
2021); interleaved with v chunks (Megatron's order; each chunk takes ``T_r / v`` as the cost
model prices it, not its own block count): 2(p - r - 1) + (v - 1) p warm-up chunk forwards,
then pairs, micro-batches taken p at a time through chunk 0, 1, … (backwards through the
chunks in reverse); zero-bubble (ZB-H1, Qi et al. 2023): the 1f1b order with the backward
halved into input gradients B and weight gradients W as the cost model prices it (B = W = half
the backward), rank r deferring its W by r micro-batches so they fill the drain.

After the flush every rank runs its once-per-step tail D_r (exposed gradient reduction, then the
optimizer step); the step ends with the slowest tail: the optimizer waits for the flush
(gradient clipping's global norm spans every stage), which is the cost model's ``max_s D_s``.
Times in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.estimate import StageDetail

SEGMENT_KINDS = ("forward", "recompute", "backward", "weight", "p2p", "dp", "optimizer")
"""What a drawn segment is: passes, sends, and the once-per-step tail (exposed gradient
reduction, optimizer step)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StageWork:
    """One pipeline rank's work, seconds: per micro-batch over all its chunks, and per step."""

    forward_s: float
    recompute_s: float
    backward_s: float
    """Input-gradient backward (the whole backward unless the schedule splits off ``weight_s``)."""
    weight_s: float = 0.0
    """Weight-gradient pass split off the backward (zero-bubble), run later."""
    p2p_s: float = 0.0
    """Pipeline sends per micro-batch, both directions, all chunks."""
    dp_s: float = 0.0
    """Exposed once-per-step gradient reduction."""
    optimizer_s: float = 0.0

    @property
    def micro_s(self) -> float:
        """T_r: one micro-batch through this rank."""
        return self.forward_s + self.recompute_s + self.backward_s + self.weight_s + self.p2p_s

    @property
    def tail_s(self) -> float:
        """D_r."""
        return self.dp_s + self.optimizer_s


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """One drawn interval on one pipeline rank."""

    rank: int
    kind: str
    """One of ``SEGMENT_KINDS``."""
    micro: int
    """Micro-batch, -1 for the once-per-step tail."""
    chunk: int
    """Model chunk on this rank (interleaved), 0 otherwise."""
    start_s: float
    end_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    """A simulated step."""

    schedule: str
    pp: int
    num_microbatches: int
    chunks: int
    segments: tuple[Segment, ...]
    flush_s: float
    """When the last backward (or weight-gradient pass) ends on any rank."""
    step_s: float
    """flush + the slowest rank's tail."""

    def idle_s(self, rank: int) -> float:
        """Seconds rank ``rank`` waits before the flush (its share of the bubble)."""
        busy = sum(g.end_s - g.start_s for g in self.segments
                   if g.rank == rank and g.micro >= 0)
        return self.flush_s - busy


@dataclass(frozen=True, slots=True)
class _Op:
    kind: str
    """F, B or W."""
    micro: int
    chunk: int


def rank_order(schedule: str, rank: int, pp: int, m: int, v: int = 1) -> list[_Op]:
    """The order in which pipeline rank ``rank`` runs its operations (see the module)."""
    if schedule not in ("gpipe", "1f1b", "interleaved", "zero-bubble"):
        raise ValueError(f"unknown schedule {schedule!r}")
    if pp == 1:
        return [op for j in range(m) for op in (_Op("F", j, 0), _Op("B", j, 0))]
    if schedule == "gpipe":
        return [_Op("F", j, 0) for j in range(m)] + [_Op("B", j, 0) for j in range(m)]
    if schedule == "interleaved" and v > 1:
        return _interleaved(rank, pp, m, v)
    warm = min(pp - rank - 1, m)
    order = [_Op("F", j, 0) for j in range(warm)]
    split = schedule == "zero-bubble"
    for i in range(m):
        if warm + i < m:
            order.append(_Op("F", warm + i, 0))
        order.append(_Op("B", i, 0))
        if split and i >= rank:
            order.append(_Op("W", i - rank, 0))
    if split:
        order += [_Op("W", j, 0) for j in range(max(0, m - rank), m)]
    return order


def _interleaved(rank: int, pp: int, m: int, v: int) -> list[_Op]:
    """Megatron's interleaved 1F1B order for ``rank`` (m a multiple of pp)."""
    total = m * v

    def op(kind: str, k: int) -> _Op:
        chunk = (k % (pp * v)) // pp
        return _Op(kind, (k // (pp * v)) * pp + k % pp, chunk if kind == "F" else v - 1 - chunk)

    warm = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    order = [op("F", k) for k in range(warm)]
    for i in range(total - warm):
        order += [op("F", warm + i), op("B", i)]
    return order + [op("B", k) for k in range(total - warm, total)]


def simulate(work: tuple[StageWork, ...], schedule: str, num_microbatches: int,
             chunks: int = 1) -> Timeline:
    """Run every rank's order (``rank_order``) under the dependencies of the module docstring."""
    pp, m, v = len(work), num_microbatches, chunks
    if schedule == "interleaved" and v > 1 and m % pp:
        raise ValueError(f"the interleaved schedule needs micro-batches ({m}) a multiple of pp ({pp})")
    stages = pp * v
    orders = [rank_order(schedule, r, pp, m, v) for r in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro, virtual stage) -> end time
    free = [0.0] * pp
    at = [0] * pp
    segments: list[Segment] = []
    left = sum(map(len, orders))
    while left:
        progressed = False
        for r in range(pp):
            w = work[r]
            while at[r] < len(orders[r]):
                op = orders[r][at[r]]
                k = op.chunk * pp + r
                if op.kind == "F":
                    deps = [("F", op.micro, k - 1)] if k > 0 else []
                elif op.kind == "B":
                    deps = [("F", op.micro, k)] + ([("B", op.micro, k + 1)] if k < stages - 1 else [])
                else:
                    deps = [("B", op.micro, k)]
                if any(d not in done for d in deps):
                    break
                t = max([free[r]] + [done[d] for d in deps])
                parts: tuple[tuple[str, float], ...]
                if op.kind == "F":
                    parts = (("forward", w.forward_s), ("p2p", w.p2p_s / 2))
                elif op.kind == "B":
                    parts = (("recompute", w.recompute_s), ("backward", w.backward_s), ("p2p", w.p2p_s / 2))
                else:
                    parts = (("weight", w.weight_s),)
                for kind, dur in parts:
                    if dur > 0:
                        segments.append(Segment(rank=r, kind=kind, micro=op.micro, chunk=op.chunk,
                                                start_s=t, end_s=t + dur / v))
                    t += dur / v
                done[(op.kind, op.micro, k)] = free[r] = t
                at[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} order deadlocks (pp={pp}, m={m}, v={v})")
    flush = max(free)
    for r, w in enumerate(work):
        t = flush
        for kind, dur in (("dp", w.dp_s), ("optimizer", w.optimizer_s)):
            if dur > 0:
                segments.append(Segment(rank=r, kind=kind, micro=-1, chunk=0, start_s=t, end_s=t + dur))
            t += dur
    return Timeline(schedule=schedule, pp=pp, num_microbatches=m, chunks=v, segments=tuple(segments),
                    flush_s=flush, step_s=flush + max(w.tail_s for w in work))


def stage_work(details: tuple[StageDetail, ...], schedule: str) -> tuple[StageWork, ...]:
    """Each rank's ``StageWork`` from the cost model's ``stage_details``; zero-bubble halves the
    backward into B and W, as ``cost_models.pipeline`` prices it."""
    out = []
    for d in details:
        weight = d.backward_s / 2 if schedule == "zero-bubble" else 0.0
        out.append(StageWork(forward_s=d.forward_s, recompute_s=d.recompute_s,
                             backward_s=d.backward_s - weight, weight_s=weight, p2p_s=d.p2p_s,
                             dp_s=d.dp_tail_s, optimizer_s=d.optimizer_s))
    return tuple(out)
