"""What every ``autopar`` command shares: the app, its options, errors (one line, exit 2) and tables."""

from __future__ import annotations

import dataclasses
import sys
from enum import Enum
from typing import Any

import typer

try:  # typer >= 0.22 carries its own copy of click
    from typer._click import exceptions as _click_errors
except ImportError:  # pragma: no cover - older typer on stock click
    from click import exceptions as _click_errors  # type: ignore[no-redef]
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from autopar.errors import UserError
from autopar.plan import Plan
from cost_models import ProfileError
from cost_models.strategy import RECOMPUTE, Estimate

_HELP_ORDER = ("plan", "estimate", "explain", "profile", "verify", "inspect", "run", "calibrate", "export", "launch",
               "tokenize", "report", "demo")
"""The order ``autopar --help`` lists the commands in (cli and cli_local register them); any other comes last."""


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

    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: _HELP_ORDER.index(n) if n in _HELP_ORDER else len(_HELP_ORDER))


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
    op = "op"


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
CLUSTER = typer.Option(..., "--cluster", help="Hardware profile name (dgx-a100-80g, dgx-a100-40g, dgx-h100, dgx-h200, dgx-h800, dgx-b200, grand-teton-h100-96g, jean-zay-a100-80g, cpu-local) or path")
GPUS = typer.Option(..., "--gpus", help="Total number of devices")
BATCH = typer.Option(..., "--global-batch", help="Sequences per optimizer step")
SEQ = typer.Option(None, "--seq-len", help="Training sequence length (default: the model's)")
DTYPE = typer.Option(None, "--dtype", help="bf16, fp16 or fp32 (default: bf16 where the profile has it)")
JSON = typer.Option(False, "--json", help="Print JSON instead of tables")
TRUST = typer.Option(False, "--trust-code", help="Allow what can run code: a plan file whose model is a Python "
                     "file (path.py:factory), a checkpoint without autopar's manifest (README: What is code)")
RECIPE = typer.Option(None, "--recipe", help="Execution recipe priced: autopar (default: the program "
                      "autopar runs), torchtitan, torchtitan-compile, torchtitan-asynctp, megatron-2021, "
                      "megatron-core, megatron-core-te, deepspeed, llm-foundry, or a path to a recipe .json")
SAVE = typer.Option(None, "--save", help="Write checkpoints (DCP) into this directory: DIR/step-N, DIR/latest; "
                    "after the last step and every --save-every steps, each complete before it replaces the last")
SAVE_EVERY = typer.Option(0, "--save-every", help="Save every K steps too (0: after the last step only)")
RESUME = typer.Option(None, "--resume", help="Start from a checkpoint, or a --save directory's latest, saved by "
                      "any plan of this model")
DATA = typer.Option(None, "--data", help="Train on this token file (nanoGPT's flat uint16 .bin, uint32 if "
                    "named *.u32; `autopar tokenize` writes one) instead of synthetic tokens")


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
                                         for mode in RECOMPUTE if mode in plan.recompute))
    if plan.estimate is not None:
        table.add_row("fits", f"{'yes' if plan.estimate.fits else 'NO'} (peak "
                      f"{_gib(plan.estimate.memory.peak_bytes)} per device)")
    console.print(table)

