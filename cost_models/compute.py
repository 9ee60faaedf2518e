"""Compute time of one micro-batch through a block, the embedding and the head (seconds).

Every kernel is a roofline: the larger of its FLOPs at the GEMM's efficiency and its bytes at
``hbm_bw · memory_efficiency``. A block's GEMMs are rebuilt from the profile's shape (QKV,
attention output, MLP up and down on one tp rank; QKᵀ and AV batched over heads): the
efficiency of an (m x k) @ (k x n) GEMM follows the profile's shape law,
``matmul_efficiency · m / (m + H) · n / (n + H) · k / (k + D)`` (H ``matmul_half_dim``, D
``matmul_half_depth``: a thin output cannot fill the tensor cores, a shallow reduction cannot
hide a tile's loads and epilogue; ``benchmarks/gpu_kernels.py`` measures both: on an H100 H is
8 and D 112, so a k = 512 reduction runs at 0.82 of a deep one). The backward
runs each GEMM's two gradients at their own shapes: the input gradient (m x n) @ (n x k) and
the weight gradient (k x m) @ (m x n), whose reduction is the tokens. The times are scaled to
the profile's own FLOP counts, so an architecture with other GEMMs keeps the traced FLOPs at
the efficiency of its shape.

Element-wise kernels are memory-bound; their traffic is counted per byte the block saves for
backward (``memory.block_act_bytes`` parts), from the fused kernels Megatron-LM runs
(``FWD_TRAFFIC``/``BWD_TRAFFIC``). The part tensor parallelism leaves replicated is computed
redundantly on every tp rank unless sequence parallelism splits it (Korthikanti et al. Table 4).

Backward runs each GEMM's two gradients and the element-wise backward kernels. Recompute
repeats, per block, the whole forward (full), the attention core's QKᵀ, softmax, dropout and
AV (selective), or the forward but for every second weight GEMM and the attention kernel,
whose outputs were kept (op).

The execution recipe (``Strategy.recipe``) sets what runs: with fused attention the core is
one FlashAttention-style kernel that skips the masked causal blocks (it executes
``(s + FLASH_TILE) / 2s`` of the QKᵀ and AV FLOPs; all of them on the blocks whose own code
passes an explicit mask, where the program runs them as written: ``executed_fraction``) at the
profile's ``attention_efficiency`` of its kernel family (``sdpa``: the one torch dispatches on
the device), scaled by the
family's sequence law at seq / cp tokens (``attention_half_seq``), moves no s x s bytes, and
runs its backward as 2.5 times the forward's
FLOPs (FlashAttention-2 recomputes QKᵀ and the probabilities: five GEMMs against two);
``elementwise_traffic`` scales the element-wise bytes (eager unfused norms and activations move
more than Megatron's fused kernels). A pass of a block can be no faster than the host
dispatching its kernels: ``kernels_per_block`` (backward twice as many) times the profile's
``kernel_dispatch_us``, which is what bounds small micro-batches and wide TP of small models.
On a device that runs its operators on the dispatching thread (CPU ranks,
``host_overlaps_device`` false) the host time adds to the pass instead.

Context parallelism of degree c (``Strategy.tokens``) leaves each rank seq/c tokens of every
sequence: every GEMM, element-wise kernel, the embedding and the head see seq/c tokens, and the
attention core computes seq/c queries against all seq keys, 1/c of the sequence's attention
FLOPs. Causal load balancing (Megatron-Core / Transformer Engine, torch's ``context_parallel``:
the sequence cut into 2c chunks, rank r taking chunks r and 2c-1-r) gives every rank the same
share of the causal work, so the executed fraction stays ``causal_fraction(seq)`` on each. The
core is always the fused kernel under CP (``Strategy.fused_attention``). The K,V exchange is
communication (``cost_models.blockcomm.block_cp_s``); the ring programs run the core as cp
kernels whose outputs are merged and gradients accumulated (torch's in fp32, Transformer
Engine's in 16 bits), element-wise traffic of its own (``cost_models.ring.cp_merge_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.hardware import HardwareProfile, ProfileError
from cost_models.host import checkpoint_s, dispatch_s, tp_host_s, with_host
from cost_models.model_profile import ModelProfile
from cost_models.recipe import Fp8WeightCast
from cost_models.attention import FLASH_BWD_RATIO, executed_fraction
from cost_models.ring import cp_merge_bytes
from cost_models.states import tp_whole_params, whole_qkv_params
from cost_models.strategy import Strategy

FWD_TRAFFIC = (2.2, 2 / 3, 1.8)
"""Element-wise forward bytes moved per saved byte: (replicated, tp-sharded, attention core).
GPT block with Megatron's fused kernels, per token in units of h: two LayerNorms (read 2,
write 2) and two bias-dropout-adds (read 2 + 2, write 2 + 1-byte mask) move 22 for 10 saved;
bias-GeLU moves 16 (read 8, write 8) for 24 saved; scale-mask-softmax and dropout move
9 bytes per score (read 2 write 2, read 2 write 2 + mask) for 5 saved."""
BWD_TRAFFIC = (3.4, 1.0, 2.2)
"""Element-wise backward bytes per saved byte: LayerNorm backward (6) and dropout backward
(5) twice, plus the two residual-gradient adds (6 each): 34 for 10; GeLU backward (read 16,
write 8): 24 for 24; dropout and softmax backward (5 + 6): 11 per score for 5."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PassTimes:
    """Seconds of one micro-batch's forward, recompute and backward."""

    forward_s: float
    recompute_s: float
    backward_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.recompute_s + self.backward_s


