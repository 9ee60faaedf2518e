"""Where a plan's ranks peak: the moment of each rank's most bytes allocated, and what ran then.

    python benchmarks/memory_census.py PLAN.json [--steps 4]

Runs the plan on this machine's CPU ranks (torchrun, gloo), profiles its last two steps with
``runtime.phases.recording`` (the c10 CPU allocator's running total at every allocation) and
prints, per rank, the peak as ``calibrate`` and ``plan_quality`` measure it (the live state at
the second profiled step's start plus the most allocated beyond it), the operators enclosing
that moment (a pipeline action such as ``Backward 1`` names the micro-batch), and the most
allocated inside each top-level event of that step (tensor operators apart): what a memory term of the cost model has
to explain.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MIB = 2**20


def census(plan_file: str, steps: int) -> dict:
    """This rank's peak and what enclosed it (run under torchrun)."""
    import torch.distributed as dist
    from torch._C._profiler import _EventType

    from autopar.plan import plan_from_dict
    from autopar.runtime import phases
    from autopar.runtime.context import build_context, init_distributed
    from autopar.runtime.train import build_program, step_on_batch, synthetic_batch

    plan = plan_from_dict(json.loads(Path(plan_file).read_text()))
    device = init_distributed(300)
    prog = build_program(plan, build_context(plan, device))
    for step in range(steps - 2):
        step_on_batch(prog, *synthetic_batch(plan, step, 0))
    with phases.recording(device) as prof:
        for step in range(steps - 2, steps):
            step_on_batch(prog, *synthetic_batch(plan, step, 0))
    live = phases.live_bytes(prog.modules, prog.optimizers)
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    tree = prof.profiler.kineto_results.experimental_event_tree()
    ops = [n for n in phases._walk(tree) if n.tag != _EventType.Allocation]
    allocs, base = phases.step_allocations(prof)
    start = allocs[0].start_time_ns
    peak = max(allocs, key=lambda n: n.extra_fields.total_allocated)
    at = peak.start_time_ns
    levels = []
    for n in sorted((n for n in tree if n.tag != _EventType.Allocation and n.start_time_ns >= start),
                    key=lambda n: n.start_time_ns):
        inside = [a.extra_fields.total_allocated for a in allocs if n.start_time_ns <= a.start_time_ns <= n.end_time_ns]
        if inside and not n.name.startswith("aten::"):  # top-level tensor ops: the optimizer's, the loss's
            levels.append((n.name[:48], (max(inside) - base) / MIB, n.start_time_ns <= at <= n.end_time_ns))
    enclosing = [n.name for n in sorted(ops, key=lambda n: n.start_time_ns) if n.start_time_ns <= at <= n.end_time_ns]
    out = {"rank": dist.get_rank(), "live_mib": live / MIB, "beyond_mib": (peak.extra_fields.total_allocated - base) / MIB,
           "at": enclosing, "levels": levels}
    dist.barrier()
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="a plan JSON (`autopar plan --out`) for this machine's CPU ranks")
    parser.add_argument("--steps", type=int, default=4, help="steps run, the last two profiled (at least 3)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the folder each rank writes its census to
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3: the peak is read in the second of two profiled steps")
    if args.worker:
        mine = census(args.plan, args.steps)
        (Path(args.worker) / f"rank{mine['rank']}.json").write_text(json.dumps(mine))
        os._exit(0)  # as autopar's worker leaves: torch's teardown may abort a rank
    gpus = json.loads(Path(args.plan).read_text())["gpus"]
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
               __file__, args.plan, "--steps", str(args.steps), "--worker", out]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        found = sorted((json.loads(f.read_text()) for f in Path(out).glob("rank*.json")), key=lambda r: r["rank"])
    if done.returncode != 0 or len(found) != gpus:
        sys.exit(f"the census run failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    for r in found:
        print(f"rank {r['rank']}: peak {r['live_mib'] + r['beyond_mib']:.2f} MiB (live {r['live_mib']:.2f} at the "
              f"step's start + {r['beyond_mib']:.2f}), inside {' > '.join(r['at'][:6])}")
        for name, mib, here in r["levels"]:
            print(f"    {mib:8.2f} MiB  {name}{'   <- peak' if here else ''}")


if __name__ == "__main__":
    main()
