"""The ``autopar`` command line (design.md): plan, estimate, explain, inspect, verify, profile,
run, launch, tokenize, export, report, demo.

Bad input exits 2 with one line on stderr; ``--json`` prints machine-readable output.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

try:  # typer >= 0.22 carries its own copy of click
    from typer._click import exceptions as _click_errors
except ImportError:  # pragma: no cover - older typer on stock click
    from click import exceptions as _click_errors  # type: ignore[no-redef]
from rich import box
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from autopar.cli_checks import check_cp, check_out, check_pins, check_save, load_plan_file, parse_axis_order
from autopar.errors import UserError
from autopar.spec import parse_model_spec
from autopar.export.common import Target as ExportTarget
from autopar.limits import MAX_LOCAL_RANKS, check_count, check_seconds
from autopar.plan import Plan
from autopar.solve import Pins, Solution, explain as explain_plan, explanation_dict
from autopar.workflow import estimate_strategy, fixed_strategy, launch_refusal, lead_refusal, make_plan, read_job
from cost_models import ProfileError
from cost_models.strategy import Estimate

def _one_line(message: str) -> str:
    return " ".join(str(message).split())


class _OneLineGroup(TyperGroup):
    """The command group: usage errors (unknown option, bad value) are one line on stderr and
    exit 2, like every other bad input, however the app is called (console script, CliRunner)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # type: ignore[override]
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name or "autopar", complete_var, standalone_mode=False, **extra)
        except _click_errors.UsageError as exc:
            if isinstance(exc, getattr(_click_errors, "NoArgsIsHelpError", ())) and exc.ctx is not None:
                typer.echo(exc.ctx.get_help())
                sys.exit(0)
            hint = f" (see `autopar {exc.ctx.info_name} --help`)" if exc.ctx and exc.ctx.parent else ""
            typer.echo(f"autopar: error: {_one_line(exc.format_message())}{hint}", err=True)
            sys.exit(2)
        except typer.Abort:
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(cls=_OneLineGroup, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="autopar: plan and run parallel training of transformers.")
console = Console()


class Schedule(str, Enum):
    gpipe = "gpipe"
    one_f_one_b = "1f1b"
    interleaved = "interleaved"
    zero_bubble = "zero-bubble"


class Recompute(str, Enum):
    none = "none"
    selective = "selective"
    full = "full"


def _fail(message: str) -> None:
    typer.echo(f"autopar: error: {_one_line(message)}", err=True)
    raise typer.Exit(2)


def _guard(fn):
    """Run a command body; user errors become one line on stderr and exit 2."""
    try:
        return fn()
    except (UserError, ProfileError) as exc:
        _fail(str(exc))


# Shared options (design.md names).
MODEL = typer.Option(..., "--model", help="Preset (gpt3-175b, llama3-8b, ...) or spec gpt:layers=..,hidden=..,heads=..,vocab=..,seq=..")
CLUSTER = typer.Option(..., "--cluster", help="Hardware profile name (dgx-a100-80g, dgx-a100-40g, dgx-h100, dgx-h200, dgx-h800, dgx-b200, grand-teton-h100-96g, cpu-local) or path")
GPUS = typer.Option(..., "--gpus", help="Total number of devices")
BATCH = typer.Option(..., "--global-batch", help="Sequences per optimizer step")
SEQ = typer.Option(None, "--seq-len", help="Training sequence length (default: the model's)")
DTYPE = typer.Option(None, "--dtype", help="bf16, fp16 or fp32 (default: bf16 where the profile has it)")
JSON = typer.Option(False, "--json", help="Print JSON instead of tables")
TRUST = typer.Option(False, "--trust-code", help="Allow what can run code: a plan file whose model is a Python "
                     "file (path.py:factory), a checkpoint without autopar's manifest (README: What is code)")
RECIPE = typer.Option(None, "--recipe", help="Execution recipe priced: autopar (default: the program "
                      "autopar runs), torchtitan, megatron-2021, megatron-core, megatron-core-te, "
                      "deepspeed, llm-foundry, or a path to a recipe .json")


