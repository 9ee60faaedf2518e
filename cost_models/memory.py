"""Bytes on one device: model states (precision recipe, ZeRO sharding), activations, buffers.

Model states per parameter (``RECIPES``; weights + gradients + optimizer):
- ``megatron`` 2 + 4 + 12 = 18: 16-bit weights, fp32 gradients, fp32 master weights and Adam's
  two moments (Korthikanti et al. Fig. 1: 45.56 GiB for the 22B model at TP 8);
- ``zero`` 2 + 2 + 12 = 16: the ZeRO paper's fp16 gradients (Rajbhandari et al., Table 1);
- ``fp32`` 4 + 4 + 8 = 16: fp32 weights are the master weights, plus the two moments.
ZeRO stage 1 shards the optimizer states (master included) over dp, 2 also the gradients,
3 also the weights. Tensor parallelism divides all block, embedding (vocab-parallel) and head
parameters by tp; the few norm and bias parameters Megatron replicates (4h of 12h² + 13h per
block) are divided too, an error below 0.1 % for h ≥ 1024.

CPU offload (``Strategy.offload``, FSDP2's ``CPUOffloadPolicy``) keeps ZeRO's shards in host
memory: the weight, gradient and optimizer shards (fp32 master included) leave the device
(``host_state_bytes``); the device keeps the unsharded 16-bit weights between all-gathers under
ZeRO 1/2 (ZeRO 3: only the buffers' two gathered blocks) and the unsharded accumulated
gradients under ZeRO 1 (ZeRO 2: one block's before its reduce-scatter, in the buffers).

Activations follow Korthikanti et al. Table 2 from the ModelProfile's three per-token fields
(16-bit activations, 1-byte masks; doubled for fp32 training). Sizes in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.hardware import HardwareProfile
from cost_models.model_profile import ModelProfile
from cost_models.strategy import Strategy

DDP_BUCKET_BYTES = 25e6
"""PyTorch DDP's default gradient bucket; two are live (one reducing, one filling)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    """Bytes per parameter of each part of the training state, before ZeRO sharding."""

    weight: float
    grad: float
    optimizer: float
    """Optimizer states, fp32 master weights included when kept apart from the weights."""
    master_copy: bool
    """The optimizer keeps fp32 master weights apart from the (16-bit) model weights."""


RECIPES = {
    "megatron": Recipe(weight=2, grad=4, optimizer=12, master_copy=True),
    "zero": Recipe(weight=2, grad=2, optimizer=12, master_copy=True),
    "fp32": Recipe(weight=4, grad=4, optimizer=8, master_copy=False),
}


