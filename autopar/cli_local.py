"""The ``autopar`` commands that run on this machine: profile, verify, run, calibrate, tokenize, demo."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from autopar.cli_checks import check_out, check_save, load_plan_file
from autopar.cli_common import (DATA, JSON, MODEL, RESUME, SAVE, SAVE_EVERY, TRUST, _guard, _print_plan, app,
                                console)
from autopar.errors import UserError
from autopar.limits import MAX_LOCAL_RANKS, check_count
from autopar.plan import Plan
from autopar.workflow import launch_refusal, make_plan, read_job


def _local_plan(plan_file: Path, trust_code: bool, command: str) -> Plan:
    """The plan ``autopar run``/``calibrate`` may start on this machine: every rank local
    (torchrun --standalone), every feature it uses proven on the model's twin."""
    the_plan = load_plan_file(plan_file, trust_code)
    if the_plan.gpus > MAX_LOCAL_RANKS:
        raise UserError(f"autopar {command} starts every rank on this machine (torchrun --standalone); a plan of "
                        f"{the_plan.gpus} devices needs at most {MAX_LOCAL_RANKS}: plan for fewer --gpus")
    refusal = launch_refusal(the_plan)
    if refusal:
        raise UserError(refusal)
    from autopar.profile import cuda_devices
    gpus = cuda_devices()
    if 0 < gpus < the_plan.gpus:  # with no GPU the ranks run on CPU (gloo)
        raise UserError(f"autopar {command} starts one rank per GPU on this machine, which has {gpus}; a plan of "
                        f"{the_plan.gpus} devices needs {the_plan.gpus}: plan for --gpus {gpus}")
    return the_plan


