"""Context parallelism (CP): every sequence split over the cp ranks, attention over all-gathered
keys and values (the scheme of Llama 3's long-context training, Dubey et al. 2024 Sec. 3.3.2,
and of torchtitan's ``context_parallel_rotate_method = "allgather"``).

Why not torch's own. ``torch.distributed.tensor.experimental.context_parallel`` (torch 2.13)
patches SDPA's CUDA kernels only (``aten._scaled_dot_product_{flash,efficient,cudnn}_attention``):
on CPU SDPA runs ``_scaled_dot_product_flash_attention_for_cpu``, and the patched call fails
with "Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a
sharding strategy registered" (tried on gloo with 2 ranks), so nothing of it could be proved
against one process here. It also works by swapping a module-level SDPA for the duration of a
context. This module is the all-gather-KV fallback, on stock parts: an autograd-aware
all-gather (``_functional_collectives.all_gather_single_autograd``: all-gather forward,
reduce-scatter backward) and SDPA.

Layout (causal load balancing, ``zigzag_positions``): a sequence of s tokens is cut into 2c
chunks of s / 2c (c = cp); cp rank r holds chunks r and 2c-1-r, so every rank's queries see
the same number of keys under the causal mask. Embeddings, norms, MLPs and the head act on a
rank's s / c tokens; learned positions and RoPE read the tokens' global positions
(``Embedding.positions``, ``Attention.positions`` of ``autopar.model``: plain attributes, not
buffers, which DDP would overwrite with rank 0's).

Attention (``AllGatherKVAttention``, in place of each block's ``CoreAttention``): the local K and
V ([b, kv heads, s/c, d], tp-local heads under TP) are all-gathered over the cp group in one
collective, put back in sequence order, and each local chunk of queries attends to the prefix
of keys up to its own end under a lower-right causal mask (``causal_lower_right``): chunk g
sees (g + 1) s / 2c keys, no masked-out block is computed. In the backward the reduce-scatter
sums every rank's dK, dV into the owner's.

Memory: the gathered K and V (s tokens, not s / c) are not kept for the backward. A block that
does not recompute runs its attention core as selective recompute does (``build_program``
maps none to selective under cp > 1): the core keeps its local q, k, v and in the backward
gathers K, V again and recomputes its forward before its backward (SDPA keeps no log-sum-exp
that a backward-only pass could reuse). So every block's saved activations fall as 1 / c; the
cost model prices the extra all-gather and core forward (the ``autopar`` recipe's
``cp_recomputes_attention``).

Loss and gradients: each rank's loss is the mean over its tokens (all ranks hold equally many),
so the global-batch mean is the mean over dp x cp ranks; weights are replicated over cp, and
their gradients reduce (mean) over the flattened dp x cp mesh by FSDP2 or DDP, as in
torchtitan and Megatron-Core (``ParallelContext.replica_mesh``, ``runtime.parallelize``).

Scope: the built-in ``gpt``/``llama`` models, alone or with TP (and SP) and DP/ZeRO; not with
pipelining, not HF or user modules (``autopar.layout.context_parallel_unsupported`` says why,
before launch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from autopar.model import Attention, CoreAttention, Embedding


def zigzag_positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions (int64 [seq / cp], ascending) of cp rank ``rank``'s tokens: chunks
    ``rank`` and ``2 cp - 1 - rank`` of the 2 cp equal chunks of a sequence of ``seq`` tokens."""
    if cp < 1 or not 0 <= rank < cp or seq % (2 * cp):
        raise ValueError(f"context parallelism cuts a sequence into 2 x cp chunks: seq={seq} must be a multiple "
                         f"of {2 * cp} (cp={cp}, rank={rank})")
    chunk = seq // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def shard_sequence(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """The tokens of ``t`` (sequence along ``dim``) that cp rank ``rank`` holds."""
    return t.index_select(dim, zigzag_positions(t.shape[dim], cp, rank).to(t.device))


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every cp rank's shard (``shards[r]`` of rank r), in order."""
    cp = len(shards)
    seq = cp * shards[0].shape[dim]
    gathered = torch.cat(shards, dim)
    order = torch.cat([zigzag_positions(seq, cp, r) for r in range(cp)])
    return gathered.index_select(dim, torch.argsort(order).to(gathered.device))


def zigzag_mask(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Which keys (in sequence order) each of rank ``rank``'s queries attends to under the
    causal mask of the global positions: bool [seq / cp, seq]."""
    q = zigzag_positions(seq, cp, rank)
    return torch.arange(seq)[None, :] <= q[:, None]


def zigzag_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Causal attention of rank ``rank``'s queries q [b, heads, s/cp, d] over the whole
    sequence's k, v [b, kv heads, s, d] (sequence order): each of its two chunks against the
    keys up to its end, lower-right causal. Returns [b, heads, s/cp, d]."""
    seq = k.shape[2]
    chunk = seq // (2 * cp)
    gqa = k.shape[1] != q.shape[1]
    out = []
    for i, g in enumerate((rank, 2 * cp - 1 - rank)):
        end = (g + 1) * chunk
        qi = q[:, :, i * chunk:(i + 1) * chunk]
        out.append(F.scaled_dot_product_attention(qi, k[:, :, :end], v[:, :, :end],
                                                  attn_mask=causal_lower_right(chunk, end), enable_gqa=gqa))
    return torch.cat(out, dim=2)


class AllGatherKVAttention(CoreAttention):
    """``CoreAttention`` over a cp group: gathers K and V (autograd-aware), then
    ``zigzag_attention``. A ``CoreAttention`` still, so selective recompute re-runs it (and its
    all-gather) in the backward. No parameters: state dicts are unchanged."""

    def __init__(self, group: dist.ProcessGroup, cp: int, rank: int, seq: int, device: torch.device) -> None:
        super().__init__()
        self.group, self.cp, self.rank = group, cp, rank
        order = torch.cat([zigzag_positions(seq, cp, r) for r in range(cp)])
        self.to_sequence_order = torch.argsort(order).to(device)
        """Gathered (rank-major) index of each position. Not a buffer: DDP broadcasts those."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = torch.stack((k, v)).movedim(3, 0).contiguous()  # [s/cp, 2, b, kv heads, d]
        kv = funcol.all_gather_single_autograd(kv, 0, self.group)  # rank-major: [s, 2, b, kv heads, d]
        kv = kv.index_select(0, self.to_sequence_order).movedim(0, 3)  # [2, b, kv heads, s, d]
        return zigzag_attention(q, kv[0], kv[1], self.cp, self.rank)


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup, cp: int, rank: int, seq: int) -> None:
    """Make ``model`` (a built-in model stage) train on cp rank ``rank``'s tokens of sequences
    of ``seq`` tokens, in place: global positions for learned positions and RoPE, and every
    attention core replaced by ``AllGatherKVAttention`` over ``group``. Before recompute wraps
    the cores."""
    device = next(model.parameters()).device
    positions = zigzag_positions(seq, cp, rank).to(device)
    for module in list(model.modules()):
        if isinstance(module, Embedding):
            module.positions = positions
        elif isinstance(module, Attention):
            module.positions = positions
            module.core = AllGatherKVAttention(group, cp, rank, seq, device)
