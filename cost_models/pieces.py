"""Costs of one piece of a model on one device: a block, the embedding or the head (seconds
and bytes): its compute, tensor-parallel exchanges, the exposed part of its data-parallel
collectives per micro-batch and per step, its optimizer step and FSDP2 hooks, its states.

What overlaps follows the execution recipe (``Strategy.recipe``): with ``dp_overlap`` each
data-parallel collective hides behind the pass it serves and only its excess is exposed
(``piece``); without it (Megatron-LM 2021's local DDP under a pipeline) all of it is. Under
a pipeline, recipes that run FSDP2 through torch.distributed.pipelining keep the stage's
weights gathered and gradients unsharded until the last backward
(``states.holds_unsharded``), which changes both the collectives and the memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models import comm, compute, host, memory, states
from cost_models.hardware import HardwareProfile
from cost_models.model_profile import ModelProfile
from cost_models.strategy import Strategy


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """Costs of one block, the embedding, or the head on one device."""

    compute_s: float
    tp_s: float
    dp_exposed_s: float
    """Per micro-batch, in T_s."""
    dp_tail_s: float
    """Per step, in D_s."""
    optimizer_s: float
    state: states.StateBytes
    act_bytes: float
    host_bytes: float = 0.0
    """Offloaded state in host memory."""
    forward_s: float = 0.0
    """The part of ``time_s`` in the forward pass (compute, its tp exchanges, exposed ZeRO-3
    gathers); the backward takes what forward and recompute leave."""
    recompute_s: float = 0.0
    """The part of ``time_s`` spent recomputing (compute and its tp exchanges)."""

    @property
    def time_s(self) -> float:
        return self.compute_s + self.tp_s + self.dp_exposed_s

    @property
    def tail_s(self) -> float:
        return self.dp_tail_s + self.optimizer_s


def plus(a: Piece, b: Piece, n: float) -> Piece:
    """``a`` and ``n`` copies of ``b`` on one device (time, tails, states, activations)."""
    return Piece(compute_s=a.compute_s + n * b.compute_s, tp_s=a.tp_s + n * b.tp_s,
                  dp_exposed_s=a.dp_exposed_s + n * b.dp_exposed_s, dp_tail_s=a.dp_tail_s + n * b.dp_tail_s,
                  optimizer_s=a.optimizer_s + n * b.optimizer_s,
                  state=states.StateBytes(params=a.state.params + n * b.state.params,
                                          grads=a.state.grads + n * b.state.grads,
                                          optimizer=a.state.optimizer + n * b.state.optimizer),
                  act_bytes=a.act_bytes + n * b.act_bytes, host_bytes=a.host_bytes + n * b.host_bytes,
                  forward_s=a.forward_s + n * b.forward_s, recompute_s=a.recompute_s + n * b.recompute_s)


def optimizer_bytes_per_param(rec: states.StateLayout) -> float:
    """Device-memory traffic of the optimizer step per (sharded) parameter: the gradient-norm
    read and the clipping scale (read, write), Adam (read gradient, states and weights, write
    states and weights), the copy of fp32 master weights into the 16-bit weights, and zeroing
    the gradients. Megatron's bf16 recipe (2 + 4 + 12): 4 + 8 + (4 + 24) + 6 + 4 = 50 bytes."""
    master = 4 + rec.weight if rec.master_copy else 0.0
    states = 2 * rec.optimizer if rec.master_copy else 2 * (rec.optimizer + rec.weight)
    return 5 * rec.grad + states + master


def grad_accum_bytes_per_param(rec: states.StateLayout, strat: Strategy) -> float:
    """Device-memory traffic per parameter and micro-batch of adding the backward's fresh
    gradient into the gradient buffer, unless the weight-gradient GEMMs accumulate in place
    (``grad_accum_fusion``): read the 16-bit gradient, read and write the buffer's element
    (Megatron-LM 2021's local DDP hook ``param.main_grad.add_(param.grad)``, run for every
    parameter in every micro-batch's backward: 2 + 2 + 2 = 6 bytes with 16-bit gradients,
    2 + 4 + 4 = 10 with fp32 ones). ZeRO 2/3 add the reduce-scattered shard into theirs."""
    if strat.recipe.grad_accum_fusion:
        return 0.0
    per = (states.compute_copy_bytes(strat) or rec.weight) + 2 * rec.grad
    return per / strat.replicas if strat.zero >= 2 and not states.holds_unsharded(strat) else per


