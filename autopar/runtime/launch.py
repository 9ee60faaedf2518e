"""Run plans locally: torchrun with one process per device of the plan (gloo on CPU).

``run_plans`` starts one torchrun job for several plans of the same size (the worker runs them
in turn in one process group); ``run_plan`` is the one-plan case behind ``autopar run``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from autopar.errors import UserError
from autopar.plan import Plan
from autopar.runtime.train import RunResult


def _first_error(workdir: Path, log: str) -> str:
    """The first rank's one-line report, else the log's last line."""
    for line in log.splitlines():
        if line.startswith("autopar: rank"):
            return line.removeprefix("autopar: ")
    tail = [line for line in log.splitlines() if line.strip()]
    return tail[-1] if tail else "no output"


def run_plans(plans: list[Plan], steps: int, *, workdir: Path | None = None, dump_params: bool = False,
              timeout_s: float = 600.0, threads_per_rank: int = 1) -> list[RunResult]:
    """Train each plan for ``steps`` optimizer steps in one torchrun job; one result per plan.
    With ``dump_params`` the final weights land in ``workdir/result.json.params<i>.rank<r>.pt``."""
    sizes = {p.gpus for p in plans}
    if len(sizes) != 1:
        raise UserError(f"plans of one job must have the same number of devices, got {sorted(sizes)}")
    world = sizes.pop()
    own = workdir is None
    tmp = tempfile.TemporaryDirectory(prefix="autopar-run-") if own else None
    wd = Path(tmp.name) if tmp else workdir
    wd.mkdir(parents=True, exist_ok=True)
    try:
        paths = []
        for i, plan in enumerate(plans):
            paths.append(wd / f"plan{i}.json")
            plan.save(paths[-1])
        out = wd / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "autopar.runtime.worker", *map(str, paths), "--steps", str(steps), "--out", str(out),
               "--timeout-s", str(min(timeout_s, 300.0))]
        if dump_params:
            cmd.append("--dump-params")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank), "PYTHONWARNINGS": "ignore"}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            raise UserError(f"the run did not finish in {timeout_s:.0f} s; try fewer --steps") from None
        log = proc.stdout + proc.stderr
        (wd / "run.log").write_text(log)
        if proc.returncode != 0 or not out.is_file():
            where = f"; full log in {wd / 'run.log'}" if not own else ""
            raise UserError(f"the run failed: {_first_error(wd, log)}{where}")
        runs = json.loads(out.read_text())["runs"]
        return [RunResult(losses=r["losses"], step_times_s=r["step_times_s"]) for r in runs]
    finally:
        if tmp is not None:
            tmp.cleanup()


def run_plan(plan: Plan, steps: int) -> RunResult:
    """Train ``plan`` locally for ``steps`` optimizer steps (``autopar run``)."""
    if steps < 1:
        raise UserError(f"--steps must be at least 1, got {steps}")
    return run_plans([plan], steps)[0]
