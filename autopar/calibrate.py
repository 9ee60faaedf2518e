"""``autopar calibrate PLAN.json``: run a plan, see where its step time went, refit the
cluster profile's efficiency constants to it, and write the refitted profile.

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
from typing import Callable

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
    strat = plan.strategy()
    weights, _ = block_gemms(model, strat)
    return sum(g.flops for g in weights) / sum(gemm_s(g, hw, strat.dtype, elem_bytes(strat)) for g in weights) / 1e12


def _solve(value: Callable[[float], float], target: float, old: float) -> tuple[float, str]:
    """The efficiency e in [LOW, 1] with ``value(e) = target`` (``value`` falls as e rises), by
    bisection, and a note: where even e = 1 predicts more, e = 1; where even e = ``LOW``
    predicts less, the phase is not this constant's to explain: ``old`` is kept."""
    if value(1.0) >= target:
        return 1.0, "" if value(1.0) == target else " (predicted slower even at 1: set to 1)"
    if value(LOW) <= target:
        return old, f" (predicted faster even at {LOW:g}: kept)"
    lo, hi = LOW, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if value(mid) > target else (lo, mid)
    return (lo + hi) / 2, ""


def refit(plan: Plan, model: ModelProfile, hw: HardwareProfile, run: Measured,
          anchor: bool = False) -> tuple[HardwareProfile, tuple[Fit, ...]]:
    """``hw`` with its constants refitted to ``run`` (module docstring), and the fits.
    ``anchor``: the run is ``autopar profile``'s reference, whose operators give the rates even
    on shared cores, where they can (no pipeline)."""
    strat = plan.strategy()

    def est(profile: HardwareProfile) -> Estimate:
        return estimate(model, profile, strat, global_batch=plan.global_batch)

    fits, orig = [], hw
    # Ranks that share cores: one waiting (a pipeline stage in the fill, the drain or for a
    # peer's activations; a data-parallel rank ahead of its peers, at the all-reduce) lends
    # its share of the core to the others, whose operators then run up to ``ranks_per_core``
    # times faster than the profile's rates with every rank busy: their times cannot give those
    # rates (a deep-narrow GPT at pp 4 ran its GEMMs at 1.33x the profile's, and a peak raised
    # by that priced the other plans 30 % fast; a long-sequence GPT's DDP step of 0.32 s spent
    # 0.21 s in operators on its median rank, and an element-wise rate fitted to that priced
    # the grid 20-30 % fast). The peak is scaled to the step instead (``_fit_step``).
    shared = hw.ranks_per_core > 1 and (plan.mesh.pp > 1 or not anchor)
    if not shared:
        ratio = run.gemm_tflops / _gemm_tflops(model, hw, plan)
        new = max(LOW, hw.matmul_efficiency * ratio)
        why = f"GEMMs ran at {run.gemm_tflops * 1e3:.3g} GFLOP/s, {ratio:.3g}x the rate predicted"
        if new > 1.0:
            # Faster than the profile's peak: the peak was measured low (on CPU ranks, with every
            # rank computing at once, where a step leaves some waiting), so the peak rises instead.
            old_peak = hw.peak_tflops[plan.dtype]
            fits.append(Fit(name=f"peak_tflops.{plan.dtype}", old=old_peak, new=old_peak * new,
                            why=f"{why}, above the peak"))
            hw = replace(hw, peak_tflops={**hw.peak_tflops, plan.dtype: old_peak * new})
            new = 1.0
        fits.append(Fit(name="matmul_efficiency", old=hw.matmul_efficiency, new=new, why=why))
        hw = replace(hw, matmul_efficiency=new)

    def fitted(name: str, old: float, make: Callable[[float], HardwareProfile],
               value: Callable[[Estimate], float], target: float, phase: str) -> HardwareProfile:
        if value(est(make(old))) == 0.0 and target == 0.0:
            fits.append(Fit(name=name, old=old, new=old, why=f"the plan has no {phase}"))
            return make(old)
        e, note = _solve(lambda x: value(est(make(x))), target, old)
        fits.append(Fit(name=name, old=old, new=e, why=f"{phase} measured {target * 1e3:.4g} ms{note}"))
        return make(e)

    base = hw
    hw = fitted("optimizer_memory_efficiency", orig.optimizer_memory_efficiency or orig.memory_efficiency,
                lambda e: replace(base, optimizer_memory_efficiency=e), lambda x: x.time.optimizer_s,
                run.optimizer_s, "optimizer step")
    if shared:
        fits.append(_fit_step(plan, hw, run, est))
        return replace(hw, peak_tflops={**hw.peak_tflops, plan.dtype: fits[-1].new}), tuple(fits)
    base = hw
    hw = fitted("memory_efficiency", hw.memory_efficiency, lambda e: replace(base, memory_efficiency=e),
                lambda x: x.time.compute_s, run.compute_s,
                "compute (device time)" if hw.host_overlaps_device else "compute (time in operators)")
    return hw, tuple(fits)


