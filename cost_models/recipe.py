"""Execution recipes: the program being priced, as data.

The same strategy (degrees, ZeRO stage, micro-batch, schedule, recompute) runs as different
programs in different frameworks: Megatron-LM 2021 keeps the s x s attention scores and
reduces gradients after the pipeline flush; Megatron-Core overlaps its tensor-parallel
collectives with the weight-gradient GEMMs; FSDP2 programs (autopar's own runtime,
torchtitan) call FlashAttention through SDPA, keep fp32 sharded weights and gather bf16
copies. A recipe names those choices so the cost model prices the program that runs. The
shipped recipes are JSON files in ``cost_models/recipes/`` (``autopar`` is the default: the
program autopar's own runtime generates); ``load_recipe`` also takes a path to a file of the
same form.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import get_type_hints

RECIPE_DIR = Path(__file__).resolve().parent / "recipes"
DEFAULT_RECIPE = "autopar"
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
"""The pipeline schedules a plan names (``cost_models.pipeline``)."""
RECOMPUTE_MODES = ("none", "selective", "full", "op")
"""The recompute modes, in ``cost_models.strategy.RECOMPUTE``'s order."""
MESH_AXIS_NAMES = ("pp", "dp", "cp", "tp")
"""The device-mesh axes an axis order lists (``cost_models.axes.MESH_AXES``)."""


class RecipeError(ValueError):
    """A recipe that cannot be found or read; the message names the fix."""


class Attention(str, Enum):
    """How the attention core runs."""

    FUSED = "fused"
    """One FlashAttention-style kernel: no s x s scores in memory, only the log-sum-exp kept for
    backward, masked causal blocks skipped (about half the QKᵀ and AV FLOPs executed)."""
    UNFUSED = "unfused"
    """QKᵀ, scale-mask-softmax, dropout and AV as separate kernels; scores, softmax output and
    dropout mask kept for backward (Korthikanti et al. 2022's 5as per token)."""


class DpOverlap(str, Enum):
    """When data-parallel collectives overlap with compute."""

    ALWAYS = "always"
    """Gradient reduction during the (last micro-batch's) backward, ZeRO-3 weight prefetch
    during compute (DDP buckets, FSDP2 hooks, Megatron-Core's overlap_grad_reduce)."""
    UNPIPELINED = "unpipelined"
    """Overlapped (PyTorch DDP) without a pipeline; after the flush, exposed, with one
    (Megatron-LM 2021's local DDP)."""
    NEVER = "never"
    """Every data-parallel collective on the critical path."""


class ContextParallel(str, Enum):
    """How the program exchanges keys and values between the context-parallel ranks (cp > 1);
    every rank holds 2 of the 2 cp load-balanced chunks of each sequence (``compute``)."""

    NONE = "none"
    """The program has no context parallelism (autopar's own runtime, DeepSpeed's recipes:
    Ulysses is another scheme, not priced)."""
    RING = "ring"
    """Ring attention: cp - 1 point-to-point steps per layer pass, each sending the local K,V
    block to the next rank while attention runs on the block received (Megatron-Core /
    Transformer Engine ``--cp-comm-type p2p``, the default; Liu et al. 2023)."""
    ALL_GATHER = "all_gather"
    """K and V all-gathered over the cp group before one attention kernel, their gradients
    reduce-scattered after it, not overlapped (autopar's own runtime,
    ``autopar/runtime/context_parallel.py``)."""
    GATHER_RING = "gather_ring"
    """torch's ``context_parallel`` with ``_RotateMethod.ALL_GATHER`` (torchtitan's default
    ``context_parallel_rotate_method``): attention runs as cp kernels, one per peer's K,V
    block, their outputs merged in fp32 (``_SDPAMerger``); each pass all-gathers K and V
    once, behind its first (local) kernel; the backward accumulates dK, dV in fp32 and passes
    them round the ring (an all-to-all permute) behind each kernel, the last pass exposed
    (``_templated_ring_attention``/``_backward``)."""