@dataclass(frozen=True, kw_only=True, slots=True)
class Gemm:
    """A (batched) GEMM (batch × m × k) @ (k × n) on one device."""

    batch: float
    m: float
    n: float
    k: float

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    def nbytes(self, elem: float) -> float:
        return elem * self.batch * (self.m * self.k + self.k * self.n + self.m * self.n)


def elem_bytes(strat: Strategy) -> int:
    """Bytes per activation element: 4 for fp32 training, else 2."""
    return 4 if strat.dtype == "fp32" else 2


def gemm_efficiency(g: Gemm, hw: HardwareProfile, dtype: str = "bf16") -> float:
    """Fraction of dense peak the GEMM ``g`` reaches under the profile's shape law; Float8
    GEMMs at ``fp8_matmul_efficiency`` of the fp8 peak and with ``fp8_matmul_half_depth``
    where the profile gives them (an H100 needs a reduction four times deeper in fp8 than in
    bf16 to reach the same fraction: ``benchmarks/gpu_kernels.py``)."""
    h, d = hw.matmul_half_dim, hw.matmul_half_depth
    if dtype == "fp8":
        base = hw.fp8_matmul_efficiency or hw.matmul_efficiency
        d = hw.fp8_matmul_half_depth or d
    else:
        base = hw.matmul_efficiency
    return base * g.m / (g.m + h) * g.n / (g.n + h) * g.k / (g.k + d)


def grad_gemms(g: Gemm) -> tuple[Gemm, Gemm]:
    """The backward's GEMMs of ``g``: the input gradient (m x n) @ (n x k) and the weight
    gradient (k x m) @ (m x n)."""
    return (Gemm(batch=g.batch, m=g.m, n=g.k, k=g.n), Gemm(batch=g.batch, m=g.k, n=g.n, k=g.m))


def gemm_s(g: Gemm, hw: HardwareProfile, dtype: str, elem: float) -> float:
    """Roofline time of one GEMM: FLOPs at its shape's efficiency, or its operand bytes."""
    return max(g.flops / (hw.compute_flops(dtype) * gemm_efficiency(g, hw, dtype)), memory_s(g.nbytes(elem), hw))


def memory_s(nbytes: float, hw: HardwareProfile) -> float:
    """Element-wise time of ``nbytes`` of device-memory traffic."""
    return nbytes / (hw.hbm_bw_gbps * 1e9 * hw.memory_efficiency)


def optimizer_memory_s(nbytes: float, hw: HardwareProfile, fused: bool = True) -> float:
    """Optimizer-step time of ``nbytes`` of device-memory traffic: large fused multi-tensor
    kernels (apex ``multi_tensor_adam``/``scale``/``l2norm``, torch's foreach/fused AdamW) at
    ``optimizer_memory_efficiency`` (``memory_efficiency`` where the profile leaves it 0 or
    the recipe's optimizer is not ``fused``)."""
    eff = (hw.optimizer_memory_efficiency if fused else 0.0) or hw.memory_efficiency
    return nbytes / (hw.hbm_bw_gbps * 1e9 * eff)