def fsdp_copy_bytes_per_param(strat: Strategy) -> float:
    """Device-memory traffic per parameter and micro-batch of FSDP's buffer copies, where
    the recipe has them (``ExecutionRecipe.fsdp_copies``): each all-gather copies the
    gathered 16-bit weights out of its flat buffer into the parameters (read and write), each
    reduce-scatter copies the 16-bit gradients into its buffer in the reduce dtype. ZeRO-3
    gathers twice and reduces once per micro-batch (once per micro-batch and per step under a
    pipeline that holds them, ``states.holds_unsharded``); ZeRO-2 reduces per micro-batch and
    gathers per step; ZeRO-1 both per step (spread over the micro-batches here)."""
    if not strat.recipe.fsdp_copies or strat.replicas == 1 or strat.zero == 0:
        return 0.0
    rec = states.state_layout(strat)
    gather = 2 * states.gather_bytes(strat)
    reduce = (states.compute_copy_bytes(strat) or rec.weight) + rec.grad
    m = strat.num_microbatches
    if strat.zero == 3 and not states.holds_unsharded(strat):
        return 2 * gather + reduce
    if strat.zero == 3:
        return gather + reduce / m
    if strat.zero == 2 and not states.holds_unsharded(strat):
        return reduce + gather / m
    return (gather + reduce) / m


def block_piece(model: ModelProfile, passes: compute.PassTimes, tp: compute.PassTimes,
                 hw: HardwareProfile, strat: Strategy, rep: comm.Group) -> Piece:
    """One block: its dense weights replicated over dp x cp (``piece`` over ``rep``), and for
    a mixture of experts its routed experts' weights (1/ep of them per rank) replicated over the
    edp group: their gradient reduction and ZeRO collectives run there, under the same rules,
    hiding behind the same passes (so a block whose two reductions each fit the backward is
    priced as hiding both: optimistic when they share the links), and their optimizer step
    and states count on top."""
    dense = piece(states.dense_layer_params(model, strat), passes, tp,
                   memory.block_act_bytes(model, strat), hw, strat, rep, tensors=model.block_param_tensors)
    if not model.moe:
        return dense
    _, edp = comm.expert_groups(hw, strat)
    none = compute.PassTimes(forward_s=0.0, recompute_s=0.0, backward_s=0.0)
    e = piece(states.expert_layer_params(model, strat), passes, none, 0.0, hw,
               states.expert_strategy(strat), edp)
    return replace(dense, compute_s=dense.compute_s + e.compute_s - passes.total_s,
                   dp_exposed_s=dense.dp_exposed_s + e.dp_exposed_s, dp_tail_s=dense.dp_tail_s + e.dp_tail_s,
                   optimizer_s=dense.optimizer_s + e.optimizer_s,
                   state=states.layer_state_bytes(model, strat),
                   host_bytes=dense.host_bytes + e.host_bytes,
                   forward_s=dense.forward_s + e.forward_s - passes.forward_s)


def dp_hides(strat: Strategy, hw: HardwareProfile) -> bool:
    """Whether data-parallel collectives can hide behind the passes: the recipe's
    ``dp_overlap`` on a device that runs behind its host (CUDA streams). Where the host runs
    the operators (CPU ranks, ``host_overlaps_device`` false) only DDP's bucketed all-reduce
    (ZeRO 0 with tp = pp = ep = 1: the autopar runtime's DDP) runs beside the backward, on
    gloo's own thread; FSDP2's all-gathers and reduce-scatters (ZeRO 1-3, and its
    ``replicate`` under tp, pp or ep) are synchronous there (torch 2.13: no streams on CPU,
    ``unshard_async_op`` false), the host waits for each."""
    if not strat.dp_overlap:
        return False
    return hw.host_overlaps_device or runs_ddp(strat)


