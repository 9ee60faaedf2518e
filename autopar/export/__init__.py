"""``autopar export``: a plan as another framework's launch configuration.

One module per target (``megatron``, ``deepspeed``, ``torchtitan``, ``accelerate``), each with
``adapt`` (replace what the target cannot express by the nearest setting it can, priced),
``render`` (the file and the command that launches it) and ``parse`` (read a file back into
``Settings``, for round trips). ``export_plan`` runs the three steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autopar.errors import UserError
from autopar.export import accelerate, deepspeed, megatron, torchtitan
from autopar.export.common import Adapter, Gap, Pricer, Priced, Settings, Target, cost_note, model_shape, nodes
from autopar.plan import Plan

FRAMEWORKS = {Target.MEGATRON: megatron.FRAMEWORK, Target.DEEPSPEED: deepspeed.FRAMEWORK,
              Target.TORCHTITAN: torchtitan.FRAMEWORK, Target.ACCELERATE: accelerate.FRAMEWORK}
DEFAULT_FILES = {Target.MEGATRON: megatron.DEFAULT_FILE, Target.DEEPSPEED: deepspeed.DEFAULT_FILE,
                 Target.TORCHTITAN: torchtitan.DEFAULT_FILE, Target.ACCELERATE: accelerate.DEFAULT_FILE}


@dataclass(frozen=True, kw_only=True, slots=True)
class Export:
    """A plan exported to one framework."""

    target: Target
    framework: str
    """The framework release the file is written for."""
    filename: str
    content: str
    launch: str
    """The command that starts training with the file."""
    gaps: tuple[Gap, ...]
    """What the framework cannot express, and the nearest setting written instead."""
    plan: Plan
    """The plan as the framework will run it (the original one when there are no gaps)."""
    planned: Priced
    exported: Priced
    """The cost model on the original plan and on ``plan``."""

    def summary(self) -> str:
        """The cost model on the plan as exported against the plan as planned."""
        return cost_note(self.planned, self.exported, "as planned")

    def as_dict(self) -> dict:
        return {"target": self.target.value, "framework": self.framework, "file": self.filename,
                "content": self.content, "launch": self.launch,
                "warnings": [g.as_dict() for g in self.gaps],
                "planned_step_time_s": self.planned.step_time_s, "exported_step_time_s": self.exported.step_time_s,
                "exported_fits": self.exported.fits}


def export_plan(plan: Plan, target: Target | str, filename: str | None = None,
                pricer: Pricer | None = None) -> Export:
    """``plan`` as ``target``'s configuration, written for a file named ``filename``."""
    target = Target(target)
    if plan.mesh.ep > 1 and target not in (Target.MEGATRON, Target.TORCHTITAN):
        raise UserError(f"the plan has ep={plan.mesh.ep}: the {target.value} export does not write expert "
                        "parallelism; export it with --to megatron (--expert-model-parallel-size) or torchtitan, "
                        "or re-plan with --ep 1")
    name = filename or DEFAULT_FILES[target]
    if target == Target.TORCHTITAN and not Path(name).stem.isidentifier():
        raise UserError(f"--out {name}: torchtitan imports the config as a module (--module {Path(name).stem}); "
                        "name the file like a Python module, e.g. autopar_torchtitan.py")
    a = Adapter(plan, target, pricer)
    if target == Target.DEEPSPEED:
        deepspeed.adapt(a)
    elif target == Target.ACCELERATE:
        accelerate.adapt(a)
    else:  # the targets that build the model need its shape
        shape = model_shape(plan)
        (megatron if target == Target.MEGATRON else torchtitan).adapt(a, shape)
        shape = model_shape(a.plan) if a.plan.model != plan.model else shape
    out = a.plan
    where = nodes(out)
    planned, exported = a.total() if a.gaps else (Priced(), Priced())
    header = [f"{FRAMEWORKS[target]}: exported by `autopar export --to {target.value}` from the plan for",
              f"{plan.model} on {plan.gpus} x {plan.cluster} (global batch {plan.global_batch}, seq {plan.seq_len}).",
              *(f"WARNING: {g.line(target)}" for g in a.gaps),
              *([f"WARNING: as exported: {cost_note(planned, exported, 'as planned')}"] if a.gaps else [])]
    if target == Target.MEGATRON:
        content, launch = megatron.render(out, shape, a.recipe, where, header)
        launch = launch.replace("<script>", Path(name).name)
    elif target == Target.DEEPSPEED:
        content, launch = deepspeed.render(out, a.recipe, where, Path(name).name)
    elif target == Target.TORCHTITAN:
        content, launch = torchtitan.render(out, shape, where, header, Path(name).stem)
    else:
        content, launch = accelerate.render(out, where, header, Path(name).name)
    return Export(target=target, framework=FRAMEWORKS[target], filename=name, content=content, launch=launch,
                  gaps=tuple(a.gaps), plan=out, planned=planned, exported=exported)


def read_back(target: Target | str, text: str, layers: int) -> Settings:
    """The settings an exported file states (``layers``: the model's blocks, for targets whose
    file does not name them)."""
    target = Target(target)
    if target == Target.MEGATRON:
        return megatron.parse(text)
    if target == Target.DEEPSPEED:
        return deepspeed.parse(text, layers)
    if target == Target.TORCHTITAN:
        return torchtitan.parse(text)
    return accelerate.parse(text, layers)


__all__ = ["Export", "Gap", "Settings", "Target", "cost_note", "export_plan", "read_back"]