class Fp8WeightCast(str, Enum):
    """How often Float8 linears cast their 16-bit weights to fp8 (with ``Strategy.fp8``)."""

    EVERY_PASS = "every_pass"
    """In every forward and every backward of every micro-batch (torchao's Float8Linear keeps
    the 16-bit weight for the backward and casts it again there)."""
    FORWARD = "forward"
    """Once per micro-batch, in the forward: the cast writes the fp8 weight and its transpose,
    and the backward reuses the transpose (Transformer Engine's linears called without
    ``is_first_microbatch``, as llm-foundry's ``te.Linear`` layers are)."""
    ONCE_PER_STEP = "once_per_step"
    """Once per step, on the first micro-batch, the cast kept for the others (Transformer
    Engine's fp8 weight cache: Megatron-Core's schedules call ``set_is_first_microbatch`` on
    each model chunk's first micro-batch)."""


class SpCopy(str, Enum):
    """Whether sequence parallelism's collectives copy the full hidden states once more
    (with ``Strategy.sequence_parallel``)."""

    NONE = "none"
    """No copy: the hidden states are sequence-first, ``[s, b, h]`` (Megatron), so each
    all-gather and reduce-scatter runs over the outermost dimension, or the collectives are
    pipelined with their GEMMs and read the shards in place (async TP, userbuffers)."""
    BATCH_FIRST = "batch_first"
    """The hidden states are batch-first, ``[b, s, h]``, sharded on the sequence (DTensor's
    ``Shard(1)``), on torch 2.10 or later: the functional reduce-scatter first rearranges its
    input so the shards lie along dim 0 (``_chunk_or_narrow_cat``: ``torch.cat``), and the
    all-gather, whose shards arrive stacked on dim 0, rearranges its output into dim 1
    (``_maybe_view_chunk_cat``): a copy of the full tensor each, read and written, except
    the all-gather's where the micro-batch is one sequence, a view there
    (pytorch/pytorch#169404). Eager and torch.compile'd alike: Inductor emits the copies as
    ``cat`` kernels (seen in its output code for a compiled DTensor SP block, torch 2.13)."""
    BATCH_FIRST_BEFORE_2_10 = "batch_first_before_2_10"
    """Batch-first as above, on torch before 2.10: the all-gather's copy at every micro-batch
    size too (``torch.cat(torch.chunk(...))``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutionRecipe:
    """How a framework runs a strategy: the switches the cost model prices (see module)."""

    name: str
    description: str
    attention: Attention
    attention_kernel: str = "flash2"
    """The fused kernel family (a key of the profile's ``attention_efficiency``): ``flash2``
    (FlashAttention-2), ``cudnn`` (cuDNN / FA3-class), ``triton`` (FlashAttention's Triton
    kernel) or ``sdpa`` (whichever torch's scaled_dot_product_attention dispatches on the
    device: the profile's ``sdpa_kernel``)."""
    state: str
    """Training-state layout (``cost_models.states.STATE_LAYOUTS``): ``megatron`` 16-bit
    weights + fp32 gradients + fp32 master and moments (2 + 4 + 12 bytes per parameter),
    ``zero`` 16-bit gradients (2 + 2 + 12), ``fp32`` fp32 weights that are the master, fp32
    gradients, two moments (4 + 4 + 8; 16-bit copies gathered or cast for compute: FSDP2's
    MixedPrecisionPolicy, torch.autocast). fp32 training uses ``fp32`` whatever the recipe."""
    dp_overlap: DpOverlap
    tp_overlap: bool
    """The backward's column-parallel collectives hide behind the weight-gradient GEMMs
    (Megatron's async tensor-parallel all-reduce); False: every TP collective is exposed
    (DTensor TP without async TP, Megatron-LM 2021)."""
    tp_comm_overlap: bool = False
    """Every tensor-parallel collective, forward and backward, is split and pipelined with
    the GEMM next to it (Transformer Engine's userbuffers, ``--tp-comm-overlap``; torch's
    async TP): it hides behind that one GEMM, not the pass's others
    (``blockcomm.pipelined_tp_s``)."""
    tp_overlap_reduces_partials: bool = False
    """With ``tp_comm_overlap`` and SP, each pipelined reduce-scatter sends every chunk's
    partial sums to its owner and sums the tp of them in one more kernel after the GEMM
    (torch's async TP: ``_fused_matmul_reduce_scatter_impl`` returns ``torch.sum`` of the
    stacked partials), reading the full partials and writing the shard; False: the reduction
    runs inside the communication kernel (Transformer Engine's userbuffers reduce-scatter)."""
    tp_overlap_backward_scatter: bool = True
    """With ``tp_comm_overlap`` and SP, the backward's reduce-scatters out of the
    column-parallel layers' input gradients are pipelined too (Transformer Engine: one fused
    QKV and one fused up projection, each gradient one GEMM). False where each of those
    gradients is a sum of several GEMMs' (torchtitan's separate wq, wk, wv and w1, w3) and the
    overlap fuses a reduce-scatter only where one matmul makes its input (torch's
    micro-pipeline TP pass, ``_find_producer_matmul``): the two run as plain reduce-scatters,
    exposed, with their rearranging copy (``sp_copy``'s scatter copy)."""
    grad_accum_fusion: bool
    """Weight-gradient GEMMs accumulate straight into the gradient buffer (Megatron's
    ``--gradient-accumulation-fusion``); False: every micro-batch's backward writes a fresh
    gradient that a separate element-wise pass adds in (PyTorch AccumulateGrad)."""
    fused_optimizer: bool
    """The optimizer step runs as large multi-tensor kernels (apex/Megatron, torch ``fused``
    or ``foreach`` AdamW) at the profile's ``optimizer_memory_efficiency``; False: per-tensor
    kernels at ``memory_efficiency``."""
    pp_unsharded_accumulation: bool
    """Under a pipeline, ZeRO-2/3 keep the stage's weights gathered and its gradients unsharded
    until the last micro-batch's backward (torch.distributed.pipelining turns off FSDP2's
    ``reshard_after_backward`` and gradient sync for every backward but the last); the
    gradients are reduce-scattered once per step."""
    fsdp_copies: bool = False
    """ZeRO's collectives go through flat buffers the parameters and gradients are copied
    out of and into (FSDP1's FlatParameter, FSDP2's foreach copy-in/copy-out); False: the
    parameters are views into the communication buffers (Megatron's distributed optimizer)."""
    pp_scatter_gather: bool = True
    """Pipeline sends split over the tp ranks and all-gathered by the receiver (Megatron's
    scatter/gather, Narayanan et al. 2021); False: every tp rank sends the whole activation
    (DeepSpeed's pipeline engine)."""
    fp8_saves_fp8_inputs: bool = False
    """Float8 linears keep their inputs for the weight gradient as the 1-byte cast
    (Transformer Engine) instead of the 16-bit tensor (torchao's default)."""
    sp_saves_gathered_inputs: bool = False
    """With sequence parallelism, each sub-layer's column-parallel GEMMs keep the all-gathered
    (whole-sequence) norm output they read for their weight gradients (torch's DTensor SP:
    the gather is an autograd op ahead of the GEMMs, which save what they receive); False:
    they keep the sequence shard and gather it again in the backward (Megatron-LM, Transformer
    Engine; Korthikanti et al. 2022's accounting)."""
    fp8_cast_bytes: float = 5.0
    """Device-memory bytes per element of a Float8 cast: 5 with dynamic (just-in-time)
    scaling, torchao's tensorwise default (read for the amax, read again and write one byte);
    3 with Transformer Engine's delayed scaling (the amax comes from history)."""
    fp8_weight_cast: Fp8WeightCast = Fp8WeightCast.EVERY_PASS
    """How often the weights are cast to fp8 (``Fp8WeightCast``)."""
    fp8_all_gather: bool = False
    """With ZeRO/FSDP, Float8 linears cast each rank's weight shard to fp8 before the weight
    all-gather, which then moves 1 byte per parameter, and the cast reads and writes the
    shard only (torchao's ``enable_fsdp_float8_all_gather`` with
    ``precompute_float8_dynamic_scale_for_fsdp``: one amax all-reduce per step)."""
    fp8_tp_gather: bool = False
    """With sequence parallelism, SP's all-gathers move fp8 casts made on the sequence shard,
    1 byte per element: the column-parallel inputs in the forward (torchao's
    ``PrepareFloat8ModuleInput``, Transformer Engine's quantizing norm) and the row-parallel
    layers' output gradients in the backward (torchao's ``Float8RowwiseParallel`` casts them
    before the redistribute, TE's ``grad_output_preprocess`` before its gather); the
    reduce-scatters, forward and backward, stay 16-bit."""
    sp_copy: SpCopy = SpCopy.NONE
    """Whether SP's collectives copy the full hidden states once more (``SpCopy``)."""
    logits_bytes: float = 4.0
    """Bytes per logit the loss keeps for backward: 4 for Megatron's fp32 logits and for eager
    fp32 cross-entropy (its fp32 log-probabilities), 6 where the 16-bit logits are kept too."""
    autocast: bool = False
    """The program runs its 16-bit training under ``torch.autocast`` where FSDP2 does not cast
    the weights alone (autopar's runtime: every plan but ZeRO 2/3 over dp > 1): norms in fp32
    and one 16-bit cast of a norm's output per GEMM reading it, each kept
    (``ModelProfile.autocast_act_bytes_per_token``)."""
    loss_backward_bytes: float = 0.0
    """Bytes per logit the loss's backward allocates beyond ``logits_bytes`` while it runs (one
    micro-batch at a time): 8 for eager fp32 cross-entropy (log_softmax's backward holds the
    incoming gradient and its result, both fp32: 4 kept + 8 = 12, measured on an H100 by
    ``benchmarks/gpu_memory_probe.py``); 0 where the gradient is computed in place (Megatron's
    fused vocab-parallel cross-entropy)."""
    loss_parallel_backward_bytes: float | None = None
    """Under tp > 1, where the logits stay split over the vocabulary and torch's
    ``loss_parallel`` runs the loss (DTensor's log-softmax and NLL handlers): what its backward
    allocates beyond ``logits_bytes``; None: ``loss_backward_bytes``. 12 for the eager fp32
    loss: ``_nll_loss_and_log_softmax_backward`` holds zeros, their sum with exp of the kept
    log-probabilities and its product with the gradient, fp32, at once (4 kept + 12 = 16,
    measured on CPU ranks by ``benchmarks/loss_memory.py``)."""
    elementwise_traffic: float = 1.0
    """Element-wise device-memory traffic relative to Megatron-LM's fused kernels (fused
    LayerNorm, bias-GeLU, bias-dropout-add, scale-mask-softmax): above 1 for eager unfused
    norms and activations."""
    context_parallel: ContextParallel = ContextParallel.NONE
    """How context parallelism runs in this program, or that it has none (``ContextParallel``;
    with cp > 1 the attention core is always the fused kernel: Megatron's CP runs only through
    Transformer Engine's flash attention, torch's through SDPA)."""
    moe_load_imbalance: float = 1.0
    """Tokens the busiest expert-parallel rank computes and receives over the mean, in a
    dropless mixture of experts (its grouped GEMMs and all-to-all set the layer's pace). 1.0,
    the default, is perfect balance: what an auxiliary balancing loss or DeepSeek-V3's
    loss-free bias balancing (Wang et al. 2024, arXiv 2408.15664) aims at; measured routing
    is never quite that even, so the default is optimistic. A model's capacity factor caps it
    (tokens past capacity are dropped)."""
    expert_tensor_parallel: bool = True
    """Whether each routed expert's GEMMs split over tp like the dense MLP's (expert TP = tp,
    Megatron-LM's original layout); false: router and experts are replicated over tp, every tp
    rank computing the same routed tokens (expert TP = 1)."""
    kv_repeated: bool = False
    """K and V reach the attention kernel repeated to the query heads (torchtitan's Llama:
    ``repeat_kv`` before SDPA), so a context-parallel exchange moves heads, not kv_heads, per
    token; false: the kernel reads the grouped K, V (SDPA ``enable_gqa``, Transformer
    Engine)."""
    cp_recomputes_attention: bool = False
    """Under cp > 1 the attention core of a block that is not recomputed is recomputed anyway
    (its gathered K,V are not kept: the core keeps its local q, k, v and gathers again in the
    backward): recompute none runs and is priced as selective (autopar's all-gather CP,
    ``autopar/runtime/context_parallel.py``); ``Strategy.recompute_run``."""
    dtensor_parameters: bool = False
    """The weights are DTensors wherever they are sharded or replicated by FSDP2 (ZeRO 1-3, its
    ``replicate``) or split by tensor parallelism (torch.distributed's FSDP2 and DTensor TP,
    as autopar's runtime and torchtitan run them): each parameter's optimizer step goes through
    DTensor's dispatch (the profile's ``dtensor_optimizer_us`` per tensor). False: plain
    tensors (Megatron, DeepSpeed, DDP)."""
    sliding_window: bool = False
    """The fused attention kernel runs the model's local windows (Transformer Engine's
    ``window_size``: Megatron-LM's ``--window-size`` and ``--window-attn-skip-freq``), executing
    a windowed layer's band of tiles (``ModelProfile.attention_windows``); false: causal
    attention over the whole sequence on every layer."""
    runs_module_as_written: bool = False
    """The program runs the model's own module (autopar's runtime), so an attention core the
    model writes out by hand (``ModelProfile.written_attention``) runs op by op: its scores
    are kept and moved, its GEMMs run as GEMMs. False: the framework builds its own blocks
    around its attention kernel (Megatron, DeepSpeed's Megatron, torchtitan, llm-foundry)."""
    kernels_per_block: int = 0
    """Kernels one transformer block's forward launches (backward about twice as many); with
    the profile's ``kernel_dispatch_us``, a pass can be no faster than its host dispatch."""
    schedules: tuple[str, ...] = SCHEDULES
    """The pipeline schedules this program runs (``SCHEDULES``; interleaved with 2 or more
    virtual stages per rank): the search plans no other (``autopar.plan.runtime_unsupported``)."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """The ZeRO stages this program runs without a pipeline."""
    pipeline_zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """The ZeRO stages this program runs with pp > 1 (DeepSpeed's pipeline engine: 0 and 1)."""
    sequence_parallel: bool = True
    """Whether this program has sequence parallelism beside tensor parallelism."""
    recompute_modes: tuple[str, ...] = RECOMPUTE_MODES
    """The recompute modes this program has (``RECOMPUTE_MODES``, ``cost_models.strategy.RECOMPUTE``)."""
    uniform_recompute: bool = False
    """The program recomputes every block in one mode (torchtitan's one activation-checkpointing
    policy, DeepSpeed's all-or-none); False: blocks may mix modes (autopar's runtime)."""
    uniform_stages: bool = False
    """The program splits the blocks evenly over the pipeline stages, the first stages taking
    the remainder (DeepSpeed's ``PipelineModule(partition_method="uniform")``,
    ``pipeline.partition_uniform``): the search places no other. Needs ``uniform_recompute``."""
    recompute_block: bool = False
    """Besides one mode on every block, the program can recompute (full) the first k blocks of
    every model chunk and none of the others, k the same for all chunks (Megatron-Core's
    ``--recompute-granularity full --recompute-method block --recompute-num-layers k``): the
    search prices those plans on the even split of the blocks (``pipeline.partition_uniform``),
    at their best k. Needs ``uniform_recompute`` and the modes none and full."""
    axis_orders: tuple[str, ...] = ()
    """The mesh orders this program lays out, each the mesh axes outermost first, comma-separated
    (``pp,dp,cp,tp``); empty: any."""
    notes: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    """Where each switch comes from (framework source, documentation)."""

    @property
    def has_context_parallel(self) -> bool:
        """Whether the program can split sequences over a cp axis."""
        return self.context_parallel != ContextParallel.NONE

    def __post_init__(self) -> None:
        if self.elementwise_traffic <= 0:
            raise RecipeError(f"recipe {self.name!r}: elementwise_traffic must be positive")
        if self.kernels_per_block < 0:
            raise RecipeError(f"recipe {self.name!r}: kernels_per_block must be >= 0")
        for key, allowed in (("schedules", SCHEDULES), ("zero_stages", (0, 1, 2, 3)),
                             ("pipeline_zero_stages", (0, 1, 2, 3)), ("recompute_modes", RECOMPUTE_MODES)):
            value = getattr(self, key)
            if not value or len(set(value)) != len(value) or not set(value) <= set(allowed):
                raise RecipeError(f"recipe {self.name!r}: {key} must list distinct values of "
                                  f"{', '.join(map(str, allowed))}, got {_shown(list(value))}")
        if self.uniform_stages and not self.uniform_recompute:
            raise RecipeError(f"recipe {self.name!r}: uniform_stages needs uniform_recompute (one mode for every block)")
        if self.recompute_block and not (self.uniform_recompute and "full" in self.recompute_modes):
            raise RecipeError(f"recipe {self.name!r}: recompute_block needs uniform_recompute and the full "
                              "recompute mode (it mixes none and full in a fixed pattern)")
        if "1f1b" not in self.schedules or "none" not in self.recompute_modes:
            raise RecipeError(f"recipe {self.name!r}: schedules must have 1f1b and recompute_modes none "
                              "(every program runs one stage and no recompute)")
        if self.axis_orders and ",".join(MESH_AXIS_NAMES) not in self.axis_orders:
            raise RecipeError(f"recipe {self.name!r}: axis_orders must have {','.join(MESH_AXIS_NAMES)}, the order "
                              "every candidate is first laid out in")
        for order in self.axis_orders:
            if sorted(order.split(",")) != sorted(MESH_AXIS_NAMES):
                raise RecipeError(f"recipe {self.name!r}: each of axis_orders lists {', '.join(MESH_AXIS_NAMES)} "
                                  f"once, comma-separated, outermost first; got {_shown(order)}")

    def runs_order(self, order: tuple[str, ...], active: frozenset[str]) -> bool:
        """Whether this program lays its mesh out in ``order`` (axis names outermost first), read
        on the ``active`` axes (degree > 1) alone: where the others sit changes no group."""
        if not self.axis_orders:
            return True
        mine = tuple(a for a in order if a in active)
        return any(tuple(a for a in allowed.split(",") if a in active) == mine for allowed in self.axis_orders)


_BOUNDS = {"moe_load_imbalance": (1.0, 64.0), "fp8_cast_bytes": (0.5, 64.0), "logits_bytes": (0.5, 64.0),
           "loss_backward_bytes": (0.0, 64.0), "loss_parallel_backward_bytes": (0.0, 64.0), "elementwise_traffic": (0.01, 100.0),
           "kernels_per_block": (0, 1_000_000)}
"""Plausible range of each numeric switch."""


def _shown(value: object) -> str:
    """A user value on one short line."""
    if isinstance(value, int) and abs(value).bit_length() > 128:
        return "a very long integer"
    try:
        text = " ".join(repr(value).split())
    except RecursionError:
        text = f"a deeply nested {type(value).__name__}"
    return text if len(text) <= 60 else text[:59] + "…"


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.json"))


ENUMS = (Attention, DpOverlap, ContextParallel, Fp8WeightCast, SpCopy)
"""The closed vocabularies a recipe's switches take (JSON strings)."""


def recipe_from_dict(data: object, where: str) -> ExecutionRecipe:
    """Build a recipe from parsed JSON; any problem is a ``RecipeError`` naming ``where``."""
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {where} must be a JSON object")
    known = {f.name for f in fields(ExecutionRecipe)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise RecipeError(f"recipe {where} has unknown keys {unknown}; known: {', '.join(sorted(known))}")
    hints = get_type_hints(ExecutionRecipe)
    for key, value in data.items():
        kind = hints[key]
        if kind == (float | None):  # optional: null, or a number as a float's
            if value is None:
                continue
            kind = float
        if kind in ENUMS:
            if value not in [e.value for e in kind]:
                raise RecipeError(f"recipe {where} is malformed: {key} must be one of "
                                  f"{', '.join(e.value for e in kind)}, got {_shown(value)}")
        elif kind is bool and not isinstance(value, bool):
            raise RecipeError(f"recipe {where} is malformed: {key} must be true or false, got {_shown(value)}")
        elif kind is str and not isinstance(value, str):
            raise RecipeError(f"recipe {where} is malformed: {key} must be a string, got {_shown(value)}")
        elif kind in (int, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
            low, high = _BOUNDS[key]
            try:
                inside = ok and math.isfinite(value) and low <= value <= high
            except OverflowError:
                inside = False
            if not inside:
                raise RecipeError(f"recipe {where} is malformed: {key} must be a number in [{low:g}, {high:g}], "
                                  f"got {_shown(value)}")
        elif key == "notes" and (not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values())):
            raise RecipeError(f"recipe {where} is malformed: notes must map names to strings")
        elif kind in (tuple[str, ...], tuple[int, ...]):
            item = str if kind == tuple[str, ...] else int
            if not isinstance(value, list) or not all(isinstance(v, item) and not isinstance(v, bool) for v in value):
                raise RecipeError(f"recipe {where} is malformed: {key} must be a list of "
                                  f"{'strings' if item is str else 'integers'}, got {_shown(value)}")
    try:
        kw = dict(data)
        kw.update({k: hints[k](v) for k, v in kw.items() if hints[k] in ENUMS})
        kw.update({k: tuple(v) for k, v in kw.items() if hints[k] in (tuple[str, ...], tuple[int, ...])})
        kw = {k: float(v) if hints[k] in (float, float | None) and v is not None else v for k, v in kw.items()}
        recipe = ExecutionRecipe(**kw)
    except (TypeError, ValueError) as exc:
        raise RecipeError(f"recipe {where} is malformed: {' '.join(str(exc).split())[:200]}") from None
    from cost_models.states import STATE_LAYOUTS  # states imports strategy, which imports us
    if recipe.state not in STATE_LAYOUTS:
        raise RecipeError(f"recipe {where}: state {recipe.state!r} is not one of "
                          f"{', '.join(STATE_LAYOUTS)}")
    return recipe


BASE_DEPTH = 8
"""How many recipes one ``base`` chain may hold (a cycle stops here)."""


@lru_cache(maxsize=64)
def load_recipe(name_or_path: str = DEFAULT_RECIPE) -> ExecutionRecipe:
    """A shipped recipe by name (``megatron-core``) or a JSON file by path (immutable, cached).
    A recipe whose JSON has ``"base": NAME`` is that recipe (shipped name or path) with the
    file's keys in place of its own; their ``notes`` are merged, the file's winning."""
    return recipe_from_dict(*_recipe_data(name_or_path, BASE_DEPTH))


def _recipe_data(name_or_path: str, depth: int) -> tuple[object, str]:
    """(the recipe's keys with its ``base`` chain resolved, where it was read); a recipe with a
    base and no ``name`` of its own is named after its file."""
    if depth <= 0:
        raise RecipeError(f"recipe {_shown(name_or_path)}: its base chain is over {BASE_DEPTH} recipes "
                          "long (a cycle?); name a recipe without a base")
    try:
        path = Path(name_or_path)
        if not path.suffix:
            path = RECIPE_DIR / f"{name_or_path}.json"
        found = path.is_file()
        raw = path.read_bytes() if found and path.stat().st_size <= 1 << 20 else None
    except (OSError, ValueError) as exc:  # unreadable, a name the OS refuses
        raise RecipeError(f"cannot read recipe {_shown(name_or_path)}: {' '.join(str(exc).split())[:200]}") from None
    if not found:
        raise RecipeError(f"unknown recipe {_shown(name_or_path)}; use one of "
                          f"{', '.join(available_recipes())} or a path to a recipe .json file")
    if raw is None:
        raise RecipeError(f"recipe file {path} is over 1 MiB, not a recipe")
    try:
        data = json.loads(raw.decode("utf-8-sig"))
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, too deep, a huge integer
        raise RecipeError(f"recipe file {path} is not valid JSON: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(data, dict) or "base" not in data:
        return data, str(path)
    base = data["base"]
    if not isinstance(base, str):
        raise RecipeError(f"recipe {path} is malformed: base must be a recipe name or path, got {_shown(base)}")
    if Path(base).suffix and not Path(base).is_absolute():
        base = str(path.parent / base)  # a path relative to the file naming it (a name: shipped)
    merged, _ = _recipe_data(base, depth - 1)
    if not isinstance(merged, dict):
        raise RecipeError(f"recipe {_shown(base)} (the base of {path}) must be a JSON object")
    own = {"name": path.stem, **{k: v for k, v in data.items() if k != "base"}}
    out = {**merged, **own}
    if isinstance(merged.get("notes"), dict) and isinstance(own.get("notes"), dict):
        out["notes"] = {**merged["notes"], **own["notes"]}
    return out, str(path)
