"""The Plan: the one versioned, frozen record passed from the solver to everything after it.

Serialised generically: ``dataclasses.asdict`` out, a type-hint-driven rebuild in; a file of
another ``version`` is refused with the fix.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from autopar.errors import UserError
from autopar.layout import Anatomy
from cost_models.recipe import ExecutionRecipe, RecipeError, load_recipe
from cost_models.strategy import RECOMPUTE, Estimate, Strategy

PLAN_VERSION = 1
AXES = ("pp", "dp", "tp")
"""The mesh axes the runtime builds, in Megatron's rank order (outermost first)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Mesh:
    """Degrees of the device-mesh axes; their product is the number of devices."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.ep


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """How to train ``model`` on ``cluster``: every choice the runtime needs, nothing else."""

    version: int = PLAN_VERSION
    model: str
    """Model spec string or preset name (``autopar.spec.parse_model_spec``)."""
    cluster: str
    """Hardware profile name or path."""
    gpus: int
    global_batch: int
    """Sequences per optimizer step, over all data-parallel ranks."""
    seq_len: int
    dtype: str = "bf16"
    mesh: Mesh
    zero_stage: int = 0
    micro_batch_size: int = 1
    num_microbatches: int = 1
    """Micro-batches per optimizer step on each data-parallel rank."""
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    stage_layers: tuple[int, ...]
    """Transformer blocks on each pipeline stage, first to last."""
    recompute: tuple[str, ...]
    """Recompute mode of each transformer block: none, selective or full."""
    offload: bool = False
    """Optimizer state and master weights kept in host memory."""
    axis_order: tuple[str, ...] = AXES
    """Mesh axes from outermost to innermost: ranks that differ only in the last axis are
    consecutive (share a node first). Megatron's order is pp, dp, tp."""
    recipe: str = "autopar"
    """The execution recipe the estimate priced (``cost_models/recipes`` name or a path)."""
    verified: tuple[tuple[str, str], ...] = ()
    """(check, "" if it passed else the one-line reason it failed) of each runtime feature
    proved on the model's tiny twin before planning (``autopar verify``; ``features``); empty
    when not verified (the built-in models are proved by autopar's own parity tests)."""
    layout: Anatomy | None = None
    """The model's layout as the runtime shards it (blocks, embedding, head, column/row GEMMs,
    packed projections, norms: ``autopar.layout``), read off the trace when planning; None for
    a plan made elsewhere (the runtime then derives it)."""
    estimate: Estimate | None = None

    def __post_init__(self) -> None:
        if self.version != PLAN_VERSION:
            raise UserError(f"plan version {self.version} is not supported by this autopar "
                            f"(version {PLAN_VERSION}); re-create it with `autopar plan`")
        if self.mesh.size != self.gpus:
            raise UserError(f"plan mesh {self.mesh} has {self.mesh.size} devices but gpus={self.gpus}")
        if len(self.stage_layers) != self.mesh.pp * self.virtual_stages:
            raise UserError(f"plan has {len(self.stage_layers)} stage_layers entries for "
                            f"pp={self.mesh.pp} x virtual_stages={self.virtual_stages}")
        if len(self.recompute) != sum(self.stage_layers):
            raise UserError(f"plan has {len(self.recompute)} recompute entries for "
                            f"{sum(self.stage_layers)} layers")
        if sorted(self.axis_order) != sorted(AXES):
            raise UserError(f"plan axis_order {self.axis_order} must order the axes {', '.join(AXES)}")
        per_step = self.mesh.dp * self.micro_batch_size * self.num_microbatches
        if per_step != self.global_batch:
            raise UserError(f"plan dp x micro_batch_size x num_microbatches = {per_step} "
                            f"but global_batch = {self.global_batch}")

    @property
    def num_layers(self) -> int:
        return sum(self.stage_layers)

    def features(self) -> tuple[str, ...]:
        """The runtime features this plan uses, by ``autopar verify``'s check names: dp (ZeRO
        1-3 on FSDP2), tp, sp, pp, selective."""
        used = {"dp": self.mesh.dp > 1 and self.zero_stage > 0, "tp": self.mesh.tp > 1,
                "sp": self.sequence_parallel, "pp": self.mesh.pp > 1, "selective": "selective" in self.recompute}
        return tuple(name for name, on in used.items() if on)

    def refusal(self) -> str | None:
        """Why the runtime must not run this plan: a feature it uses that the twin failed."""
        failed = {check: reason for check, reason in self.verified if reason}
        for feature in self.features():
            if feature in failed:
                return f"{self.model} failed the {feature} check on its twin ({failed[feature]}); re-plan without it"
        return None

    def strategy(self) -> Strategy:
        """The cost model's view of this plan: per pipeline rank, its blocks (over its
        virtual stages r, r + pp, ...) counted per recompute mode; ``recompute`` is the most
        common mode (what zero-bubble's fill fraction reads)."""
        pp, starts = self.mesh.pp, [0]
        for n in self.stage_layers:
            starts.append(starts[-1] + n)
        per_rank = []
        for r in range(pp):
            modes = [m for vs in range(r, len(self.stage_layers), pp)
                     for m in self.recompute[starts[vs]:starts[vs + 1]]]
            per_rank.append(tuple(modes.count(m) for m in RECOMPUTE))
        totals = [self.recompute.count(m) for m in RECOMPUTE]
        nominal = RECOMPUTE[max(range(len(RECOMPUTE)), key=lambda i: (totals[i], -i))]
        return Strategy(dp=self.mesh.dp, tp=self.mesh.tp, pp=pp, zero=self.zero_stage,
                        micro_batch=self.micro_batch_size, num_microbatches=self.num_microbatches,
                        schedule=self.schedule, virtual_stages=self.virtual_stages,
                        sequence_parallel=self.sequence_parallel, recompute=nominal,
                        stage_layers=tuple(map(sum, per_rank)), stage_recompute=tuple(per_rank),
                        offload=self.offload, axis_order=self.axis_order,
                        dtype=self.dtype, recipe=self.execution_recipe())

    def execution_recipe(self) -> ExecutionRecipe:
        """The plan's recipe, loaded; an unknown one is a ``UserError`` naming the fix."""
        try:
            return load_recipe(self.recipe)
        except RecipeError as exc:
            raise UserError(f"plan recipe: {exc}") from None

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, so identical plans are identical bytes."""
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())


def _build(tp: typing.Any, value: typing.Any) -> typing.Any:
    """Rebuild ``value`` (parsed JSON) as type ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _build(inner, value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise UserError(f"plan field of type {tp.__name__} must be an object, got {value!r}")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = set(value) - names
        if unknown:
            raise UserError(f"plan has unknown {tp.__name__} fields {sorted(unknown)}")
        return tp(**{k: _build(hints[k], v) for k, v in value.items()})
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v) for v in value)
        if len(value) != len(args):
            raise UserError(f"plan field {value!r} must have {len(args)} entries")
        return tuple(_build(a, v) for a, v in zip(args, value))
    if origin is dict:
        return dict(value)
    return value