@app.command()
def profile(ranks: int = typer.Option(4, "--ranks", help="Processes to measure at once (devices of the cluster)"),
            out: Path = typer.Option(Path("my-cluster.json"), "--out", help="Where to write the hardware profile"),
            name: Optional[str] = typer.Option(None, "--name", help="The profile's name (default: --out's stem)"),
            repeats: int = typer.Option(1, "--repeats", help="Runs of every measurement; each figure their median"),
            links: Optional[str] = typer.Option(None, "--links", help="With --ranks 1 (no peer to time collectives "
                                                "with): the profile whose links plans of more devices use"),
            as_json: bool = JSON) -> None:
    """Measure this machine as a cluster (GEMMs, memory bandwidth, per-op dispatch, collectives
    fitted to the cost model's α-β law, then a reference training run's efficiencies) and write a
    hardware profile for --cluster."""
    def body() -> None:
        from rich.progress import Progress
        from autopar.profile import PHASES, profile_machine
        with Progress(console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("profiling", total=len(PHASES))

            def on_phase(phase: str, run: int) -> None:
                bar.update(task, completed=PHASES.index(phase) if phase in PHASES else 0,
                           description=f"profiling: {phase}" + (f" (run {run + 1} of {repeats})" if repeats > 1 else ""))
            result = profile_machine(ranks, out, name or out.stem, on_phase, repeats, links)
        if as_json:
            typer.echo(json.dumps(result, indent=2))
            return
        table = Table("figure", "value", title=f"{result['name']}: {result['device']} x {ranks}")
        tier = result["intra_node"]
        for key, value in (("peak TFLOP/s", result["peak_tflops"]), ("matmul efficiency", result["matmul_efficiency"]),
                           ("memory GB/s", result["hbm_bw_gbps"]),
                           ("element-wise efficiency (reference run)", round(result["memory_efficiency"], 4)),
                           ("optimizer efficiency (reference run)", round(result["optimizer_memory_efficiency"], 4)),
                           ("dispatch us/op", result["kernel_dispatch_us"]),
                           ("TP host us per split Linear", result["tp_linear_us"]),
                           ("FSDP2 hooks us per group", result["fsdp_hook_us"]),
                           ("pipeline host us per chunk (zero-bubble: per block)",
                            f"{result['pp_chunk_us']} ({result['zb_block_us']})"),
                           ("checkpoint host us per block (" + ", ".join(result["checkpoint_us"]) + ")",
                            ", ".join(str(v) for v in result["checkpoint_us"].values())),
                           ("collective us per call", tier.get("call_latency_us", 0.0)),
                           ("collective alpha us/step", tier["latency_us"]), ("bus GB/s", tier["bw_gbps"]),
                           ("p2p GB/s", tier["p2p_bw_gbps"])):
            table.add_row(key, str(value))
        console.print(table)
        console.print(f"written to {out}; use it with --cluster {out}")
    _guard(body)


@app.command()
def verify(model: str = MODEL,
           cached: bool = typer.Option(True, "--cache/--no-cache", help="Reuse verdicts cached for this architecture"),
           as_json: bool = JSON) -> None:
    """Prove each parallel dimension (FSDP, TP, SP, PP, selective recompute) on the model's tiny
    twin: 2 gloo ranks against one process, losses and gradients."""
    def body() -> None:
        from autopar.verify import verify as run_checks
        result = run_checks(model, use_cache=cached)
        if as_json:
            typer.echo(json.dumps({"model": result.model, "twin": result.twin, "checks": {
                v.check.value: {"ok": v.ok, "reason": v.reason} for v in result.verdicts}}, indent=2, sort_keys=True))
            return
        table = Table("check", "result", "why", title=f"twin: {result.twin}")
        for v in result.verdicts:
            table.add_row(v.check.value, "equal to one process" if v.ok else "REFUSED", v.reason)
        console.print(table)
    _guard(body)


@app.command()
def run(plan_file: Path = typer.Argument(..., help="A plan JSON from `autopar plan --out`"),
        steps: int = typer.Option(3, "--steps", min=1, help="Optimizer steps"),
        save: Optional[Path] = SAVE, save_every: int = SAVE_EVERY, resume: Optional[Path] = RESUME,
        max_restarts: int = typer.Option(0, "--max-restarts", help="torchrun restarts after a failure; each "
                                         "resumes from the latest checkpoint in --save"),
        data: Optional[Path] = DATA, trust_code: bool = TRUST, as_json: bool = JSON) -> None:
    """Run a plan locally under torchrun (gloo on CPU) on a token file or synthetic tokens."""
    def body() -> None:
        if max_restarts < 0:
            raise UserError(f"--max-restarts must be at least 0, got {max_restarts}")
        check_save(save, resume, trust_code=trust_code, save_every=save_every)
        the_plan = _local_plan(plan_file, trust_code, "run")
        from functools import partial

        from autopar.runtime import TrainConfig
        from autopar.runtime import run_plan as run_one
        cfg = TrainConfig(data=data)
        run_plan = partial(run_one, save_every=save_every, max_restarts=max_restarts, trust_code=trust_code)
        if as_json:
            result = run_plan(the_plan, steps, resume=resume, save=save, cfg=cfg)
            typer.echo(json.dumps({"losses": result.losses, "step_times_s": result.step_times_s}))
            return
        shown: set[int] = set()
        if console.is_terminal:  # a live bar; plain lines otherwise (pipes, logs)
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                          console=console) as bar:
                task = bar.add_task("starting ranks", total=steps)

                def on_step(step: int, loss: float, seconds: float) -> None:
                    shown.add(step)
                    bar.console.print(f"step {step}: loss {loss:.6f}  {seconds:.3f} s")
                    bar.update(task, advance=1, description=f"step {step}: loss {loss:.4f}")
                result = run_plan(the_plan, steps, resume=resume, save=save, cfg=cfg, on_step=on_step)
        else:
            def on_step(step: int, loss: float, seconds: float) -> None:
                shown.add(step)
                typer.echo(f"step {step}: loss {loss:.6f}  {seconds:.3f} s")
            result = run_plan(the_plan, steps, resume=resume, save=save, cfg=cfg, on_step=on_step)
        for i, (loss, t) in enumerate(zip(result.losses, result.step_times_s), start=result.start_step):
            if i not in shown:  # a step the live view missed
                console.print(f"step {i}: loss {loss:.6f}  {t:.3f} s")
    _guard(body)


@app.command()
def calibrate(plan_files: list[Path] = typer.Argument(..., help="Plan JSONs from `autopar plan --out`, of one "
                                                      "cluster: each is run, and one refit explains them all"),
              steps: int = typer.Option(10, "--steps", min=2, help="Optimizer steps: warm-up, timed, then 3 "
                                        "profiled"),
              warmup: int = typer.Option(2, "--warmup", min=1, help="First steps, not timed"),
              out: Optional[Path] = typer.Option(None, "--out", help="Write the refitted profile here (default: "
                                                 "<profile>.calibrated.json); plan with --cluster FILE"),
              trust_code: bool = TRUST, as_json: bool = JSON) -> None:
    """Run plans profiled, compare each phase with the estimate and refit the profile to them."""
    def body() -> None:
        from autopar.calibrate import calibrate_plans, write_profile
        plans = [_local_plan(f, trust_code, "calibrate") for f in plan_files]
        target = out or Path(f"{Path(plans[0].cluster).stem}.calibrated.json")
        check_out(target)
        names = " ".join(f.name for f in plan_files)
        cals = calibrate_plans(plans, steps, warmup, f"`autopar calibrate {names} --steps {steps}`")
        write_profile(cals[0].profile, target)
        if as_json:
            each = [{"plan": str(f), "phases": [dataclasses.asdict(p) for p in c.phases], "gemm_tflops": c.gemm_tflops,
                     "peak_predicted_bytes": c.peak_predicted_bytes, "peak_measured_bytes": c.peak_measured_bytes}
                    for f, c in zip(plan_files, cals)]
            typer.echo(json.dumps({**{k: v for k, v in each[0].items() if k != "plan"}, "plans": each,
                                   "fits": [dataclasses.asdict(f) for f in cals[0].fits], "profile": str(target)}))
            return
        for f, the_plan, cal in zip(plan_files, plans, cals):
            table = Table(title=f"{f.name}: {the_plan.model} on {the_plan.gpus} x {the_plan.cluster}", box=box.SQUARE)
            for col in ("phase, ms per step", "predicted", "measured", "after refit"):
                table.add_column(col)
            for p in cal.phases:
                table.add_row(p.name, f"{p.before_s * 1e3:.1f}", f"{p.measured_s * 1e3:.1f}", f"{p.after_s * 1e3:.1f}")
            console.print(table)
            console.print(f"peak memory: predicted {cal.peak_predicted_bytes / 2**30:.3f} GiB, measured "
                          f"{cal.peak_measured_bytes / 2**30:.3f} GiB")
        for fit in cals[0].fits:
            console.print(f"{fit.name}: {fit.old:.4g} -> {fit.new:.4g} ({fit.why})")
        console.print(f"refitted profile written to {target}")
    _guard(body)