def _estimate_dict(est: Estimate) -> dict:
    return dataclasses.asdict(est)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _print_estimate(est: Estimate) -> None:
    table = Table(title="estimate", show_header=False)
    table.add_row("step time", f"{est.step_time_s:.4g} s")
    table.add_row("tokens/s", f"{est.tokens_per_s:,.0f}")
    table.add_row("TFLOP/s per device", f"{est.tflops_per_gpu:.1f}")
    table.add_row("MFU", f"{est.mfu:.1%}")
    table.add_row("fits", f"{'yes' if est.fits else 'NO'} (peak {_gib(est.memory.peak_bytes)})")
    for k, v in dataclasses.asdict(est.time).items():
        table.add_row(f"time.{k}", f"{v:.4g} s")
    for k, v in dataclasses.asdict(est.memory).items():
        table.add_row(f"memory.{k}", _gib(v))
    console.print(table)


def _print_plan(plan: Plan) -> None:
    table = Table(title=f"plan: {plan.model} on {plan.gpus} x {plan.cluster}", show_header=False)
    m = plan.mesh
    table.add_row("mesh", f"dp={m.dp} tp={m.tp} pp={m.pp}" + (f" cp={m.cp}" if m.cp > 1 else "")
                  + (f" ep={m.ep} (experts over ep x edp = {m.ep} x {m.edp} of dp x cp)" if m.ep > 1 else ""))
    table.add_row("zero stage", str(plan.zero_stage))
    table.add_row("micro-batch x micro-batches", f"{plan.micro_batch_size} x {plan.num_microbatches}")
    table.add_row("schedule", plan.schedule + (f" (v={plan.virtual_stages})" if plan.virtual_stages > 1 else ""))
    table.add_row("sequence parallel", str(plan.sequence_parallel))
    table.add_row("cpu offload", str(plan.offload))
    table.add_row("mesh axis order", " > ".join(plan.axis_order) + " (outermost first)")
    table.add_row("execution recipe", plan.recipe)
    table.add_row("stage layers", " ".join(map(str, plan.stage_layers)))
    table.add_row("recompute", ", ".join(f"{mode} x{plan.recompute.count(mode)}"
                                         for mode in ("none", "selective", "full") if mode in plan.recompute))
    if plan.estimate is not None:
        table.add_row("fits", f"{'yes' if plan.estimate.fits else 'NO'} (peak "
                      f"{_gib(plan.estimate.memory.peak_bytes)} per device)")
    console.print(table)


