"""What-if sweeps: the same search (``workflow.make_plan``) at each value of one input (cluster
size, global batch or sequence length), with throughput, MFU and cost per million tokens.

The model is traced and verified once per distinct shape (a ``seq-len`` sweep traces once per
length). A value no plan fits gives a row with the search's reason, not an error; a value that
is bad input (not whole nodes, not positive) is one ``UserError`` line before anything runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from autopar.errors import UserError
from autopar.plan import Plan
from autopar.solve import Pins
from autopar.profiles import profile_spec
from autopar.workflow import Job, make_plan, read_job, verdicts
from cost_models import ModelProfile
from cost_models.strategy import Estimate

SWEEP_KEYS = ("gpus", "global-batch", "seq-len")
"""What ``--what-if KEY=v1,v2,...`` may sweep."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sweep:
    key: str
    """One of ``SWEEP_KEYS``."""
    values: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class WhatIfRow:
    """The best plan at one swept value, or why there is none."""

    value: int
    gpus: int
    plan: Plan | None
    estimate: Estimate | None
    search_s: float
    """Wall time of this value's search, s."""
    reason: str = ""
    """Why no plan fits (empty when one does)."""

    @property
    def mesh(self) -> str:
        """``dp x tp x pp`` of the plan, or "-"."""
        if self.plan is None:
            return "-"
        m = self.plan.mesh
        return f"{m.dp}x{m.tp}x{m.pp}"

    def cost_per_mtok(self, price_per_gpu_hour: float) -> float:
        """USD per million trained tokens at ``price_per_gpu_hour`` USD per device-hour."""
        if self.estimate is None:
            raise ValueError("no plan at this value")
        return self.gpus * price_per_gpu_hour / 3600 / self.estimate.tokens_per_s * 1e6


def parse_sweep(text: str) -> Sweep:
    """``gpus=512,1024,2048`` (``global-batch=``, ``seq-len=``); bad text is one ``UserError`` line."""
    key, sep, rest = text.partition("=")
    key = key.strip().replace("_", "-")
    if not sep or key not in SWEEP_KEYS:
        raise UserError(f"--what-if {text!r}: use KEY=v1,v2,... with KEY one of {', '.join(SWEEP_KEYS)}")
    try:
        values = tuple(int(v.replace("_", "")) for v in rest.split(",") if v.strip())
    except ValueError:
        raise UserError(f"--what-if {text!r}: the values must be whole numbers, e.g. {key}=512,1024") from None
    if not values or min(values) <= 0:
        raise UserError(f"--what-if {text!r}: give one or more positive values")
    if len(set(values)) != len(values):
        raise UserError(f"--what-if {text!r}: a value is repeated")
    return Sweep(key=key, values=values)


def sweep_jobs(sweep: Sweep, *, model: str, cluster: str, gpus: int | None, global_batch: int | None,
               seq_len: int | None, dtype: str | None, recipe: str | None) -> list[Job]:
    """One checked ``Job`` per swept value (the swept input replaces its option)."""
    jobs = []
    for v in sweep.values:
        g, b, s = gpus, global_batch, seq_len
        if sweep.key == "gpus":
            g = v
        elif sweep.key == "global-batch":
            b = v
        else:
            s = v
        if g is None:
            raise UserError("--gpus is missing (give it, or sweep it with --what-if gpus=...)")
        if b is None:
            raise UserError("--global-batch is missing (give it, or sweep it with --what-if global-batch=...)")
        jobs.append(read_job(model, cluster, g, b, s, dtype, recipe))
    return jobs


def run_sweep(sweep: Sweep, jobs: list[Job], pins: Pins = Pins(), time_limit_s: float = 60.0,
              verify: bool = True) -> tuple[WhatIfRow, ...]:
    """``make_plan`` at each value, tracing and verifying each distinct model shape once."""
    profiles: dict[object, tuple[ModelProfile, tuple[tuple[str, str], ...]]] = {}
    rows = []
    for value, job in zip(sweep.values, jobs):
        if job.spec not in profiles:
            profiles[job.spec] = (profile_spec(job.spec), verdicts(job.spec) if verify else ())
        prof, verified = profiles[job.spec]
        start = time.perf_counter()
        try:
            plan, sol = make_plan(job, pins, time_limit_s, profile=prof, verified=verified)
        except UserError as exc:
            rows.append(WhatIfRow(value=value, gpus=job.gpus, plan=None, estimate=None,
                                  search_s=time.perf_counter() - start, reason=str(exc)))
            continue
        rows.append(WhatIfRow(value=value, gpus=job.gpus, plan=plan,
                              estimate=sol.estimate, search_s=time.perf_counter() - start))
    return tuple(rows)


def rows_dict(sweep: Sweep, rows: tuple[WhatIfRow, ...], price: float | None) -> dict:
    """JSON-ready form of a sweep."""
    out = []
    for r in rows:
        item: dict = {sweep.key: r.value, "gpus": r.gpus, "search_s": r.search_s}
        if r.estimate is None:
            item["reason"] = r.reason
        else:
            e = r.estimate
            item.update(mesh=r.mesh, step_time_s=e.step_time_s, tokens_per_s=e.tokens_per_s, mfu=e.mfu,
                        peak_bytes=e.memory.peak_bytes, fits=e.fits)
            if price is not None:
                item["usd_per_million_tokens"] = r.cost_per_mtok(price)
        out.append(item)
    return {"what_if": sweep.key, "values": list(sweep.values), "price_per_gpu_hour": price, "rows": out}
