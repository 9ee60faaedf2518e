"""Model states on one device: the state layout, ZeRO sharding, offload to the host, and the
parameters of a block, the embedding and the head per device. Sizes in bytes.

Model states per parameter (``STATE_LAYOUTS``, chosen by the execution recipe; weights +
gradients + optimizer):
- ``megatron`` 2 + 4 + 12 = 18: 16-bit weights, fp32 gradients, fp32 master weights and Adam's
  two moments (Korthikanti et al. Fig. 1: 45.56 GiB for the 22B model at TP 8);
- ``zero`` 2 + 2 + 12 = 16: the ZeRO paper's fp16 gradients (Rajbhandari et al., Table 1);
- ``fp32`` 4 + 4 + 8 = 16: fp32 weights are the master weights, plus the two moments; 16-bit
  training computes on 16-bit copies (FSDP2's gathered ``param_dtype`` weights, autocast's
  cast cache: 2 more bytes per parameter while held, ``compute_copy_bytes``).
ZeRO stage 1 shards the optimizer states (master included) over dp, 2 also the gradients,
3 also the weights (``state_bytes`` has the exact rule, including the pipeline's unsharded
accumulation under FSDP2). Tensor parallelism divides all block, embedding (vocab-parallel) and head
parameters by tp; the few norm and bias parameters Megatron replicates (4h of 12h² + 13h per
block) are divided too, an error below 0.1 % for h ≥ 1024. ZeRO shards over dp x cp
(``Strategy.replicas``: the weights are replicated over cp, Megatron's "dp-cp" group).

CPU offload (``Strategy.offload``, FSDP2's ``CPUOffloadPolicy``) keeps ZeRO's shards in host
memory: the weight, gradient and optimizer shards (fp32 master included) leave the device
(``host_state_bytes``); the device keeps the unsharded 16-bit weights between all-gathers under
ZeRO 1/2 (ZeRO 3: only the buffers' two gathered blocks) and the unsharded accumulated
gradients under ZeRO 1 (ZeRO 2: one block's before its reduce-scatter, in the buffers).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models.axes import Degrees
from cost_models.model_profile import ModelProfile
from cost_models.strategy import Strategy

DDP_BUCKET_BYTES = 25e6
"""PyTorch DDP's default gradient bucket size: under ZeRO 1-2 two are live (one reducing, one
filling). Under ZeRO-0 the gradients themselves live in the buckets (Megatron's contiguous
gradient buffer; torch DDP with ``gradient_as_bucket_view``, as autopar's runtime builds it),
so the buckets add nothing to the states."""
DDP_FIRST_BUCKET_BYTES = float(1 << 20)
"""torch DDP's first bucket (``dist._DEFAULT_FIRST_BUCKET_BYTES``): the last parameters' gradients,
the first ready in the backward, reduce early in a bucket of their own."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StateLayout:
    """Bytes per parameter of each part of the training state, before ZeRO sharding."""

    weight: float
    grad: float
    optimizer: float
    """Optimizer states, fp32 master weights included when kept apart from the weights."""
    master_copy: bool
    """The optimizer keeps fp32 master weights apart from the (16-bit) model weights; False:
    the weights are the master (fp32), and 16-bit training computes on gathered or cast
    copies."""


STATE_LAYOUTS = {
    "megatron": StateLayout(weight=2, grad=4, optimizer=12, master_copy=True),
    "zero": StateLayout(weight=2, grad=2, optimizer=12, master_copy=True),
    "fp32": StateLayout(weight=4, grad=4, optimizer=8, master_copy=False),
}


def state_layout(strat: Strategy) -> StateLayout:
    """The recipe's layout; fp32 training keeps ``fp32`` whatever the recipe."""
    return STATE_LAYOUTS["fp32" if strat.dtype == "fp32" else strat.recipe.state]


def compute_copy_bytes(strat: Strategy) -> float:
    """Bytes per parameter of the 16-bit copy a layout whose weights are the fp32 master
    computes on (FSDP2's gathered ``param_dtype`` weights, autocast's cast cache); 0 when the
    weights are used as stored."""
    lay = state_layout(strat)
    elem = 4 if strat.dtype == "fp32" else 2
    return 0.0 if lay.master_copy or lay.weight <= elem else float(elem)


def gather_bytes(strat: Strategy) -> float:
    """Bytes per parameter a ZeRO all-gather moves: the weights in their compute dtype, or 1
    under ``recipe.fp8_all_gather`` (the 16-bit embedding and head priced so too)."""
    if strat.fp8 and strat.recipe.fp8_all_gather:
        return 1.0
    return compute_copy_bytes(strat) or state_layout(strat).weight


def holds_unsharded(strat: Strategy) -> bool:
    """ZeRO-2/3 under a pipeline keep the stage's weights gathered and gradients unsharded
    until the last backward (``ExecutionRecipe.pp_unsharded_accumulation``)."""
    return strat.recipe.pp_unsharded_accumulation and strat.mesh.pp > 1 and strat.zero >= 2 \
        and strat.replicas > 1


@dataclass(frozen=True, kw_only=True, slots=True)
class StateBytes:
    """Model-state bytes on one device."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def grads_sharded(strat: Strategy) -> bool:
    """The gradients live sharded over the replicas (``state_bytes``)."""
    if holds_unsharded(strat):
        return False
    return strat.zero >= 2 or (strat.zero == 1 and strat.num_microbatches == 1 and strat.recipe.fsdp_copies)


def head_gather_bytes(model: ModelProfile, strat: Strategy) -> float:
    """The head's weights gathered under ZeRO-3 at the last stage's peak: the loss comes right
    after their forward and their backward right after it, so every implementation holds them
    gathered then (FSDP2 groups the final norm and the head and keeps them gathered in between,
    ``runtime.parallelize``), bytes. 0 where the weights are not sharded or stay gathered."""
    if strat.zero < 3 or strat.replicas == 1 or holds_unsharded(strat):
        return 0.0
    return last_params(model, strat) * gather_bytes(strat)


def state_bytes(params: float, strat: Strategy) -> StateBytes:
    """Model states of ``params`` parameters (already divided by tp) on one of the
    ``strat.replicas`` (dp x cp) ranks, in device memory (with ``offload``, what stays on the device).

    The weights are sharded by ZeRO-3, or by ZeRO >= 1 where they are the fp32 master; the
    weights computed on are held unsharded under ZeRO 0-2 (and ZeRO-3 when the pipeline keeps
    them gathered): a layout's 16-bit copy, or where FSDP gathers them (ZeRO >= 1 with the
    master sharded, ``reshard_after_forward=False``; FSDP2's ``replicate``, ``fsdp_replicate``)
    a whole copy in the compute dtype, fp32 in fp32 training. The gradients are sharded by
    ZeRO >= 2 unless the pipeline accumulates them unsharded, and by ZeRO-1 on FSDP with one
    micro-batch (its once-per-step reduce-scatter runs in that backward, a block at a time:
    ``fsdp_copies``; Megatron's distributed optimizer keeps its whole gradient buffer), the
    optimizer states by ZeRO >= 1.
    """
    lay, zero, dp = state_layout(strat), strat.zero, strat.replicas
    copy = compute_copy_bytes(strat)
    hold = holds_unsharded(strat)
    master_sharded = not lay.master_copy and zero >= 1
    gathered = master_sharded or fsdp_replicate(strat)
    copy_held = (gather_bytes(strat) if gathered else copy) if (zero < 3 or hold) else 0.0
    if strat.offload:
        return StateBytes(params=(0.0 if zero >= 3 and not hold else params * (copy or lay.weight)),
                          grads=params * lay.grad if zero == 1 or hold else 0.0, optimizer=0.0)
    weight = lay.weight / (dp if zero >= 3 or master_sharded else 1)
    if lay.master_copy and hold:
        weight = lay.weight
    return StateBytes(params=params * (weight + copy_held),
                      grads=params * lay.grad / (dp if grads_sharded(strat) else 1),
                      optimizer=params * lay.optimizer / (dp if zero >= 1 else 1))


def torch_ddp(strat: Strategy) -> bool:
    """The data-parallel wrapper is torch's DDP with the gradients as views of its buckets:
    ZeRO 0 over replicas with tp = pp = ep = 1 in a recipe whose program makes every split
    weight a DTensor and keeps DDP's plain tensors there (``ExecutionRecipe.dtensor_parameters``)."""
    m = strat.mesh
    return (strat.recipe.dtensor_parameters and strat.zero == 0 and strat.replicas > 1
            and m.tp == 1 and m.pp == 1 and m.ep == 1)


def fsdp_replicate(strat: Strategy) -> bool:
    """ZeRO 0 on FSDP2's ``replicate`` (the DTensor recipes where DDP is not run: tp, pp or
    ep > 1): its unshard copies every weight into a new unsharded parameter (a world of one
    gathers by copy, ``FSDPParamGroup.wait_for_unshard``), kept until the backward."""
    return (strat.recipe.dtensor_parameters and strat.zero == 0 and strat.replicas > 1
            and not torch_ddp(strat))


def host_state_bytes(params: float, strat: Strategy) -> float:
    """Bytes of host memory the offloaded shards of ``params`` parameters take on one of
    ``strat.replicas`` (dp x cp) ranks: weight, gradient and optimizer shards (0 without ``offload``)."""
    if not strat.offload:
        return 0.0
    lay = state_layout(strat)
    return params * (lay.weight + lay.grad + lay.optimizer) / strat.replicas


def layer_params(model: ModelProfile, strat: Strategy) -> float:
    """Parameters of one block on one device: the dense part over tp, the routed experts over
    ep x etp (``Strategy.etp``: tp where each expert's GEMMs split like the dense MLP's, 1
    where the recipe replicates the experts over tp)."""
    return dense_layer_params(model, strat) + expert_layer_params(model, strat)


def dense_layer_params(model: ModelProfile, strat: Strategy) -> float:
    """Parameters of one block outside its routed experts on one device (the QKV projection
    whole under multi-query TP: ``whole_qkv_params``; low-rank projections whole under any TP:
    ``ModelProfile.block_tp_whole_params``)."""
    whole = tp_whole_params(model, strat)
    return (model.dense_block_params - whole) / strat.mesh.tp + whole


def tp_whole_params(model: ModelProfile, strat: Strategy) -> float:
    """Parameters of one block that every tp rank holds whole: multi-query TP's QKV
    (``whole_qkv_params``) and latent attention's low-rank projections
    (``ModelProfile.block_tp_whole_params``). 0 without TP."""
    if strat.mesh.tp == 1:
        return 0.0
    return whole_qkv_params(model, strat) + model.block_tp_whole_params


def whole_qkv_params(model: ModelProfile, strat: Strategy) -> float:
    """Parameters of one block's QKV projection that every tp rank holds whole: under
    multi-query attention (one K,V head, which tp does not split) autopar's runtime keeps the
    GEMMs making K and V whole and replicated over tp (``runtime.tp_families``). Priced as a
    QKV packed in one GEMM (Falcon-7B, GPT-BigCode), all of it whole; with K and V
    projections of their own (Gemma 2B) only they are, so this over-counts Q's share (h² of
    h (h + 2d)). 0 otherwise."""
    if strat.mesh.tp == 1 or model.kv_heads != 1 or model.heads == 1:
        return 0.0
    return (model.heads + 2 * model.kv_heads) * (model.hidden / model.heads) * model.hidden


def expert_layer_params(model: ModelProfile, strat: Strategy) -> float:
    """Routed-expert parameters of one block on one device: experts / ep of them, each over etp."""
    return model.expert_params / (strat.etp * strat.mesh.ep)


def expert_strategy(strat: Strategy) -> Strategy:
    """``strat`` as the expert weights see it: their replicas are the edp = dp x cp / ep
    ranks holding the same experts (ZeRO shards and gradients reduce over them)."""
    m = strat.mesh
    if m.ep == 1 and m.cp == 1:
        return strat
    return replace(strat, mesh=Degrees(pp=m.pp, dp=m.edp, tp=m.tp), axis_order=strat.axis_order)


def layer_state_bytes(model: ModelProfile, strat: Strategy) -> StateBytes:
    """Model states of one block on one device: the dense part sharded over dp x cp, the
    routed experts (1/ep of them) over edp."""
    dense = state_bytes(dense_layer_params(model, strat), strat)
    if not model.moe:
        return dense
    e = state_bytes(expert_layer_params(model, strat), expert_strategy(strat))
    return StateBytes(params=dense.params + e.params, grads=dense.grads + e.grads,
                      optimizer=dense.optimizer + e.optimizer)


def layer_host_bytes(model: ModelProfile, strat: Strategy) -> float:
    """``host_state_bytes`` of one block (experts sharded over edp)."""
    return (host_state_bytes(dense_layer_params(model, strat), strat)
            + host_state_bytes(expert_layer_params(model, strat), expert_strategy(strat)))


def first_params(model: ModelProfile, strat: Strategy) -> float:
    """Embedding parameters on one device of the first stage (vocab-parallel over tp)."""
    return model.embed_params / strat.mesh.tp


def last_params(model: ModelProfile, strat: Strategy) -> float:
    """Head parameters on one device of the last stage; a tied projection is the embedding's
    own weight when pp = 1, and a copy (counted) when pp > 1."""
    shared = model.vocab * model.hidden if model.tied and strat.mesh.pp == 1 else 0
    return (model.head_params - shared) / strat.mesh.tp
