"""The steps behind the CLI and the Python API: read the inputs, plan, estimate one strategy.

One-way: spec + profile -> trace -> cost -> solve -> Plan. Nothing here touches torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.errors import UserError
from autopar.limits import MAX_GLOBAL_BATCH, MAX_GPUS, check_count, check_seconds
from autopar.plan import DTYPES, Mesh, Plan
from autopar.solve import Pins, Solution, search
from autopar.solve.infeasible import op_refusal, op_unpriced
from autopar.solve.space import recipe_refusal
from autopar.spec import ModelSpec, parse_model_spec, with_seq
from autopar.layout import Anatomy, tp_splits_heads
from autopar.profiles import profile_and_layout, profile_spec, shaped_spec
from cost_models import HardwareProfile, ModelProfile, ProfileError, Strategy, estimate, load_profile
from cost_models.axes import Degrees
from cost_models.estimate import even_stage_layers
from cost_models.pipeline import block_method_k, chunk_sizes
from cost_models.recipe import DEFAULT_RECIPE, ExecutionRecipe, RecipeError, load_recipe
from cost_models.strategy import RECOMPUTE, Estimate


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """The three inputs, read and checked: a model, a cluster and the training settings."""

    spec: ModelSpec
    hw: HardwareProfile
    cluster: str
    """The cluster as the user named it (profile name or path), recorded in the plan."""
    gpus: int
    global_batch: int
    dtype: str
    recipe: ExecutionRecipe
    recipe_name: str
    """The recipe as the user named it (shipped name or path), recorded in the plan."""

    @property
    def seq_len(self) -> int:
        return self.spec.seq


def read_recipe(name: str | None) -> ExecutionRecipe:
    """The execution recipe by name or path; a bad one is a ``UserError`` naming the fix."""
    try:
        return load_recipe(name or DEFAULT_RECIPE)
    except RecipeError as exc:
        raise UserError(str(exc)) from None


def read_job(model: str | ModelSpec, cluster: str, gpus: int, global_batch: int,
             seq_len: int | None = None, dtype: str | None = None,
             recipe: str | None = None) -> Job:
    """Parse and check the inputs; every problem is a ``UserError`` naming the fix. A user
    module's shape (layers, heads ...) is traced last, so that ``Job.spec`` states it. A
    ``ModelSpec`` is taken as it is (a module object's shape, traced by ``autopar.parallelize``)."""
    check_count("--gpus", gpus, MAX_GPUS)
    check_count("--global-batch", global_batch, MAX_GLOBAL_BATCH)
    traced = isinstance(model, ModelSpec)
    spec = model if isinstance(model, ModelSpec) else parse_model_spec(model)
    if seq_len is not None:
        spec = with_seq(spec, seq_len)
    try:
        hw = load_profile(cluster)
    except ProfileError as exc:
        raise UserError(str(exc)) from None
    if gpus > hw.devices_per_node and gpus % hw.devices_per_node:
        raise UserError(f"--gpus {gpus} is not a multiple of the {hw.devices_per_node} devices per "
                        f"node of {hw.name}; use whole nodes (e.g. {gpus // hw.devices_per_node * hw.devices_per_node})")
    trainable = [d for d in DTYPES if d in hw.peak_tflops]
    if not trainable:
        raise UserError(f"profile {hw.name} gives no peak for a training dtype; add one of "
                        f"{', '.join(DTYPES)} to its peak_tflops")
    dtype = dtype or ("bf16" if "bf16" in trainable else trainable[0])
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype} is not a training dtype; use one of {', '.join(DTYPES)}")
    if dtype not in hw.peak_tflops:
        raise UserError(f"--dtype {dtype} has no peak in profile {hw.name}; use one of "
                        f"{', '.join(sorted(hw.peak_tflops))}")
    execution = read_recipe(recipe)
    return Job(spec=spec if traced else shaped_spec(spec), hw=hw, cluster=cluster, gpus=gpus,
               global_batch=global_batch, dtype=dtype, recipe=execution, recipe_name=recipe or DEFAULT_RECIPE)


