"""Planner time on the issue's anchor jobs, as the user waits for it, and the plan against
Megatron's published one.

    python benchmarks/search_time.py [--repeats 3]
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null \
        python benchmarks/search_time.py --once 1 [--no-search]   # instructions of one search

Part 1 prints, per job, the wall time of whole ``autopar plan`` processes (a subprocess each:
interpreter start, imports, the search, printing) against the issue's target on an idle 2-core
machine: ``cold`` is the first plan of the model, with an empty trace cache (torch imported,
the model built and traced on meta: ``autopar.profiles``), ``warm`` the median of ``repeats``
later ones (the trace read from the cache, torch not imported). Then the median search
time of ``repeats`` in-process searches (tracing excluded: benchmarks/trace_time.py times it),
the candidates considered, how many went to a placement solve, the proven gap and the plan.
Part 2 plans every row of Narayanan et al. 2021 Table 1 (same model, GPUs, batch) freely and
pinned to the published TP and PP, and prints both predicted throughputs under the same cost
model. Part 3 reruns the first jobs under a tight ``--time-limit`` to show the best plan found
and its proven gap.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autopar.solve import Pins, describe, search
from autopar.errors import UserError
from autopar.profiles import profile_spec
from autopar.workflow import read_job

# (label, model, cluster, gpus, global batch, seq len, target). Turing-530B: Calculon's job is
# 5,128 A100 with batch up to 2,520; 5,128 = 8 x 641 splits no batch <= 2,520 over dp x tp x pp
# (641 is prime and > 105 layers), so autopar plans the largest whole mesh below it, 5,120.
# The target is the issue's, for the whole `autopar plan` process on an idle 2-core machine,
# seconds (None: no target, shown for scale).
JOBS = [
    ("Turing-530B, 5120 (of 5128) A100, batch 2520", "megatron-529.6b", "dgx-a100-80g", 5120, 2520, None, 2.0),
    ("Turing-530B, 5120 (of 5128) A100, batch 2560", "megatron-529.6b", "dgx-a100-80g", 5120, 2560, None, 2.0),
    ("Llama-3 405B, 16384 H100, 16M tokens", "llama3-405b", "dgx-h100", 16384, 2048, 8192, 2.0),
    ("GPT 1T, 3072 A100", "megatron-1t", "dgx-a100-80g", 3072, 3072, None, 3.0),
    # The MoE / long-context issue's anchors: Llama-3 405B's 128K stage with cp > 1 (<= 1 s),
    # a DeepSeek-V3-shaped model on 2,048 H800 (<= 2 s), Mixtral 8x7B on 64 H100 (no target).
    ("Llama-3 405B, 16384 H100, seq 131072", "llama3-405b", "dgx-h100", 16384, 128, 131072, 1.0),
    ("DeepSeek-V3 671B, 2048 H800, 61M tokens", "deepseek-v3", "dgx-h800", 2048, 15360, 4096, 2.0),
    ("Mixtral 8x7B, 64 H100", "mixtral-8x7b", "dgx-h100", 64, 512, None, None),
    ("96-layer Llama-2-7B-shaped GPT, 1024 A100", "gpt:layers=96,hidden=4096,heads=32,vocab=32000,seq=2048",
     "dgx-a100-80g", 1024, 1024, None, None),
]
ROOT = Path(__file__).resolve().parent.parent

# Narayanan et al. SC'21 Table 1: (preset, TP, PP, GPUs, batch).
TABLE1 = [("megatron-1.7b", 1, 1, 32, 512), ("megatron-3.6b", 2, 1, 64, 512),
          ("megatron-7.5b", 4, 1, 128, 512), ("megatron-18.4b", 8, 1, 256, 1024),
          ("megatron-39.1b", 8, 2, 512, 1536), ("megatron-76.1b", 8, 4, 1024, 1792),
          ("megatron-145.6b", 8, 8, 1536, 2304), ("megatron-310.1b", 8, 16, 1920, 2160),
          ("megatron-529.6b", 8, 35, 2520, 2520), ("megatron-1t", 8, 64, 3072, 3072)]


def plan_process(model: str, cluster: str, gpus: int, batch: int, seq: int | None,
                 time_limit: float) -> tuple[float, dict]:
    """Wall time of one whole ``autopar plan --json`` process, and its JSON (``$AUTOPAR_CACHE``
    as the caller set it). The process reads and writes compiled bytecode as installed Python
    does (pip compiles a wheel's modules; an editable install's first run writes its
    ``__pycache__``): where ``PYTHONDONTWRITEBYTECODE`` is set, as in some sandboxes, every
    process would compile autopar's ~50 modules again, about 0.1 s a user does not wait for."""
    cmd = [sys.executable, "-m", "autopar.cli", "plan", "--model", model, "--cluster", cluster,
           "--gpus", str(gpus), "--global-batch", str(batch), "--time-limit", str(time_limit), "--json"]
    if seq is not None:
        cmd += ["--seq-len", str(seq)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT, env=env)
    return time.perf_counter() - t, json.loads(out.stdout)