def _fit_step(plan: Plan, hw: HardwareProfile, run: Measured, est: Callable[[HardwareProfile], Estimate]) -> Fit:
    """The plan's dtype's peak (and with it every rate the profile states as a fraction of it)
    scaled so that the predicted step equals the measured one, by bisection on the scale within
    ``STEP_SCALES``; beyond them the peak is kept and the fit says so."""
    peak = hw.peak_tflops[plan.dtype]

    def step(scale: float) -> float:
        return est(replace(hw, peak_tflops={**hw.peak_tflops, plan.dtype: peak * scale})).step_time_s
    lo, hi = STEP_SCALES
    if not step(hi) <= run.step_s <= step(lo):
        return Fit(name=f"peak_tflops.{plan.dtype}", old=peak, new=peak,
                   why=f"step measured {run.step_s * 1e3:.4g} ms, beyond {lo:g}-{hi:g}x the peak's: kept")
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if step(mid) > run.step_s else (lo, mid)
    return Fit(name=f"peak_tflops.{plan.dtype}", old=peak, new=peak * math.sqrt(lo * hi),
               why=f"step measured {run.step_s * 1e3:.4g} ms (ranks sharing cores: its operators' rates are not "
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


def calibrate(plan: Plan, model: ModelProfile, hw: HardwareProfile, warmup: int,
              run_fn: Callable[[], tuple[list[float], tuple[dict[str, float], ...]]],
              source: str, anchor: bool = False) -> Calibration:
    """Run the plan (``run_fn``: its step times and every rank's phase summary; again where
    its profiled steps were stretched, ``dilation``), refit ``hw`` to it (``refit``; ``anchor``:
    ``autopar profile``'s reference run); the new profile's notes say what was fitted, from
    what run (``source``) and when."""
    times, ranks = run_fn()
    for _ in range(ATTEMPTS - 1):
        if hw.host_overlaps_device or dilation(times, warmup) <= DILATION_LIMIT:
            break
        again = run_fn()
        if dilation(again[0], warmup) < dilation(times, warmup):
            times, ranks = again
    run = measured(times, warmup, ranks, stages(plan))
    strat = plan.strategy()
    before = estimate(model, hw, strat, global_batch=plan.global_batch)
    new, fits = refit(plan, model, hw, run, anchor)
    after = estimate(model, new, strat, global_batch=plan.global_batch)
    notes = {**new.notes, "calibrated": f"{source} on {date.today().isoformat()} (profiled steps "
             f"{dilation(times, warmup):.2f}x the others): "
             + "; ".join(f"{f.name} {f.old:.4g} -> {f.new:.4g} ({f.why})" for f in fits)}
    return Calibration(phases=phases(before, run, after), fits=fits, profile=replace(new, notes=notes),
                       gemm_tflops=run.gemm_tflops, peak_predicted_bytes=max(before.stage_peak_bytes or
                                                                             (before.memory.peak_bytes,)),
                       peak_measured_bytes=run.peak_bytes)


def write_profile(profile: HardwareProfile, out: Path) -> None:
    """The profile in the shipped JSON format (``cost_models.hardware.profile_from_dict``)."""
    out.write_text(json.dumps(dataclasses.asdict(profile), indent=2) + "\n")


def calibrate_plan(plan: Plan, steps: int, warmup: int, source: str, anchor: bool = False) -> Calibration:
    """``calibrate`` of ``plan`` on this machine (``runtime.run_job``, profiled after ``warmup``
    steps), against the profile the plan names (``anchor``: ``autopar profile``'s reference)."""
    if steps < warmup + 1 + PROFILED:
        raise UserError(f"--steps {steps} leaves no step to time after {warmup} warm-up steps and before the "
                        f"{PROFILED} profiled ones; use --steps {warmup + 1 + PROFILED} or more")
    from autopar.profiles import profile_spec
    from autopar.runtime import RunSpec, run_job
    from autopar.workflow import read_job
    job = read_job(plan.model, plan.cluster, plan.gpus, plan.global_batch, plan.seq_len, plan.dtype, plan.recipe)

    def run_fn() -> tuple[list[float], tuple[dict[str, float], ...]]:
        (result,) = run_job([RunSpec(plan=plan, steps=steps, phases=PROFILED)])
        return result.step_times_s, result.phases
    return calibrate(plan, profile_spec(job.spec), job.hw, warmup, run_fn, source, anchor)