@app.command()
def plan(model: str = MODEL, cluster: str = CLUSTER,
         gpus: Optional[int] = typer.Option(None, "--gpus", help="Total number of devices (required "
                                            "unless --what-if sweeps it)"),
         global_batch: Optional[int] = typer.Option(None, "--global-batch", help="Sequences per optimizer "
                                                    "step (required unless --what-if sweeps it)"),
         seq_len: Optional[int] = SEQ, dtype: Optional[str] = DTYPE,
         tp: Optional[int] = typer.Option(None, "--tp", help="Pin tensor-parallel degree"),
         pp: Optional[int] = typer.Option(None, "--pp", help="Pin pipeline-parallel degree"),
         dp: Optional[int] = typer.Option(None, "--dp", help="Pin data-parallel degree"),
         zero: Optional[int] = typer.Option(None, "--zero", min=0, max=3, help="Pin ZeRO stage"),
         mbs: Optional[int] = typer.Option(None, "--mbs", help="Pin micro-batch size"),
         schedule: Optional[Schedule] = typer.Option(None, "--schedule", help="Pin pipeline schedule"),
         vpp: Optional[int] = typer.Option(None, "--vpp", min=1, help="Pin virtual stages per pipeline rank"),
         cp: Optional[int] = typer.Option(None, "--cp", help="Pin context-parallel degree (above 1 only "
                                          "under a recipe that has it: autopar, megatron-core, megatron-core-te, torchtitan)"),
         ep: Optional[int] = typer.Option(None, "--ep", help="Pin expert-parallel degree (MoE models: divides "
                                          "the routed experts and dp x cp, whose ranks it regroups)"),
         sp: Optional[bool] = typer.Option(None, "--sp/--no-sp", help="Pin sequence parallelism"),
         recompute: Optional[Recompute] = typer.Option(None, "--recompute", help="Pin recompute mode"),
         offload: Optional[bool] = typer.Option(None, "--offload/--no-offload",
                                                help="Pin CPU offload of ZeRO shards and the optimizer step"),
         axis_order: Optional[str] = typer.Option(None, "--axis-order",
                                                  help="Pin the mesh axis order, outermost first, e.g. pp,dp,tp"),
         out: Optional[Path] = typer.Option(None, "--out", help="Write the plan JSON here (with --what-if: "
                                            "a directory for the plot, the table and the plans)"),
         time_limit: float = typer.Option(60.0, "--time-limit", help="Search time limit, s"),
         verify_twin: bool = typer.Option(True, "--verify/--no-verify",
                                          help="Prove each parallel dimension on the model's tiny twin "
                                               "first (HF models; cached) and plan without the ones that fail"),
         what_if: Optional[str] = typer.Option(None, "--what-if", help="Sweep one input, e.g. gpus=512,1024,2048 "
                                               "(or global-batch=..., seq-len=...): the search at each value as a "
                                               "table; --out DIR writes the plot, the table and each plan there"),
         price: Optional[float] = typer.Option(None, "--price-per-gpu-hour", help="USD per device-hour for "
                                               "--what-if's cost per million tokens (default: the profile's)"),
         recipe: Optional[str] = RECIPE, as_json: bool = JSON) -> None:
    """Search the best plan for a model on a cluster."""
    def body() -> None:
        check_pins(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, mbs=mbs, vpp=vpp)
        check_cp(cp, recipe)
        check_seconds("--time-limit", time_limit)
        pins = Pins(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, micro_batch=mbs,
                    schedule=schedule.value if schedule else None, virtual_stages=vpp,
                    sequence_parallel=sp, recompute=recompute.value if recompute else None,
                    offload=offload, axis_order=parse_axis_order(axis_order))
        if what_if is not None:
            _plan_what_if(what_if, pins, model=model, cluster=cluster, gpus=gpus, global_batch=global_batch,
                          seq_len=seq_len, dtype=dtype, recipe=recipe, time_limit=time_limit,
                          verify=verify_twin, out=out, price=price, as_json=as_json)
            return
        if price is not None:
            raise UserError("--price-per-gpu-hour prices a --what-if sweep; add --what-if")
        if gpus is None or global_batch is None:
            missing = "--gpus" if gpus is None else "--global-batch"
            raise UserError(f"{missing} is missing; give it, or sweep it with --what-if {missing[2:]}=v1,v2,...")
        check_out(out)
        job = read_job(model, cluster, gpus, global_batch, seq_len, dtype, recipe)
        result, sol = make_plan(job, pins, time_limit, verify=verify_twin)
        if out is not None:
            try:
                result.save(out)
            except OSError as exc:
                raise UserError(f"--out {out}: cannot write the plan ({exc.strerror or exc})") from None
        if as_json:
            typer.echo(json.dumps({"plan": json.loads(result.to_json()),
                                   "estimate": _estimate_dict(sol.estimate),
                                   "search": _search_dict(sol)}, indent=2, sort_keys=True))
            return
        _print_plan(result)
        _print_estimate(sol.estimate)
        console.print(f"search: {sol.time_s:.2f} s, {sol.candidates} candidates, {sol.solved} placements "
                      f"solved, {'optimal' if sol.optimal else f'gap {sol.gap:.2%}'}"
                      + (f"; written to {out}" if out else ""))
    _guard(body)


