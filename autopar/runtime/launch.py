"""Run plans locally: torchrun with one process per device of the plan (gloo on CPU).

``run_job`` starts one torchrun job for several runs of the same size (the worker runs them
in turn in one process group); ``run_plan`` is the one-plan case behind ``autopar run``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from autopar.checkpoint_dir import resolve
from autopar.data import open_corpus
from autopar.errors import UserError
from autopar.plan import Plan
from autopar.runtime.train import RunResult, TrainConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec:
    """One run of a job: train ``plan`` for ``steps`` optimizer steps."""

    plan: Plan
    steps: int
    resume: Path | None = None
    """A checkpoint (saved by any plan of the model), or a ``save`` directory (its latest), to start from."""
    save: Path | None = None
    """The directory to write checkpoints into (``autopar.checkpoint_dir``): after the last step,
    and every ``save_every`` steps."""
    save_every: int = 0
    """Save every this many steps too (0: after the last step only)."""
    phases: int = 0
    """Profile this many last steps (``runtime.phases``, for ``autopar calibrate``; the
    profiler slows them): ``RunResult.phases`` gets every rank's summary; 0: no profiling."""
    dump: bool = False
    """Write the full weights (``run<i>.final.rank<r>.pt``, and ``run<i>.loaded…`` after a
    resume) beside the job's result, for comparisons."""


def _check_experts(plan: Plan) -> None:
    """Refuse, before any process starts, an expert-parallel layout the runtime cannot run, as
    far as the model spec and the plan's layout tell (the worker checks an HF model's module)."""
    from autopar.layout import expert_parallel_unsupported
    from autopar.spec import parse_model_spec
    spec, ep = parse_model_spec(plan.model), plan.mesh.ep
    moe = bool(spec.experts) or (plan.layout is not None and plan.layout.any_experts())
    if not moe and ep == 1:
        return
    if spec.arch == "hf" and plan.layout is None:  # MoE or not: its trace tells (the worker checks that)
        if ep == 1:
            return
        moe = True
    reason = expert_parallel_unsupported(ep=ep, dp=plan.mesh.dp, sequence_parallel=plan.sequence_parallel,
                                         moe=moe, experts=spec.experts, user_module=spec.arch == "module")
    if reason:
        raise UserError(reason)


def _rank_logs(logs: Path | None) -> dict[int, Path]:
    """Each rank's stderr file in the job's torchrun log directory ``logs``
    (``attempt_<n>/<rank>/stderr.log``; one node: local rank = rank; the last attempt)."""
    found: dict[int, Path] = {}
    if logs is None:
        return found
    attempts = [p for p in logs.glob("attempt_*") if p.name.removeprefix("attempt_").isdigit()]
    for attempt in sorted(attempts, key=lambda p: int(p.name.removeprefix("attempt_"))):
        for path in attempt.glob("*/stderr.log"):
            if path.parent.name.isdigit():
                found[int(path.parent.name)] = path
    return found


def _meaningful(lines: list[str]) -> str:
    """The last line with a letter or digit (skips rules of ``=`` and ``-``), or ''."""
    return next((line.strip() for line in reversed(lines) if any(c.isalnum() for c in line)), "")


_TORCHRUN_ENV = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"}
"""What a torchrun worker inherits from its own launcher: a job started from inside one (a
rank verifying a model's twin) must not join that job."""


def _killed(log: str, reported: set[int]) -> str:
    """``rank R killed by signal S; then `` for a rank that a signal ended without a report,
    other than the SIGTERM/SIGINT torchrun stops the others with (torchrun may name a rank that
    lost its connection to it as the root cause), else ''."""
    for rank, code in re.findall(r"\brank\s*:\s*(\d+).*?\bexitcode\s*:\s*(-?\d+)", log, re.S):
        if int(code) < 0 and -int(code) not in (signal.SIGTERM, signal.SIGINT) and int(rank) not in reported:
            name = next((sig.name for sig in signal.Signals if sig == -int(code)), "?")
            return f"rank {rank} killed by signal {-int(code)} ({name}); then "
    return ""