def _host_rate(gbps: float, name: str, hw: HardwareProfile) -> float:
    if gbps <= 0:
        raise ProfileError(f"profile {hw.name!r} has no {name}; CPU offload needs "
                           "host_memory_gib, host_link_bw_gbps and host_optimizer_gbps")
    return gbps * 1e9


def host_copy_s(nbytes: float, hw: HardwareProfile) -> float:
    """One host<->device copy of ``nbytes`` over the device's PCIe link, s."""
    return nbytes / _host_rate(hw.host_link_bw_gbps, "host_link_bw_gbps", hw) if nbytes else 0.0


def host_optimizer_s(nbytes: float, hw: HardwareProfile) -> float:
    """The optimizer step on the CPU moving ``nbytes`` of host memory (memory-bound), s."""
    return nbytes / _host_rate(hw.host_optimizer_gbps, "host_optimizer_gbps", hw) if nbytes else 0.0


COLUMN_PARALLEL = (True, False, True, False)
"""Which of ``block_gemms``' weight GEMMs, in its order, are column-parallel (their input the
full hidden state, SP's all-gathered one): QKV and the up projection(s) (or a mixture of
experts' dense rest), not the attention output and the down projection."""


def block_gemms(model: ModelProfile, strat: Strategy) -> tuple[list[Gemm], list[Gemm]]:
    """(weight GEMMs, attention-core GEMMs) of one block's forward on one tp rank; for a
    mixture of experts the dense ones only (attention, router, shared experts: what is left
    of the dense FLOPs after attention's projections, as one GEMM of that width), the routed
    experts' in ``expert_gemms``. The weight GEMMs alternate column- and row-parallel
    (``COLUMN_PARALLEL``): QKV, attention output, up, down."""
    t, h, f = strat.mesh.tp, model.hidden, model.ffn
    d = h / model.heads
    tokens = strat.tokens(model.seq)
    qkv = (model.heads + 2 * model.kv_heads) * d
    whole = whole_qkv_params(model, strat) > 0  # multi-query TP: the QKV projection whole on every rank
    attn = [Gemm(batch=1, m=tokens, n=qkv if whole else qkv / t, k=h), Gemm(batch=1, m=tokens, n=h, k=h / t)]
    if model.moe:
        rest = (model.block_matmul_flops_per_token - model.expert_flops_per_token) / 2 \
            - h * qkv - model.heads * d * h
        weights = attn + ([Gemm(batch=1, m=tokens, n=rest / h / t, k=h)] if rest >= h else [])
    else:
        # GeLU MLP has one up projection, SwiGLU two (gate and up): read it off the FLOP count.
        rest = model.block_matmul_flops_per_token / 2 - h * qkv - model.heads * d * h - f * h
        ups = min(2, max(1, round(rest / (h * f))))
        weights = attn + [Gemm(batch=1, m=tokens, n=ups * f / t, k=h), Gemm(batch=1, m=tokens, n=h, k=f / t)]
    heads = strat.micro_batch * model.heads / t
    q = model.seq / strat.mesh.cp  # each cp rank's queries against every key
    core = [Gemm(batch=heads, m=q, n=model.seq, k=d),   # scores = Q Kᵀ
            Gemm(batch=heads, m=q, n=d, k=model.seq)]   # probabilities @ V
    return weights, core


def dense_flops_per_token(model: ModelProfile, strat: Strategy) -> float:
    """Forward FLOPs per token of one block's weight GEMMs outside the routed experts on one
    tp rank: split over tp, but for the weights every rank holds whole (``states.
    tp_whole_params``: multi-query TP's QKV, latent attention's low-rank projections), which
    each rank computes whole (2 FLOPs per weight and token)."""
    whole = 2 * tp_whole_params(model, strat)
    return (model.block_matmul_flops_per_token - model.expert_flops_per_token - whole) / strat.mesh.tp + whole


