"""A parallel strategy (the part of a plan the cost model reads) and the estimate it gets."""

from __future__ import annotations

from dataclasses import dataclass, field

from cost_models.axes import DEFAULT_ORDER, Axis, Degrees, parse_order
from cost_models.recipe import Attention, DpOverlap, ExecutionRecipe, load_recipe

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
RECOMPUTE = ("none", "selective", "full", "op")
"""Recompute modes of a block: none; selective, the attention core (Korthikanti et al. 2022);
full, the whole block from its input; op, per-op selective (torchtitan's ``selective_ac_option =
"op"``: the outputs of every second weight GEMM and of the attention kernel kept, the rest
recomputed in the backward; ``ModelProfile.op_*``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    """How one training step is split over the devices."""

    mesh: Degrees = Degrees()
    """Degree of each parallel axis; the product of the mesh axes is the number of devices
    (ep regroups dp x cp: ``cost_models.axes``)."""
    zero: int = 0
    """ZeRO stage 0-3 over the dp axis (1: optimizer states, 2: + gradients, 3: + parameters)."""
    micro_batch: int = 1
    """Sequences per micro-batch per dp rank."""
    num_microbatches: int = 1
    """Micro-batches per optimizer step per dp rank (pipeline depth and/or accumulation)."""
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    stage_layers: tuple[int, ...] = ()
    """Transformer blocks per pipeline stage; empty means as even as possible."""
    stage_recompute: tuple[tuple[int, ...], ...] = ()
    """Per pipeline stage, its blocks in each recompute mode (``RECOMPUTE`` order; they sum to
    ``stage_layers``); empty means every block uses ``recompute``."""
    lead_recompute: str = ""
    """Recompute mode of the model's leading blocks of another kind (``ModelProfile.lead``,
    priced with the first stage; one mode for all of them); "" means ``recompute``."""
    offload: bool = False
    """ZeRO's sharded weights, gradients and optimizer states (fp32 master included) live in
    host memory and the optimizer step runs on the CPU (FSDP2's ``CPUOffloadPolicy``); needs
    ZeRO >= 1."""
    axis_order: tuple[Axis, ...] = DEFAULT_ORDER
    """The mesh axes from outermost (largest rank stride) to innermost (consecutive ranks,
    which share a node first); ``comm.axis_groups`` derives each axis's tier from it. Held in
    canonical form (``axes.canonical_order``: cp listed only when cp > 1)."""
    dtype: str = "bf16"
    fp8: bool = False
    """The blocks' weight GEMMs run in Float8 (torchao Float8Linear, Transformer Engine):
    the fp8 peak, a scaled cast of every GEMM operand; attention, norms and the head stay in
    ``dtype``. Needs a profile with an ``fp8`` peak."""
    recipe: ExecutionRecipe = field(default_factory=load_recipe)
    """The program priced (``cost_models.recipe``): attention kernel, training-state layout,
    what overlaps; default ``autopar``, the program autopar's runtime generates."""

    def __post_init__(self) -> None:
        if min(self.mesh.values()) < 1:
            axis = next(a for a in Axis if self.mesh[a] < 1)
            raise ValueError(f"{axis} must be >= 1, got {self.mesh[axis]}")
        if min(self.micro_batch, self.num_microbatches, self.virtual_stages) < 1:
            name = next(n for n in ("micro_batch", "num_microbatches", "virtual_stages") if getattr(self, n) < 1)
            raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero stage must be 0, 1, 2 or 3, got {self.zero}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; use one of {', '.join(SCHEDULES)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"unknown recompute {self.recompute!r}; use one of {', '.join(RECOMPUTE)}")
        if self.lead_recompute and self.lead_recompute not in RECOMPUTE:
            raise ValueError(f"unknown lead_recompute {self.lead_recompute!r}; use one of {', '.join(RECOMPUTE)}")
        try:  # names ("pp", ...) become members, in canonical form (cp listed iff cp > 1)
            object.__setattr__(self, "axis_order", parse_order(self.axis_order, self.mesh))
        except ValueError as exc:
            raise ValueError(f"axis_order {exc}, got {self.axis_order}") from None
        if self.replicas % self.mesh.ep:
            raise ValueError(f"ep={self.mesh.ep} must divide dp x cp = {self.replicas}: expert parallelism "
                             "regroups the data-parallel ranks")
        if self.mesh.cp > 1 and not self.recipe.has_context_parallel:
            raise ValueError(f"cp={self.mesh.cp}: the {self.recipe.name} recipe has no context parallelism; "
                             "price it under one that has (megatron-core, megatron-core-te, torchtitan)")
        if self.fp8 and self.dtype == "fp32":
            raise ValueError("fp8 linears train in a 16-bit dtype; use dtype bf16 with fp8")
        if self.offload and self.zero < 1:
            raise ValueError("offload moves ZeRO's shards to the host; it needs zero >= 1")
        if self.stage_layers and len(self.stage_layers) != self.mesh.pp:
            raise ValueError(f"stage_layers has {len(self.stage_layers)} entries for pp={self.mesh.pp}")
        if self.stage_recompute:
            if len(self.stage_recompute) != self.mesh.pp or any(
                    len(c) != len(RECOMPUTE) or min(c) < 0 for c in self.stage_recompute):
                raise ValueError(f"stage_recompute needs {self.mesh.pp} entries of "
                                 f"{len(RECOMPUTE)} non-negative counts")
            if self.stage_layers and tuple(map(sum, self.stage_recompute)) != self.stage_layers:
                raise ValueError("stage_recompute counts must add up to stage_layers")

    def stage_loads(self, layers: int) -> tuple:
        """Each stage's load for ``StageCosts``: per-mode counts, or block counts (even split
        of ``layers`` when ``stage_layers`` is empty)."""
        placed = sum(map(sum, self.stage_recompute)) if self.stage_recompute else sum(self.stage_layers)
        if placed and placed != layers:
            raise ValueError(f"the placement holds {placed} blocks but the model repeats {layers} (leading "
                             "blocks of another kind are the first stage's, outside stage_layers)")
        if self.stage_recompute:
            return self.stage_recompute
        if self.stage_layers:
            return self.stage_layers
        q, r = divmod(layers, self.mesh.pp)
        if q < 1:
            raise ValueError(f"cannot split {layers} layers over {self.mesh.pp} pipeline stages")
        return tuple(q + (1 if s < r else 0) for s in range(self.mesh.pp))

    @property
    def lead_mode(self) -> str:
        """The recompute mode of the leading blocks (``lead_recompute``, else ``recompute``)."""
        return self.lead_recompute or self.recompute

    @property
    def dp_overlap(self) -> bool:
        """Data-parallel collectives overlap with compute (the recipe's rule at this pp)."""
        rule = self.recipe.dp_overlap
        return rule == DpOverlap.ALWAYS or (rule == DpOverlap.UNPIPELINED and self.mesh.pp == 1)

    @property
    def devices(self) -> int:
        return self.mesh.size

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights, dp x cp (Megatron's "dp-cp" group): the weights are
        replicated over cp, so gradients reduce and ZeRO shards over all of them."""
        return self.mesh.dp * self.mesh.cp

    @property
    def etp(self) -> int:
        """Ranks each routed expert's GEMMs split over: tp, or 1 where the recipe replicates
        the experts over tp (``ExecutionRecipe.expert_tensor_parallel``)."""
        return self.mesh.tp if self.recipe.expert_tensor_parallel else 1

    @property
    def moe_rows(self) -> float:
        """The share of a micro-batch's tokens one rank's MoE layer routes and computes: 1 / tp
        where each expert's GEMMs split over tp (its rows whole, ``etp``) is counted by the
        caller; replicated experts run 1 / tp of the tokens under sequence parallelism (each
        rank its own sequence shard: autopar's runtime, torchtitan), all of them without (every
        tp rank computes the same tokens)."""
        return 1.0 / self.mesh.tp if self.sequence_parallel and not self.recipe.expert_tensor_parallel else 1.0

    def uses_mode(self, mode: str) -> bool:
        """Whether some block (the leading ones included) is planned in recompute ``mode``."""
        i = RECOMPUTE.index(mode)
        return self.recompute == mode or self.lead_recompute == mode or any(c[i] for c in self.stage_recompute)

    def recompute_run(self, mode: str | None = None) -> str:
        """The recompute mode the program runs for a block planned with ``mode`` (default the
        strategy's): under context parallelism a recipe with ``cp_recomputes_attention``
        recomputes the attention core of a block planned without recompute (selective)."""
        mode = mode or self.recompute
        if mode == "none" and self.mesh.cp > 1 and self.recipe.cp_recomputes_attention:
            return "selective"
        return mode

    def tokens(self, seq: int) -> float:
        """Tokens of one micro-batch on one rank: each cp rank holds seq / cp of every sequence."""
        return self.micro_batch * seq / self.mesh.cp

    @property
    def fused_attention(self) -> bool:
        """The attention core runs as one fused kernel: the recipe's, and always under context
        parallelism (Megatron-Core's CP runs only in Transformer Engine's fused attention,
        torch's in SDPA's flash kernel)."""
        return self.recipe.attention == Attention.FUSED or self.mesh.cp > 1


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Bytes on the most loaded device (the stage with the highest peak)."""

    peak_bytes: float
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    buffers_bytes: float
    host_bytes: float = 0.0
    """Offloaded training state in host memory per device (the stage with the most)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TimeBreakdown:
    """Seconds of one optimizer step on the critical path."""

    compute_s: float
    tp_comm_s: float
    """Exposed tensor-parallel and context-parallel (K,V exchange) communication: one
    field for both keeps the estimate JSON as it was before context parallelism."""
    dp_comm_s: float
    pp_comm_s: float
    """Pipeline sends, and the pipeline schedule's own host time per chunk (``pipeline.host_s``)."""
    bubble_s: float
    optimizer_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    """The cost model's verdict on one strategy (design.md's ``estimate`` JSON)."""

    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    fits: bool
    memory: MemoryBreakdown
    time: TimeBreakdown
    stage_peak_bytes: tuple[float, ...] = field(default=())
