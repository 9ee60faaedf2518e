"""``autopar calibrate PLAN.json [PLAN.json ...]``: run plans of one cluster, see where each
step's time went, refit the cluster profile's efficiency constants to them all at once
(``refit_runs``), and write the refitted profile.

The run is profiled on every rank after warm-up (``runtime.phases``: each phase the median of
the profiled steps). On CPU ranks, where the profiled steps ran more than ``DILATION_LIMIT``
times the others (``dilation``: the machine was busy while profiling), the plan is run again,
up to ``ATTEMPTS`` runs, and the least stretched is kept. Its phases are set against the
estimate's (``TimeBreakdown``):

- **compute** (time inside GEMMs, attention, element-wise operators) against ``compute_s``;
  **optimizer** (on CPU ranks timed in the unprofiled steps) against ``optimizer_s``; what
  the step spends **outside operators** on its slowest rank (waiting for collectives, the
  pipeline bubble, Python between operators) against the rest of ``step_time_s``. Compute and
  optimizer are the slowest pipeline stage's, each the median over the stage's ranks.

The constants are refitted in the order that isolates each (every fit is one number, found
by bisection on the estimate itself, so the cost model's own formulas decide what it means):

1. ``matmul_efficiency``: scaled by the GEMM rate the ranks reached (profiler FLOPs over
   GEMM time, median over ranks) over the rate the profile predicts at the plan's shapes; a
   rate above the peak raises the plan's dtype's ``peak_tflops`` instead (efficiency 1), and
   with it every rate the profile states as a fraction of the peak (fused attention);
2. ``optimizer_memory_efficiency``: so that the predicted optimizer step equals measured (its
   host time per parameter tensor, ``optimizer_tensor_us``, comes from ``autopar profile``
   and stays: the efficiency prices the bytes the step moves);
3. ``memory_efficiency`` (element-wise throughput): so that the predicted compute equals the
   time measured inside operators (a GPU's device time; a CPU rank's operators, where their
   dispatch lands too). On CPU ranks element-wise operators are not memory-bound (GELU's tanh,
   softmax and normalisation run at a tenth of a streaming add's rate), so this fit is what
   prices them. It was once fitted to the whole step there, which made it the step's residual:
   the reference step is ~6 % element-wise, so a step's noise of a few per cent moved it 0.06
   to 0.82 over one profile's five reference runs; against the operators' time, 0.095 to
   0.153 and 0.236 to 0.356 in two profiles. The time outside operators (a GPU idle around
   the step's synchronisation, a CPU rank waiting for its peers or running Python) is the
   model's to predict, not this constant's to absorb.

Ranks that share cores (``ranks_per_core`` > 1) are the exception. A rank that waits (a
pipeline stage in the fill and the drain; a data-parallel rank the machine ran ahead of its
peers, at the all-reduce) lends its share of the cores to the others, whose operators then run
faster than the profile's every-rank-busy rates: their times cannot give those rates. After the
optimizer fit, the plan's dtype's peak is scaled instead so that the predicted step equals the
measured one. The exception to that is ``autopar profile``'s reference run (``anchor``), which
is where the profile's rates inside a step come from: a data-parallel reference is fitted to its
operators as above (nothing else gives the element-wise rate), and the profile is made with
the same fit on every machine.

The links' α and β are not refitted: they come from ``autopar profile``'s collective
benchmarks, which time them alone, while a training step's time outside operators mixes
waiting for collectives with Python and the bubble, which one run cannot tell apart.
A constant is kept within the profile's bounds (efficiencies in (0, 1]); one a phase cannot
move (the plan has no such phase, or the bound is reached) keeps its value and says so. Peak
memory is compared, not fitted (CUDA: the allocator's peak; CPU: the live state plus the most
the profiler saw allocated at once, ``runtime.phases``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path
from typing import Callable, Sequence

from autopar.errors import UserError
from autopar.plan import Plan
from cost_models import HardwareProfile, ModelProfile, estimate
from cost_models.axes import Axis
from cost_models.compute import block_gemms, elem_bytes, gemm_s
from cost_models.strategy import Estimate

LOW = 1e-3
"""Least efficiency a fit may set."""
STEP_SCALES = (0.1, 10.0)
"""The range of peak scales a step fit searches (``_fit_step``)."""
PROFILED = 3
"""Steps run under the profiler, after the timed ones (the profiler slows small operators)."""
DILATION_LIMIT = 1.2
"""Most the profiled steps may take over the unprofiled ones (median of each) on CPU ranks
before ``calibrate`` runs the plan again (``dilation``)."""
ATTEMPTS = 3
"""Runs ``calibrate`` makes at most to get profiled steps within ``DILATION_LIMIT``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Phase:
    """One phase of a step: seconds predicted before, measured, predicted after the refit."""

    name: str
    before_s: float
    measured_s: float
    after_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Fit:
    """One refitted constant: its old and new value and what set it."""

    name: str
    old: float
    new: float
    why: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """What ``calibrate`` measured and refitted."""

    phases: tuple[Phase, ...]
    fits: tuple[Fit, ...]
    profile: HardwareProfile
    """The refitted profile."""
    gemm_tflops: float
    """GEMM rate the ranks reached (median), TFLOP/s."""
    peak_predicted_bytes: float
    peak_measured_bytes: float
    """Largest over ranks."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Measured:
    """A profiled run's phases, seconds per step (``runtime.phases``)."""

    step_s: float
    compute_s: float
    optimizer_s: float
    gemm_tflops: float
    peak_bytes: float

    @property
    def comm_s(self) -> float:
        return max(0.0, self.step_s - self.compute_s - self.optimizer_s)