def runs_ddp(strat: Strategy) -> bool:
    """Whether the autopar runtime runs ``strat``'s data parallelism on DDP (plain tensors,
    bucketed all-reduce): ZeRO 0 over whole models (tp = pp = ep = 1)."""
    return strat.zero == 0 and strat.mesh.tp == 1 and strat.mesh.pp == 1 and strat.mesh.ep == 1


def ddp_exposed_s(pieces: list[tuple[float, float]], rep: comm.Group, hw: HardwareProfile) -> float:
    """Seconds torch DDP's gradient all-reduce adds to the last micro-batch's backward (the
    earlier ones run under ``no_sync``): ``pieces`` are (gradient bytes, backward seconds) in
    backward order (head, blocks from the last, embedding). DDP fills its buckets in that order
    (the first ``DDP_FIRST_BUCKET_BYTES``, then ``DDP_BUCKET_BYTES`` each), a piece's gradients
    ready when its backward ends; each bucket's all-reduce starts once it is full and the one
    before it is done (one stream, one gloo thread). What runs past the backward is exposed,
    and ``hw.overlap_penalty`` of what runs beside it (``comm.exposed_s``): on CPU ranks, whose
    gloo thread takes the cores the backward runs on, 1, every bucket's time. A model of a
    bucket or two reduces almost all of it after the backward; a large one hides all but its
    last bucket where the penalty is 0."""
    full_s = comm.best_all_reduce_s(states.DDP_BUCKET_BYTES, rep)
    clock, end, filled, cap, busy = 0.0, 0.0, 0.0, states.DDP_FIRST_BUCKET_BYTES, 0.0
    for nbytes, seconds in pieces:
        clock += seconds
        take = min(nbytes, cap - filled)
        filled += take
        if filled < cap:
            continue
        one = comm.best_all_reduce_s(filled, rep)
        whole, filled = divmod(nbytes - take, states.DDP_BUCKET_BYTES)
        end = max(end, clock) + one + whole * full_s
        busy += one + whole * full_s
        cap = states.DDP_BUCKET_BYTES
    if filled > 0:
        one = comm.best_all_reduce_s(filled, rep)
        end = max(end, clock) + one
        busy += one
    tail = max(0.0, end - clock)
    return tail + hw.overlap_penalty * max(0.0, busy - tail)


def optimizer_host_s(tensors: int, hw: HardwareProfile, strat: Strategy) -> float:
    """Host time of the optimizer step of ``tensors`` parameter tensors, s: each tensor's
    operators (``optimizer_tensor_us``), and what DTensor parameters add to them
    (``dtensor_optimizer_us``; ``ExecutionRecipe.dtensor_parameters``: under FSDP2 or tp; not
    under DDP or on one device)."""
    split = strat.mesh.tp > 1 or (strat.replicas > 1 and not runs_ddp(strat)) or strat.mesh.ep > 1
    dtensor = hw.dtensor_optimizer_us if strat.recipe.dtensor_parameters and split else 0.0
    return tensors * (hw.optimizer_tensor_us + dtensor) * 1e-6


def hooks_s(hw: HardwareProfile, strat: Strategy) -> float:
    """Host time of FSDP2's hooks around one parameter group's passes per micro-batch, s:
    where the autopar runtime wraps pieces in FSDP2 groups (data parallel, not on DDP) and the
    host runs the operators (on CUDA the hooks run while the device works)."""
    if hw.host_overlaps_device or strat.replicas == 1 or runs_ddp(strat):
        return 0.0
    return hw.fsdp_hook_us * 1e-6