def _first_error(wd: Path, logs: Path | None, log: str) -> str:
    """The one-line report of the rank that failed first (the earliest ``rank<R>.err``), after
    a rank a signal killed first (``_killed``); without a report, the rank torchrun names as the
    root cause and its exit code or last line."""
    reports = {}
    for rank, path in _rank_logs(logs).items():
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.startswith("autopar: rank")]
        if lines:
            reports[rank] = lines[-1].removeprefix("autopar: ")
    if reports:
        def written(rank: int) -> float:
            err = wd / f"rank{rank}.err"
            return err.stat().st_mtime_ns if err.is_file() else float("inf")
        return _killed(log, set(reports)) + reports[min(reports, key=lambda r: (written(r), r))]
    root = log.rpartition("Root Cause")[2] or log  # torchrun's summary lists other failures first
    cause = re.search(r"\brank\s*:\s*(\d+).*?\bexitcode\s*:\s*(-?\d+)", root, re.S)
    if cause:
        rank, code = int(cause.group(1)), int(cause.group(2))
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        rank_log = _rank_logs(logs).get(rank)
        last = _meaningful(rank_log.read_text(errors="replace").splitlines()) if rank_log else ""
        return f"rank {rank} {how}" + (f": {last}" if last else "")
    return _meaningful(log.splitlines()) or "no output"


def _kept(wd: Path) -> str:
    return f"; rank logs and tracebacks in {wd}"