def _plan_what_if(text: str, pins: Pins, *, model: str, cluster: str, gpus: Optional[int],
                  global_batch: Optional[int], seq_len: Optional[int], dtype: Optional[str],
                  recipe: Optional[str], time_limit: float, verify: bool, out: Optional[Path],
                  price: Optional[float], as_json: bool) -> None:
    """``plan --what-if``: the search at each swept value, as a table (JSON) and a plot."""
    import time

    from autopar.report import require_matplotlib, write_what_if
    from autopar.report.whatif import parse_sweep, rows_dict, run_sweep, sweep_jobs
    sweep = parse_sweep(text)
    if price is not None and price <= 0:
        raise UserError(f"--price-per-gpu-hour must be positive, got {price}")
    if out is not None:
        require_matplotlib()
    jobs = sweep_jobs(sweep, model=model, cluster=cluster, gpus=gpus, global_batch=global_batch,
                      seq_len=seq_len, dtype=dtype, recipe=recipe)
    price = price if price is not None else (jobs[0].hw.price_per_gpu_hour or None)
    start = time.perf_counter()
    rows = run_sweep(sweep, jobs, pins, time_limit, verify)
    elapsed = time.perf_counter() - start
    files = write_what_if(out, sweep, rows, price) if out is not None else []
    if as_json:
        typer.echo(json.dumps({**rows_dict(sweep, rows, price), "time_s": elapsed,
                               "files": [str(f) for f in files]}, indent=2, sort_keys=True))
        return
    table = Table(sweep.key, "dp.tp.pp", "schedule", "step s", "tokens/s", "MFU", "peak GiB", "$/M tok",
                  box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, pad_edge=False,
                  title=f"what if: {jobs[0].spec.name} on {cluster}")
    for r in rows:
        if r.estimate is None or r.plan is None:
            table.add_row(f"{r.value:,}", "-", f"no plan: {r.reason}", "", "", "", "", "")
            continue
        e, p = r.estimate, r.plan
        table.add_row(f"{r.value:,}", f"{p.mesh.dp}.{p.mesh.tp}.{p.mesh.pp}",
                      p.schedule + (f" v={p.virtual_stages}" if p.virtual_stages > 1 else ""),
                      f"{e.step_time_s:.4g}", f"{e.tokens_per_s:,.0f}", f"{e.mfu:.1%}",
                      f"{e.memory.peak_bytes / 2**30:.1f}", f"{r.cost_per_mtok(price):.3g}" if price else "-")
    console.print(table)
    console.print(f"{len(rows)} searches in {elapsed:.1f} s"
                  + ("" if price else "; no price: pass --price-per-gpu-hour for cost per million tokens")
                  + (f"; plot, table and plans written to {out}" if out is not None else ""))


def _search_dict(sol: Solution) -> dict:
    return {"time_s": sol.time_s, "candidates": sol.candidates, "solved": sol.solved,
            "optimal": sol.optimal, "gap": sol.gap}