def _scaled_s(gemms: list[Gemm], flops: float, hw: HardwareProfile, strat: Strategy,
              dtype: str | None = None, backward: bool = False) -> float:
    """Time of ``gemms`` (``backward``: of their gradients, ``grad_gemms``) rescaled to
    ``flops`` (the traced count of the forward) at their own efficiency."""
    shape_flops = sum(g.flops for g in gemms)
    if shape_flops <= 0 or flops <= 0:
        return 0.0
    elem = 1 if dtype == "fp8" else elem_bytes(strat)
    run = [x for g in gemms for x in grad_gemms(g)] if backward else gemms
    return sum(gemm_s(g, hw, dtype or strat.dtype, elem) for g in run) * flops / shape_flops


def fp8_cast_bytes(model: ModelProfile, strat: Strategy) -> tuple[float, float]:
    """(forward, backward) device-memory bytes of one block's Float8 casts per micro-batch on
    one tp rank: each weight GEMM's input (forward) and output gradient (backward) scaled and
    cast per element, on the rank's sequence shard where the cast comes before SP's all-gather
    (``tp_gathered``: a column-parallel layer's input, a row-parallel one's output gradient),
    ``recipe.fp8_cast_bytes`` each (dynamic scaling: read for the amax, read and write one
    byte), and its weights as often as
    ``recipe.fp8_weight_cast`` says: in each pass, in the forward, or once per step (spread
    over the step's micro-batches). 0 without ``fp8``."""
    if not strat.fp8:
        return 0.0, 0.0
    weights, _ = block_gemms(model, strat)
    per = strat.recipe.fp8_cast_bytes
    split = tp_gathered(strat)
    ins = sum(g.m * g.k / (split if column else 1) for g, column in zip(weights, COLUMN_PARALLEL))
    grads = sum(g.m * g.n / (1 if column else split) for g, column in zip(weights, COLUMN_PARALLEL))
    w = (model.dense_block_params + model.expert_params / strat.mesh.ep) / strat.mesh.tp
    w /= fp8_cast_shards(strat)
    cast = strat.recipe.fp8_weight_cast
    if cast == Fp8WeightCast.EVERY_PASS:
        return per * (ins + w), per * (grads + w)
    if cast == Fp8WeightCast.FORWARD:
        return per * (ins + w), per * grads
    return per * (ins + w / max(1, strat.num_microbatches)), per * grads


def tp_gathered(strat: Strategy) -> int:
    """Ranks a Float8 cast that SP all-gathers is split over: under SP with
    ``recipe.fp8_tp_gather`` each tp rank casts its sequence shard before the all-gather (a
    column-parallel input: torchao's ``PrepareFloat8ModuleInput``, Transformer Engine's
    quantizing norm; a row-parallel output gradient in the backward: torchao's
    ``Float8RowwiseParallel`` casts it before its redistribute, Transformer Engine's
    ``grad_output_preprocess``), else every rank casts the whole tensor."""
    return strat.mesh.tp if fp8_sp_gather(strat) else 1


def fp8_sp_gather(strat: Strategy) -> bool:
    """Whether SP's all-gathers move fp8 casts (Float8 linears under ``recipe.fp8_tp_gather``):
    the column-parallel inputs in the forward, the row-parallel output gradients in the
    backward."""
    return strat.fp8 and strat.sequence_parallel and strat.recipe.fp8_tp_gather


def fp8_cast_shards(strat: Strategy) -> int:
    """Ranks a weight's Float8 cast is split over: each casts its ZeRO shard before the
    gather under ``recipe.fp8_all_gather``, else every rank casts the whole weight."""
    return strat.replicas if strat.fp8 and strat.recipe.fp8_all_gather and strat.zero >= 1 else 1


def fused(strat: Strategy) -> bool:
    return strat.fused_attention


def kernel_fused(model: ModelProfile, strat: Strategy) -> bool:
    """The attention core runs as one fused kernel (``fused``), unless the model writes it out
    by hand and the program runs the module as written (``recipe.runs_module_as_written``):
    then its two products run as GEMMs and its scores move through memory."""
    return fused(strat) and not (model.written_attention and strat.recipe.runs_module_as_written)


