"""The per-rank entry point torchrun starts, for ``autopar run`` and ``autopar launch``'s scripts::

    python -m autopar.runtime.worker PLAN.json [--steps K] [--data FILE] [--save DIR [--save-every K]]
                                     [--resume DIR] [--trust-code] [--out FILE]
    python -m autopar.runtime.worker --job JOB.json

The first form is one run of a plan (what ``autopar launch`` writes); the second a job file
(``runtime.launch.run_job``, behind ``autopar run``): a list of runs (plan, steps, optional
checkpoint to resume from and to save to, whether to dump the full weights) executed in turn in
one process group, so tests pay the start-up once; both become the same job. Rank 0 prints
each step's loss and writes ``{"runs": [{"losses", "step_times_s", "start_step"}, ...]}`` to
the job's ``out``.

A run with ``save`` writes checkpoints (``autopar.checkpoint_dir``) every ``save_every`` steps
and after its last. Under torchrun ``--max-restarts``, a restarted worker (``TORCHELASTIC_RESTART_COUNT``
> 0) resumes each run from the latest checkpoint that run wrote (same ``TORCHELASTIC_RUN_ID``,
same store), trains to the run's original last step and reports the losses of every step, those
before the failure from the checkpoint's record: the result equals an uninterrupted run's.
``runtime.faults`` is the test hook that kills a rank on purpose. Every rank reports its own exception (any ``BaseException``: DCP's
``CheckpointException`` is one), on one line to stderr (``autopar: rank R: Type: first line``;
``autopar run`` has torchrun keep each rank's stderr in its own file) and in full to
``rank<R>.err`` beside the output (without an output, to stderr after that line), so a failure
on one rank is not seen only as the others hanging.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback
from pathlib import Path
from typing import Callable, NoReturn

import torch
import torch.distributed as dist

from autopar import checkpoint_dir
from autopar.plan import load_plan, refuse_code
from autopar.runtime import checkpoint, phases
from autopar.runtime.faults import Fault, kill_if
from autopar.runtime.context import build_context, check_plan, init_distributed
from autopar.runtime.state import full_state
from autopar.runtime.train import Program, TrainConfig, build_program, train


def _dump(prog: Program, out: Path, name: str, rank: int) -> None:
    """This rank's share of the full weights (dp, cp and tp rank 0 of each stage write)."""
    state = full_state(prog)
    if state is not None:
        torch.save(state, out.with_name(f"{name}.rank{rank}.pt"))


def _print_step(step: int, loss: float, seconds: float) -> None:
    print(f"step {step}: loss {loss:.6f}  {seconds:.3f} s", flush=True)


