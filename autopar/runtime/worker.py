"""The per-rank entry point torchrun starts, for ``autopar run`` and ``autopar launch``'s scripts::

    python -m autopar.runtime.worker PLAN.json [--steps K] [--data FILE] [--save DIR] [--resume DIR] [--out FILE]
    python -m autopar.runtime.worker --job JOB.json

The first form is one run of a plan (what ``autopar launch`` writes); the second a job file
(``runtime.launch.run_job``, behind ``autopar run``): a list of runs (plan, steps, optional
checkpoint to resume from and to save to, whether to dump the full weights) executed in turn in
one process group, so tests pay the start-up once; both become the same job. Rank 0 prints
each step's loss and writes ``{"runs": [{"losses", "step_times_s", "start_step"}, ...]}`` to
the job's ``out``. Every rank reports its own exception (any ``BaseException``: DCP's
``CheckpointException`` is one), on one line to stderr (``autopar: rank R: Type: first line``;
``autopar run`` has torchrun keep each rank's stderr in its own file) and in full to
``rank<R>.err`` beside the output (without an output, to stderr after that line), so a failure
on one rank is not seen only as the others hanging.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from autopar.plan import load_plan
from autopar.runtime import checkpoint, phases
from autopar.runtime.context import build_context, init_distributed
from autopar.runtime.state import full_state
from autopar.runtime.train import Program, TrainConfig, build_program, train


def _dump(prog: Program, out: Path, name: str, rank: int) -> None:
    """This rank's share of the full weights (dp and tp rank 0 of each stage write)."""
    state = full_state(prog)
    if state is not None:
        torch.save(state, out.with_name(f"{name}.rank{rank}.pt"))


def _print_step(step: int, loss: float, seconds: float) -> None:
    print(f"step {step}: loss {loss:.6f}  {seconds:.3f} s", flush=True)


def _profiled(plan, steps: int, profiled: int, ctx, cfg: TrainConfig, prog: Program, start: int, sample: int,
              rank: int):
    """Train ``steps - profiled`` steps, then profile the last ``profiled`` (``runtime.phases``):
    the run's result and,
    on rank 0, every rank's phase summary with its peak memory (CUDA: the allocator's peak;
    CPU: the live weights, gradients and optimizer state plus the most allocated at once beyond
    them, bytes: ``runtime.phases``)."""
    plain = steps - profiled
    first = train(plan, plain, ctx, cfg, program=prog, start_step=start, start_sample=sample,
                  on_step=_print_step if rank == 0 else None)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    live = phases.live_bytes(prog.modules, prog.optimizers)
    with phases.recording(ctx.device) as prof:
        rest = train(plan, profiled, ctx, cfg, program=prog, start_step=start + plain,
                     start_sample=sample + plain * plan.global_batch, on_step=_print_step if rank == 0 else None)
    mine = phases.summary(prof, profiled, ctx.device)
    mine.update(rank=rank, peak_bytes=float(torch.cuda.max_memory_allocated()) if ctx.device.type == "cuda"
                else live + mine["peak_delta_bytes"])
    gathered: list = [None] * dist.get_world_size() if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    joined = type(first)(losses=first.losses + rest.losses, step_times_s=first.step_times_s + rest.step_times_s,
                         start_step=start)
    return joined, gathered if rank == 0 else None


def run_job(job: dict, rank: int) -> list[dict]:
    device = init_distributed(job.get("timeout_s", 300.0))
    data = job.get("data")
    cfg = TrainConfig(lr=job.get("lr", TrainConfig().lr), optimizer=job.get("optimizer", "adamw"),
                      data=Path(data) if data else None)
    out = Path(job["out"]) if job.get("out") else None
    results = []
    for i, run in enumerate(job["runs"]):
        plan = load_plan(run["plan"])
        ctx = build_context(plan, device)
        prog = build_program(plan, ctx, cfg)
        where = checkpoint.load(prog, run["resume"]) if run.get("resume") else checkpoint.Position(step=0, samples=0)
        start = where.step
        sample = where.samples if where.samples is not None else start * plan.global_batch
        if run.get("dump") and run.get("resume") and out is not None:
            _dump(prog, out, f"run{i}.loaded", rank)
        if run.get("phases"):  # ``autopar calibrate``: profile the last steps
            result, summaries = _profiled(plan, run["steps"], run["phases"], ctx, cfg, prog, start, sample, rank)
        else:
            result, summaries = train(plan, run["steps"], ctx, cfg, program=prog, start_step=start, start_sample=sample,
                                   on_step=_print_step if rank == 0 else None), None
        if run.get("save"):
            checkpoint.save(prog, run["save"], start + run["steps"], sample + run["steps"] * plan.global_batch)
        if run.get("dump") and out is not None:
            _dump(prog, out, f"run{i}.final", rank)
        results.append({"losses": result.losses, "step_times_s": result.step_times_s, "start_step": start,
                        **({"phases": summaries} if summaries is not None else {})})
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


def _fail(exc: BaseException, out: Path | None, rank: int, code: int) -> NoReturn:
    """Report this rank's failure (one line to stderr; the traceback to ``rank<R>.err`` beside
    ``out``, or after that line), then exit at once with ``code``: torchrun stops the other
    ranks, and no collective or atexit handler can hang this one."""
    try:
        if out is not None:
            out.with_name(f"rank{rank}.err").write_text(traceback.format_exc())
    finally:
        print(f"autopar: {report(exc, rank)}", file=sys.stderr, flush=True)
        if out is None:
            traceback.print_exc(file=sys.stderr)
            sys.stderr.flush()
        os._exit(code)


def parse_args(argv: list[str]) -> dict:
    """The job the command line describes: a job file's (``--job``), or one run of a plan."""
    parser = argparse.ArgumentParser(prog="python -m autopar.runtime.worker",
                                     description="Train a plan: one process of the torchrun job.")
    parser.add_argument("plan", nargs="?", help="the plan JSON to train")
    parser.add_argument("--job", help="a job file of several runs (written by autopar run)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--data", help="token file to train on (default: synthetic tokens)")
    parser.add_argument("--save", help="write a checkpoint here after the last step")
    parser.add_argument("--resume", help="start from this checkpoint (saved by any plan of the model)")
    parser.add_argument("--out", help="rank 0 writes the losses and step times here (JSON)")
    args = parser.parse_args(argv)
    if (args.job is None) == (args.plan is None):
        parser.error("give a plan or --job (one of them)")
    if args.job is not None:
        return json.loads(Path(args.job).read_text())
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    return {"runs": [{"plan": args.plan, "steps": args.steps, "resume": args.resume, "save": args.save}],
            "out": args.out, "data": args.data}


def main(argv: list[str] | None = None) -> None:
    job = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(job["out"]) if job.get("out") else None
    rank = int(os.environ.get("RANK", 0))
    try:
        results = run_job(job, rank)
        if rank == 0 and out is not None:
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
    # The work is done, the result written and the process group destroyed: leave without the
    # interpreter's teardown, where torch 2.13's destructors sometimes abort a rank (SIGABRT,
    # "terminate called without an active exception"), which torchrun reports as a failed run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