def expert_gemms(model: ModelProfile, strat: Strategy) -> list[Gemm]:
    """The routed experts' grouped GEMMs of one block's forward on the busiest rank: its
    experts / ep local experts, each computing its share of the routed rows (tokens x topk x
    ep / experts, times ``memory.moe_load``: the rank receives the top-k copies of the tokens
    of its ep group), up/gate (2f / etp wide; SwiGLU) and down (f / etp deep; ``Strategy.etp``)."""
    if not model.moe:
        return []
    from cost_models.memory import moe_load  # memory imports nothing of compute
    t, h, f = strat.etp, model.hidden, model.expert_ffn
    local = model.experts / strat.mesh.ep
    copies = expert_copies(model, strat)
    rows = strat.tokens(model.seq) * strat.moe_rows * copies * strat.mesh.ep / model.experts * moe_load(model, strat)
    ups = max(1, round(model.expert_flops_per_token / (2 * (model.expert_copies or model.topk) * h * f) - 1))
    return [Gemm(batch=local, m=rows, n=ups * f / t, k=h), Gemm(batch=local, m=rows, n=h, k=f / t)]


def expert_copies(model: ModelProfile, strat: Strategy) -> float:
    """Copies of each token the program runs through the routed experts: as the model's code
    does (``ModelProfile.expert_copies``) where the program runs the module as written, top-k
    where the framework builds its own routed MLP."""
    if strat.recipe.runs_module_as_written and model.expert_copies:
        return model.expert_copies
    return model.topk


def expert_flops_per_token(model: ModelProfile, strat: Strategy) -> float:
    """Forward FLOPs per token of the routed experts in ``strat``'s program (``expert_copies``)."""
    if strat.recipe.runs_module_as_written:
        return model.expert_flops_per_token
    return model.routed_expert_flops_per_token()


def expert_gemm_s(model: ModelProfile, hw: HardwareProfile, strat: Strategy, backward: bool = False) -> float:
    """Forward (``backward``: backward) seconds of one block's routed-expert GEMMs on the
    busiest rank (the traced FLOPs of the routed tokens over tp, times the load, at the
    grouped GEMMs' shape efficiency; the local experts' weights are read whatever the rows:
    small batches are bandwidth-bound)."""
    if not model.moe:
        return 0.0
    from cost_models.memory import moe_load
    tokens = strat.tokens(model.seq) * strat.moe_rows
    flops = tokens * expert_flops_per_token(model, strat) / strat.etp * moe_load(model, strat)
    return _scaled_s(expert_gemms(model, strat), flops, hw, strat, "fp8" if strat.fp8 else None, backward)


def moe_traffic_bytes(model: ModelProfile, strat: Strategy) -> float:
    """Element-wise device-memory bytes of one MoE layer's forward on one rank besides its
    GEMMs: the router's fp32 logits, softmax and top-k over the experts (written, read and
    written: 3 x 4 bytes per expert per token), and the permutation of the top-k token copies
    into expert order before the dispatch and back after the combine (each read and written:
    4 x topk x h elements, times the load). Under ep > 1 with several experts on a rank, the
    rows an all-to-all brings are grouped by local expert after it and put back in source
    order before the combine's (Megatron's alltoall dispatcher: ``sort_chunks_by_idxs`` in
    ``dispatch_postprocess`` and ``combine_preprocess``; torchtitan's ``_permute`` after its
    dispatch): 4 x topk x h more. The backward moves the same."""
    if not model.moe:
        return 0.0
    from cost_models.memory import moe_load
    tokens = strat.tokens(model.seq) * strat.moe_rows
    router = 12.0 * model.experts * tokens
    passes = 8.0 if strat.mesh.ep > 1 and model.experts > strat.mesh.ep else 4.0
    permute = passes * model.topk * model.hidden * elem_bytes(strat) * tokens * moe_load(model, strat) / strat.etp
    return router + permute