def _is_restart() -> bool:
    """Whether torchrun restarted this worker after a failure."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def _source(run: dict, rank: int, trust_code: bool) -> checkpoint_dir.Found | None:
    """The checkpoint a run starts from: after a torchrun restart, the latest one this run
    (torchrun's run id) saved; else ``--resume``'s. Rank 0 verifies its checksums, the other
    ranks wait for it (a rank 0 that refuses ends the job)."""
    found = None
    if run.get("save") and _is_restart():
        found = checkpoint_dir.of_run(Path(run["save"]), os.environ.get("TORCHELASTIC_RUN_ID"))
        if found is not None and rank == 0:
            found = checkpoint_dir.resolve(found.path, trust_code=trust_code)
    if found is None and run.get("resume"):
        found = checkpoint_dir.resolve(Path(run["resume"]), trust_code=trust_code, check=rank == 0)
    if found is not None and dist.is_initialized():
        dist.barrier()
    return found


def _restarted(run: dict, found: checkpoint_dir.Found | None) -> checkpoint_dir.RunRecord | None:
    """The record of ``found`` if this very run (torchrun's run id, its --save store) wrote it."""
    record = found.manifest.run if found is not None and found.manifest is not None else None
    mine = (_is_restart() and record is not None and record.run_id is not None and run.get("save")
            and record.run_id == os.environ.get("TORCHELASTIC_RUN_ID")
            and found is not None and found.path.parent.resolve() == Path(run["save"]).resolve())
    return record if mine else None


def _one_run(prog: Program, run: dict, cfg: TrainConfig, where: checkpoint.Position,
             record: checkpoint_dir.RunRecord | None, rank: int) -> dict:
    """Train one run from ``where`` (``record``: this run's own checkpoint after a restart),
    saving every ``save_every`` steps and after the last; ``{"losses", "step_times_s",
    "start_step"}`` of the run's steps, those before a restart taken from the record."""
    plan = prog.plan
    step = where.step
    sample = where.samples if where.samples is not None else step * plan.global_batch
    if record is not None:  # this run's own checkpoint: go on to its end, keep its earlier losses
        start, end = record.start_step, record.end_step
        cut = slice(start - record.first_step, step - record.first_step)
        losses, times = list(record.losses[cut]), list(record.step_times_s[cut])
    else:
        start, end, losses, times = step, step + run["steps"], [], []
    every, store = run.get("save_every") or 0, run.get("save")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")

    def after(done_step: int, loss: float, seconds: float) -> None:
        if rank == 0:
            _print_step(done_step, loss, seconds)
        losses.append(loss)
        times.append(seconds)
        done = done_step + 1
        if store and (done == end or (every and done % every == 0)):
            checkpoint.save(prog, store, done, sample + (done - step) * plan.global_batch,
                            checkpoint_dir.RunRecord(run_id=run_id, start_step=start, end_step=end, first_step=start,
                                                     losses=tuple(losses), step_times_s=tuple(times)))
        if done < end:
            kill_if(Fault.STEP, rank, done)

    kill_if(Fault.STEP, rank, step)
    profiled = min(run.get("phases") or 0, end - step)  # ``autopar calibrate``: profile the last steps
    optimizer_s: list[float] = []
    if end - profiled > step:
        optimizer_s = train(plan, end - profiled - step, prog.ctx, cfg, program=prog, start_step=step,
                            start_sample=sample, on_step=after).optimizer_times_s
    result = {"losses": losses, "step_times_s": times, "start_step": start}
    if profiled:
        at = end - profiled
        result["phases"] = _profiled(prog, profiled, cfg, at, sample + (at - step) * plan.global_batch, after, rank,
                                     optimizer_s)
    return result


def _profiled(prog: Program, steps: int, cfg: TrainConfig, step: int, sample: int,
              after: Callable[[int, float, float], None], rank: int, optimizer_s: list[float]) -> list[dict] | None:
    """Train ``steps`` steps from ``step`` under the profiler (``runtime.phases``); on rank 0,
    every rank's phase summary with its peak memory, bytes (CUDA: the allocator's peak; CPU:
    the live weights, gradients and optimizer state plus the most allocated at once beyond
    them), and where given its optimizer step's median over the timed steps before
    (``optimizer_timed``, s; ``optimizer_s`` of ``train``): the profiler adds its own time to
    each of the step's many small operators (an AdamW step of 133 small tensors on CPU: 31
    events a tensor, 6.2 ms plain, 13.8 ms profiled)."""
    cuda = prog.ctx.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    live = phases.live_bytes(prog.modules, prog.optimizers)

    def marked(done: int, loss: float, seconds: float) -> None:
        phases.step_ended()
        after(done, loss, seconds)
    with phases.recording(prog.ctx.device) as prof:
        train(prog.plan, steps, prog.ctx, cfg, program=prog, start_step=step, start_sample=sample, on_step=marked)
    mine = phases.summary(prof, steps, prog.ctx.device)
    mine.update(rank=rank, peak_bytes=float(torch.cuda.max_memory_allocated()) if cuda
                else live + mine["peak_delta_bytes"])
    if optimizer_s:
        mine["optimizer_timed"] = statistics.median(optimizer_s)
    if not dist.is_initialized():
        return [mine]
    gathered: list = [None] * dist.get_world_size() if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    return gathered if rank == 0 else None


def run_job(job: dict, rank: int) -> list[dict]:
    trust_code = bool(job.get("trust_code"))
    device = init_distributed(job.get("timeout_s", 300.0))
    if dist.is_initialized():  # every rank has joined: a refusal below cannot cut one off mid-join
        dist.barrier()
    plans = [load_plan(run["plan"]) for run in job["runs"]]
    for plan, run in zip(plans, job["runs"]):  # every rank refuses every run it cannot start
        if not trust_code:
            refuse_code(plan, run["plan"])
        check_plan(plan)
    data = job.get("data")
    cfg = TrainConfig(lr=job.get("lr", TrainConfig().lr), optimizer=job.get("optimizer", "adamw"),
                      data=Path(data) if data else None)
    out = Path(job["out"]) if job.get("out") else None
    results = []
    for i, (plan, run) in enumerate(zip(plans, job["runs"])):
        ctx = build_context(plan, device)
        prog = build_program(plan, ctx, cfg)
        found = _source(run, rank, trust_code)
        where = checkpoint.load(prog, found) if found is not None else checkpoint.Position(step=0, samples=0)
        if run.get("dump") and found is not None and out is not None:
            _dump(prog, out, f"run{i}.loaded", rank)
        result = _one_run(prog, run, cfg, where, _restarted(run, found), rank)
        if run.get("dump") and out is not None:
            _dump(prog, out, f"run{i}.final", rank)
        results.append(result)
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
    parser.add_argument("--save", help="write checkpoints into this directory (DIR/step-N, DIR/latest), "
                        "after the last step and every --save-every steps")
    parser.add_argument("--save-every", type=int, default=0, help="also save every K steps (0: only at the end)")
    parser.add_argument("--resume", help="start from this checkpoint, or a --save directory's latest (saved by "
                        "any plan of the model)")
    parser.add_argument("--trust-code", action="store_true", help="allow a plan naming a Python file, and a "
                        "checkpoint without autopar's manifest (README: What is code)")
    parser.add_argument("--out", help="rank 0 writes the losses and step times here (JSON)")
    args = parser.parse_args(argv)
    if (args.job is None) == (args.plan is None):
        parser.error("give a plan or --job (one of them)")
    if args.job is not None:
        return json.loads(Path(args.job).read_text())
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.save_every < 0:
        parser.error(f"--save-every must be at least 0, got {args.save_every}")
    return {"runs": [{"plan": args.plan, "steps": args.steps, "resume": args.resume, "save": args.save,
                      "save_every": args.save_every}],
            "out": args.out, "data": args.data, "trust_code": args.trust_code}


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