@app.command()
def estimate(model: str = MODEL, cluster: str = CLUSTER, gpus: int = GPUS, global_batch: int = BATCH,
             seq_len: Optional[int] = SEQ, dtype: Optional[str] = DTYPE,
             tp: int = typer.Option(1, "--tp"), pp: int = typer.Option(1, "--pp"),
             dp: Optional[int] = typer.Option(None, "--dp"),
             zero: int = typer.Option(0, "--zero", min=0, max=3),
             mbs: int = typer.Option(1, "--mbs"),
             schedule: Schedule = typer.Option(Schedule.one_f_one_b, "--schedule"),
             vpp: int = typer.Option(1, "--vpp", help="Virtual stages per pipeline rank"),
             cp: int = typer.Option(1, "--cp", help="Context-parallel degree (above 1 only under a recipe "
                                    "that has it: autopar, megatron-core, megatron-core-te, torchtitan)"),
             ep: int = typer.Option(1, "--ep", help="Expert-parallel degree (MoE models: divides the routed "
                                    "experts and dp x cp, whose ranks it regroups)"),
             sp: bool = typer.Option(False, "--sp/--no-sp"),
             recompute: Recompute = typer.Option(Recompute.none, "--recompute"),
             fp8: bool = typer.Option(False, "--fp8/--no-fp8", help="Float8 weight GEMMs (priced "
                                      "only: the runtime has no Float8 linears yet)"),
             recipe: Optional[str] = RECIPE, as_json: bool = JSON) -> None:
    """Evaluate one fixed strategy with the cost model the planner uses."""
    def body() -> None:
        check_pins(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, mbs=mbs, vpp=vpp)
        check_cp(cp, recipe)
        job = read_job(model, cluster, gpus, global_batch, seq_len, dtype, recipe)
        strat = fixed_strategy(job, tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=mbs,
                               schedule=schedule.value, sequence_parallel=sp,
                               recompute=recompute.value, virtual_stages=vpp, fp8=fp8, cp=cp, ep=ep)
        est = estimate_strategy(job, strat)
        if as_json:
            typer.echo(json.dumps(_estimate_dict(est), indent=2, sort_keys=True))
        else:
            _print_estimate(est)
    _guard(body)


@app.command()
def explain(plan_file: Path = typer.Argument(..., help="A plan JSON from `autopar plan --out`"),
            top_k: int = typer.Option(5, "--top-k", min=1, help="Alternatives to list"),
            time_limit: float = typer.Option(10.0, "--time-limit", help="Time limit per search, s"),
            recipe: Optional[str] = typer.Option(None, "--recipe", help="Price under this execution "
                                                 "recipe instead of the plan's own"),
            trust_code: bool = TRUST, as_json: bool = JSON) -> None:
    """Why this plan: the top alternatives and, per dimension, the best plan at each neighbour."""
    def body() -> None:
        from autopar.profiles import profile_spec
        check_seconds("--time-limit", time_limit)
        the_plan = load_plan_file(plan_file, trust_code)
        if recipe is not None:
            the_plan = dataclasses.replace(the_plan, recipe=recipe)
        the_plan.strategy()  # a recipe that cannot run the plan (cp > 1) is refused before tracing
        job = read_job(the_plan.model, the_plan.cluster, the_plan.gpus, the_plan.global_batch,
                       the_plan.seq_len, the_plan.dtype, the_plan.recipe)
        the_plan.check_model(job.spec)  # a user module's shape is known once traced
        prof = profile_spec(job.spec)
        failed = {check: reason for check, reason in the_plan.verified if reason}
        info = explanation_dict(explain_plan(prof, job.hw, job.gpus, job.global_batch, job.dtype,
                                             the_plan.strategy(lead=prof.lead_layers), top_k, time_limit,
                                             tuple(failed)))
        info["refused"] = failed
        if as_json:
            typer.echo(json.dumps(info, indent=2, sort_keys=True))
            return
        console.print(f"plan step time {info['step_time_s']:.4g} s")
        if info.get("moe"):
            console.print(f"experts: {info['moe']}")
        for check, reason in failed.items():
            console.print(f"refused: {check} (failed on the model's twin: {reason})")
        table = Table("#", "step time s", "vs plan", "alternative", title=f"top {top_k} alternatives")
        for i, alt in enumerate(info["alternatives"], 1):
            table.add_row(str(i), f"{alt['step_time_s']:.4g}",
                          f"{alt['step_time_s'] / info['step_time_s'] - 1:+.1%}", alt["strategy"])
        console.print(table)
        table = Table("dimension", "chosen", "neighbour", "best step time s", "vs plan", "plan or reason",
                      title="why each choice beat its neighbours")
        for d in info["dimensions"]:
            for n in d["neighbours"]:
                t = n["step_time_s"]
                table.add_row(d["name"], d["chosen"], n["value"], "-" if t is None else f"{t:.4g}",
                              "does not fit" if t is None else f"{t / info['step_time_s'] - 1:+.1%}",
                              n["note"])
        console.print(table)
    _guard(body)