def block_gemm_s(model: ModelProfile, hw: HardwareProfile, strat: Strategy,
                 backward: bool = False) -> tuple[float, float]:
    """(weight GEMMs, attention core) seconds of one block's forward (``backward``: its
    backward), one micro-batch; the weight GEMMs include the routed experts'
    (``expert_gemm_s``)."""
    tokens = strat.tokens(model.seq)
    weights, core = block_gemms(model, strat)
    attn_flops = tokens * model.block_attn_flops_per_token / strat.mesh.tp
    if kernel_fused(model, strat):
        eff = hw.attention_eff(strat.recipe.attention_kernel, model.seq / strat.mesh.cp, model.head_dim)
        core_s = attn_flops * executed_fraction(model, strat) / (hw.compute_flops(strat.dtype) * eff)
        core_s *= FLASH_BWD_RATIO if backward else 1.0
    else:
        core_s = _scaled_s(core, attn_flops, hw, strat, backward=backward)
    dense = tokens * dense_flops_per_token(model, strat)
    return (_scaled_s(weights, dense, hw, strat, "fp8" if strat.fp8 else None, backward)
            + expert_gemm_s(model, hw, strat, backward), core_s)


def block_elementwise_bytes(model: ModelProfile, strat: Strategy,
                            traffic: tuple[float, float, float]) -> tuple[float, float]:
    """(non-attention, attention-core) element-wise bytes of one block on one tp rank; a fused
    attention kernel moves no s x s bytes."""
    scale = elem_bytes(strat) / 2 * strat.tokens(model.seq) * strat.recipe.elementwise_traffic
    sp = strat.mesh.tp if strat.sequence_parallel else 1
    repl, sharded, attn = model.act_bytes_per_token(fused(strat), own_blocks=not strat.recipe.runs_module_as_written,
                                                    kv_repeated=strat.recipe.kv_repeated)
    rest = traffic[0] * repl / sp + traffic[1] * sharded / strat.mesh.tp
    core = 0.0 if kernel_fused(model, strat) else traffic[2] * attn / strat.mesh.tp
    return scale * rest, scale * core


def pass_key(strat: Strategy) -> tuple:
    """Everything of ``strat`` that ``block_times``, ``first_times`` and ``last_times`` read
    (tests/test_cost_models.py checks that strategies equal in it get equal times): the
    degrees that split a micro-batch's work, the micro-batch, SP, precision, the recipe and
    the recompute mode the program runs, and the micro-batch count where Float8 weights are
    cast once per step (``Fp8WeightCast.ONCE_PER_STEP``), the shard where they are cast
    before the gather (``recipe.fp8_all_gather``). They read the device, never the
    topology (nodes, links), so profiles that differ in links only may share them."""
    m = strat.mesh
    per_step = strat.fp8 and strat.recipe.fp8_weight_cast == Fp8WeightCast.ONCE_PER_STEP
    return (m.tp, m.cp, m.ep, strat.micro_batch, strat.sequence_parallel, strat.dtype, strat.fp8,
            strat.recipe, strat.recompute_run(), strat.num_microbatches if per_step else 0,
            fp8_cast_shards(strat))


def block_times(model: ModelProfile, hw: HardwareProfile, strat: Strategy) -> PassTimes:
    """One block, one micro-batch, on one tp rank (communication not included)."""
    weights_s, core_s = block_gemm_s(model, hw, strat)
    weights_bwd, core_bwd = block_gemm_s(model, hw, strat, backward=True)
    fwd_rest, fwd_core = block_elementwise_bytes(model, strat, FWD_TRAFFIC)
    bwd_rest, bwd_core = block_elementwise_bytes(model, strat, BWD_TRAFFIC)
    merge_fwd, merge_bwd = cp_merge_bytes(model, strat)
    fwd_core, bwd_core = fwd_core + merge_fwd, bwd_core + merge_bwd
    cast_fwd, cast_bwd = fp8_cast_bytes(model, strat)
    moe = moe_traffic_bytes(model, strat)
    cast_fwd, cast_bwd = cast_fwd + moe, cast_bwd + moe
    host = dispatch_s(hw, strat) + tp_host_s(strat, model.block_tp_linears * hw.tp_linear_us) / 3
    fwd_device = weights_s + core_s + memory_s(fwd_rest + fwd_core + cast_fwd, hw)
    fwd = with_host(host, fwd_device, hw)
    bwd = with_host(2 * host, weights_bwd + core_bwd + memory_s(bwd_rest + bwd_core + cast_bwd, hw), hw)
    mode = strat.recompute_run()
    checkpoint = checkpoint_s(hw, mode)
    if mode == "full":
        rc = with_host(host + checkpoint, fwd_device, hw)
    elif mode == "selective":
        rc = with_host(checkpoint, core_s + memory_s(fwd_core, hw), hw)
    elif mode == "op":
        # The weight GEMMs it did not keep (at the block's mean GEMM efficiency), their Float8
        # casts, and every element-wise kernel; the attention kernel's output is kept.
        share = model.op_recompute_flops_per_token / model.block_matmul_flops_per_token
        rc = with_host(host + checkpoint, share * (weights_s + memory_s(cast_fwd, hw)) + memory_s(fwd_rest, hw), hw)
    else:
        rc = 0.0
    return PassTimes(forward_s=fwd, recompute_s=rc, backward_s=bwd)


