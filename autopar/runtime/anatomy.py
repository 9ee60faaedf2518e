"""What the runtime needs to know of a model, read off the tracer's ModelGraph (no layer-name lists).

A decoder-only LM is: parameterised modules before the first block (the vocabulary embedding,
learned positions), a stack of identical blocks, a final norm and the output head. Inside a
block, the tracer labels every weight GEMM ``column`` (reads the replicated input, writes a
sharded output) or ``row`` (reads the sharded activation, all-reduces its output) — Megatron's
split — and the modules whose parameters are all 1-D are the norms, which sequence parallelism
runs on sequence shards (blocks are pre-norm: each norm feeds a sub-layer, not the residual).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from autopar.trace import ModelGraph


@dataclass(frozen=True, kw_only=True, slots=True)
class Anatomy:
    """Module names (fully qualified in the whole model, or relative to a block)."""

    blocks: tuple[str, ...]
    """The repeated blocks, in order."""
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
    """Norms of a block, relative to it."""
    post_norms: tuple[str, ...] = ()
    """Those of ``norms`` applied to a row-parallel GEMM's output before the residual add
    (Gemma-2's sandwich norms), not feeding a sub-layer."""


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _is_norm(module: nn.Module) -> bool:
    params = list(module.parameters(recurse=False))
    return bool(params) and all(p.dim() == 1 for p in params) and not list(module.children())


def anatomy(graph: ModelGraph, model: nn.Module, vocab: int) -> Anatomy:
    """The anatomy of ``model`` (the whole model, as traced into ``graph``)."""
    if len(graph.blocks) != 1:
        raise ValueError(f"the runtime needs one kind of repeated block, the tracer found {len(graph.blocks)}")
    block = graph.blocks[0]
    first = block.names[0]
    splits = {lin.split for lin in block.linears}
    if splits - {"column", "row"}:
        raise ValueError(f"the runtime cannot split {', '.join(sorted(splits - {'column', 'row'}))} weights "
                         "(mixture of experts) yet")
    rel = {lin.split: [] for lin in block.linears}
    for lin in block.linears:
        rel[lin.split].append(_parent(lin.name).removeprefix(first + "."))
    block_mod = model.get_submodule(first)
    norms = tuple(n for n, m in block_mod.named_modules() if n and _is_norm(m))
    top = [n for n in graph.nodes if n.params and n.module]
    block_set = set(block.names)
    inside = tuple(b + "." for b in block.names)
    pre = {n.module for n in graph.pre}
    order = [n.module for n in top if n.module not in block_set and not n.module.startswith(inside)]
    heads = [n.module for n in top if n.shape and n.shape[-1] == vocab and n.module not in block_set]
    embeds = [m for m in order if isinstance(model.get_submodule(m), nn.Embedding)
              and model.get_submodule(m).num_embeddings == vocab]
    if not heads or not embeds:
        raise ValueError("the tracer found no vocabulary embedding or output head in this model")
    head, embed = heads[-1], embeds[0]
    before = list(dict.fromkeys(order[:order.index(head)]))
    after_blocks = [m for m in before if m != embed and m not in pre and _is_norm(model.get_submodule(m))]
    first_extra = tuple(m for m in before if m != embed and m not in after_blocks)
    return Anatomy(blocks=block.names, container=_parent(first), embed=embed, first_extra=first_extra,
                   final_norm=after_blocks[-1] if after_blocks else "", head=head,
                   column=tuple(rel.get("column", ())), row=tuple(rel.get("row", ())), norms=norms,
                   post_norms=tuple(n for n in norms if f"{first}.{n}" in block.fed_by_row),
                   packed=tuple((_parent(lin.name).removeprefix(first + "."),
                                 lin.sections or (lin.out_features // lin.packed,) * lin.packed)
                                for lin in block.linears if lin.packed > 1))