def layer_layout(strat: Strategy, layers: int, lead: int = 0) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(blocks per virtual stage, recompute per block) of a strategy's placement of ``layers``
    repeated blocks after ``lead`` leading blocks of another kind.

    Pipeline rank r runs virtual stages r, r + pp, … (looped, as Megatron's interleaved
    schedule wants); its blocks split over its v chunks as evenly as possible (earlier chunks
    take the remainder), its recompute modes in ``RECOMPUTE`` order along them; under a recipe
    with Megatron's block method whose counts are its (``pipeline.block_method_k``), the first
    k blocks of every chunk in full and the rest in none. The leading
    blocks open virtual stage 0, in ``strat.lead_mode``: a plan's ``stage_layers`` count every
    block of the model.
    """
    loads = strat.stage_recompute or tuple(
        tuple(n if m == strat.recompute else 0 for m in RECOMPUTE) for n in
        (strat.stage_layers or even_stage_layers(layers, strat.mesh.pp)))
    v, pp = strat.virtual_stages, strat.mesh.pp
    full, others = RECOMPUTE.index("full"), [i for i, m in enumerate(RECOMPUTE) if m not in ("none", "full")]
    block = block_method_k([chunk_sizes(sum(c), v) for c in loads], [c[full] for c in loads]) \
        if strat.recipe.recompute_block and not any(c[i] for c in loads for i in others) else None
    chunks: dict[int, list[str]] = {}
    for r, counts in enumerate(loads):
        modes = [m for m, k in zip(RECOMPUTE, counts) for _ in range(k)]
        if len(modes) < v:
            raise UserError(f"pipeline rank {r} holds {len(modes)} blocks, fewer than its "
                            f"{v} virtual stages; use a smaller --vpp")
        at = 0
        for c, size in enumerate(chunk_sizes(len(modes), v)):
            chunks[c * pp + r] = modes[at:at + size] if block is None else \
                ["full"] * min(block, size) + ["none"] * (size - min(block, size))
            at += size
    chunks[0] = [strat.lead_mode] * lead + chunks[0]
    order = sorted(chunks)
    return (tuple(len(chunks[vs]) for vs in order),
            tuple(m for vs in order for m in chunks[vs]))


def plan_from_strategy(job: Job, strat: Strategy, est: Estimate | None,
                       verified: tuple[tuple[str, str], ...] = (), layout: Anatomy | None = None,
                       lead: int = 0) -> Plan:
    """The Plan that records ``strat`` (with its placement of the repeated blocks, after
    ``lead`` leading blocks of another kind: ``ModelProfile.lead_layers``) for ``job``."""
    stage_layers, recompute = layer_layout(strat, job.spec.layers - lead, lead)
    return Plan(model=job.spec.name, cluster=job.cluster, gpus=job.gpus,
                global_batch=job.global_batch, seq_len=job.seq_len, dtype=job.dtype,
                mesh=Mesh.of(strat.mesh), zero_stage=strat.zero,
                micro_batch_size=strat.micro_batch, num_microbatches=strat.num_microbatches,
                schedule=strat.schedule, virtual_stages=strat.virtual_stages,
                sequence_parallel=strat.sequence_parallel, stage_layers=stage_layers,
                recompute=recompute, offload=strat.offload,
                axis_order=strat.axis_order, recipe=job.recipe_name, verified=verified, layout=layout,
                estimate=est)


def verdicts(spec: ModelSpec) -> tuple[tuple[str, str], ...]:
    """(check, "" or why it failed) of every runtime feature on ``spec``'s twin (``autopar.verify``,
    cached per architecture); empty for the built-in models, which autopar's own parity tests
    prove, and for mixtures of experts (``tests/test_runtime_ep.py`` proves the layouts
    ``autopar.layout.expert_parallel_unsupported`` allows)."""
    if spec.arch not in ("hf", "module") or spec.experts:
        return ()
    from autopar.verify import verify
    return tuple((v.check.value, v.reason) for v in verify(spec.name).verdicts)


def export_lead_refusal(spec: ModelSpec, target: str) -> str | None:
    """Why the ``target`` export does not take ``spec``'s model (one line), or None: it leads
    with blocks of another kind (``ModelProfile.lead``, GLM-4.5's dense block before the MoE
    ones), which autopar prices, plans and runs, but the export writes one kind of block for.
    The HF families Megatron-Core builds (``autopar.export.hfblocks``: DeepSeek-V2/V3, GLM-4.5)
    export to Megatron as themselves (``--moe-layer-freq``). Read off the (cached) trace of an
    HF model or a user module. torchtitan builds DeepSeek-V3's (``autopar.export.torchtitan``)."""
    from autopar.export.hfblocks import CONFIGS
    from autopar.export.titanmodels import DEEPSEEK_V3
    writes_lead = {"megatron": CONFIGS, "torchtitan": (DEEPSEEK_V3,)}
    if spec.arch not in ("hf", "module") or spec.source in writes_lead.get(target, ()):
        return None
    profile = profile_spec(spec)
    if profile.lead is None:
        return None
    fix = ("export it with --to megatron, which writes its leading dense blocks (--moe-layer-freq)"
           if spec.source in CONFIGS else "set the leading blocks in the framework yourself "
           "(e.g. Megatron-Core's --moe-layer-freq)")
    return (f"{spec.name} leads with {profile.lead_layers} dense blocks before its {profile.layers} repeated ones: "
            f"autopar plans and runs it (`autopar run`, `autopar launch`), but the {target} export writes one kind "
            f"of block; {fix}")