@app.command()
def profile(ranks: int = typer.Option(4, "--ranks", help="Processes to measure at once (devices of the cluster)"),
            out: Path = typer.Option(Path("my-cluster.json"), "--out", help="Where to write the hardware profile"),
            name: Optional[str] = typer.Option(None, "--name", help="The profile's name (default: --out's stem)"),
            repeats: int = typer.Option(1, "--repeats", help="Runs of every measurement; each figure their median"),
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
            result = profile_machine(ranks, out, name or out.stem, on_phase, repeats)
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
def inspect(model: str = MODEL, seq_len: Optional[int] = SEQ, as_json: bool = JSON) -> None:
    """Show what the tracer sees: parameters, repeated blocks, FLOPs and activation bytes."""
    def body() -> None:
        from autopar.spec import parse_model_spec, with_seq
        from autopar.trace import trace_spec
        from autopar.trace.report import graph_summary
        spec = parse_model_spec(model)
        spec = with_seq(spec, seq_len) if seq_len is not None else spec
        info = graph_summary(trace_spec(spec), spec)
        if as_json:
            typer.echo(json.dumps(info, indent=2, sort_keys=True))
            return
        console.print(f"{info['model']}: {info['params']:,} parameters ({_gib(info['param_bytes'])} in "
                      f"{info['dtype']}), {info['capture']}, input {info['input_shape']}, "
                      f"{info['forward_flops_per_token']:.4g} forward FLOPs/token, "
                      f"{info['training_flops_per_token']:.4g} training FLOPs/token")
        table = Table("block", "repeats", "params", "fwd FLOPs/token", "act B/token (fused)",
                      "act B/token (Megatron)", "heads/kv", "experts", "nodes")
        for b in info["blocks"]:
            table.add_row(b["kind"], str(b["repeats"]), f"{b['params']:,}", f"{b['forward_flops_per_token']:.4g}",
                          f"{b['activation_bytes_per_token']['total']:.4g}",
                          f"{b['recipe_activation_bytes_per_token']['total']:.4g}",
                          f"{b['heads']}/{b['kv_heads']}", str(b["experts"]), str(b["nodes"]))
        console.print(table)
        for b in info["blocks"]:
            console.print(f"{b['kind']} weights: " + ", ".join(
                f"{lin['name']} {lin['in_features']}->{lin['out_features']} {lin['split']}"
                + (f" x{lin['experts']}" if lin["experts"] else "") for lin in b["linears"]))
        console.print(f"outside blocks: {info['outside_blocks']['params']:,} parameters, "
                      f"{info['outside_blocks']['forward_flops_per_token']:.4g} FLOPs/token, "
                      f"vocab-parallel: {', '.join(info['vocab_parallel']) or 'none'}")
        shape = info["shape"]
        console.print("shape priced: " + (" ".join(f"{k}={int(v)}" for k, v in shape.items()) if shape
                                          else f"none ({info['shape_error']})"), markup=False)
    _guard(body)


SAVE = typer.Option(None, "--save", help="Write checkpoints (DCP) into this directory: DIR/step-N, DIR/latest; "
                    "after the last step and every --save-every steps, each complete before it replaces the last")
SAVE_EVERY = typer.Option(0, "--save-every", help="Save every K steps too (0: after the last step only)")
RESUME = typer.Option(None, "--resume", help="Start from a checkpoint, or a --save directory's latest, saved by "
                      "any plan of this model")
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
    return the_plan


DATA = typer.Option(None, "--data", help="Train on this token file (nanoGPT's flat uint16 .bin, uint32 if "
                    "named *.u32; `autopar tokenize` writes one) instead of synthetic tokens")


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
def calibrate(plan_file: Path = typer.Argument(..., help="A plan JSON from `autopar plan --out`"),
              steps: int = typer.Option(10, "--steps", min=2, help="Optimizer steps: warm-up, timed, then 3 "
                                        "profiled"),
              warmup: int = typer.Option(2, "--warmup", min=1, help="First steps, not timed"),
              out: Optional[Path] = typer.Option(None, "--out", help="Write the refitted profile here (default: "
                                                 "<profile>.calibrated.json); plan with --cluster FILE"),
              trust_code: bool = TRUST, as_json: bool = JSON) -> None:
    """Run a plan profiled, compare each phase with the estimate and refit the profile to it."""
    def body() -> None:
        from autopar.calibrate import calibrate_plan, write_profile
        the_plan = _local_plan(plan_file, trust_code, "calibrate")
        target = out or Path(f"{Path(the_plan.cluster).stem}.calibrated.json")
        check_out(target)
        cal = calibrate_plan(the_plan, steps, warmup, f"`autopar calibrate {plan_file.name} --steps {steps}`")
        write_profile(cal.profile, target)
        if as_json:
            typer.echo(json.dumps({"phases": [dataclasses.asdict(p) for p in cal.phases],
                                   "fits": [dataclasses.asdict(f) for f in cal.fits], "gemm_tflops": cal.gemm_tflops,
                                   "peak_predicted_bytes": cal.peak_predicted_bytes,
                                   "peak_measured_bytes": cal.peak_measured_bytes, "profile": str(target)}))
            return
        table = Table(title=f"{the_plan.model} on {the_plan.gpus} x {the_plan.cluster}", box=box.SQUARE)
        for col in ("phase, ms per step", "predicted", "measured", "after refit"):
            table.add_column(col)
        for p in cal.phases:
            table.add_row(p.name, f"{p.before_s * 1e3:.1f}", f"{p.measured_s * 1e3:.1f}", f"{p.after_s * 1e3:.1f}")
        console.print(table)
        for f in cal.fits:
            console.print(f"{f.name}: {f.old:.4g} -> {f.new:.4g} ({f.why})")
        console.print(f"peak memory: predicted {cal.peak_predicted_bytes / 2**30:.3f} GiB, measured "
                      f"{cal.peak_measured_bytes / 2**30:.3f} GiB; refitted profile written to {target}")
    _guard(body)


@app.command()
def export(plan_file: Path = typer.Argument(..., help="A plan JSON from `autopar plan --out`"),
           to: ExportTarget = typer.Option(..., "--to", help="Framework: megatron (launch script with "
                                           "pretrain_gpt.py arguments), deepspeed (ds_config.json), torchtitan "
                                           "(config module), accelerate (config YAML)"),
           out: Optional[Path] = typer.Option(None, "--out", help="Write the configuration here (default: stdout)"),
           trust_code: bool = TRUST, as_json: bool = JSON) -> None:
    """Write a plan as another framework's configuration. What the framework cannot express is a
    warning on stderr naming the nearest setting written instead and its predicted cost."""
    def body() -> None:
        from autopar.export import export_plan
        the_plan = load_plan_file(plan_file, trust_code)
        lead = lead_refusal(parse_model_spec(the_plan.model))
        if lead:
            raise UserError(lead)
        result = export_plan(the_plan, to, str(out) if out is not None else None)
        for gap in result.gaps:
            typer.echo(f"autopar: warning: {gap.line(result.target)}", err=True)
        if result.gaps:
            typer.echo(f"autopar: warning: as exported: {result.summary()}", err=True)
        if out is not None:
            try:
                out.write_text(result.content)
            except OSError as exc:
                raise UserError(f"cannot write {out}: {exc.strerror}") from None
        if as_json:
            typer.echo(json.dumps(result.as_dict(), indent=2, sort_keys=True))
        elif out is not None:
            typer.echo(f"wrote {out} ({result.framework})\nlaunch: {result.launch}")
        else:
            typer.echo(result.content, nl=False)
            typer.echo(f"autopar: launch: {result.launch}", err=True)
    _guard(body)


@app.command()
def launch(plan_file: Path = typer.Argument(..., help="A plan JSON from `autopar plan --out`"),
           out: Path = typer.Option(..., "--out", help="Directory to write node.sh, sbatch.sh, run.md and the plan into"),
           nodes: Optional[int] = typer.Option(None, "--nodes", help="Nodes (default: the plan's devices over "
                                               "--gpus-per-node)"),
           gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", help="Devices per node (default: "
                                                       "the cluster profile's, at most the plan's)"),
           rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of the c10d "
                                                       "rendezvous, on the first node (default for one node: "
                                                       "localhost:29500; Slurm: the allocation's first node)"),
           max_restarts: int = typer.Option(0, "--max-restarts", help="torchrun restarts after a failure"),
           steps: int = typer.Option(3, "--steps", help="Optimizer steps"),
           data: Optional[Path] = DATA, save: Optional[Path] = SAVE, save_every: int = SAVE_EVERY,
           resume: Optional[Path] = RESUME, trust_code: bool = TRUST) -> None:
    """Write the commands that train a plan on several nodes: torchrun per node, Slurm sbatch, run.md."""
    def body() -> None:
        from autopar.jobscripts import local_notes, plan_launch, write_launch
        if save_every and save is None:
            raise UserError(f"--save-every {save_every} saves into --save DIR; add --save DIR")
        the_plan = load_plan_file(plan_file, trust_code)
        # A user module may live on the cluster only: not traced here (an HF model is).
        refusal = the_plan.refusal() or lead_refusal(parse_model_spec(the_plan.model), trace_modules=False)
        if refusal:
            raise UserError(refusal)
        spec = plan_launch(the_plan, out, nodes=nodes, gpus_per_node=gpus_per_node, endpoint=rdzv_endpoint,
                           max_restarts=max_restarts, steps=steps, data=data, save=save, resume=resume,
                           save_every=save_every, trust_code=trust_code)
        for note in local_notes(spec):
            typer.echo(f"autopar: note: {note}", err=True)
        files = write_launch(spec)
        typer.echo(f"wrote {', '.join(p.name for p in files)} to {spec.out}; see run.md: sbatch sbatch.sh, "
                   f"or bash node.sh on each of {spec.nodes} node(s) x {spec.gpus_per_node} devices")
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