def recipe(strat: Strategy) -> Recipe:
    """The strategy's recipe; ``auto`` picks fp32 for fp32 training, else megatron."""
    if strat.precision != "auto":
        return RECIPES[strat.precision]
    return RECIPES["fp32" if strat.dtype == "fp32" else "megatron"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StateBytes:
    """Model-state bytes on one device."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def state_bytes(params: float, rec: Recipe, zero: int, dp: int,
                offload: bool = False) -> StateBytes:
    """Model states of ``params`` parameters (already divided by tp) on one of ``dp`` ranks,
    in device memory (with ``offload``, what stays on the device)."""
    if offload:
        return StateBytes(params=0.0 if zero >= 3 else params * rec.weight,
                          grads=params * rec.grad if zero == 1 else 0.0, optimizer=0.0)
    return StateBytes(params=params * rec.weight / (dp if zero >= 3 else 1),
                      grads=params * rec.grad / (dp if zero >= 2 else 1),
                      optimizer=params * rec.optimizer / (dp if zero >= 1 else 1))


def host_state_bytes(params: float, rec: Recipe, zero: int, dp: int, offload: bool) -> float:
    """Bytes of host memory the offloaded shards of ``params`` parameters take on one of ``dp``
    ranks: weight, gradient and optimizer shards (0 without ``offload``)."""
    if not offload:
        return 0.0
    return params * (rec.weight + rec.grad + rec.optimizer) / dp


def layer_params(model: ModelProfile, strat: Strategy) -> float:
    """Parameters of one block on one device."""
    return model.block_params / strat.tp


def first_params(model: ModelProfile, strat: Strategy) -> float:
    """Embedding parameters on one device of the first stage (vocab-parallel over tp)."""
    return model.embed_params / strat.tp


def last_params(model: ModelProfile, strat: Strategy) -> float:
    """Head parameters on one device of the last stage; a tied projection is the embedding's
    own weight when pp = 1, and a copy (counted) when pp > 1."""
    shared = model.vocab * model.hidden if model.tied and strat.pp == 1 else 0
    return (model.head_params - shared) / strat.tp


def act_scale(strat: Strategy) -> float:
    """Activation bytes relative to the profile's 16-bit figures."""
    return 2.0 if strat.dtype == "fp32" else 1.0


def block_act_bytes(model: ModelProfile, strat: Strategy, recompute: str | None = None) -> float:
    """Bytes one block keeps for backward per micro-batch (Korthikanti et al. Table 2).

    none: s b (repl / (tp if SP else 1) + sharded / tp + attn / tp); selective: without attn;
    full: the block input only, 2 s b h (/ tp with SP).
    """
    recompute = recompute or strat.recompute
    tokens = strat.micro_batch * model.seq
    sp = strat.tp if strat.sequence_parallel else 1
    if recompute == "full":
        return act_scale(strat) * tokens * 2 * model.hidden / sp
    per_token = (model.block_act_bytes_replicated_per_token / sp
                 + model.block_act_bytes_sharded_per_token / strat.tp)
    if recompute == "none":
        per_token += model.block_act_bytes_attn_per_token / strat.tp
    return act_scale(strat) * tokens * per_token


def block_attn_act_bytes(model: ModelProfile, strat: Strategy) -> float:
    """The attention-core part of ``block_act_bytes`` (what selective recompute drops)."""
    tokens = strat.micro_batch * model.seq
    return act_scale(strat) * tokens * model.block_act_bytes_attn_per_token / strat.tp


def first_act_bytes(model: ModelProfile, strat: Strategy) -> float:
    """Embedding: the 1-byte dropout mask of its output, s b h (/ tp with SP)."""
    sp = strat.tp if strat.sequence_parallel else 1
    return strat.micro_batch * model.seq * model.hidden / sp


def last_act_bytes(model: ModelProfile, strat: Strategy) -> float:
    """Head: inputs of the final norm and of the projection, 4 s b h (/ tp with SP), and the
    logits kept in fp32 for the loss, 4 s b V / tp (Korthikanti et al. Sec. 4.3)."""
    tokens = strat.micro_batch * model.seq
    sp = strat.tp if strat.sequence_parallel else 1
    return act_scale(strat) * tokens * 4 * model.hidden / sp + tokens * 4 * model.vocab / strat.tp


def base_buffer_bytes(model: ModelProfile, hw: HardwareProfile, strat: Strategy) -> float:
    """Bytes every device needs besides states, saved activations and recompute workspace:

    - hw.reserve_gib (CUDA context, allocator fragmentation);
    - data-parallel buffers: two 25 MB DDP buckets (ZeRO 0-2, dp > 1), or for ZeRO-3 the
      unsharded weights of two blocks (current and prefetched) and the unsharded gradients of
      one block before its reduce-scatter;
    - with offload under ZeRO 2, the unsharded gradients of one block before their
      reduce-scatter and copy to the host.
    """
    rec = recipe(strat)
    total = hw.reserve_gib * 2**30
    if strat.dp > 1:
        if strat.zero >= 3:
            total += layer_params(model, strat) * (2 * rec.weight + rec.grad)
        else:
            total += 2 * DDP_BUCKET_BYTES
            if strat.offload and strat.zero == 2:
                total += layer_params(model, strat) * rec.grad
    return total


def workspace_bytes(model: ModelProfile, strat: Strategy, recompute: str | None = None) -> float:
    """Recompute workspace: full recompute rebuilds one block's activations of one
    micro-batch during its backward; selective rebuilds one block's attention core."""
    recompute = recompute or strat.recompute
    if recompute == "full":
        return block_act_bytes(model, strat, "none")
    if recompute == "selective":
        return block_attn_act_bytes(model, strat)
    return 0.0


def buffer_bytes(model: ModelProfile, hw: HardwareProfile, strat: Strategy) -> float:
    """``base_buffer_bytes`` plus the workspace of the strategy's recompute mode."""
    return base_buffer_bytes(model, hw, strat) + workspace_bytes(model, strat)