def launch_refusal(plan: Plan) -> str | None:
    """Why ``plan`` must not start (one line), or None: a feature it uses failed on the model's
    twin, as recorded in the plan or, for one it records no verdict of (a plan made without
    verification, or before the check existed), as verified now."""
    known = plan.refusal()
    if known:
        return known
    recorded = dict(plan.verified)
    missing = [f for f in plan.features() if f not in recorded]  # all of them, or checks added since
    if not missing or parse_model_spec(plan.model).arch not in ("hf", "module"):
        return None
    from autopar.verify import Check, verify
    result = verify(plan.model, checks=tuple(Check(f) for f in missing))
    return replace(plan, verified=(*plan.verified, *((v.check.value, v.reason) for v in result.verdicts))).refusal()


def make_plan(job: Job, pins: Pins = Pins(), time_limit_s: float = 60.0,
              profile: ModelProfile | None = None, verify: bool = True,
              verified: tuple[tuple[str, str], ...] | None = None) -> tuple[Plan, Solution]:
    """Trace, verify the runtime's features on the model's twin (``verdicts``; unless ``verify``
    is False or the verdicts are given, e.g. computed once for all ranks of a job), search
    without the features that failed, and record the best strategy as a Plan."""
    check_seconds("--time-limit", time_limit_s)
    check_op(pins.recompute, pins.cp, job.spec)
    if pins.ep is not None and pins.ep > 1:
        check_ep(job.spec, pins.ep)
    layout = None
    if profile is None:
        profile, layout = profile_and_layout(job.spec)
    if verified is None:
        verified = verdicts(job.spec) if verify else ()
    refused = tuple(c for c, reason in verified if reason)
    if job.recipe.name == DEFAULT_RECIPE and not job.spec.builtin:
        refused += ("cp",)  # autopar's context parallelism replaces the built-in models' attention only
    pins = replace(pins, recipe=job.recipe, refused=refused)
    refusal = recipe_refusal(pins)
    if refusal:
        raise UserError(refusal)
    sol = search(profile, job.hw, job.gpus, job.global_batch, job.dtype, pins, time_limit_s)
    return plan_from_strategy(job, sol.strategy, sol.estimate, verified, layout, profile.lead_layers), sol


def check_ep(spec: ModelSpec, ep: int, replicas: int | None = None) -> None:
    """``--ep`` above 1: a mixture of experts whose routed experts it divides, and (when known)
    dividing the dp x cp ranks it regroups; one ``UserError`` line otherwise."""
    if not spec.experts and spec.arch != "module":
        raise UserError(f"--ep {ep}: {spec.name} has no routed experts; expert parallelism splits a mixture of experts")
    if spec.experts and spec.experts % ep:
        raise UserError(f"--ep {ep} does not divide the {spec.experts} routed experts of {spec.name}")
    if replicas is not None and replicas % ep:
        raise UserError(f"--ep {ep} does not divide dp x cp = {replicas}, the ranks expert parallelism regroups")


