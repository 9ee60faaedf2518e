"""Is the planner's pick the fastest plan? Every plan it ranks, measured on this machine.

    python benchmarks/plan_quality.py [--ranks 4] [--keep 24] [--spread 0] [--steps 10] [--rounds 3]
                                      [--models deep-narrow,wide,long-seq]
                                      [--profile cpu-local] [--save RUNS.json | --replay RUNS.json]
                                      [--confirm K [--confirm-out H2H.json]] [--show-confirm H2H.json]

For each model below (deep-narrow, wide, long-sequence GPTs, whose plans differ), the search
proves its ``--keep`` best strategies under the profile (``search(keep=…)``: every feasible
one where there are fewer), plus plain DDP and plain FSDP (ZeRO-3) at one micro-batch per
rank, plus ``--spread`` more from the rest of the space, evenly spaced in predicted rank
among those predicted within ``SPREAD_CAP`` times the best (``spread``): the best ones lie
within 15-25 % of each other, where this machine's rounds disagree as much, so their ranking
alone measures the noise more than the model; the spread ones show how it ranks the space.
Each is trained ``--steps`` steps on ``--ranks`` gloo CPU ranks, all plans of a model in
one torchrun job; a round's time of a plan is the median of its steps after 2 of warm-up and
before the 3 last, which run under the profiler for its peak memory (``runtime.phases``); of
its rounds' profiles, the one whose profiled steps ran closest to its others is kept, as
``autopar calibrate`` keeps it (``profiled_round``), and each round prints the CPU that other
processes took while it ran (``foreign_load``). The
job runs ``--rounds`` times, every other round in reverse order (a machine's slow minutes fall
on different plans), and a plan's time is the median of its rounds': two runs of one program
differ by up to 12 % in a single round on a shared 2-core machine.

Printed per model: predicted against measured step time for every plan (mean and max
|error|, Spearman rank correlation), the pick's measured rank and its time over the best
measured (the oracle), plain DDP's and FSDP's over the oracle, and peak memory predicted
against measured. Then the profile is refitted (``autopar.calibrate``) on ONE run, the first
model's pick, and everything is re-predicted with it: the first model's rows are in-sample,
the others out-of-sample; then each model again under the profile refitted on its own pick's
run (one summary line each), as `autopar calibrate PLAN` is used, and under the profile refitted
on its pick's, plain DDP's and plain FSDP's runs together (`autopar calibrate PICK DDP FSDP`:
one plan the machine happened to run fast no longer sets the profile alone). The calibrated
planner's pick is measured too if it is new.

``--save`` writes every measured run (plan, step times, rank summaries); ``--replay`` prices
those same runs again under ``--profile`` without running anything (the plans measured are
then the saved ones, not the new profile's ranking): a changed cost model is judged against
the same measurements.

``--confirm K`` then measures the pick, the grid's fastest plan, plain DDP and plain FSDP again,
K fresh rounds (``head_to_head``): the grid's fastest is the least of many noisy times and reads
low for that alone (the winner's curse), so the pick is judged against it on rounds that chose
nothing. With ``--replay`` the grid is the saved one and the pick the current planner's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autopar.calibrate import PROFILED, dilation, measured, refit_runs, stages  # noqa: E402
from autopar.plan import Mesh, Plan, plan_from_dict  # noqa: E402
from autopar.profiles import profile_spec  # noqa: E402
from autopar.runtime import RunResult, RunSpec, run_job  # noqa: E402
from autopar.solve import describe, search  # noqa: E402
from autopar.workflow import plan_from_strategy, read_job  # noqa: E402
from cost_models import HardwareProfile, estimate, load_profile  # noqa: E402

MODELS = [  # (label, model, global batch)
    ("deep-narrow", "gpt:layers=8,hidden=128,heads=4,vocab=512,seq=64,tied=0", 32),
    ("wide", "gpt:layers=2,hidden=512,heads=8,vocab=512,seq=64,tied=0", 16),
    ("long-seq", "gpt:layers=4,hidden=128,heads=4,vocab=512,seq=512,tied=0", 8),
]
WARMUP = 2
SPREAD_CAP = 3.0
"""``--spread`` plans are predicted at most this many times the best one's step (deep-narrow's
slowest plans take 15 s a step, 60 times its best)."""


def baseline(model: str, batch: int, ranks: int, seq: int, layers: int, zero: int, cluster: str) -> Plan:
    return Plan(model=model, cluster=cluster, gpus=ranks, global_batch=batch, seq_len=seq, dtype="fp32",
                mesh=Mesh(dp=ranks), zero_stage=zero, micro_batch_size=batch // ranks, num_microbatches=1,
                schedule="1f1b", stage_layers=(layers,), recompute=("none",) * layers)


def key(plan: Plan) -> str:
    return describe(plan.strategy())


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1]) if len(a) > 2 else float("nan")


def spread(alternatives: list, keep: int, n: int) -> list:
    """``n`` strategies of ``alternatives`` (best first) beyond the ``keep`` best, evenly spaced
    in rank among those predicted within ``SPREAD_CAP`` times the best (all of them where
    there are no more than ``n``)."""
    rest = [a.strategy for a in alternatives[keep:]
            if a.step_time_s <= SPREAD_CAP * alternatives[0].step_time_s]
    if n <= 0:
        return []
    if len(rest) <= n:
        return rest
    if n == 1:
        return [rest[len(rest) // 2]]
    return [rest[round(i * (len(rest) - 1) / (n - 1))] for i in range(n)]


def repeatability(runs: list) -> tuple[float, float, float] | None:
    """How well this machine's measurements agree with themselves, from the rounds of each
    plan (``summarise``'s fourth element): the median over pairs of rounds of their Spearman
    correlation across the plans (r), the median over plans of their rounds' spread
    ((max - min) / median), and the Spearman-Brown ceiling sqrt(k r / (1 + (k - 1) r)): about
    the correlation an error-free prediction can reach against the median of k rounds. None
    with one round."""
    rounds = [[round_s(t) for t in r[3]] for r in runs]
    k = min(len(x) for x in rounds)
    if k < 2 or len(rounds) < 3:
        return None
    per = [[x[j] for x in rounds] for j in range(k)]
    r = statistics.median(spearman(per[i], per[j]) for i in range(k) for j in range(i + 1, k))
    spread = statistics.median((max(x) - min(x)) / statistics.median(x) for x in rounds)
    return r, spread, math.sqrt(k * r / (1 + (k - 1) * r)) if r > 0 else 0.0


def round_s(step_times_s: list[float]) -> float:
    """One round's time of a plan: the median of its steps after warm-up, before the profiled."""
    return statistics.median(step_times_s[WARMUP:-PROFILED])


def profiled_round(runs: tuple[RunResult, ...]) -> RunResult:
    """The round of a plan whose profiled steps ran closest to its others (least
    ``calibrate.dilation``) among those with a profile: what ``calibrate`` would keep."""
    return min((r for r in runs if r.phases), key=lambda r: dilation(r.step_times_s, WARMUP))


def summarise(rounds: list[list[RunResult]]) -> list[tuple[float, float, RunResult, list[list[float]]]]:
    """(median over rounds of ``round_s``, the largest peak bytes over ranks and the run of its
    ``profiled_round``, every round's step times) of each plan; ``rounds[k][i]`` is plan i's
    run in round k."""
    out = []
    for runs in zip(*rounds):
        kept = profiled_round(runs)
        out.append((statistics.median(round_s(r.step_times_s) for r in runs),
                    max(x["peak_bytes"] for x in kept.phases), kept, [r.step_times_s for r in runs]))
    return out


def cpu_seconds() -> tuple[float, float, float]:
    """(wall clock, the machine's busy CPU seconds since boot (/proc/stat: all but idle and
    iowait; steal included: a hypervisor's other guests), this process's waited-for
    descendants' CPU seconds), to difference around a job (``foreign_load``)."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.monotonic(), busy, kids.ru_utime + kids.ru_stime


def foreign_load(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Cores' worth of CPU that something other than the job used while it ran (other
    processes, or a hypervisor's steal): the machine's busy seconds less the job's, over the
    wall time. Rounds with more of it ran slower for reasons outside the plans."""
    wall, busy, kids = (a - b for a, b in zip(after, before))
    return max(0.0, busy - kids) / wall if wall > 0 else 0.0


def measure(plans: list[Plan], steps: int, rounds: int) -> list[tuple[float, float, RunResult, list[list[float]]]]:
    """``summarise`` of each plan trained ``steps`` steps, all in one job, ``rounds`` times
    (odd rounds in reverse order); each round prints the foreign load it ran under."""
    out = []
    for k in range(rounds):
        order = plans if k % 2 == 0 else plans[::-1]
        before = cpu_seconds() if Path("/proc/stat").is_file() else None
        runs = run_job([RunSpec(plan=p, steps=steps, phases=PROFILED) for p in order], timeout_s=3600)
        if before is not None:
            print(f"  round {k + 1} of {len(plans)} plans: foreign load {foreign_load(before, cpu_seconds()):.2f} "
                  f"cores of {os.cpu_count()}", flush=True)
        out.append(runs if k % 2 == 0 else runs[::-1])
    return summarise(out)


def save(path: str, cases: list) -> None:
    """Every measured run of ``cases``: its plan, its ``profiled_round``'s step times and rank
    summaries (the first round's in grids before 1128h), and every round's step times."""
    out = [{"label": label, "plans": [json.loads(p.to_json()) for p in plans],
            "runs": [{"step_times_s": r.step_times_s, "phases": list(r.phases), "rounds": rounds}
                     for _, _, r, rounds in runs]}
           for label, _, _, plans, runs, _, _, _ in cases]
    Path(path).write_text(json.dumps(out, indent=1) + "\n")


def replayed(path: str) -> dict[str, tuple[list[Plan], list]]:
    """The saved plans and runs of each model label (``save``)."""
    data = json.loads(Path(path).read_text())
    out = {}
    for case in data:
        runs = [[RunResult(step_times_s=times, phases=tuple(r["phases"]) if times == r["step_times_s"] else ())
                 for times in r.get("rounds", [r["step_times_s"]])] for r in case["runs"]]
        out[case["label"]] = ([plan_from_dict(p) for p in case["plans"]], summarise([list(k) for k in zip(*runs)]))
    return out


def report(label: str, plans: list[Plan], runs: list, hw: HardwareProfile, model, pick: str,
           ddp: str, fsdp: str, top: int, table: bool = True) -> None:
    pred = [estimate(model, hw, p.strategy(), global_batch=p.global_batch) for p in plans]
    meas = [t for t, *_ in runs]
    errs = [abs(e.step_time_s / m - 1) for e, m in zip(pred, meas)]
    mem = [abs(max(e.stage_peak_bytes or (e.memory.peak_bytes,)) / b - 1) for e, (_, b, *_) in zip(pred, runs)]
    oracle = min(meas)
    order = sorted(range(len(plans)), key=lambda i: meas[i])
    by_key = {key(p): i for i, p in enumerate(plans)}
    if table:
        print(f"  {'plan':58s} {'predicted s':>11s} {'measured s':>10s} {'error':>7s} {'peak pred/meas MiB':>19s}")
    for i in order if table else ():
        flag = " <- pick" if key(plans[i]) == pick else ""
        print(f"  {key(plans[i])[:58]:58s} {pred[i].step_time_s:11.4f} {meas[i]:10.4f} "
              f"{pred[i].step_time_s / meas[i] - 1:+7.1%} "
              f"{max(pred[i].stage_peak_bytes or (pred[i].memory.peak_bytes,)) / 2**20:9.1f}/{runs[i][1] / 2**20:<9.1f}"
              f"{flag}")
    p = by_key.get(pick)
    print(f"  {label}: {len(plans)} plans; step time |error| mean {statistics.mean(errs):.1%} max {max(errs):.1%}; "
          f"Spearman {spearman([e.step_time_s for e in pred], meas):.3f}; peak memory |error| mean "
          f"{statistics.mean(mem):.1%} max {max(mem):.1%}")
    if len(plans) > top > 2:
        best = sorted(range(len(plans)), key=lambda i: pred[i].step_time_s)[:top]
        rest = [meas[i] for i in range(len(plans)) if i not in best]
        rho = spearman([pred[i].step_time_s for i in best], [meas[i] for i in best])
        print(f"  the {top} predicted fastest alone: Spearman {rho:.3f}; the rest span "
              f"{min(rest) / oracle:.2f}-{max(rest) / oracle:.2f} x the oracle")
    again = repeatability(runs)
    if again is not None:
        print(f"  the measurements themselves: rounds agree at Spearman {again[0]:.3f} (median over pairs), a plan's "
              f"rounds spread {again[1]:.1%} (median); ceiling for an error-free model about {again[2]:.2f}")
    if p is not None:
        print(f"  pick: measured rank {order.index(p) + 1} of {len(plans)}, {meas[p] / oracle:.3f} x the oracle; "
              f"plain DDP {meas[by_key[ddp]] / oracle:.3f} x, plain FSDP {meas[by_key[fsdp]] / oracle:.3f} x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--keep", type=int, default=24)
    parser.add_argument("--spread", type=int, default=0, help="plans from the rest of the space (``spread``)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", default="cpu-local")
    parser.add_argument("--models", default=",".join(label for label, _, _ in MODELS),
                        help="the models to measure, by label, comma-separated (default all)")
    runs_file = parser.add_mutually_exclusive_group()
    runs_file.add_argument("--save", help="write the measured runs here (JSON)")
    runs_file.add_argument("--replay", help="price the runs saved here instead of measuring")
    parser.add_argument("--confirm", type=int, default=0,
                        help="rounds of a fresh head-to-head of the pick, the grid's fastest, plain DDP and FSDP")
    parser.add_argument("--confirm-out", help="write the head-to-head's runs here (JSON)")
    parser.add_argument("--show-confirm", help="print the head-to-heads saved here (--confirm-out) and stop")
    args = parser.parse_args()
    if args.show_confirm:
        for record in json.loads(Path(args.show_confirm).read_text()):
            show_head_to_head(record)
        return
    saved = replayed(args.replay) if args.replay else {}
    print(f"{args.ranks} gloo CPU ranks, profile {args.profile}; load average {os.getloadavg()[0]:.2f} at start")
    labels = args.models.split(",")
    unknown = sorted(set(labels) - {label for label, _, _ in MODELS})
    if unknown:
        parser.error(f"unknown model {', '.join(unknown)}; the models are {', '.join(m[0] for m in MODELS)}")
    cases = []
    picked: dict[str, Plan] = {}
    for label, model, batch in (m for m in MODELS if m[0] in labels):
        if args.replay and label not in saved:
            continue
        job = read_job(model, args.profile, args.ranks, batch, dtype="fp32")
        prof = profile_spec(job.spec)
        sol = search(prof, job.hw, args.ranks, batch, "fp32", keep=args.keep if not args.spread else 100_000)
        chosen = [a.strategy for a in sol.alternatives[:args.keep]] + spread(list(sol.alternatives), args.keep, args.spread)
        by_key = {key(p): p for p in (plan_from_strategy(job, st, None) for st in chosen)}
        pick = key(plan_from_strategy(job, sol.strategy, None))
        ddp, fsdp = (baseline(model, batch, args.ranks, job.spec.seq, job.spec.layers, z, args.profile) for z in (0, 3))
        by_key.setdefault(key(ddp), ddp)
        by_key.setdefault(key(fsdp), fsdp)
        listed, runs = saved[label] if args.replay else (list(by_key.values()), None)
        cases.append((label, job, prof, listed, runs or measure(listed, args.steps, args.rounds), pick, key(ddp), key(fsdp)))
        picked[label] = plan_from_strategy(job, sol.strategy, None)
    if args.save:
        save(args.save, cases)
    hw = load_profile(args.profile)
    print("\n== shipped profile")
    for label, job, prof, plans, runs, pick, ddp_key, fsdp_key in cases:
        print(f"\n{label} ({job.spec.name}, global batch {job.global_batch})")
        report(label, plans, runs, hw, prof, pick, ddp_key, fsdp_key, args.keep)
    # Refit on one run: the first model's pick, for every model; then each model on its own pick.
    first = calibrated(cases[0], hw)
    print(f"\n== calibrated on {cases[0][0]}'s pick ({cases[0][5]}): {first[1]}")
    for n, case in enumerate(cases):
        recalibrated(case, first[0], args, "in-sample" if n == 0 else "out-of-sample")
    print("\n== each model calibrated on its own pick's run (the way `autopar calibrate PLAN` is used)")
    for case in cases:
        own, fits = calibrated(case, hw)
        print(f"\n{case[0]}: {fits}")
        recalibrated(case, own, args, "", table=False)
    print("\n== each model calibrated on its pick's, plain DDP's and plain FSDP's runs together "
          "(`autopar calibrate PICK DDP FSDP`)")
    for case in cases:
        three, fits = calibrated(case, hw, baselines=True)
        print(f"\n{case[0]}: {fits}")
        recalibrated(case, three, args, "", table=False)
    if args.confirm:
        confirmed = [head_to_head(case, picked[case[0]], args.steps, args.confirm) for case in cases]
        if args.confirm_out:
            Path(args.confirm_out).write_text(json.dumps(confirmed, indent=1) + "\n")


def head_to_head(case: tuple, pick: Plan, steps: int, rounds: int) -> dict:
    """The pick, the grid's fastest plan (its measured oracle), plain DDP and plain FSDP
    measured again, ``rounds`` fresh rounds alternating their order, printed
    (``show_head_to_head``). The grid's oracle is the least of many noisy times, so its own
    time reads low (the winner's curse); fresh rounds of a few plans chosen beforehand carry no
    such selection. Returns the runs (JSON-ready: ``--confirm-out``, ``--show-confirm``)."""
    label, _, _, plans, runs, _, ddp_key, fsdp_key = case
    oracle = plans[min(range(len(plans)), key=lambda i: runs[i][0])]
    roles: dict[str, list[str]] = {}
    chosen: list[Plan] = []
    for role, plan in (("pick", pick), ("grid's fastest", oracle),
                       ("plain DDP", next(p for p in plans if key(p) == ddp_key)),
                       ("plain FSDP", next(p for p in plans if key(p) == fsdp_key))):
        if key(plan) not in roles:
            chosen.append(plan)
        roles.setdefault(key(plan), []).append(role)
    fresh = measure(chosen, steps, rounds)
    record = {"label": label, "roles": [roles[key(p)] for p in chosen],
              "plans": [json.loads(p.to_json()) for p in chosen], "rounds": [f[3] for f in fresh]}
    show_head_to_head(record)
    return record


def show_head_to_head(record: dict) -> None:
    """Each plan of a head-to-head (``head_to_head``'s record): its median over the rounds of
    ``round_s`` against the fastest plan's, and paired, round by round (the plans of a round
    ran in one job, under the same machine state): the median and range of its time over the
    fastest's in that round, and in how many rounds it was the fastest."""
    plans = [plan_from_dict(p) for p in record["plans"]]
    per_round = [[round_s(r) for r in rounds] for rounds in record["rounds"]]
    times = [statistics.median(rs) for rs in per_round]
    best = min(range(len(plans)), key=times.__getitem__)
    n = min(len(rs) for rs in per_round)
    print(f"\n{record['label']}: head-to-head, {n} fresh rounds of {len(plans)} plans (x: its median over the "
          f"fastest's; paired: the median and range over rounds of its time over the fastest's in the round)")
    for plan, roles, t, rs in zip(plans, record["roles"], times, per_round):
        wins = sum(1 for k in range(n) if rs[k] == min(x[k] for x in per_round))
        paired = [a / b for a, b in zip(rs, per_round[best])]
        print(f"  {' = '.join(roles):34s} {key(plan)[:50]:50s} {t:8.4f} s  {t / times[best]:.3f} x  "
              f"paired {statistics.median(paired):.3f} ({min(paired):.3f}-{max(paired):.3f}), "
              f"fastest in {wins} of {n}")


def calibrated(case: tuple, hw: HardwareProfile, baselines: bool = False) -> tuple[HardwareProfile, str]:
    """``hw`` refitted to the run of ``case``'s pick (``baselines``: and of plain DDP and plain
    FSDP, fitted together: ``autopar calibrate PICK DDP FSDP``), and what moved."""
    label, job, prof, plans, runs, pick, ddp_key, fsdp_key = case
    keys = [key(p) for p in plans]
    chosen = sorted({keys.index(k) for k in ((pick, ddp_key, fsdp_key) if baselines else (pick,))})
    cal, fits = refit_runs([(plans[i], prof, replace(measured(runs[i][2].step_times_s, WARMUP, runs[i][2].phases,
                                                              stages(plans[i])), step_s=runs[i][0]))
                            for i in chosen], hw)
    return cal, "; ".join(f"{f.name} {f.old:.3g} -> {f.new:.3g}" for f in fits)


def recalibrated(case: tuple, cal: HardwareProfile, args: argparse.Namespace, what: str, table: bool = True) -> None:
    """``case`` reported under ``cal``, its new pick measured where it is new (not on replay)."""
    label, job, prof, plans, runs, pick, ddp_key, fsdp_key = case
    new = plan_from_strategy(job, search(prof, cal, args.ranks, job.global_batch, "fp32").strategy, None)
    if key(new) not in [key(p) for p in plans] and not args.replay:
        plans, runs = plans + [new], runs + measure([new], args.steps, args.rounds)
    if what:
        print(f"\n{label} ({what})")
    report(label, plans, runs, cal, prof, key(new), ddp_key, fsdp_key, args.keep, table)


if __name__ == "__main__":
    main()