def piece(params: float, passes: compute.PassTimes, tp: compute.PassTimes, act: float,
           hw: HardwareProfile, strat: Strategy, rep: comm.Group, *,
           reduced_last: bool = False, tensors: int = 0) -> Piece:
    """Costs of one block (or the embedding/head) holding ``params`` parameters per device.

    ZeRO 2/3 collectives run every micro-batch; with ``dp_overlap`` each hides behind the
    pass it serves (prefetched all-gathers behind the forward, reduce-scatters behind the
    backward), exposing only what is longer than that pass. The once-per-step reduction
    (ZeRO 0 all-reduce, ZeRO 1 reduce-scatter) hides behind the last micro-batch's backward
    of the same piece unless ``reduced_last`` (the embedding's gradient is the last to be
    ready); the all-gather of updated weights (ZeRO 1/2) behind the next forward. Every
    data-parallel collective runs over ``rep``, the dp x cp group (``comm.replica_group``);
    where nothing can hide them, ``dp_hides``. The optimizer step of its ``tensors`` parameter
    tensors adds their host time (``optimizer_host_s``), and each micro-batch
    the hooks of its FSDP2 group (``hooks_s``, a third of them in the forward).
    """
    rec = states.state_layout(strat)
    grads, weights = params * rec.grad, params * states.gather_bytes(strat)
    rs, ag = comm.reduce_scatter_s(grads, rep), comm.all_gather_s(weights, rep)
    fwd, bwd = passes.forward_s, passes.recompute_s + passes.backward_s
    if not dp_hides(strat, hw):
        fwd = bwd = 0.0
    bwd_window = 0.0 if reduced_last else bwd
    hide = lambda comm_s, window_s: comm.exposed_s(comm_s, window_s, hw)  # noqa: E731
    exposed, tail, exposed_fwd = 0.0, 0.0, 0.0
    if strat.zero == 0:
        tail = hide(comm.best_all_reduce_s(grads, rep), bwd_window)
    elif strat.zero == 1:
        tail = hide(rs, bwd_window) + hide(ag, fwd)
    elif states.holds_unsharded(strat):
        # Gathered weights and unsharded gradients through the pipeline: one reduce-scatter
        # per step; ZeRO-3 re-gathers once per micro-batch (the forward reshards, the
        # backward does not), ZeRO-2 once after the step.
        tail = hide(rs, bwd_window)
        if strat.zero == 2:
            tail += hide(ag, fwd)
        else:
            exposed = hide(ag, bwd)
    elif strat.zero == 2:
        exposed, tail = hide(rs, bwd), hide(ag, fwd)
    else:
        exposed_fwd = hide(ag, fwd)
        exposed = exposed_fwd + hide(ag + rs, bwd)
    sharded = params / (strat.replicas if strat.zero >= 1 else 1)
    if strat.offload:
        opt = compute.host_optimizer_s(sharded * optimizer_bytes_per_param(rec), hw)
        up = compute.host_copy_s(sharded * rec.weight, hw)
        down = compute.host_copy_s(sharded * rec.grad, hw)
        if strat.zero >= 3:
            exposed += 2 * up
            exposed_fwd += up
        else:
            tail += up
        if strat.zero >= 2:
            exposed += down
        else:
            tail += down
    else:
        opt = host.with_host(optimizer_host_s(tensors, hw, strat),
                                compute.optimizer_memory_s(sharded * optimizer_bytes_per_param(rec), hw,
                                                           strat.recipe.fused_optimizer), hw)
    accum = compute.memory_s(params * (grad_accum_bytes_per_param(rec, strat)
                                       + fsdp_copy_bytes_per_param(strat)), hw)
    hooks = hooks_s(hw, strat) if params > 0 else 0.0
    return Piece(compute_s=passes.total_s + accum + hooks, tp_s=tp.total_s, dp_exposed_s=exposed, dp_tail_s=tail,
                  optimizer_s=opt,
                  state=states.state_bytes(params, strat), act_bytes=act,
                  host_bytes=states.host_state_bytes(params, strat),
                  forward_s=passes.forward_s + tp.forward_s + exposed_fwd + hooks / 3,
                  recompute_s=passes.recompute_s + tp.recompute_s)
