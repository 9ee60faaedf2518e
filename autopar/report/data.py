"""What the report shows, computed without matplotlib: the plan re-priced by the cost model, its
schedule simulated (``timeline``), each rank's memory, the step by kind (exposed and
overlapped communication), the search's best alternatives, and measured step times.

Seconds and bytes throughout.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from autopar.errors import UserError
from autopar.plan import Plan
from autopar.report.timeline import Timeline, simulate, stage_work
from autopar.solve import Pins, describe, search
from cost_models import HardwareProfile, ModelProfile, Strategy, estimate
from cost_models.estimate import StageDetail, stage_details
from cost_models.pipeline import chunks
from cost_models.recipe import DpOverlap
from cost_models.strategy import Estimate


@dataclass(frozen=True, kw_only=True, slots=True)
class CommKind:
    """One kind of communication on the critical path of a step."""

    name: str
    exposed_s: float
    """On the critical path (the cost model's time breakdown; includes the profile's
    ``overlap_penalty`` share of what overlaps)."""
    overlapped_s: float
    """Hidden behind compute: the same collectives priced with nothing overlapped, less
    ``exposed_s``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Alternative:
    """One of the search's best strategies, re-estimated for its memory."""

    rank: int
    """1 = best."""
    summary: str
    step_time_s: float
    peak_bytes: float
    tokens_per_s: float
    mfu: float
    fits: bool
    is_plan: bool
    """The strategy the plan records."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Measured:
    """Step times of ``autopar run --json`` (its file)."""

    step_times_s: tuple[float, ...]
    losses: tuple[float, ...]

    @property
    def typical_s(self) -> float:
        """Median step time without the first (warm-up) step when there are at least two."""
        steps = self.step_times_s[1:] if len(self.step_times_s) > 1 else self.step_times_s
        return statistics.median(steps)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportData:
    plan: Plan
    hw: HardwareProfile
    strategy: Strategy
    estimate: Estimate
    details: tuple[StageDetail, ...]
    """Per pipeline rank, first to last."""
    timeline: Timeline
    comm: tuple[CommKind, ...]
    alternatives: tuple[Alternative, ...]
    measured: Measured | None
    search_note: str
    """How the alternatives were found (or why there are none)."""

    @property
    def summary(self) -> str:
        return summary(self.strategy)


def summary(s: Strategy) -> str:
    """``solve.describe`` plus offload (which it leaves out)."""
    return describe(s) + (" offload" if s.offload else "")


def read_measured(path: Path) -> Measured:
    """The JSON ``autopar run --json`` prints; a bad file is one ``UserError`` line."""
    if not path.is_file():
        raise UserError(f"--measured {path} does not exist; write it with `autopar run PLAN --json > {path}`")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"--measured {path} is not valid JSON: {exc}") from None
    times = data.get("step_times_s") if isinstance(data, dict) else None
    if not isinstance(times, list) or not times or not all(
            isinstance(t, (int, float)) and t > 0 and math.isfinite(t) for t in times):
        raise UserError(f"--measured {path} needs a non-empty list of positive step_times_s "
                        "(the output of `autopar run PLAN --json`)")
    losses = data.get("losses") or []
    return Measured(step_times_s=tuple(float(t) for t in times),
                    losses=tuple(float(x) for x in losses if isinstance(x, (int, float))))


def _no_overlap(strat: Strategy) -> Strategy:
    """``strat`` under its recipe with every overlap switched off."""
    return replace(strat, recipe=replace(strat.recipe, dp_overlap=DpOverlap.NEVER, tp_overlap=False,
                                         tp_comm_overlap=False))


def comm_kinds(model: ModelProfile, hw: HardwareProfile, strat: Strategy, est: Estimate,
               details: tuple[StageDetail, ...]) -> tuple[CommKind, ...]:
    """Tensor-parallel, data-parallel and pipeline communication of the step, exposed and
    overlapped, on the stages ``estimate`` reads (the slowest per micro-batch, the longest
    tail)."""
    m = strat.num_microbatches
    st = max(range(len(details)), key=lambda s: details[s].forward_s + details[s].recompute_s
             + details[s].backward_s + details[s].p2p_s)
    sd = max(range(len(details)), key=lambda s: details[s].dp_tail_s + details[s].optimizer_s)
    raw = stage_details(model, hw, _no_overlap(strat))
    raw_tp = m * raw[st].tp_comm_s
    raw_dp = m * raw[st].dp_comm_s + raw[sd].dp_tail_s
    t = est.time
    return (CommKind(name="tensor parallel", exposed_s=t.tp_comm_s, overlapped_s=max(0.0, raw_tp - t.tp_comm_s)),
            CommKind(name="data parallel / ZeRO", exposed_s=t.dp_comm_s,
                     overlapped_s=max(0.0, raw_dp - t.dp_comm_s)),
            CommKind(name="pipeline p2p", exposed_s=t.pp_comm_s, overlapped_s=0.0))


def alternatives(model: ModelProfile, hw: HardwareProfile, plan: Plan, strat: Strategy, top_k: int,
                 time_limit_s: float) -> tuple[tuple[Alternative, ...], str]:
    """The ``top_k`` best strategies the search proves under the plan's recipe and refusals,
    each re-estimated; the plan's own strategy is marked (and added when it is not among them,
    e.g. a pinned plan)."""
    refused = tuple(check for check, reason in plan.verified if reason)
    try:
        sol = search(model, hw, plan.gpus, plan.global_batch, plan.dtype,
                     Pins(recipe=strat.recipe, refused=refused), time_limit_s, keep=top_k)
    except UserError as exc:
        return (), f"no alternatives: {exc}"
    own = summary(strat)
    out, seen = [], False
    for i, alt in enumerate(sol.alternatives, 1):
        est = estimate(model, hw, alt.strategy, global_batch=plan.global_batch)
        is_plan = summary(alt.strategy) == own and not seen
        seen = seen or is_plan
        out.append(Alternative(rank=i, summary=summary(alt.strategy), step_time_s=alt.step_time_s,
                               peak_bytes=est.memory.peak_bytes, tokens_per_s=est.tokens_per_s, mfu=est.mfu,
                               fits=est.fits, is_plan=is_plan))
    note = (f"the {len(out)} best strategies the search proved ({sol.candidates} candidates, "
            f"{sol.time_s:.1f} s{'' if sol.optimal else f', gap {sol.gap:.1%}'})")
    if not seen:
        est = estimate(model, hw, strat, global_batch=plan.global_batch)
        out.append(Alternative(rank=0, summary=own, step_time_s=est.step_time_s, peak_bytes=est.memory.peak_bytes,
                               tokens_per_s=est.tokens_per_s, mfu=est.mfu, fits=est.fits, is_plan=True))
        note += "; the plan (pinned or from another search) is not among them"
    return tuple(out), note


def report_data(plan: Plan, model: ModelProfile, hw: HardwareProfile, *, top_k: int = 10,
                time_limit_s: float = 30.0, measured: Measured | None = None) -> ReportData:
    """Everything the page draws, from the plan and the cost model."""
    strat = plan.strategy(lead=model.lead_layers)
    est = estimate(model, hw, strat, global_batch=plan.global_batch)
    details = stage_details(model, hw, strat)
    try:
        timeline = simulate(stage_work(details, strat.schedule), strat.schedule, strat.num_microbatches,
                            chunks(strat))
    except ValueError as exc:  # a hand-made plan the planner would not emit
        raise UserError(f"cannot draw this plan's schedule: {exc}") from None
    alts, note = alternatives(model, hw, plan, strat, top_k, time_limit_s) if top_k > 0 else ((), "not searched")
    return ReportData(plan=plan, hw=hw, strategy=strat, estimate=est, details=details, timeline=timeline,
                      comm=comm_kinds(model, hw, strat, est, details), alternatives=alts, measured=measured,
                      search_note=note)