def tp_windows_s(model: ModelProfile, hw: HardwareProfile, strat: Strategy,
                 backward: bool = False) -> tuple[float, ...]:
    """Seconds of the weight GEMM each of a block's four tensor-parallel exchanges is
    pipelined with under ``recipe.tp_comm_overlap``, in order: QKV, attention output, MLP up,
    MLP down (``block_gemms``), one micro-batch; backward: each one's input gradient, the GEMM
    that makes or takes the exchanged gradient. A mixture of experts' MLP counts as one GEMM
    (its dense rest and routed experts), half behind each of its two exchanges."""
    weights, _ = block_gemms(model, strat)
    dense = strat.tokens(model.seq) * dense_flops_per_token(model, strat)
    scale = dense / sum(g.flops for g in weights)
    dtype, elem = ("fp8", 1) if strat.fp8 else (strat.dtype, elem_bytes(strat))
    run = [grad_gemms(g)[0] for g in weights] if backward else weights
    t = [gemm_s(g, hw, dtype, elem) * scale for g in run]
    if model.moe:
        mlp = sum(t[2:]) + expert_gemm_s(model, hw, strat, backward) / (2 if backward else 1)
        t = t[:2] + [mlp / 2, mlp / 2]
    return tuple(t)


def wgrad_window_s(model: ModelProfile, hw: HardwareProfile, strat: Strategy) -> float:
    """Weight-gradient GEMM time of a block's column-parallel layers (QKV and MLP up): what
    hides the backward's tensor-parallel collectives when the runtime overlaps them."""
    weights, _ = block_gemms(model, strat)
    cols = weights[0::2]
    return sum(gemm_s(grad_gemms(g)[1], hw, strat.dtype, elem_bytes(strat)) for g in cols)


def first_times(model: ModelProfile, hw: HardwareProfile, strat: Strategy) -> PassTimes:
    """Embedding lookup (a gather: memory-bound), its dropout, and the gradient scatter-add:
    forward traffic = embedding output (elem bytes) + mask, per micro-batch; under DTensor
    tensor parallelism the vocab-parallel embedding's host time (``tp_host_s``)."""
    tokens = strat.tokens(model.seq)
    fwd = memory_s(tokens * model.hidden * (elem_bytes(strat) + 1), hw)
    host = tp_host_s(strat, hw.tp_linear_us)  # the vocab-parallel embedding: one row-parallel module
    return PassTimes(forward_s=with_host(host / 3, fwd, hw), recompute_s=0.0,
                     backward_s=with_host(2 * host / 3, 2 * fwd, hw))


def last_times(model: ModelProfile, hw: HardwareProfile, strat: Strategy) -> PassTimes:
    """Final norm, output projection and cross-entropy: the projection GEMM at its shape's
    efficiency plus the fp32 logits written, read by the softmax and written back as
    probabilities (3 x 4 s b V / tp); backward runs the GEMM's two gradients. Under DTensor
    tensor parallelism the vocab-parallel head and loss add the profile's ``tp_loss_us``."""
    tokens = strat.tokens(model.seq)
    flops = tokens * model.head_flops_per_token / strat.mesh.tp
    g = [Gemm(batch=1, m=tokens, n=model.vocab / strat.mesh.tp, k=model.hidden)]
    logits = memory_s(3 * tokens * model.vocab / strat.mesh.tp * 4, hw)
    host = tp_host_s(strat, hw.tp_loss_us)
    return PassTimes(forward_s=with_host(host / 3, _scaled_s(g, flops, hw, strat) + logits, hw), recompute_s=0.0,
                     backward_s=with_host(2 * host / 3, _scaled_s(g, flops, hw, strat, backward=True) + logits, hw))
