"""Why a plan: the best alternatives the search proved, and for each search dimension the
best plan with that dimension moved to each neighbouring value (the rest searched again)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.errors import UserError
from autopar.solve.search import Alternative, search
from autopar.solve.space import Pins, candidates
from cost_models import HardwareProfile, ModelProfile, Strategy
from cost_models.axes import Axis
from cost_models.blockcomm import moe_terms
from cost_models.strategy import RECOMPUTE

DIMENSIONS = ((Axis.TP, "tp"), (Axis.PP, "pp"), (Axis.CP, "cp"), (Axis.EP, "ep"), ("zero", "zero"), ("micro_batch", "micro_batch"),
              ("schedule", "schedule"), ("virtual_stages", "virtual_stages"),
              ("sequence_parallel", "sequence_parallel"), ("recompute", "recompute"))
"""(Strategy field or mesh axis, Pins field) of each dimension explained."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Neighbour:
    """The best plan with one dimension set to ``value``; ``step_time_s`` None when none fits."""

    value: str
    step_time_s: float | None
    note: str
    """The plan found (short form), or why there is none."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Dimension:
    name: str
    chosen: str
    neighbours: tuple[Neighbour, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Explanation:
    step_time_s: float
    """The plan's own step time, seconds."""
    alternatives: tuple[Alternative, ...]
    dimensions: tuple[Dimension, ...]
    moe: str = ""
    """For a mixture of experts, the plan's expert terms (``moe_note``); "" for a dense model."""


def moe_note(model: ModelProfile, hw: HardwareProfile, s: Strategy) -> str:
    """The expert terms of ``s`` on its slowest stage, one line: all-to-all and expert GEMM
    seconds per step, expert state per device, the ep group's tier."""
    t = moe_terms(model, hw, s)
    tier = "across nodes" if t.ep_inter_node else "inside a node"
    return (f"ep={s.mesh.ep}: all-to-all {t.all_to_all_s:.3g} s/step ({tier}), expert GEMMs "
            f"{t.expert_gemm_s:.3g} s/step, expert states {t.expert_state_bytes / 2**30:.2f} GiB/device")


def describe(s: Strategy) -> str:
    """A one-line summary of a strategy."""
    rc = s.recompute
    if s.stage_recompute:
        totals = [sum(c[i] for c in s.stage_recompute) for i in range(len(RECOMPUTE))]
        rc = "/".join(f"{n}{m[0]}" for n, m in zip(totals, RECOMPUTE) if n)  # 75n/3s/47f/1o
    return (f"dp={s.mesh.dp} tp={s.mesh.tp} pp={s.mesh.pp}{f' cp={s.mesh.cp}' if s.mesh.cp > 1 else ''}"
            f"{f' ep={s.mesh.ep}' if s.mesh.ep > 1 else ''} zero={s.zero} mbs={s.micro_batch} "
            f"m={s.num_microbatches} {s.schedule}{f' v={s.virtual_stages}' if s.virtual_stages > 1 else ''} "
            f"sp={int(s.sequence_parallel)} rc={rc}"
            f"{' order=' + '>'.join(s.axis_order) if s.axis_order != s.mesh.default_order() else ''}")


def _get(s: Strategy, field: str | Axis):
    return s.mesh[field] if isinstance(field, Axis) else getattr(s, field)


def _value(s: Strategy, field: str | Axis):
    if field == "recompute" and s.stage_recompute and len(
            {i for c in s.stage_recompute for i, n in enumerate(c) if n}) > 1:
        return "mixed"
    return _get(s, field)


def _neighbours(values: list, chosen) -> list:
    """The values next to ``chosen`` in sorted order (all values for unordered ones)."""
    if isinstance(chosen, str) or chosen not in values:
        return [v for v in values if v != chosen]
    i = values.index(chosen)
    return [v for v in (values[i - 1] if i > 0 else None,
                        values[i + 1] if i + 1 < len(values) else None) if v is not None]


def explain(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int, dtype: str,
            plan: Strategy, top_k: int = 5, time_limit_s: float = 10.0,
            refused: tuple[str, ...] = ()) -> Explanation:
    """Alternatives and per-dimension neighbours of ``plan`` under the same cost model, without
    the ``refused`` runtime features (``Pins.refused``)."""
    base = Pins(recipe=plan.recipe, refused=refused)
    best = search(model, hw, gpus, global_batch, dtype, base, time_limit_s=time_limit_s, keep=top_k)
    space = list(candidates(model, hw, gpus, global_batch, dtype, base))
    dims = []
    for field, pin in DIMENSIONS:
        values = sorted({_get(s, field) for s in space}, key=lambda v: (str(type(v)), v))
        if field == "recompute":  # the modes the recipe's program has
            values = [m for m in (("none", "selective", "op", "full") if model.op_priced else ("none", "selective", "full"))
                      if m in plan.recipe.recompute_modes]
        chosen = _value(plan, field)
        out = []
        for value in _neighbours(values, chosen):
            try:
                sol = search(model, hw, gpus, global_batch, dtype, Pins(**{pin: value}, recipe=plan.recipe, refused=refused),
                             time_limit_s=time_limit_s)
                note = describe(sol.strategy)
                if field == Axis.EP:
                    note += "; " + moe_note(model, hw, sol.strategy)
                out.append(Neighbour(value=str(value), step_time_s=sol.estimate.step_time_s, note=note))
            except UserError as exc:
                out.append(Neighbour(value=str(value), step_time_s=None, note=str(exc)))
        dims.append(Dimension(name=str(field), chosen=str(chosen), neighbours=tuple(out)))
    from cost_models import estimate
    own = estimate(model, hw, plan, global_batch=global_batch).step_time_s
    return Explanation(step_time_s=own, alternatives=best.alternatives, dimensions=tuple(dims),
                       moe=moe_note(model, hw, plan) if model.moe else "")


def explanation_dict(e: Explanation) -> dict:
    """JSON-ready form (strategies as their one-line summary)."""
    return {"step_time_s": e.step_time_s,
            "alternatives": [{"step_time_s": a.step_time_s, "strategy": describe(a.strategy)}
                             for a in e.alternatives],
            "dimensions": [dataclasses.asdict(d) for d in e.dimensions],
            **({"moe": e.moe} if e.moe else {})}