@app.command()
def report(plan_file: Path = typer.Argument(..., help="A plan JSON from `autopar plan --out`"),
           out: Optional[Path] = typer.Option(None, "--out", help="Directory for index.html and the figures "
                                              "(default: PLAN-report beside the plan file)"),
           measured: Optional[Path] = typer.Option(None, "--measured", help="The output of `autopar run PLAN "
                                                   "--json` saved to a file: measured step times beside the "
                                                   "predicted one"),
           top_k: int = typer.Option(10, "--top-k", min=0, help="Alternatives to search and draw (0: none)"),
           time_limit: float = typer.Option(30.0, "--time-limit", help="Time limit of the alternatives' search, s"),
           trust_code: bool = TRUST) -> None:
    """Draw the plan: a self-contained HTML page and PNG/SVG figures of its pipeline schedule, memory
    per device, step time by kind, the best alternatives and measured step times."""
    def body() -> None:
        from autopar.report import write_report
        if time_limit <= 0:
            raise UserError(f"--time-limit must be positive, got {time_limit}")
        load_plan_file(plan_file, trust_code)
        target = out if out is not None else plan_file.with_name(plan_file.stem + "-report")
        files = write_report(plan_file, target, measured_file=measured, top_k=top_k, time_limit_s=time_limit)
        console.print(f"wrote {files['page']} and {len(files) - 1} figures (PNG and SVG) in {target}")
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


def main() -> None:
    """Console-script entry point (usage errors are one line and exit 2: ``_OneLineGroup``)."""
    app(prog_name="autopar")


if __name__ == "__main__":
    main()
