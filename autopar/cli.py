"""The ``autopar`` command line (design.md): the planning commands (plan, estimate, explain, inspect, export,
launch, report) and ``main``; ``cli_local`` holds those that run here, ``cli_common`` what they share.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.table import Table

from autopar.cli_checks import check_cp, check_out, check_pins, load_plan_file, parse_axis_order
from autopar.cli_common import (BATCH, CLUSTER, DATA, DTYPE, GPUS, JSON, MODEL, RECIPE, RESUME, SAVE, SAVE_EVERY, SEQ,
                                TRUST, Recompute, Schedule, _estimate_dict, _gib, _guard, _print_estimate,
                                _print_plan, app, console)
from autopar.cli_local import DEMO_MODEL, DEMO_TEXT  # registers the local commands on ``app``
from autopar.errors import UserError
from autopar.spec import parse_model_spec
from autopar.export.common import Target as ExportTarget
from autopar.limits import check_seconds
from autopar.solve import Pins, Solution, explain as explain_plan, explanation_dict
from autopar.workflow import estimate_strategy, export_lead_refusal, fixed_strategy, make_plan, read_job

__all__ = ("app", "main", "DEMO_MODEL", "DEMO_TEXT")


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
         recompute: Optional[Recompute] = typer.Option(None, "--recompute", help="Pin recompute mode: none, "
                                                       "selective (attention core), full, op (per-op: every "
                                                       "second GEMM's output kept, torchtitan's)"),
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
             recompute: Recompute = typer.Option(Recompute.none, "--recompute", help="none, selective, full "
                                                 "or op (per-op selective, torchtitan's)"),
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
        lead = export_lead_refusal(parse_model_spec(the_plan.model), to.value)
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
        refusal = the_plan.refusal()
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


def main() -> None:
    """Console-script entry point (usage errors are one line and exit 2: ``_OneLineGroup``)."""
    app(prog_name="autopar")


if __name__ == "__main__":
    main()
