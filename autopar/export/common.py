"""What every export target shares: the gap record, the cost of a nearest setting, the model's
shape, the cluster's node layout, and the settings a file is read back into.

An exporter first *adapts* the plan: each setting the target cannot express is replaced by the
nearest one it can (a ``Gap``, priced with autopar's cost model), which yields the plan the
target will actually run; it then *renders* that plan. ``Settings`` is the common view of a
plan and of an exported file read back, so a round trip can be checked field by field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

from autopar.errors import UserError
from autopar.export import hfblocks
from autopar.export.hfblocks import Block
from autopar.plan import Plan
from autopar.spec import ModelSpec, parse_model_spec, with_seq
from cost_models import ModelProfile, ProfileError, estimate, load_profile
from cost_models.axes import DEFAULT_ORDER, Axis
from cost_models.recipe import DpOverlap, ExecutionRecipe
from cost_models.strategy import RECOMPUTE


class Target(str, Enum):
    """The frameworks a plan exports to."""

    MEGATRON = "megatron"
    DEEPSPEED = "deepspeed"
    TORCHTITAN = "torchtitan"
    ACCELERATE = "accelerate"


class Family(str, Enum):
    """The block a model is built from, as far as the targets' model builders care."""

    GPT = "gpt"
    """LayerNorm, GELU MLP, learned positions, biases (GPT-2, Megatron's GPT)."""
    LLAMA = "llama"
    """RMSNorm, SwiGLU MLP, rotary positions, no biases, grouped-query attention."""
    MCORE = "mcore"
    """A block Megatron-Core's GPT builder makes with further flags (Qwen2/3 and their MoE,
    GLM-4.5, DeepSeek-V2/V3: ``autopar.export.hfblocks``)."""
    OTHER = "other"
    """Anything else (an HF class outside those two, a user module): only its shape is known."""


_HF_FAMILIES = {"LlamaConfig": Family.LLAMA, "MistralConfig": Family.LLAMA, "MixtralConfig": Family.LLAMA,
                "GPT2Config": Family.GPT, **{c: Family.MCORE for c in hfblocks.CONFIGS}}
