"""The plan as pictures: ``autopar report`` (an HTML page and PNG/SVG figures of the schedule,
memory, step time, alternatives and measured times) and ``autopar plan --what-if`` sweeps.

The numbers come from the cost model (``data``, ``timeline``, ``whatif``: no matplotlib); the
figures need matplotlib, the optional extra ``autopar[report]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from autopar.errors import UserError

if TYPE_CHECKING:
    from autopar.report.whatif import Sweep, WhatIfRow

INSTALL_HINT = "pip install 'autopar[report]'"


def require_matplotlib() -> None:
    """Raise a one-line ``UserError`` naming the extra when matplotlib is not installed."""
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    except ImportError:
        raise UserError(f"figures need matplotlib, which is not installed: {INSTALL_HINT}") from None


def write_report(plan_file: Path, out: Path, *, measured_file: Path | None = None, top_k: int = 10,
                 time_limit_s: float = 30.0) -> dict[str, Path]:
    """Write ``out``/index.html and the figures (PNG and SVG) of the plan in ``plan_file``;
    returns the files by name (``page`` and each figure's PNG)."""
    require_matplotlib()
    from autopar.plan import load_plan
    from autopar.report import figures as fig
    from autopar.report.data import read_measured, report_data
    from autopar.report.page import render
    from autopar.profiles import profile_spec
    from autopar.workflow import read_job

    plan = load_plan(plan_file)
    measured = read_measured(measured_file) if measured_file is not None else None
    job = read_job(plan.model, plan.cluster, plan.gpus, plan.global_batch, plan.seq_len, plan.dtype, plan.recipe)
    data = report_data(plan, profile_spec(job.spec), job.hw, top_k=top_k, time_limit_s=time_limit_s,
                       measured=measured)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory")
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    draw = {"timeline": fig.timeline, "memory": fig.memory, "step": fig.step_breakdown}
    if data.alternatives:
        draw["alternatives"] = fig.alternatives
    if measured is not None:
        draw["measured"] = fig.measured
    for name, make in draw.items():
        files[name], _ = fig.save(make(data), out, name)
    page = out / "index.html"
    page.write_text(render(data, files), encoding="utf-8")
    files["page"] = page
    return files


def write_what_if(out: Path, sweep: Sweep, rows: tuple[WhatIfRow, ...], price: float | None) -> list[Path]:
    """Write a sweep (``whatif.Sweep`` and its rows) under ``out``: what-if.png and .svg (the
    plot), what-if.json (the table), and the plan at each value (plan-KEY-VALUE.json)."""
    require_matplotlib()
    import json

    from autopar.report import figures as fig
    from autopar.report.whatif import rows_dict

    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; with --what-if give a directory")
    out.mkdir(parents=True, exist_ok=True)
    png, svg = fig.save(fig.what_if(sweep.key, sweep.values, rows, price), out, "what-if")
    table = out / "what-if.json"
    table.write_text(json.dumps(rows_dict(sweep, rows, price), indent=2, sort_keys=True) + "\n")
    plans = []
    for r in rows:
        if r.plan is not None:
            plans.append(out / f"plan-{sweep.key}-{r.value}.json")
            r.plan.save(plans[-1])
    return [png, svg, table, *plans]
