"""The per-rank entry point torchrun starts: ``python -m autopar.runtime.worker JOB.json``.

A job is a list of runs (plan, steps, optional checkpoint to resume from and to save to,
whether to dump the full weights) executed in turn in one process group: runs of one job share
the world size, so tests pay the start-up once. Rank 0 writes ``{"runs": [{"losses",
"step_times_s", "start_step"}, ...]}`` to the job's ``out``. Every rank reports its own
exception (any ``BaseException``: DCP's ``CheckpointException`` is one), on one line to stderr
(``autopar: rank R: Type: first line``; the launcher has torchrun keep each rank's stderr in its
own file) and in full to ``rank<R>.err`` beside the output, so a failure on one rank is not seen
only as the others hanging.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from autopar.plan import load_plan
from autopar.runtime import checkpoint
from autopar.runtime.context import build_context, init_distributed
from autopar.runtime.state import full_state
from autopar.runtime.train import Program, TrainConfig, build_program, train


def _dump(prog: Program, out: Path, name: str, rank: int) -> None:
    """This rank's share of the full weights (dp and tp rank 0 of each stage write)."""
    state = full_state(prog)
    if state is not None:
        torch.save(state, out.with_name(f"{name}.rank{rank}.pt"))


def run_job(job: dict, rank: int) -> list[dict]:
    device = init_distributed(job.get("timeout_s", 300.0))
    cfg = TrainConfig(lr=job.get("lr", TrainConfig().lr), optimizer=job.get("optimizer", "adamw"))
    out = Path(job["out"])
    results = []
    for i, run in enumerate(job["runs"]):
        plan = load_plan(run["plan"])
        ctx = build_context(plan, device)
        prog = build_program(plan, ctx, cfg)
        start = checkpoint.load(prog, run["resume"]) if run.get("resume") else 0
        if run.get("dump") and run.get("resume"):
            _dump(prog, out, f"run{i}.loaded", rank)
        result = train(plan, run["steps"], ctx, cfg, program=prog, start_step=start)
        if run.get("save"):
            checkpoint.save(prog, run["save"], start + run["steps"])
        if run.get("dump"):
            _dump(prog, out, f"run{i}.final", rank)
        results.append({"losses": result.losses, "step_times_s": result.step_times_s, "start_step": start})
    return results


def _meaningful(text: str) -> str:
    """The first line of ``text`` with a letter or digit (skips rules of ``=`` or ``-``), or ''."""
    return next((line.strip() for line in text.splitlines() if any(c.isalnum() for c in line)), "")


def report(exc: BaseException, rank: int) -> str:
    """One line naming ``exc``: ``rank R: Type: message``. A DCP ``CheckpointException`` is
    reported by the first exception it wraps (its own text is a multi-line traceback dump)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        inner = first[0] if isinstance(first, tuple) and first else first
        if isinstance(inner, BaseException):
            return f"rank {rank}: {type(exc).__name__}: {type(inner).__name__}: {_meaningful(str(inner)) or '-'}"
    return f"rank {rank}: {type(exc).__name__}: {_meaningful(str(exc)) or type(exc).__name__}"


def _fail(exc: BaseException, out: Path, rank: int, code: int) -> NoReturn:
    """Report this rank's failure (traceback to ``rank<R>.err``, one line to stderr), then exit
    at once with ``code``: torchrun stops the other ranks, and no collective or atexit handler
    can hang this one."""
    try:
        out.with_name(f"rank{rank}.err").write_text(traceback.format_exc())
    finally:
        print(f"autopar: {report(exc, rank)}", file=sys.stderr, flush=True)
        os._exit(code)


def main(argv: list[str] | None = None) -> None:
    job_file = Path((argv or sys.argv[1:])[0])
    job = json.loads(job_file.read_text())
    out = Path(job["out"])
    rank = int(os.environ.get("RANK", 0))
    try:
        results = run_job(job, rank)
        if rank == 0:
            out.write_text(json.dumps({"runs": results}))
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except SystemExit as exc:
        if exc.code in (0, None):  # a clean exit is not a failure
            raise
        _fail(exc, out, rank, exc.code if isinstance(exc.code, int) else 1)
    except KeyboardInterrupt as exc:
        _fail(exc, out, rank, 130)
    except BaseException as exc:  # noqa: B036 - DCP's CheckpointException is a BaseException
        _fail(exc, out, rank, 1)


if __name__ == "__main__":
    main()