def fixed_strategy(job: Job, *, tp: int, pp: int, dp: int | None, zero: int, micro_batch: int,
                   schedule: str, sequence_parallel: bool, recompute: str,
                   virtual_stages: int = 1, fp8: bool = False, cp: int = 1, ep: int = 1) -> Strategy:
    """The one strategy ``estimate`` evaluates, checked against the job."""
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("mbs", micro_batch), ("vpp", virtual_stages)):
        if value <= 0:
            raise UserError(f"--{name} must be positive, got {value}")
    if job.gpus % (tp * pp * cp):
        raise UserError(f"--gpus {job.gpus} is not divisible by tp x pp x cp = {tp * pp * cp}")
    if dp is not None and dp <= 0:
        raise UserError(f"--dp must be positive, got {dp}")
    dp = dp or job.gpus // (tp * pp * cp)
    if dp * tp * pp * cp != job.gpus:
        raise UserError(f"dp x tp x pp x cp = {dp * tp * pp * cp} but --gpus is {job.gpus}")
    check_op(recompute, cp, job.spec)
    if cp > 1 and not job.recipe.has_context_parallel:
        raise UserError(f"--cp {cp}: the {job.recipe.name} recipe has no context parallelism; price it under "
                        "--recipe autopar, megatron-core, megatron-core-te or torchtitan")
    if job.seq_len % (2 * cp):
        raise UserError(f"--cp {cp} needs --seq-len a multiple of 2 x cp = {2 * cp} (load-balanced causal "
                        f"chunks), got {job.seq_len}")
    if ep > 1:
        check_ep(job.spec, ep, dp * cp)
    if fp8 and "fp8" not in job.hw.peak_tflops:
        raise UserError(f"--fp8: profile {job.hw.name} ({job.hw.device}) has no fp8 peak; Float8 "
                        "linears need an H100, H200 or B200 profile")
    if job.global_batch % (dp * micro_batch):
        raise UserError(f"--global-batch {job.global_batch} is not divisible by dp x mbs = "
                        f"{dp * micro_batch}")
    if not tp_splits_heads(job.spec.heads, job.spec.num_kv_heads, tp):
        raise UserError(f"--tp {tp} does not divide the model's {job.spec.heads} heads and "
                        f"{job.spec.num_kv_heads} kv heads")
    if pp > job.spec.layers:
        raise UserError(f"--pp {pp} exceeds the model's {job.spec.layers} layers")
    if virtual_stages > 1 and (schedule != "interleaved" or pp == 1):
        raise UserError(f"--vpp {virtual_stages} needs --schedule interleaved and --pp > 1")
    if job.spec.layers % (pp * virtual_stages) and virtual_stages > 1:
        raise UserError(f"--vpp {virtual_stages} x --pp {pp} does not divide the model's "
                        f"{job.spec.layers} layers into equal chunks")
    try:
        return Strategy(mesh=Degrees(dp=dp, cp=cp, tp=tp, pp=pp, ep=ep), zero=zero, micro_batch=micro_batch,
                        num_microbatches=job.global_batch // (dp * micro_batch),
                        schedule=schedule, virtual_stages=virtual_stages,
                        sequence_parallel=sequence_parallel and tp > 1,
                        recompute=recompute, dtype=job.dtype, fp8=fp8, recipe=job.recipe)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def check_op(recompute: str | None, cp: int | None, spec: ModelSpec) -> None:
    """Per-op recompute pinned where it does not run (under cp) or is not priced (a mixture of
    experts): one line naming the fix, before anything is traced."""
    refusal = op_refusal(spec.name, "a mixture of experts" if spec.experts else None, cp) if recompute == "op" else None
    if refusal:
        raise UserError(refusal)


def estimate_strategy(job: Job, strat: Strategy, profile: ModelProfile | None = None) -> Estimate:
    model = profile or profile_spec(job.spec)
    refusal = op_refusal(model.name, op_unpriced(model), strat.mesh.cp) if strat.uses_mode("op") else None
    if refusal:
        raise UserError(refusal)
    return estimate(model, job.hw, strat, global_batch=job.global_batch)