@app.command()
def tokenize(text: Path = typer.Argument(..., help="A text file"),
             out: Path = typer.Option(..., "--out", help="The token file to write (uint16; uint32 if named *.u32)"),
             tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="An HF tokenizers file "
                                                      "(tokenizer.json; needs the tokenizers package); "
                                                      "default: byte-level, ids 0-255")) -> None:
    """Tokenize a text file into a token file for `autopar run --data` and `autopar launch --data`."""
    def body() -> None:
        from autopar.data import tokenize_file
        done = tokenize_file(text, out, tokenizer)
        typer.echo(f"wrote {done.tokens:,} tokens ({done.dtype}, vocabulary {done.vocab:,}) to {done.path}")
    _guard(body)


DEMO_MODEL = "gpt:layers=4,hidden=128,heads=4,vocab=512,seq=64,tied=0"
DEMO_TEXT = Path(__file__).resolve().parent / "corpora" / "declaration_of_independence.txt"
"""What the demo trains on, byte-level (public domain; ``autopar/corpora/README.md``)."""


@app.command()
def demo(steps: int = typer.Option(10, "--steps", min=2, help="Optimizer steps to run (the first untimed)"),
         gpus: int = typer.Option(4, "--gpus", help="Local CPU ranks"),
         cluster: str = typer.Option("cpu-local", "--cluster",
                                     help="Profile of this machine (`autopar profile` writes one)")) -> None:
    """Plan a small GPT for the local CPU cluster, train it on a short public-domain text, and
    compare predicted and measured step time."""
    def body() -> None:
        import tempfile
        from statistics import median

        from autopar.data import tokenize_file
        from autopar.runtime import TrainConfig, run_plan
        check_count("--gpus", gpus, MAX_LOCAL_RANKS)
        job = read_job(DEMO_MODEL, cluster, gpus, global_batch=8 * gpus, dtype="fp32")
        if job.hw.launcher != "gloo":
            raise UserError(f"--cluster {cluster} profiles GPUs ({job.hw.launcher}); the demo trains on local "
                            "CPU ranks: pass cpu-local or a profile `autopar profile` wrote on this machine")
        result_plan, sol = make_plan(job)
        _print_plan(result_plan)
        console.print(f"search: {sol.time_s:.2f} s over {sol.candidates} candidates")
        with tempfile.TemporaryDirectory(prefix="autopar-demo-") as tmp:
            corpus = tokenize_file(DEMO_TEXT, Path(tmp) / "declaration.bin")
            console.print(f"training on the Declaration of Independence: {corpus.tokens:,} byte-level tokens")
            result = run_plan(result_plan, steps, cfg=TrainConfig(data=corpus.path))
        for i, (loss, t) in enumerate(zip(result.losses, result.step_times_s)):
            console.print(f"step {i}: loss {loss:.4f}  {t:.3f} s")
        measured = median(result.step_times_s[1:])
        predicted = sol.estimate.step_time_s
        console.print(f"predicted step time {predicted:.3f} s, measured {measured:.3f} s "
                      f"(median of steps 1..{steps - 1}), ratio {measured / predicted:.2f}")
        console.print(f"profile {job.hw.name}: {job.hw.notes.get('source', 'no source recorded')}"
                      + ("; measure your machine with `autopar profile --out my.json`, then "
                         "`autopar demo --cluster my.json`" if cluster == "cpu-local" else ""))
    _guard(body)