def stages(plan: Plan) -> tuple[int, ...]:
    """Each rank's pipeline stage (ranks ordered by the plan's ``axis_order``)."""
    stride = plan.mesh.strides(plan.axis_order)[Axis.PP]
    return tuple((r // stride) % plan.mesh.pp for r in range(plan.mesh.size))


def dilation(step_times_s: list[float], warmup: int) -> float:
    """The profiled steps' median time over the unprofiled steps' (after ``warmup``). On CPU
    ranks the operators run on the rank's thread, so their profiled times are in the profiled
    steps' time: the profiler's recording and the machine's slow moments stretch them. Most
    runs of the plan_quality grid stay within 1.2; a fifth reach 1.3-2.0 (a DDP step of 0.32 s
    took 0.54 s profiled, its operators 0.45 s: more than the step, and a refit on them priced
    the grid 20 % slow). Scaling the operators back by it is no cure: the profiler's own cost
    lands between operators, and GEMMs scaled so raised the peak 16 % above what other runs
    reached."""
    profiled = statistics.median(step_times_s[-PROFILED:])
    return profiled / statistics.median(step_times_s[warmup:-PROFILED])


def measured(step_times_s: list[float], warmup: int, ranks: tuple[dict[str, float], ...],
             stage_of: tuple[int, ...] = ()) -> Measured:
    """The run's phases: its step time (the median of the steps after ``warmup`` and before the
    ``PROFILED`` last) and every rank's profiler summary of the last steps. Compute and
    optimizer are the slowest stage's (``stage_of``: each rank's; default one stage), each the
    median over its ranks, which run the same program: their maximum would be the rank the
    machine descheduled most (4 ranks on 2 cores: 192-285 ms of one DDP step's operators).
    The optimizer step is a rank's timed steps' where it reports them (``optimizer_timed``: CPU
    ranks), else the profiled one: the profiler's time per event doubles a step of many small
    tensors."""
    if not ranks:
        raise UserError("the run returned no profile; run `autopar calibrate` again")
    rates = [r["gemm_flops"] / r["gemm"] for r in ranks if r["gemm"] > 0 and r["gemm_flops"] > 0]
    if not rates:
        raise UserError("the profiler saw no GEMM in the run; calibrate a plan of a transformer")
    groups: dict[int, list[dict[str, float]]] = {}
    for i, r in enumerate(ranks):
        rank = int(r.get("rank", i))
        groups.setdefault(stage_of[rank] if rank < len(stage_of) else 0, []).append(r)

    def slowest(phase: Callable[[dict[str, float]], float]) -> float:
        return max(statistics.median(phase(r) for r in group) for group in groups.values())
    return Measured(step_s=statistics.median(step_times_s[warmup:-PROFILED]),
                    compute_s=slowest(lambda r: r["gemm"] + r["attention"] + r["other"]),
                    optimizer_s=slowest(lambda r: r.get("optimizer_timed", r["optimizer"])),
                    gemm_tflops=statistics.median(rates) / 1e12,
                    peak_bytes=max(r["peak_bytes"] for r in ranks))


def _gemm_tflops(model: ModelProfile, hw: HardwareProfile, plan: Plan) -> float:
    """The GEMM rate ``hw`` predicts for one block's weight GEMMs of ``plan``, TFLOP/s."""
    strat = plan.strategy(lead=model.lead_layers)
    weights, _ = block_gemms(model, strat)
    return sum(g.flops for g in weights) / sum(gemm_s(g, hw, strat.dtype, elem_bytes(strat)) for g in weights) / 1e12


def _solve(value: Callable[[float], float], old: float) -> tuple[float, str]:
    """The efficiency e in [LOW, 1] with ``value(e) = 0`` (``value``: the sum over the runs of
    log(predicted / measured), falling as e rises), by bisection, and a note: where even e = 1
    predicts more, e = 1; where even e = ``LOW`` predicts less, the phase is not this
    constant's to explain: ``old`` is kept."""
    if value(1.0) >= 0.0:
        return 1.0, "" if value(1.0) == 0.0 else " (predicted slower even at 1: set to 1)"
    if value(LOW) <= 0.0:
        return old, f" (predicted faster even at {LOW:g}: kept)"
    lo, hi = LOW, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if value(mid) > 0.0 else (lo, mid)
    return (lo + hi) / 2, ""


def _log_error(pairs: list[tuple[float, float]]) -> float:
    """Sum of log(predicted / measured) over (predicted, measured) pairs."""
    return sum(math.log(p / m) for p, m in pairs)


def _ms(values: list[float]) -> str:
    return ", ".join(f"{v * 1e3:.4g}" for v in values) + " ms" + (f" ({len(values)} runs)" if len(values) > 1 else "")


Run = tuple[Plan, ModelProfile, Measured]
"""A measured run: the plan, its model's profile and its phases."""


def refit(plan: Plan, model: ModelProfile, hw: HardwareProfile, run: Measured,
          anchor: bool = False) -> tuple[HardwareProfile, tuple[Fit, ...]]:
    """``refit_runs`` of one run."""
    return refit_runs(((plan, model, run),), hw, anchor)


def refit_runs(runs: Sequence[Run], hw: HardwareProfile,
               anchor: bool = False) -> tuple[HardwareProfile, tuple[Fit, ...]]:
    """``hw`` with its constants refitted to ``runs`` (module docstring), and the fits. Each
    constant is one number for every run: the GEMM rate scaled by the geometric mean of the
    runs' measured over predicted rates, the others where the sum over the runs of
    log(predicted / measured) of their phase is 0, so that no one run's luck (a plan the
    machine happened to run fast) sets the profile alone. ``anchor``: one run, ``autopar
    profile``'s reference, whose operators give the rates even on shared cores, where they can
    (no pipeline)."""
    if not runs:
        raise ValueError("refit_runs needs at least one run")

    def est(profile: HardwareProfile, run: Run) -> Estimate:
        return estimate(run[1], profile, run[0].strategy(lead=run[1].lead_layers), global_batch=run[0].global_batch)

    dtypes = {plan.dtype for plan, _, _ in runs}
    if len(dtypes) > 1:
        raise UserError(f"the plans train in {', '.join(sorted(dtypes))}: calibrate plans of one dtype together")
    dtype = runs[0][0].dtype
    fits, orig = [], hw
    # Ranks that share cores: one waiting (a pipeline stage in the fill, the drain or for a
    # peer's activations; a data-parallel rank ahead of its peers, at the all-reduce) lends
    # its share of the core to the others, whose operators then run up to ``ranks_per_core``
    # times faster than the profile's rates with every rank busy: their times cannot give those
    # rates (a deep-narrow GPT at pp 4 ran its GEMMs at 1.33x the profile's, and a peak raised
    # by that priced the other plans 30 % fast; a long-sequence GPT's DDP step of 0.32 s spent
    # 0.21 s in operators on its median rank, and an element-wise rate fitted to that priced
    # the grid 20-30 % fast). The peak is scaled to the step instead (``_fit_step``).
    shared = hw.ranks_per_core > 1 and (any(plan.mesh.pp > 1 for plan, _, _ in runs) or not anchor)
    if not shared:
        rates = [(run.gemm_tflops, _gemm_tflops(model, hw, plan)) for plan, model, run in runs]
        ratio = math.exp(statistics.mean(math.log(m / p) for m, p in rates))  # geometric mean of measured / predicted
        new = max(LOW, hw.matmul_efficiency * ratio)
        why = (f"GEMMs ran at {', '.join(f'{m * 1e3:.3g}' for m, _ in rates)} GFLOP/s, {ratio:.3g}x the rate "
               "predicted" + (" (geometric mean)" if len(rates) > 1 else ""))
        if new > 1.0:
            # Faster than the profile's peak: the peak was measured low (on CPU ranks, with every
            # rank computing at once, where a step leaves some waiting), so the peak rises instead.
            old_peak = hw.peak_tflops[dtype]
            fits.append(Fit(name=f"peak_tflops.{dtype}", old=old_peak, new=old_peak * new,
                            why=f"{why}, above the peak"))
            hw = replace(hw, peak_tflops={**hw.peak_tflops, dtype: old_peak * new})
            new = 1.0
        fits.append(Fit(name="matmul_efficiency", old=hw.matmul_efficiency, new=new, why=why))
        hw = replace(hw, matmul_efficiency=new)

    def fitted(name: str, old: float, make: Callable[[float], HardwareProfile],
               value: Callable[[Estimate], float], target: Callable[[Measured], float],
               phase: str) -> HardwareProfile:
        # the runs with the phase, measured and predicted (a run with neither has nothing to say)
        having = [r for r in runs if target(r[2]) > 0.0 or value(est(make(old), r)) > 0.0]
        if not having:
            fits.append(Fit(name=name, old=old, new=old, why=f"the plan has no {phase}"))
            return make(old)
        movable = [r for r in having if value(est(make(old), r)) > 0.0]  # priced: the constant moves it
        if not movable:
            e, note = old, f" (predicted faster even at {LOW:g}: kept)"
        elif any(target(r[2]) <= 0.0 for r in movable):  # predicted, but not measured at all
            e, note = 1.0, " (predicted slower even at 1: set to 1)"
        else:
            e, note = _solve(lambda x: _log_error([(value(est(make(x), r)), target(r[2])) for r in movable]), old)
        fits.append(Fit(name=name, old=old, new=e,
                        why=f"{phase} measured {_ms([target(r[2]) for r in having])}{note}"))
        return make(e)

    base = hw
    hw = fitted("optimizer_memory_efficiency", orig.optimizer_memory_efficiency or orig.memory_efficiency,
                lambda e: replace(base, optimizer_memory_efficiency=e), lambda x: x.time.optimizer_s,
                lambda m: m.optimizer_s, "optimizer step")
    if shared:
        fits.append(_fit_step(runs, hw, dtype, est))
        return replace(hw, peak_tflops={**hw.peak_tflops, dtype: fits[-1].new}), tuple(fits)
    base = hw
    hw = fitted("memory_efficiency", hw.memory_efficiency, lambda e: replace(base, memory_efficiency=e),
                lambda x: x.time.compute_s, lambda m: m.compute_s,
                "compute (device time)" if hw.host_overlaps_device else "compute (time in operators)")
    return hw, tuple(fits)


def _fit_step(runs: Sequence[Run], hw: HardwareProfile, dtype: str,
              est: Callable[[HardwareProfile, Run], Estimate]) -> Fit:
    """The runs' dtype's peak (and with it every rate the profile states as a fraction of it)
    scaled so that the predicted steps meet the measured ones (the sum over the runs of
    log(predicted / measured) is 0; one run: its step exactly), by bisection on the scale
    within ``STEP_SCALES``; beyond them the peak is kept and the fit says so."""
    peak = hw.peak_tflops[dtype]

    def error(scale: float) -> float:
        profile = replace(hw, peak_tflops={**hw.peak_tflops, dtype: peak * scale})
        return _log_error([(est(profile, r).step_time_s, r[2].step_s) for r in runs])
    lo, hi = STEP_SCALES
    measured_ms = _ms([r[2].step_s for r in runs])
    if not error(hi) <= 0.0 <= error(lo):
        return Fit(name=f"peak_tflops.{dtype}", old=peak, new=peak,
                   why=f"step measured {measured_ms}, beyond {lo:g}-{hi:g}x the peak's: kept")
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if error(mid) > 0.0 else (lo, mid)
    return Fit(name=f"peak_tflops.{dtype}", old=peak, new=peak * math.sqrt(lo * hi),
               why=f"step measured {measured_ms} (ranks sharing cores: its operators' rates are not "
                   "the profile's)")


def phases(before: Estimate, run: Measured, after: Estimate) -> tuple[Phase, ...]:
    def rest(e: Estimate) -> float:
        return e.step_time_s - e.time.compute_s - e.time.optimizer_s
    return (Phase(name="compute", before_s=before.time.compute_s, measured_s=run.compute_s,
                  after_s=after.time.compute_s),
            Phase(name="optimizer", before_s=before.time.optimizer_s, measured_s=run.optimizer_s,
                  after_s=after.time.optimizer_s),
            Phase(name="outside operators: comm, bubble, host", before_s=rest(before), measured_s=run.comm_s,
                  after_s=rest(after)),
            Phase(name="step", before_s=before.step_time_s, measured_s=run.step_s, after_s=after.step_time_s))


RunFn = Callable[[], tuple[list[float], tuple[dict[str, float], ...]]]
"""Runs a plan: its step times and every rank's phase summary (``runtime.phases``)."""


def _least_stretched(run_fn: RunFn, hw: HardwareProfile, warmup: int) -> tuple[list[float], tuple[dict[str, float], ...]]:
    """A run of ``run_fn``, again where its profiled steps were stretched (``dilation``), up to
    ``ATTEMPTS`` runs: the least stretched."""
    times, ranks = run_fn()
    for _ in range(ATTEMPTS - 1):
        if hw.host_overlaps_device or dilation(times, warmup) <= DILATION_LIMIT:
            break
        again = run_fn()
        if dilation(again[0], warmup) < dilation(times, warmup):
            times, ranks = again
    return times, ranks


def calibrate(plan: Plan, model: ModelProfile, hw: HardwareProfile, warmup: int, run_fn: RunFn,
              source: str, anchor: bool = False) -> Calibration:
    """``calibrate_runs`` of one plan."""
    return calibrate_runs(((plan, model, run_fn),), hw, warmup, source, anchor)[0]


def calibrate_runs(jobs: Sequence[tuple[Plan, ModelProfile, RunFn]], hw: HardwareProfile, warmup: int,
                   source: str, anchor: bool = False) -> tuple[Calibration, ...]:
    """Run each plan (``_least_stretched``), refit ``hw`` to all the runs at once
    (``refit_runs``; ``anchor``: ``autopar profile``'s reference run) and compare each plan's
    phases before and after; every calibration carries the one refitted profile, whose notes
    say what was fitted, from what runs (``source``) and when."""
    taken = [(plan, model, _least_stretched(run_fn, hw, warmup)) for plan, model, run_fn in jobs]
    runs = [(plan, model, measured(times, warmup, ranks, stages(plan))) for plan, model, (times, ranks) in taken]
    new, fits = refit_runs(runs, hw, anchor)
    stretch = ", ".join(f"{dilation(times, warmup):.2f}" for _, _, (times, _) in taken)
    notes = {**new.notes, "calibrated": f"{source} on {date.today().isoformat()} (profiled steps "
             f"{stretch}x the others): " + "; ".join(f"{f.name} {f.old:.4g} -> {f.new:.4g} ({f.why})" for f in fits)}
    profile = replace(new, notes=notes)
    out = []
    for plan, model, run in runs:
        strat = plan.strategy(lead=model.lead_layers)
        before = estimate(model, hw, strat, global_batch=plan.global_batch)
        after = estimate(model, new, strat, global_batch=plan.global_batch)
        out.append(Calibration(phases=phases(before, run, after), fits=fits, profile=profile,
                               gemm_tflops=run.gemm_tflops,
                               peak_predicted_bytes=max(before.stage_peak_bytes or (before.memory.peak_bytes,)),
                               peak_measured_bytes=run.peak_bytes))
    return tuple(out)


def write_profile(profile: HardwareProfile, out: Path) -> None:
    """The profile in the shipped JSON format (``cost_models.hardware.profile_from_dict``)."""
    out.write_text(json.dumps(dataclasses.asdict(profile), indent=2) + "\n")


def calibrate_plans(plans: Sequence[Plan], steps: int, warmup: int, source: str,
                    anchor: bool = False) -> tuple[Calibration, ...]:
    """``calibrate_runs`` of ``plans`` on this machine (``runtime.run_job``, one plan after the
    other, each profiled after ``warmup`` steps), against the profile they name (one for all;
    ``anchor``: ``autopar profile``'s reference)."""
    if steps < warmup + 1 + PROFILED:
        raise UserError(f"--steps {steps} leaves no step to time after {warmup} warm-up steps and before the "
                        f"{PROFILED} profiled ones; use --steps {warmup + 1 + PROFILED} or more")
    clusters, dtypes = sorted({plan.cluster for plan in plans}), sorted({plan.dtype for plan in plans})
    if len(clusters) > 1:
        raise UserError(f"the plans name {len(clusters)} clusters ({', '.join(clusters)}); calibrate plans of one "
                        "cluster together")
    if len(dtypes) > 1:  # before any run (``refit_runs`` refuses them too)
        raise UserError(f"the plans train in {', '.join(dtypes)}: calibrate plans of one dtype together")
    from autopar.profiles import profile_spec
    from autopar.runtime import RunSpec, run_job
    from autopar.workflow import read_job

    def run_fn(plan: Plan) -> RunFn:
        def run() -> tuple[list[float], tuple[dict[str, float], ...]]:
            (result,) = run_job([RunSpec(plan=plan, steps=steps, phases=PROFILED)])
            return result.step_times_s, result.phases
        return run
    jobs = [read_job(p.model, p.cluster, p.gpus, p.global_batch, p.seq_len, p.dtype, p.recipe) for p in plans]
    return calibrate_runs([(p, profile_spec(j.spec), run_fn(p)) for p, j in zip(plans, jobs)], jobs[0].hw, warmup,
                          source, anchor)