"""HF config classes whose block one of the families reproduces (``Family.MCORE``'s: up to
``hfblocks.Block.notes``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Shape:
    """The model's shape as the targets' model arguments need it."""

    family: Family
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    """Training sequence length (the plan's)."""
    max_positions: int
    """Positions the model supports: at least ``seq``."""
    tied: bool
    experts: int = 0
    topk: int = 0
    source: str = ""
    """What the model is (preset, spec, HF class or module path), for messages."""
    block: Block | None = None
    """The block's further Megatron flags, read off an HF config (``hfblocks.READ``)."""


def model_spec(plan: Plan) -> ModelSpec:
    """The plan's model with every shape field known (a user module is traced for them)."""
    from autopar.profiles import shaped_spec
    spec = parse_model_spec(plan.model)
    return shaped_spec(with_seq(spec, plan.seq_len)) if spec.arch == "module" else spec


def model_shape(plan: Plan) -> Shape:
    spec = model_spec(plan)
    family = {"gpt": Family.GPT, "llama": Family.LLAMA}.get(spec.arch) or _HF_FAMILIES.get(spec.source, Family.OTHER)
    block = None
    if spec.arch == "hf" and spec.source in hfblocks.READ:
        from autopar.profiles import profile_spec
        lead = profile_spec(spec).lead_layers if family == Family.MCORE else 0
        block = hfblocks.read(spec, lead, plan.seq_len)
    return Shape(family=family, layers=spec.layers, hidden=spec.hidden, heads=spec.heads,
                 kv_heads=spec.num_kv_heads, ffn=spec.ffn_hidden, vocab=spec.vocab, seq=plan.seq_len,
                 max_positions=max(spec.seq, plan.seq_len), tied=spec.tied, experts=spec.experts,
                 topk=spec.topk, source=spec.source or spec.name, block=block)


def llama_twin(shape: Shape) -> str:
    """A ``llama:`` spec with ``shape``'s dimensions: the nearest model a target that builds
    only Llama-style blocks can train, and a spec the cost model can price (Mixtral-style, with
    the same routed experts and top-k, when ``shape`` has experts: a dense twin could not take
    the plan's ep)."""
    moe = f",experts={shape.experts},topk={shape.topk}" if shape.experts else ""
    return (f"llama:layers={shape.layers},hidden={shape.hidden},heads={shape.heads},"
            f"kv_heads={shape.kv_heads},ffn={shape.ffn},vocab={shape.vocab},seq={shape.max_positions},"
            f"tied={int(shape.tied)}{moe}")


def twin_options(plan: Plan, shape: Shape, nearest: str) -> list[Option]:
    """The Llama-style twin of ``shape`` as the one candidate for a model gap (``nearest`` with
    ``{spec}`` for its spec), or none when no such spec exists (odd head size ...)."""
    twin = llama_twin(shape)
    try:
        parse_model_spec(twin)
    except UserError:
        return []
    return [Option(nearest=nearest.format(spec=twin), plan=replace_plan(plan, model=twin))]


@dataclass(frozen=True, kw_only=True, slots=True)
class Nodes:
    """How the plan's devices sit on machines (from its hardware profile)."""

    count: int
    per_node: int


def nodes(plan: Plan) -> Nodes:
    try:
        per_node = load_profile(plan.cluster).devices_per_node
    except ProfileError as exc:
        raise UserError(f"plan cluster: {exc}") from None
    per_node = min(per_node, plan.gpus)
    return Nodes(count=max(1, plan.gpus // per_node), per_node=per_node)


# ---- placement --------------------------------------------------------------------------------

def chunks(plan: Plan) -> list[tuple[str, ...]]:
    """Recompute modes of the blocks of each virtual stage, in stage order (stage c·pp + r is
    pipeline rank r's chunk c)."""
    out, at = [], 0
    for n in plan.stage_layers:
        out.append(plan.recompute[at:at + n])
        at += n
    return out


def counts(modes: tuple[str, ...]) -> tuple[int, ...]:
    """Blocks per recompute mode (``RECOMPUTE`` order)."""
    return tuple(modes.count(m) for m in RECOMPUTE)


def mode_counts(n: int, mode: str = "none", k: int | None = None) -> tuple[int, ...]:
    """Counts per mode (``RECOMPUTE`` order) of ``n`` blocks: ``k`` (default all) in ``mode``,
    the rest none."""
    k = n if k is None else k
    return tuple((k if m == mode else 0) + (n - k if m == "none" else 0) for m in RECOMPUTE)


def with_chunks(plan: Plan, new: list[tuple[str, ...]] | list[list[str]], virtual_stages: int | None = None,
                **changes: object) -> Plan:
    """``plan`` with another placement (blocks and recompute modes per virtual stage)."""
    return replace_plan(plan, stage_layers=tuple(len(c) for c in new),
                        recompute=tuple(m for c in new for m in c),
                        virtual_stages=virtual_stages or plan.virtual_stages, **changes)


def per_rank(plan: Plan) -> list[tuple[str, ...]]:
    """Each pipeline rank's modes over its chunks (first chunk first)."""
    pp, cs = plan.mesh.pp, chunks(plan)
    return [tuple(m for c in range(plan.virtual_stages) for m in cs[c * pp + r]) for r in range(pp)]


def contiguous(plan: Plan, sizes: tuple[int, ...], virtual_stages: int = 1, **changes: object) -> Plan:
    """``plan`` with its blocks re-cut into stages of ``sizes`` (stage order), each block
    keeping its recompute mode."""
    new, at = [], 0
    for n in sizes:
        new.append(plan.recompute[at:at + n])
        at += n
    return with_chunks(plan, new, virtual_stages, **changes)


def uniform_recompute(plan: Plan, mode: str) -> Plan:
    return replace_plan(plan, recompute=(mode,) * plan.num_layers)


def replace_plan(plan: Plan, **changes: object) -> Plan:
    """``dataclasses.replace`` on a plan; the estimate it carried no longer applies."""
    return dataclasses.replace(plan, estimate=None, **changes)  # type: ignore[arg-type]


def axis_order(plan: Plan) -> tuple[Axis, ...]:
    """The plan's mesh order without the axes of degree 1 (their position does not matter)."""
    return plan.mesh.active(plan.axis_order)


def order_gap(a: Adapter, reason: str, nearest: str, orders: tuple[tuple[Axis, ...], ...] = (DEFAULT_ORDER,)) -> None:
    """A gap unless the plan's mesh order (axes of degree > 1) is one of ``orders`` (each
    outermost first), a framework's own; the nearest plan takes Megatron's default order."""
    mine = axis_order(a.plan)
    if not any(tuple(x for x in full if x in mine) == mine for full in orders):
        a.gap("axis_order", ",".join(a.plan.axis_order), reason,
              [Option(nearest=nearest, plan=replace_plan(a.plan, axis_order=DEFAULT_ORDER))])


# ---- the cost of a nearest setting ----------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class Priced:
    """The cost model's verdict on one plan: step time and fit, or why it has none."""

    step_time_s: float | None = None
    fits: bool | None = None
    why_not: str = ""




def dp_overlap(plan: Plan, recipe: ExecutionRecipe) -> bool:
    """``Strategy.dp_overlap`` of ``plan`` under ``recipe``, read off the recipe's rule (no
    strategy built: the recipe need not price every degree of the plan, e.g. its cp)."""
    return recipe.dp_overlap == DpOverlap.ALWAYS or (recipe.dp_overlap == DpOverlap.UNPIPELINED
                                                     and plan.mesh.pp == 1)


_PRICED = ("model", "cluster", "gpus", "global_batch", "seq_len", "dtype", "mesh", "zero_stage", "micro_batch_size",
           "num_microbatches", "schedule", "virtual_stages", "sequence_parallel", "stage_layers", "recompute",
           "offload", "axis_order")
"""The plan fields a price depends on (the recipe is priced as given)."""


class Pricer:
    """Prices plans of one job with ``cost_models.estimate``; traces each model once."""

    def __init__(self) -> None:
        self._profiles: dict[tuple[str, int], ModelProfile] = {}
        self._cache: dict[tuple[tuple, ExecutionRecipe], Priced] = {}

    def __call__(self, plan: Plan, recipe: ExecutionRecipe) -> Priced:
        key = (tuple(getattr(plan, f) for f in _PRICED), recipe)
        if key not in self._cache:
            self._cache[key] = self._price(plan, recipe)
        return self._cache[key]

    def _price(self, plan: Plan, recipe: ExecutionRecipe) -> Priced:
        from autopar.profiles import profile_spec
        from autopar.workflow import read_job
        try:
            job = read_job(plan.model, plan.cluster, plan.gpus, plan.global_batch, plan.seq_len,
                           plan.dtype, plan.recipe)
            at = (plan.model, plan.seq_len)
            if at not in self._profiles:
                self._profiles[at] = profile_spec(job.spec)
            profile = self._profiles[at]
            est = estimate(profile, job.hw, plan.strategy(recipe, lead=profile.lead_layers),
                           global_batch=plan.global_batch)
        except (UserError, ProfileError, ValueError) as exc:
            return Priced(why_not=str(exc))
        return Priced(step_time_s=est.step_time_s, fits=est.fits)


# ---- gaps -----------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class Gap:
    """A plan setting the target cannot express, and the nearest setting written instead."""

    setting: str
    """The plan's field (``schedule``, ``zero_stage``, ``recompute`` ...)."""
    planned: str
    """Its value in the plan."""
    nearest: str
    """What the export writes instead, in the target's own terms."""
    reason: str
    """Why the target cannot express the planned value."""
    planned_cost: Priced
    """The cost model on the plan as it was before this gap (earlier gaps applied)."""
    nearest_cost: Priced
    """The cost model on the plan with the nearest setting."""

    def line(self, target: Target) -> str:
        """One line for stderr."""
        return (f"{target.value} cannot express {self.setting}={self.planned} ({self.reason}); "
                f"wrote the nearest: {self.nearest}; {cost_note(self.planned_cost, self.nearest_cost)}")

    def as_dict(self) -> dict:
        return {"setting": self.setting, "planned": self.planned, "nearest": self.nearest,
                "reason": self.reason, "planned_step_time_s": self.planned_cost.step_time_s,
                "nearest_step_time_s": self.nearest_cost.step_time_s, "nearest_fits": self.nearest_cost.fits,
                "not_priced": self.nearest_cost.why_not or None}


def cost_note(before: Priced, after: Priced, what: str = "before it") -> str:
    """``predicted step 1.31 s (+4.8% on 1.25 s before it), fits`` or why there is no price."""
    if after.step_time_s is None or before.step_time_s is None:
        return f"not priced ({after.why_not or before.why_not})"
    change = after.step_time_s / before.step_time_s - 1
    return (f"predicted step {after.step_time_s:.4g} s ({change:+.1%} on {before.step_time_s:.4g} s {what}), "
            f"{'fits' if after.fits else 'DOES NOT FIT in device memory'}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Option:
    """One candidate for a gap: how the target writes it, and the plan it amounts to."""

    nearest: str
    plan: Plan
    recipe: ExecutionRecipe | None = None
    """The execution recipe under it, when the candidate changes what overlaps."""


class Adapter:
    """The plan as the target will run it, built one gap at a time.

    ``gap`` prices every candidate with the cost model and keeps the fastest that fits (the
    one that needs the least memory when none fits; the first when none can be priced)."""

    def __init__(self, plan: Plan, target: Target, pricer: Pricer | None = None) -> None:
        self.original = plan
        self.plan = plan
        self.recipe = plan.execution_recipe()
        self.target = target
        self.gaps: list[Gap] = []
        self._price = pricer or Pricer()

    def gap(self, setting: str, planned: object, reason: str, options: list[Option]) -> Option:
        if not options:
            raise UserError(f"{self.target.value} cannot express {setting}={planned} ({reason}) and has "
                            "no nearest setting; export to another framework or re-plan")
        before = self._price(self.plan, self.recipe)
        priced = [(o, self._price(o.plan, o.recipe or self.recipe)) for o in options]
        chosen, cost = min(priced, key=lambda oc: _preference(oc[1]))
        self.gaps.append(Gap(setting=setting, planned=_text(planned), nearest=chosen.nearest,
                             reason=reason, planned_cost=before, nearest_cost=cost))
        self.plan = chosen.plan
        if chosen.recipe is not None:
            self.recipe = chosen.recipe
        return chosen

    def refit(self, modes: dict[str, str]) -> None:
        """When the nearest settings chosen so far no longer fit in device memory but the plan
        did, recompute every block with one of ``modes`` (mode -> how the target writes it),
        the fastest that fits; nothing when none does."""
        if not self.gaps or self._price(self.plan, self.recipe).fits is not False:
            return
        if self._price(self.original, self.original.execution_recipe()).fits is not True:
            return
        options = [Option(nearest=text, plan=uniform_recompute(self.plan, mode)) for mode, text in modes.items()
                   if set(self.plan.recompute) != {mode}]
        fitting = [o for o in options if self._price(o.plan, self.recipe).fits]
        if fitting:
            self.gap("recompute", describe_recompute(self.plan), "the nearest settings above do not fit in "
                     "device memory", fitting)

    def total(self) -> tuple[Priced, Priced]:
        """(the original plan, the plan as exported) priced."""
        return (self._price(self.original, self.original.execution_recipe()),
                self._price(self.plan, self.recipe))


def _preference(p: Priced) -> tuple:
    if p.step_time_s is None:
        return (2, 0.0)
    return (0 if p.fits else 1, p.step_time_s)


def _text(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def describe_recompute(plan: Plan) -> str:
    """``full x12, none x20`` when every stage holds the same mix, else per run of stages:
    ``stages 0-9: selective x4; stages 10-19: full x4``."""
    per = [counts(c) for c in chunks(plan)]

    def mix(c: tuple[int, int, int]) -> str:
        return ", ".join(f"{m} x{k}" for m, k in zip(RECOMPUTE, c) if k) or "no blocks"
    if len(set(per)) == 1:
        return ", ".join(f"{m} x{plan.recompute.count(m)}" for m in RECOMPUTE if m in plan.recompute)
    runs: list[list] = []
    for i, c in enumerate(per):
        if runs and runs[-1][2] == c:
            runs[-1][1] = i
        else:
            runs.append([i, i, c])
    return "; ".join(f"stage{'s' if a != b else ''} {a}{f'-{b}' if a != b else ''}: {mix(c)}" for a, b, c in runs)


# ---- settings read back -----------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """A plan's settings in common terms; read back from an exported file, a field is None
    where the file does not say it."""

    gpus: int | None = None
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    """Expert-parallel degree (a regrouping of the dp x cp ranks, in devices per expert group)."""
    zero: int | None = None
    offload: bool | None = None
    micro_batch_size: int | None = None
    num_microbatches: int | None = None
    global_batch: int | None = None
    schedule: str | None = None
    """Pipeline schedule; None without a pipeline."""
    virtual_stages: int | None = None
    sequence_parallel: bool | None = None
    stage_layers: tuple[int, ...] | None = None
    recompute: tuple[tuple[int, ...], ...] | None = None
    """Per virtual stage, its blocks per recompute mode (``RECOMPUTE`` order)."""
    dtype: str | None = None
    axis_order: tuple[Axis, ...] | None = None
    """Mesh axes of degree > 1, outermost first."""

    @classmethod
    def of(cls, plan: Plan) -> Settings:
        pp = plan.mesh.pp
        return cls(gpus=plan.gpus, dp=plan.mesh.dp, tp=plan.mesh.tp, pp=pp, cp=plan.mesh.cp, ep=plan.mesh.ep,
                   zero=plan.zero_stage if plan.mesh.dp > 1 else 0, offload=plan.offload, micro_batch_size=plan.micro_batch_size,
                   num_microbatches=plan.num_microbatches, global_batch=plan.global_batch,
                   schedule=plan.schedule if pp > 1 else None, virtual_stages=plan.virtual_stages if pp > 1 else 1,
                   sequence_parallel=plan.sequence_parallel and plan.mesh.tp > 1,
                   stage_layers=plan.stage_layers, recompute=tuple(counts(c) for c in chunks(plan)),
                   dtype=plan.dtype, axis_order=axis_order(plan))

    def mismatches(self, expected: Settings) -> dict[str, tuple[object, object]]:
        """{field: (read, expected)} for the fields this one states and that differ."""
        out = {}
        for f in dataclasses.fields(self):
            got = getattr(self, f.name)
            if got is not None and got != getattr(expected, f.name):
                out[f.name] = (got, getattr(expected, f.name))
        return out


def derive_batch(dp: int, micro: int | None, global_batch: int | None) -> int | None:
    """Micro-batches per step per dp rank from a global batch: G / (micro x dp), None when it
    does not divide."""
    if not micro or not global_batch or dp < 1:
        return None
    n, rem = divmod(global_batch, dp * micro)
    return n if not rem else None
