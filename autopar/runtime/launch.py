"""Run plans locally: torchrun with one process per device of the plan (gloo on CPU).

``run_job`` starts one torchrun job for several runs of the same size (the worker runs them
in turn in one process group); ``run_plan`` is the one-plan case behind ``autopar run``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from autopar.errors import UserError
from autopar.plan import Plan
from autopar.runtime.train import RunResult, TrainConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec:
    """One run of a job: train ``plan`` for ``steps`` optimizer steps."""

    plan: Plan
    steps: int
    resume: Path | None = None
    """A checkpoint directory (saved by any plan of the model) to start from."""
    save: Path | None = None
    """Where to write a checkpoint after the last step."""
    dump: bool = False
    """Write the full weights (``run<i>.final.rank<r>.pt``, and ``run<i>.loaded…`` after a
    resume) beside the job's result, for comparisons."""


def _first_error(log: str) -> str:
    """The first rank's one-line report, else the log's last line."""
    for line in log.splitlines():
        if line.startswith("autopar: rank"):
            return line.removeprefix("autopar: ")
    tail = [line for line in log.splitlines() if line.strip()]
    return tail[-1] if tail else "no output"


def run_job(runs: list[RunSpec], *, workdir: Path | None = None, cfg: TrainConfig = TrainConfig(),
            timeout_s: float = 600.0, threads_per_rank: int = 1) -> list[RunResult]:
    """Execute ``runs`` in turn in one torchrun job of their common size; one result each."""
    sizes = {r.plan.gpus for r in runs}
    if len(sizes) != 1:
        raise UserError(f"runs of one job must have the same number of devices, got {sorted(sizes)}")
    world = sizes.pop()
    own = workdir is None
    tmp = tempfile.TemporaryDirectory(prefix="autopar-run-") if own else None
    wd = Path(tmp.name) if tmp else Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    try:
        entries = []
        for i, run in enumerate(runs):
            run.plan.save(wd / f"plan{i}.json")
            entries.append({"plan": str(wd / f"plan{i}.json"), "steps": run.steps, "dump": run.dump,
                            "resume": str(run.resume) if run.resume else None,
                            "save": str(run.save) if run.save else None})
        out = wd / "result.json"
        (wd / "job.json").write_text(json.dumps({"runs": entries, "out": str(out), "lr": cfg.lr, "optimizer": cfg.optimizer,
                                                 "timeout_s": min(timeout_s, 300.0)}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "autopar.runtime.worker", str(wd / "job.json")]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank), "PYTHONWARNINGS": "ignore"}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            raise UserError(f"the run did not finish in {timeout_s:.0f} s; try fewer --steps") from None
        log = proc.stdout + proc.stderr
        (wd / "run.log").write_text(log)
        if proc.returncode != 0 or not out.is_file():
            where = f"; full log in {wd / 'run.log'}" if not own else ""
            raise UserError(f"the run failed: {_first_error(log)}{where}")
        return [RunResult(losses=r["losses"], step_times_s=r["step_times_s"], start_step=r["start_step"])
                for r in json.loads(out.read_text())["runs"]]
    finally:
        if tmp is not None:
            tmp.cleanup()


def run_plan(plan: Plan, steps: int, *, resume: Path | None = None, save: Path | None = None) -> RunResult:
    """Train ``plan`` locally for ``steps`` optimizer steps (``autopar run``)."""
    if steps < 1:
        raise UserError(f"--steps must be at least 1, got {steps}")
    if resume is not None and not (Path(resume) / ".metadata").is_file():
        raise UserError(f"{resume} is not a checkpoint (no .metadata); write one with `autopar run --save DIR`")
    return run_job([RunSpec(plan=plan, steps=steps, resume=resume, save=save)])[0]
