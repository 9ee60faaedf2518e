"""A model's layout as the runtime shards it: its blocks, embedding, head and each block's
column/row GEMMs, packed projections and norms, by module name. Read off the trace
(``autopar.trace.anatomy``), recorded in the Plan, read by the runtime. Pure data: no torch.

A decoder-only LM is: parameterised modules before the first block (the vocabulary embedding,
learned positions), a stack of identical blocks (after a few leading blocks of another kind:
DeepSeek-V3's dense ones, ``Anatomy.lead``), a final norm and the output head. Inside a
block, the tracer labels every weight GEMM ``column`` (reads the replicated input, writes a
sharded output) or ``row`` (reads the sharded activation, all-reduces its output) — Megatron's
split — or ``replicate`` (a low-rank projection whose output a norm hands to a column GEMM:
DeepSeek's latent attention, kept whole), and the modules whose parameters are all 1-D are the
norms. A mixture-of-experts block also has a router (a GEMM whose outputs are the experts: kept
replicated) and a module holding every expert's weights stacked in their leading dim (HF
transformers 5's ``*Experts``), which expert parallelism shards by experts
(``autopar.runtime.experts``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Anatomy:
    """Module names (fully qualified in the whole model, or relative to a block)."""

    blocks: tuple[str, ...]
    """The repeated blocks, in order (the leading ones of another kind first: ``lead``)."""
    container: str
    """The ModuleList/ModuleDict holding them."""
    embed: str
    """The vocabulary embedding (first stage)."""
    first_extra: tuple[str, ...]
    """Other parameterised modules before the blocks: learned positions, an embedding norm
    (Bloom), an embedding projection (OPT's ``project_in``)."""
    final_norm: str
    """The norm between the last block and the head ("" if none)."""
    head: str
    """The output projection to the vocabulary (last stage)."""
    column: tuple[str, ...]
    """Column-parallel GEMMs of a block, relative to it."""
    row: tuple[str, ...]
    """Row-parallel GEMMs of a block, relative to it."""
    packed: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """(column GEMM, widths of its projections) of each GEMM whose output the block cuts into
    consecutive projections (GPT-2's fused Q/K/V: ``("attn.c_attn", (768, 768, 768))``; Phi-3's
    GQA ``qkv_proj``: q, k and v widths)."""
    norms: tuple[str, ...]
    """Norms of a block on its hidden width, relative to it."""
    post_norms: tuple[str, ...] = ()
    """Those of ``norms`` applied to a row-parallel GEMM's output before the residual add
    (Gemma-2's sandwich norms), not feeding a sub-layer."""
    experts: tuple[str, ...] = ()
    """Modules of a block holding stacked expert weights ([experts, ...] parameters), relative
    to it; empty for a dense model."""
    routers: tuple[str, ...] = ()
    """The MoE routers (gates) of a block, relative to it: replicated, never split."""
    head_norms: tuple[str, ...] = ()
    """Norms of one attention head's width applied to each head of a column GEMM's output
    (Qwen3's and Gemma 3's q/k norms), relative to the block: under TP each rank norms its own
    heads, and their weight's gradient sums over the tp ranks."""
    width_norms: tuple[str, ...] = ()
    """Norms over the whole output of a column GEMM (OLMo 2's q/k norms, across every head),
    relative to the block: under TP each rank holds a shard of the normed width, so the
    statistic is reduced over the tp ranks (a DTensor sharded on the last dimension)."""
    replicated: tuple[str, ...] = ()
    """Low-rank GEMMs of a block, relative to it, that tensor parallelism keeps whole on every
    rank (DeepSeek's ``q_a_proj``, ``kv_a_proj_with_mqa``: a norm hands their output to a
    column GEMM); their weights' gradients are whole on each rank."""
    partial_outputs: tuple[tuple[str, tuple[int, int]], ...] = ()
    """(GEMM of ``replicated``, its output columns [start, end)) that every query head reads
    (DeepSeek's RoPE key): each tp rank's heads give a partial sum of their gradient, summed
    over the ranks in the backward."""
    inner_norms: tuple[str, ...] = ()
    """Norms of a low-rank GEMM's output (DeepSeek's ``q_a_layernorm``), relative to the block:
    whole on every rank, no sequence shards."""
    lead: Anatomy | None = None
    """The leading blocks of another kind (DeepSeek-V3's, GLM-4.5's dense blocks before their
    mixture-of-experts ones): their names (``lead.blocks``, the first of ``blocks``) and their
    GEMMs, norms and experts relative to them; None where every block is of one kind."""

    def kind(self, block: str) -> Anatomy:
        """The anatomy of ``block``'s kind: whose column/row GEMMs, norms, experts it has."""
        return self.lead if self.lead is not None and block in self.lead.blocks else self

    def kinds(self) -> tuple[Anatomy, ...]:
        """Every block kind's anatomy, the leading one first."""
        return (self.lead, self) if self.lead is not None else (self,)

    def any_experts(self) -> bool:
        """Whether any block kind holds stacked experts (a mixture-of-experts model)."""
        return any(k.experts for k in self.kinds())


def tp_splits_heads(heads: int, kv_heads: int, tp: int) -> bool:
    """Whether autopar's runtime splits a model's attention over ``tp`` ranks: tp divides the
    query heads and the K,V heads, or there is one K,V head (multi-query attention), kept whole
    on every rank (``runtime.tp_families.replicate_single_kv``)."""
    return heads % tp == 0 and (kv_heads % tp == 0 or kv_heads == 1)


def expert_parallel_unsupported(*, ep: int, dp: int, sequence_parallel: bool, moe: bool,
                                experts: int = 0, user_module: bool = False) -> str | None:
    """Why autopar's runtime cannot run a model (``moe``: it has MoE blocks, of ``experts``
    experts each, 0 if not known yet) with expert-parallel degree ``ep``, or None. Pure data
    (the planner may call it). What is refused has no parity proof yet: expert parallelism
    regroups the dp ranks (ep divides dp) and shards whole experts (ep divides their number);
    under sequence parallelism MoE layers run on each tp rank's own tokens (``runtime.parallelize``),
    not yet beside expert parallelism; and expert parallelism is proved on HF/``moe:`` models
    only (``tests/test_runtime_ep.py``). Pipelining composes
    with it under every schedule: an ep group's ranks regroup dp, so they share a pipeline
    stage and run the same micro-batches in the same order, and the all-to-alls pair up."""
    if moe and sequence_parallel and ep > 1:
        return (f"sequence parallelism with expert parallelism (ep={ep}) is not proved in autopar's runtime yet; "
                "use --no-sp or ep = 1")
    if ep == 1:
        return None
    if not moe:
        return f"ep={ep} shards the experts of mixture-of-experts layers, and this model has none; use ep = 1"
    if ep < 1 or dp % ep:
        return f"ep={ep} must divide dp={dp} (the expert layers regroup the dp ranks into ep x dp/ep)"
    if experts and experts % ep:
        return f"ep={ep} must divide the {experts} experts of each layer"
    if user_module:
        return f"expert parallelism (ep={ep}) runs HF transformers and moe: models, not a module of your own; use ep = 1"
    return None


def context_parallel_unsupported(*, builtin: bool, cp: int, pp: int, seq: int, tp: int, sequence_parallel: bool) -> str | None:
    """Why autopar's runtime cannot run context parallelism of degree ``cp`` (``builtin``: the
    model is a built-in gpt/llama, whose attention ``runtime.context_parallel`` replaces), or
    None. Pure data (plan files and the planner call it)."""
    if cp == 1:
        return None
    if not builtin:
        return (f"context parallelism (cp={cp}) runs on the built-in gpt/llama models only (their attention "
                "is autopar's); use cp = 1 for this model")
    if pp > 1:
        return f"context parallelism (cp={cp}) does not compose with pipelining (pp={pp}) in this runtime yet; " \
               "use pp = 1 or cp = 1"
    if seq % (2 * cp):
        return f"cp={cp} needs a sequence length that is a multiple of 2 x cp = {2 * cp}, got {seq}"
    if sequence_parallel and (seq // cp) % tp:
        return f"sequence parallelism cuts a cp rank's {seq // cp} tokens over tp={tp}: they must divide"
    return None
