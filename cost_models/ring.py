"""What context parallelism adds to one block's attention core on one rank: the K,V heads the
ranks exchange (``cp_heads``; the exchange's time is ``cost_models.blockcomm.block_cp_s``) and
the element-wise bytes of the ring programs' merges (``cp_merge_bytes``; priced with the core
in ``cost_models.compute``)."""

from __future__ import annotations

from cost_models.model_profile import ModelProfile
from cost_models.recipe import ContextParallel
from cost_models.strategy import Strategy


def cp_heads(model: ModelProfile, strat: Strategy) -> float:
    """K (or V) heads per token one tp rank exchanges under context parallelism: the query
    heads where the program repeats K, V before attention (``recipe.kv_repeated``), else the
    kv heads."""
    return (model.heads if strat.recipe.kv_repeated else model.kv_heads) / strat.mesh.tp


def cp_merge_bytes(model: ModelProfile, strat: Strategy) -> tuple[float, float]:
    """(forward, backward) element-wise bytes of one block's attention core that context
    parallelism adds on one rank (c = cp kernels per pass; 0 without it or under
    ``ContextParallel.ALL_GATHER``), per element of the rank's output O (tokens x heads/tp x
    d) and of its K (as of V; tokens x ``cp_heads`` x d), as fused kernels move them, times
    ``recipe.elementwise_traffic``.

    Transformer Engine's ring (``ContextParallel.RING``: ``AttnFuncWithCPAndKVP2P``,
    transformer_engine/pytorch/attention.py at v1.8, sbhd/bshd layouts, everything in the
    activations' 16-bit dtype), averaged over the ranks (a rank r runs r of the c - 1 later
    kernels on its whole Q and half the peer's K, V, the rest on half its Q and the whole K,
    V), with r = c - 1:

    - forward: the output zeroed (2 B) and corrected once per kernel (read it and the
      kernel's, write: 6 B; 3 on a half-Q step): 8 + 5.5 r per O with the half-Q copies; K, V
      concatenated into the send buffer once (4 B each) and half copied out on the half-K,V
      steps (r per K);
    - backward: dQ set by the first kernel (4 B) and accumulated after each later one (6 B, 3
      on half), Q, O and dO halves copied for the half-Q kernels: 4 + 7.5 r per O; K, V into
      the buffer (4), their halves copied (r), dK, dV concatenated after each kernel (4, 2 on
      half) and accumulated (4, then 6, 3 on half): 12 + 8.5 r per K.

    torch's (``ContextParallel.GATHER_RING``), counted from
    ``_templated_ring_attention``/``_backward``:

    - forward: each kernel's output cast to fp32 (6 B), c - 1 merges into the running fp32
      output (read it and the kernel's, write it: 10 B), the result cast back (6 B) per O;
      K and V concatenated for the exchange before each of the c - 1 later kernels (4 B each);
    - backward: dQ accumulated in fp32 after each kernel (read, read the kernel's 16-bit
      gradient, write: 10 B) and cast back (6 B) per O; dK and dV each accumulated (10 B),
      concatenated for the exchange (8 B) after every kernel and cast back once (6 B), K, V
      concatenated again (4 B each) before the c - 1 later kernels."""
    c, method = strat.mesh.cp, strat.recipe.context_parallel
    if c == 1 or method not in (ContextParallel.GATHER_RING, ContextParallel.RING):
        return 0.0, 0.0
    d = model.hidden / model.heads
    tokens = strat.tokens(model.seq) * strat.recipe.elementwise_traffic
    o = tokens * model.heads / strat.mesh.tp * d
    kv = tokens * cp_heads(model, strat) * d
    if method == ContextParallel.RING:
        r = c - 1
        return o * (8 + 5.5 * r) + 2 * kv * (4 + r), o * (4 + 7.5 * r) + 2 * kv * (12 + 8.5 * r)
    fwd = o * (6 * c + 10 * (c - 1) + 6) + 2 * kv * 4 * (c - 1)
    bwd = o * (10 * c + 6) + 2 * kv * (18 * c + 6 + 4 * (c - 1))
    return fwd, bwd
