"""The outer strategy space: every (dp, tp, pp, micro-batch, ZeRO, schedule, v, SP) the runtime
can run, with the recompute modes the inner placement may mix (see ``autopar.solve``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from autopar.plan import runtime_unsupported
from cost_models import HardwareProfile, ModelProfile, Strategy
from cost_models.strategy import RECOMPUTE


@dataclass(frozen=True, kw_only=True, slots=True)
class Pins:
    """Strategy dimensions fixed by the user; ``None`` means searched."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    zero: int | None = None
    micro_batch: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    """Model chunks per pipeline rank (interleaved schedule)."""
    sequence_parallel: bool | None = None
    recompute: str | None = None
    """One recompute mode for every block; unpinned, the solver picks a mode per block."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One outer strategy and what its inner placement may choose."""

    strategy: Strategy
    """Everything but the placement (``stage_layers``/``stage_recompute`` empty)."""
    modes: tuple[int, ...]
    """Indices in ``RECOMPUTE`` of the modes blocks may use."""
    min_layers: int
    """Fewest blocks per stage (v under the interleaved schedule: one per chunk)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(pinned, default: list) -> list:
    return default if pinned is None else [pinned]


def _schedules(pins: Pins, pp: int, m: int, layers: int) -> Iterator[tuple[str, int]]:
    """(schedule, virtual stages): gpipe, 1f1b, interleaved with 2 ≤ v ≤ layers/pp
    (Megatron: m a multiple of pp), zero-bubble (ZB-H1, v = 1)."""
    if pp == 1:
        options = [("1f1b", 1)]
    else:
        options = [("1f1b", 1), ("gpipe", 1)]
        if m % pp == 0:
            options += [("interleaved", v) for v in range(2, layers // pp + 1)]
        options.append(("zero-bubble", 1))
    for sched, v in options:
        if pins.schedule is not None and sched != pins.schedule:
            continue
        if pins.virtual_stages is not None and v != pins.virtual_stages:
            continue
        yield sched, v


def _mode_sets(pins: Pins, schedule: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(nominal mode, modes the blocks may mix). Zero-bubble's fill fraction depends on the
    recompute mode (``cost_models.pipeline``), so it is planned with one mode on every block."""
    if pins.recompute is not None:
        yield pins.recompute, (RECOMPUTE.index(pins.recompute),)
    elif schedule == "zero-bubble":
        for i, mode in enumerate(RECOMPUTE):
            yield mode, (i,)
    else:
        yield "none", tuple(range(len(RECOMPUTE)))


def outer_candidates(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int,
                     dtype: str, pins: Pins = Pins()) -> Iterator[Candidate]:
    """Every outer candidate the runtime can run, in a fixed order."""
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
                    for sched, v in _schedules(pins, pp, m, model.layers):
                        if runtime_unsupported(dp=dp, pp=pp, zero=zero, schedule=sched,
                                               virtual_stages=v):
                            continue
                        for sp in _choices(pins.sequence_parallel, [False, True] if tp > 1 else [False]):
                            if sp and tp == 1:
                                continue  # SP splits what TP replicates: nothing at tp = 1
                            for nominal, modes in _mode_sets(pins, sched):
                                strat = Strategy(dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=b,
                                                 num_microbatches=m, schedule=sched,
                                                 virtual_stages=v, sequence_parallel=sp,
                                                 recompute=nominal, dtype=dtype)
                                yield Candidate(strategy=strat, modes=modes, min_layers=v)


def candidates(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int,
               dtype: str, pins: Pins = Pins()) -> Iterator[Strategy]:
    """The outer strategies of ``outer_candidates`` (placement left empty)."""
    for cand in outer_candidates(model, hw, gpus, global_batch, dtype, pins):
        yield cand.strategy