def time_jobs(repeats: int, time_limit: float) -> None:
    print(f"{'job':45s} {'cold s':>6s} {'warm s':>6s} {'target':>6s} {'met':>3s} {'search s':>8s} "
          f"{'candidates':>10s} {'solved':>6s} {'gap':>6s}  plan")
    for label, model, cluster, gpus, batch, seq, target in JOBS:
        with tempfile.TemporaryDirectory() as cache:
            os.environ["AUTOPAR_CACHE"] = cache
            cold, _ = plan_process(model, cluster, gpus, batch, seq, time_limit)
            walls = [plan_process(model, cluster, gpus, batch, seq, time_limit) for _ in range(repeats)]
        wall = statistics.median(w for w, _ in walls)
        job = read_job(model, cluster, gpus, batch, seq)
        prof = profile_spec(job.spec)
        times, sol = [], None
        for _ in range(repeats):
            t = time.perf_counter()
            sol = search(prof, job.hw, gpus, batch, job.dtype, time_limit_s=time_limit)
            times.append(time.perf_counter() - t)
        assert sol is not None  # repeats >= 1
        met = "-" if target is None else ("yes" if wall <= target else "no")
        print(f"{label:45s} {cold:6.2f} {wall:6.2f} {'-' if target is None else f'{target:g}':>6s} {met:>3s} "
              f"{statistics.median(times):8.2f} {sol.candidates:10d} {sol.solved:6d} {sol.gap:6.1%}  "
              f"{describe(sol.strategy)}  {sol.estimate.tflops_per_gpu:.0f} TFLOP/s, MFU {sol.estimate.mfu:.1%}")


def time_limited(limit: float) -> None:
    print(f"\n{'job, --time-limit ' + f'{limit:g} s':45s} {'search s':>8s} {'optimal':>7s} {'gap':>6s} "
          f"{'step s':>8s} {'free step s':>11s}")
    for label, model, cluster, gpus, batch, seq, _ in JOBS:
        job = read_job(model, cluster, gpus, batch, seq)
        prof = profile_spec(job.spec)
        t = time.perf_counter()
        quick = search(prof, job.hw, gpus, batch, job.dtype, time_limit_s=limit)
        took = time.perf_counter() - t
        free = search(prof, job.hw, gpus, batch, job.dtype)
        print(f"{label:45s} {took:8.2f} {str(quick.optimal):>7s} {quick.gap:6.1%} "
              f"{quick.estimate.step_time_s:8.3f} {free.estimate.step_time_s:11.3f}")


def compare_table1() -> None:
    print(f"\n{'Narayanan T1 row':18s} {'published (tp,pp)':>18s} {'tok/s published cfg':>20s} "
          f"{'tok/s plan':>12s} {'ratio':>6s} {'search s':>8s} {'gap':>5s}  plan")
    for preset, tp, pp, gpus, batch in TABLE1:
        job = read_job(preset, "dgx-a100-80g", gpus, batch)
        prof = profile_spec(job.spec)
        t = time.perf_counter()
        try:
            free = search(prof, job.hw, gpus, batch, job.dtype)
        except UserError as exc:
            print(f"{preset:18s} {f'({tp},{pp})':>18s}  planner: {exc}")
            continue
        took = time.perf_counter() - t
        try:
            pinned = search(prof, job.hw, gpus, batch, job.dtype, Pins(tp=tp, pp=pp))
            ref = f"{pinned.estimate.tokens_per_s:20,.0f}"
            ratio = f"{free.estimate.tokens_per_s / pinned.estimate.tokens_per_s:6.3f}"
        except (ValueError, UserError) as exc:  # the published split may not fit this cost model's memory
            ref, ratio = f"{'(' + str(exc)[:17] + ')':>20s}", "   n/a"
        print(f"{preset:18s} {f'({tp},{pp})':>18s} {ref} {free.estimate.tokens_per_s:12,.0f} {ratio} "
              f"{took:8.2f} {free.gap:5.1%}  {describe(free.strategy)}")


def search_once(index: int, stop: bool, time_limit: float) -> None:
    """One search of ``JOBS[index]`` in this process, its plan printed (``stop``: none)."""
    _, model, cluster, gpus, batch, seq, _ = JOBS[index]
    job = read_job(model, cluster, gpus, batch, seq)
    prof = profile_spec(job.spec)
    if not stop:
        sol = search(prof, job.hw, gpus, batch, job.dtype, time_limit_s=time_limit)
        print(f"{sol.estimate.step_time_s:.6f} s  {describe(sol.strategy)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=60.0, help="per search, s")
    parser.add_argument("--tight-limit", type=float, default=0.05,
                        help="the --time-limit of part 3, s")
    parser.add_argument("--jobs-only", action="store_true", help="part 1 only")
    parser.add_argument("--once", type=int, metavar="J",
                        help="only one in-process search of job J (0-based, part 1's order) and its plan, "
                             "to run under a profiler, e.g. PYTHONHASHSEED=0 valgrind --tool=callgrind")
    parser.add_argument("--no-search", action="store_true",
                        help="with --once: stop before the search (what imports and the model cost)")
    args = parser.parse_args()
    if args.once is not None:
        search_once(args.once, args.no_search, args.time_limit)
        return
    time_jobs(args.repeats, args.time_limit)
    if args.jobs_only:
        return
    compare_table1()
    time_limited(args.tight_limit)


if __name__ == "__main__":
    main()