def run_job(runs: list[RunSpec], *, workdir: Path | None = None, cfg: TrainConfig = TrainConfig(),
            timeout_s: float = 600.0, threads_per_rank: int = 1, max_restarts: int = 0, trust_code: bool = True,
            on_step: Callable[[int, float, float], None] | None = None) -> list[RunResult]:
    """Execute ``runs`` in turn in one torchrun job of their common size; one result each.

    ``max_restarts``: torchrun restarts the workers after a failure (a killed rank) up to this
    many times; a run with ``save`` resumes from its latest checkpoint (``runtime.worker``).
    ``trust_code``: the workers may import a plan's Python file and load a checkpoint without
    a manifest (the Python API is code already; ``autopar run`` passes its ``--trust-code``).

    Each rank's stdout and stderr go to their own files under ``<workdir>/logs`` (torchrun's
    ``--log-dir`` and ``--redirects 3``), a failing rank's traceback to ``rank<R>.err`` and
    torchrun's own output to ``run.log``. Without ``workdir`` a temporary directory holds them:
    removed after a successful job, kept after a failure, which names it."""
    sizes = {r.plan.gpus for r in runs}
    if len(sizes) != 1:
        raise UserError(f"runs of one job must have the same number of devices, got {sorted(sizes)}")
    world = sizes.pop()
    for run in runs:
        _check_experts(run.plan)
    own = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="autopar-run-")) if workdir is None else Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, run in enumerate(runs):
        run.plan.save(wd / f"plan{i}.json")
        entries.append({"plan": str(wd / f"plan{i}.json"), "steps": run.steps, "dump": run.dump, "phases": run.phases,
                        "resume": str(run.resume) if run.resume else None,
                        "save": str(run.save) if run.save else None, "save_every": run.save_every})
    out = wd / "result.json"
    for stale in (out, *wd.glob("rank*.err")):  # from an earlier job in this workdir
        stale.unlink(missing_ok=True)
    earlier = set((wd / "logs").glob("*"))
    (wd / "job.json").write_text(json.dumps({"runs": entries, "out": str(out), "lr": cfg.lr, "optimizer": cfg.optimizer,
                                             "data": str(Path(cfg.data).absolute()) if cfg.data else None,
                                             "trust_code": trust_code,
                                             "timeout_s": min(timeout_s, 300.0)}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           f"--log-dir={wd / 'logs'}", "--redirects=3", f"--max-restarts={max_restarts}",
           "-m", "autopar.runtime.worker", "--job", str(wd / "job.json")]
    env = {**{k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")},
           "OMP_NUM_THREADS": str(threads_per_rank), "PYTHONWARNINGS": "ignore",
           # torch 2.13 shares one TCPStore across restarts, where gloo finds the killed attempt's
           # addresses ("Connection refused"): a store per rendezvous round.
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        try:
            log = _wait(proc, timeout_s, wd / "logs", earlier, on_step)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun stops its workers on SIGTERM (they run in their own sessions)
            try:
                log, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                log, _ = proc.communicate()
            (wd / "run.log").write_text(log)
            raise UserError(f"the run did not finish in {timeout_s:.0f} s; try fewer --steps{_kept(wd)}") from None
    (wd / "run.log").write_text(log)
    if proc.returncode != 0 or not out.is_file():
        logs = max(set((wd / "logs").glob("*")) - earlier, key=lambda p: p.stat().st_mtime_ns, default=None)
        raise UserError(f"the run failed: {_first_error(wd, logs, log)}{_kept(wd)}")
    results = [RunResult(losses=r["losses"], step_times_s=r["step_times_s"], start_step=r["start_step"],
                         phases=tuple(r.get("phases") or ()))
               for r in json.loads(out.read_text())["runs"]]
    if own:
        shutil.rmtree(wd, ignore_errors=True)
    return results


def _wait(proc: subprocess.Popen, timeout_s: float, logs: Path, earlier: set[Path],
          on_step: Callable[[int, float, float], None] | None) -> str:
    """torchrun's own output once it exits; meanwhile each step rank 0 reports (``step N: loss
    L  T s`` in its stdout file) goes to ``on_step(N, L, T)``. Raises ``TimeoutExpired``."""
    if on_step is None:
        return proc.communicate(timeout=timeout_s)[0]
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(proc.stdout or ()), daemon=True)
    reader.start()
    deadline, seen, shown_from = time.monotonic() + timeout_s, 0, None
    while True:
        done = proc.poll() is not None
        runs = sorted(set(logs.glob("*")) - earlier)
        attempts = sorted(runs[-1].glob("attempt_*"), key=lambda p: int(p.name.rpartition("_")[2])) if runs else []
        rank0 = attempts[-1] / "0" / "stdout.log" if attempts else None
        if rank0 is not None and rank0.is_file():
            if rank0 != shown_from:  # a restart: its steps from the checkpoint on
                shown_from, seen = rank0, 0
            lines = [line.split() for line in rank0.read_text().splitlines() if line.startswith("step ")]
            for words in lines[seen:]:
                on_step(int(words[1].rstrip(":")), float(words[3]), float(words[4]))
            seen = len(lines)
        if done:
            reader.join(timeout=5)
            return "".join(chunks)
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
        time.sleep(0.2)


def run_plan(plan: Plan, steps: int, *, resume: Path | None = None, save: Path | None = None, save_every: int = 0,
             max_restarts: int = 0, trust_code: bool = True, cfg: TrainConfig = TrainConfig(),
             on_step: Callable[[int, float, float], None] | None = None) -> RunResult:
    """Train ``plan`` locally for ``steps`` optimizer steps (``autopar run``), on ``cfg.data``
    (a token file, checked before anything starts) or synthetic tokens; ``resume``'s checksums
    are verified before any rank starts."""
    if steps < 1:
        raise UserError(f"--steps must be at least 1, got {steps}")
    if save_every < 0:
        raise UserError(f"--save-every must be at least 0, got {save_every}")
    if resume is not None:
        resolve(resume, trust_code=trust_code)
    if cfg.data is not None:
        open_corpus(cfg.data, plan.seq_len)
    return run_job([RunSpec(plan=plan, steps=steps, resume=resume, save=save, save_every=save_every)], cfg=cfg,
                   max_restarts=max_restarts, trust_code=trust_code, on_step=on_step)[0]
