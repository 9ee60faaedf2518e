"""The Plan: the one versioned, frozen record passed from the solver to everything after it.

Serialised generically: ``dataclasses.asdict`` out, a type-hint-driven rebuild in; a file of
another ``version`` is refused with the fix.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from autopar.errors import UserError
from autopar.layout import Anatomy, tp_splits_heads
from autopar.limits import (MAX_GLOBAL_BATCH, MAX_GPUS, MAX_LAYERS, MAX_SEQ, check_count, is_int,
                            shown)
from cost_models.axes import DEFAULT_ORDER, Axis, Degrees, parse_order
from cost_models.jsonfile import JsonFileError, decode_json
from cost_models.recipe import DEFAULT_RECIPE, ExecutionRecipe, RecipeError, load_recipe
from cost_models.strategy import RECOMPUTE, SCHEDULES, Estimate, Strategy

if typing.TYPE_CHECKING:
    from autopar.spec import ModelSpec

PLAN_VERSION = 1
DTYPES = ("bf16", "fp16", "fp32")
"""Training dtypes the runtime has (``autopar.runtime.context.DTYPES``)."""
FEATURES = ("dp", "tp", "sp", "pp", "selective", "op", "tp+selective", "sp+full", "sp+op")
"""``autopar verify``'s check names (``autopar.verify.Check``), as ``Plan.verified`` records them."""
MAX_PLAN_BYTES = 64 << 20
"""A plan file larger than this is refused unread (a plan of 1,024 blocks is a few KiB)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Mesh(Degrees):
    """Degrees of the device-mesh axes; the product of the mesh axes (``size``) is the number
    of devices, and ep regroups the dp x cp ranks of the expert layers (``cost_models.axes``)."""

    @classmethod
    def of(cls, degrees: Degrees) -> Mesh:
        """The mesh of ``degrees``."""
        return cls(**{axis.value: degrees[axis] for axis in Axis})

    def degrees(self) -> Degrees:
        """The degree of each ``Axis`` (what the cost model and the runtime read)."""
        return Degrees(**{axis.value: self[axis] for axis in Axis})


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
    axis_order: tuple[Axis, ...] = DEFAULT_ORDER
    """Mesh axes from outermost to innermost: ranks that differ only in the last axis are
    consecutive (share a node first). Megatron's order is pp, dp, (cp,) tp; cp is listed only
    when mesh.cp > 1 (``cost_models.axes.canonical_order``), so plans without context
    parallelism read and write as before it existed."""
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
            raise UserError(f"plan version {shown(self.version)} is not supported by this autopar "
                            f"(version {PLAN_VERSION}); re-create it with `autopar plan`")
        self._check_values()
        if self.mesh.size != self.gpus:
            raise UserError(f"plan mesh {self.mesh} has {self.mesh.size} devices but gpus={self.gpus}")
        if len(self.stage_layers) != self.mesh.pp * self.virtual_stages:
            raise UserError(f"plan has {len(self.stage_layers)} stage_layers entries for "
                            f"pp={self.mesh.pp} x virtual_stages={self.virtual_stages}")
        if len(self.recompute) != sum(self.stage_layers):
            raise UserError(f"plan has {len(self.recompute)} recompute entries for "
                            f"{sum(self.stage_layers)} layers")
        per_step = self.mesh.dp * self.micro_batch_size * self.num_microbatches
        if per_step != self.global_batch:
            raise UserError(f"plan dp x micro_batch_size x num_microbatches = {per_step} "
                            f"but global_batch = {self.global_batch}")
        if self.offload and self.zero_stage < 1:
            raise UserError("plan offload moves ZeRO's shards to the host; it needs zero_stage >= 1")
        if self.sequence_parallel and self.mesh.tp == 1:
            raise UserError("plan sequence_parallel splits what tensor parallelism replicates; it needs mesh.tp > 1")

    def _check_values(self) -> None:
        """Each field on its own: kinds, enumerations and ranges (one line naming the field)."""
        for name in ("model", "cluster", "recipe"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip() or "\n" in value:
                raise UserError(f"plan {name} must be a non-empty one-line string, got {shown(value)}")
        check_count("plan gpus", self.gpus, MAX_GPUS)
        check_count("plan global_batch", self.global_batch, MAX_GLOBAL_BATCH)
        check_count("plan seq_len", self.seq_len, MAX_SEQ)
        for f in dataclasses.fields(self.mesh):
            check_count(f"plan mesh.{f.name}", getattr(self.mesh, f.name), MAX_GPUS)
        check_count("plan micro_batch_size", self.micro_batch_size, MAX_GLOBAL_BATCH)
        check_count("plan num_microbatches", self.num_microbatches, MAX_GLOBAL_BATCH)
        check_count("plan virtual_stages", self.virtual_stages, MAX_LAYERS)
        if self.dtype not in DTYPES:
            raise UserError(f"plan dtype {shown(self.dtype)} is not one of {', '.join(DTYPES)}")
        if not is_int(self.zero_stage) or self.zero_stage not in (0, 1, 2, 3):
            raise UserError(f"plan zero_stage must be 0, 1, 2 or 3, got {shown(self.zero_stage)}")
        if self.schedule not in SCHEDULES:
            raise UserError(f"plan schedule {shown(self.schedule)} is not one of {', '.join(SCHEDULES)}")
        for flag in ("sequence_parallel", "offload"):
            if not isinstance(getattr(self, flag), bool):
                raise UserError(f"plan {flag} must be true or false, got {shown(getattr(self, flag))}")
        if len(self.recompute) > MAX_LAYERS:
            raise UserError(f"plan has {len(self.recompute)} recompute entries, above autopar's limit "
                            f"of {MAX_LAYERS:,} blocks")
        for n in self.stage_layers:
            check_count("plan stage_layers entry", n, MAX_LAYERS)
        bad = sorted({m for m in self.recompute if m not in RECOMPUTE}, key=str)
        if bad:
            raise UserError(f"plan recompute modes {', '.join(map(shown, bad))} are not "
                            f"{', '.join(RECOMPUTE)}")
        try:  # names ("pp", ...) become members
            object.__setattr__(self, "axis_order", parse_order(self.axis_order, self.mesh))
        except (ValueError, TypeError):
            given = tuple(str(a) if isinstance(a, str) else a for a in self.axis_order)
            raise UserError(f"plan axis_order {shown(given)} must order the axes "
                            f"{', '.join(a for a in Axis if a != Axis.CP)} once each (and cp when "
                            f"mesh.cp > 1)") from None
        checks = [c for c, _ in self.verified]
        if any(c not in FEATURES for c in checks) or len(set(checks)) != len(checks):
            raise UserError(f"plan verified must name each of the checks {', '.join(FEATURES)} at most "
                            f"once, got {shown(checks)}")

    def check_model(self, spec: ModelSpec) -> None:
        """Refuse a plan the model it names cannot take (a hand-edited tp or stage_layers, a
        sequence beyond a learned position table, an ep that does not divide the routed experts
        or dp x cp). A user module's shape is known once traced: unknown (0) fields are not
        checked. Context parallelism needs the sequence in 2 cp chunks (causal load balancing);
        autopar's runtime refuses it and expert parallelism (``refusal``)."""
        replicas = self.mesh.dp * self.mesh.cp
        if replicas % self.mesh.ep:
            raise UserError(f"plan mesh.ep={self.mesh.ep} must divide dp x cp = {replicas} (expert parallelism "
                            "regroups the data-parallel ranks)")
        if self.mesh.ep > 1 and spec.arch != "module" and (not spec.experts or spec.experts % self.mesh.ep):
            raise UserError(f"plan mesh.ep={self.mesh.ep} must divide the routed experts of {shown(self.model)} "
                            f"({spec.experts or 'none'}); re-create it with `autopar plan`")
        if self.seq_len % (2 * self.mesh.cp):
            raise UserError(f"plan mesh.cp={self.mesh.cp} needs seq_len a multiple of 2 x cp = {2 * self.mesh.cp} "
                            f"(load-balanced causal chunks), got {self.seq_len}")
        if spec.heads and not tp_splits_heads(spec.heads, spec.num_kv_heads, self.mesh.tp):
            raise UserError(f"plan mesh.tp={self.mesh.tp} does not divide the {spec.heads} heads and "
                            f"{spec.num_kv_heads} kv heads of {shown(self.model)}; re-create it with `autopar plan`")
        if spec.layers and self.num_layers != spec.layers:
            raise UserError(f"plan stage_layers place {self.num_layers} blocks but {shown(self.model)} has "
                            f"{spec.layers}; re-create it with `autopar plan`")
        if spec.max_positions and self.seq_len > spec.max_positions:
            raise UserError(f"plan seq_len {self.seq_len} exceeds the {spec.max_positions} positions "
                            f"{shown(self.model)} learns; use seq_len <= {spec.max_positions}")

    @property
    def num_layers(self) -> int:
        return sum(self.stage_layers)

    def features(self) -> tuple[str, ...]:
        """The runtime features this plan uses, by ``autopar verify``'s check names: dp (ZeRO
        1-3 on FSDP2), tp, sp, pp, selective, op (per-op recompute), and the pairs proved
        together (tp+selective, sp+full, sp+op)."""
        tp, sp = self.mesh.tp > 1, self.sequence_parallel
        used = {"dp": self.mesh.dp > 1 and self.zero_stage > 0, "tp": tp, "sp": sp, "pp": self.mesh.pp > 1,
                "selective": "selective" in self.recompute, "op": "op" in self.recompute,
                "tp+selective": tp and "selective" in self.recompute, "sp+full": sp and "full" in self.recompute,
                "sp+op": sp and "op" in self.recompute}
        return tuple(name for name, on in used.items() if on)

    def refusal(self) -> str | None:
        """Why the runtime must not run this plan, read off the plan alone (nothing traced): context
        parallelism it does not run (with pipelining, on models other than the built-in ones),
        or a feature it uses that the twin failed."""
        if self.mesh.cp > 1:
            from autopar.layout import context_parallel_unsupported
            from autopar.spec import parse_model_spec
            m = self.mesh
            reason = runtime_unsupported(dp=m.dp * m.cp, pp=m.pp, zero=self.zero_stage, schedule=self.schedule,
                                         virtual_stages=self.virtual_stages, cp=m.cp) or \
                context_parallel_unsupported(builtin=parse_model_spec(self.model).builtin, cp=m.cp, pp=m.pp,
                                             seq=self.seq_len, tp=m.tp, sequence_parallel=self.sequence_parallel)
            if reason:
                return f"plan has cp={m.cp}: {reason}"
        reason = op_unsupported(self.recompute, self.schedule, self.mesh.pp, self.mesh.cp)
        if reason:
            return f"plan has {reason}"
        failed = {check: reason for check, reason in self.verified if reason}
        for feature in self.features():
            if feature in failed:
                return f"{self.model} failed the {feature} check on its twin ({failed[feature]}); re-plan without it"
        return None

    def strategy(self, recipe: ExecutionRecipe | None = None, lead: int = 0) -> Strategy:
        """The cost model's view of this plan under ``recipe`` (None: the plan's own): per
        pipeline rank, its blocks (over its virtual stages r, r + pp, ...) counted per
        recompute mode; ``recompute`` is the most common mode (what zero-bubble's fill
        fraction reads). ``lead``: the model's leading blocks of another kind
        (``ModelProfile.lead_layers``), the first ``lead`` of virtual stage 0, one recompute
        mode for all (``Strategy.lead_recompute``), outside the strategy's placement. A
        strategy the recipe cannot run (cp > 1 without context parallelism) is a
        ``UserError`` naming the fix."""
        pp, starts = self.mesh.pp, [0]
        for n in self.stage_layers:
            starts.append(starts[-1] + n)
        lead_modes = set(self.recompute[:lead])
        if lead and (self.stage_layers[0] <= lead or len(lead_modes) != 1):
            raise UserError(f"plan's first stage must hold the model's {lead} leading blocks, in one recompute "
                            f"mode, and a block after them; re-create it with `autopar plan`")
        per_rank = []
        for r in range(pp):
            modes = [m for vs in range(r, len(self.stage_layers), pp)
                     for m in self.recompute[max(starts[vs], lead):starts[vs + 1]]]
            per_rank.append(tuple(modes.count(m) for m in RECOMPUTE))
        totals = [self.recompute[lead:].count(m) for m in RECOMPUTE]
        nominal = RECOMPUTE[max(range(len(RECOMPUTE)), key=lambda i: (totals[i], -i))]
        try:
            return Strategy(mesh=self.mesh.degrees(), zero=self.zero_stage,
                            micro_batch=self.micro_batch_size, num_microbatches=self.num_microbatches,
                            schedule=self.schedule, virtual_stages=self.virtual_stages,
                            sequence_parallel=self.sequence_parallel, recompute=nominal,
                            stage_layers=tuple(map(sum, per_rank)), stage_recompute=tuple(per_rank),
                            lead_recompute=lead_modes.pop() if lead else "", offload=self.offload, axis_order=self.axis_order,
                            dtype=self.dtype, recipe=recipe or self.execution_recipe())
        except ValueError as exc:
            raise UserError(f"plan {exc}") from None

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
        """Write the plan's JSON at once: to a temporary file beside ``path``, then renamed, so
        a failed write leaves no partial plan."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(self.to_json())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def rebuild(tp: typing.Any, value: typing.Any, where: str) -> typing.Any:
    """Rebuild ``value`` (parsed JSON) as type ``tp``, checking its kind: ``where`` names the
    field in the one-line error (``plan mesh.tp must be an integer, got '2'``)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return rebuild(inner, value, where)
    if dataclasses.is_dataclass(tp):
        assert isinstance(tp, type)  # a type hint: the class, never an instance
        if not isinstance(value, dict):
            raise UserError(f"{where} must be a JSON object, got {shown(value)}")
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp)}
        unknown = set(value) - set(fields)
        if unknown:
            raise UserError(f"{where} has unknown fields {shown(sorted(unknown))}; remove them")
        missing = [n for n, f in fields.items() if n not in value and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise UserError(f"{where} lacks the fields {', '.join(missing)}; re-create it with `autopar plan`")
        return tp(**{k: rebuild(hints[k], v, f"{where}.{k}" if where != "plan" else f"plan {k}")
                     for k, v in value.items()})
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{where} must be a JSON array, got {shown(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(rebuild(args[0], v, f"{where} entry") for v in value)
        if len(value) != len(args):
            raise UserError(f"{where} entries must be arrays of {len(args)}, got {shown(value)}")
        return tuple(rebuild(a, v, f"{where} entry") for a, v in zip(args, value))
    if tp is bool:
        if not isinstance(value, bool):
            raise UserError(f"{where} must be true or false, got {shown(value)}")
        return value
    if tp is int:
        if not is_int(value):
            raise UserError(f"{where} must be an integer, got {shown(value)}")
        return value
    if tp is float:
        try:
            number = float(value) if is_int(value) or isinstance(value, float) else math.nan
        except OverflowError:  # an integer beyond float's range
            number = math.nan
        if not math.isfinite(number):
            raise UserError(f"{where} must be a finite number, got {shown(value)}")
        return number
    if isinstance(tp, type) and issubclass(tp, Enum):
        names = [m.value for m in tp]
        if value not in names:
            raise UserError(f"{where} must be one of {', '.join(map(str, names))}, got {shown(value)}")
        return tp(value)
    if tp is str:
        if not isinstance(value, str):
            raise UserError(f"{where} must be a string, got {shown(value)}")
        return value
    raise TypeError(f"plan field type {tp!r} has no JSON form")  # a Plan field autopar added


def plan_from_dict(data: object) -> Plan:
    """The Plan of parsed JSON, every field checked (kinds, values, consistency, and against
    the model it names: ``Plan.check_model``); anything wrong is one ``UserError`` line."""
    if not isinstance(data, dict):
        raise UserError(f"a plan is a JSON object, got {shown(data)}; create one with `autopar plan --out`")
    if data.get("version") != PLAN_VERSION:
        raise UserError(f"plan version {shown(data.get('version'))} is not supported by this autopar "
                        f"(version {PLAN_VERSION}); re-create it with `autopar plan`")
    plan = rebuild(Plan, data, "plan")
    from autopar.spec import parse_model_spec  # the spec module imports nothing of the plan's
    plan.check_model(parse_model_spec(plan.model))
    return plan


def load_plan(path: str | Path) -> Plan:
    """A plan file written by ``autopar plan --out``: any bytes that are not one give a
    ``UserError`` (not UTF-8, not JSON, too deep or too large, a field out of range)."""
    p = Path(path)
    try:
        found, size = p.is_file(), p.stat().st_size if p.is_file() else 0
        raw = p.read_bytes() if found and size <= MAX_PLAN_BYTES else b""
    except (OSError, ValueError) as exc:  # unreadable, a name the OS refuses
        raise UserError(f"cannot read plan file {shown(str(p))}: {' '.join(str(exc).split())[:200]}") from None
    if not found:
        what = "is not a file" if p.exists() else "does not exist"
        raise UserError(f"plan file {shown(str(p))} {what}; create one with `autopar plan --out FILE`")
    if size > MAX_PLAN_BYTES:
        raise UserError(f"plan file {p} is {size:,} bytes, not a plan; create one with `autopar plan --out FILE`")
    try:
        data = decode_json(raw, "plan")
    except JsonFileError as exc:
        fix = "" if "4,300" in str(exc) or "valid JSON" in str(exc) else "; create one with `autopar plan --out`"
        raise UserError(f"plan file {p} {exc}{fix}") from None
    return plan_from_dict(data)


def op_unsupported(recompute: tuple[str, ...], schedule: str, pp: int, cp: int) -> str | None:
    """Why the runtime cannot run per-op recompute (``op``) in this plan, or None: torch's
    selective checkpointing allows one backward through a block, and the zero-bubble schedule
    runs two (input, then weight gradients); context parallelism replaces the attention it keeps."""
    if "op" not in recompute:
        return None
    if schedule == "zero-bubble" and pp > 1:
        return ("per-op recompute under the zero-bubble schedule, which backpropagates through a block twice "
                "(torch's selective checkpointing allows once); re-plan with --recompute full or another schedule")
    if cp > 1:
        return f"per-op recompute with cp={cp}, which does not run with context parallelism; re-plan with --recompute full"
    return None


def runtime_unsupported(*, dp: int, pp: int, zero: int, schedule: str, virtual_stages: int,
                        cp: int = 1, ep: int = 1, offload: bool = False,
                        recipe: ExecutionRecipe | None = None, moe: bool = False,
                        sequence_parallel: bool = False) -> str | None:
    """Why the program of ``recipe`` (None: ``autopar``, autopar's own runtime on torch 2.13)
    cannot run this combination, or None if it can. Pure data, so the solver can skip what
    the runtime refuses without importing torch. Context parallelism runs only under a recipe
    that has it (``ExecutionRecipe.context_parallel``: autopar's all-gather CP, Megatron-Core,
    torchtitan); autopar's own runtime runs it without pipelining (``runtime.context_parallel``),
    so under its recipe cp x pp is refused (other recipes' programs, run through ``autopar
    export``, compose them). Expert parallelism (``ep``; ``moe``: the model has
    mixture-of-experts blocks) is planned under every recipe; autopar's own program runs what
    ``autopar.layout.expert_parallel_unsupported`` allows (ep regroups dp, under any pipeline
    schedule, sequence parallelism of MoE layers without it), without context parallelism beside it."""
    rec = recipe or load_recipe()
    if rec.name == DEFAULT_RECIPE and (ep != 1 or moe):
        from autopar.layout import expert_parallel_unsupported
        if ep > 1 and cp > 1:
            return f"expert parallelism (ep={ep}) with context parallelism (cp={cp}) is not proved in autopar's runtime; use one"
        reason = expert_parallel_unsupported(ep=ep, dp=dp, sequence_parallel=sequence_parallel, moe=moe)
        if reason:
            return reason
    if cp != 1 and not rec.has_context_parallel:
        return (f"the {rec.name} recipe has no context parallelism (cp={cp}); use cp = 1, or plan with "
                "--recipe autopar (all-gathered K,V) or megatron-core (ring attention)")
    if cp != 1 and pp != 1 and rec.name == DEFAULT_RECIPE:
        return (f"autopar's runtime does not compose context parallelism (cp={cp}) with pipelining (pp={pp}) yet; "
                "use pp = 1 or cp = 1, or plan with --recipe megatron-core and run it through `autopar export`")
    if virtual_stages > 1 and schedule not in ("interleaved", "zero-bubble"):
        return (f"virtual_stages={virtual_stages} needs the interleaved or zero-bubble schedule, "
                f"not {schedule}")
    if schedule == "zero-bubble" and zero == 3 and dp > 1 and pp > 1:
        # FSDP2 re-shards between the input- and weight-gradient passes of the split backward,
        # and the weight gradients of earlier micro-batches are lost (measured: loss off by 1e-2).
        return "the zero-bubble schedule does not compose with ZeRO-3 in torch 2.13; use --zero 2 or another schedule"
    if offload and (zero == 0 or dp == 1):
        return "CPU offload runs with FSDP2's CPUOffloadPolicy, which needs ZeRO >= 1 over dp > 1; use --zero 1..3"
    if schedule not in rec.schedules:
        return (f"the {rec.name} recipe's program has no {schedule} schedule; use --schedule "
                f"{' or '.join(rec.schedules)}")
    stages = rec.pipeline_zero_stages if pp > 1 else rec.zero_stages
    if dp > 1 and zero not in stages:
        return (f"the {rec.name} recipe's program runs ZeRO {', '.join(map(str, stages))}"
                f"{' under a pipeline' if pp > 1 else ''}, not {zero}; use --zero {stages[-1]}")
    if sequence_parallel and not rec.sequence_parallel:
        return f"the {rec.name} recipe's program has no sequence parallelism; use --no-sp"
    return None


def names_code(plan: Plan) -> bool:
    """Whether the plan's model is a Python file (``path/to/file.py:factory``), which tracing,
    pricing or running the plan imports and calls."""
    from autopar.spec import parse_model_spec
    return parse_model_spec(plan.model).arch == "module"


def refuse_code(plan: Plan, path: str | Path) -> None:
    """A ``UserError`` if the plan file ``path`` names a Python file: reading a plan is reading
    data, running its model is running code, which takes ``--trust-code`` (README: What is code)."""
    if names_code(plan):
        raise UserError(f"plan file {shown(str(path))} names Python code ({shown(plan.model)}), which this command "
                        "would import and run; pass --trust-code if you trust the plan and that file")