def plan_from_dict(data: dict) -> Plan:
    if data.get("version") != PLAN_VERSION:
        raise UserError(f"plan version {data.get('version')!r} is not supported by this autopar "
                        f"(version {PLAN_VERSION}); re-create it with `autopar plan`")
    try:
        return _build(Plan, data)
    except TypeError as exc:
        raise UserError(f"plan is malformed: {exc}") from None


def load_plan(path: str | Path) -> Plan:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"plan file {p} does not exist; create one with `autopar plan --out {p}`")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"plan file {p} is not valid JSON: {exc}") from None
    return plan_from_dict(data)


def runtime_unsupported(*, dp: int, pp: int, zero: int, schedule: str, virtual_stages: int,
                        cp: int = 1, ep: int = 1, offload: bool = False) -> str | None:
    """Why ``autopar.runtime`` cannot run this combination (torch 2.13), or None if it can.
    Pure data, so the solver can skip what the runtime refuses without importing torch."""
    if cp != 1 or ep != 1:
        return f"the runtime has no context or expert parallelism yet (cp={cp}, ep={ep}); use cp = ep = 1"
    if virtual_stages > 1 and schedule not in ("interleaved", "zero-bubble"):
        return (f"virtual_stages={virtual_stages} needs the interleaved or zero-bubble schedule, "
                f"not {schedule}")
    if schedule == "zero-bubble" and zero == 3 and dp > 1 and pp > 1:
        # FSDP2 re-shards between the input- and weight-gradient passes of the split backward,
        # and the weight gradients of earlier micro-batches are lost (measured: loss off by 1e-2).
        return "the zero-bubble schedule does not compose with ZeRO-3 in torch 2.13; use --zero 2 or another schedule"
    if offload and (zero == 0 or dp == 1):
        return "CPU offload runs with FSDP2's CPUOffloadPolicy, which needs ZeRO >= 1 over dp > 1; use --zero 1..3"
    return None
