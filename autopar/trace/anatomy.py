"""A model's :class:`~autopar.layout.Anatomy`, read off the tracer's ModelGraph and the module
tree (no layer-name lists): which modules are the blocks, the embedding, the head, the norms."""

from __future__ import annotations

from typing import Any

from torch import nn

from autopar.layout import Anatomy
from autopar.trace.graph import BlockInfo, ModelGraph
from autopar.trace.shape import leading_blocks


_SPLITS = ("column", "row", "expert-column", "expert-row", "router", "replicate")
"""Labels of a block's GEMMs the runtime takes: Megatron's column/row split of the dense ones
(tensor parallelism), the stacked expert weights (expert parallelism shards them by experts,
``runtime.experts``) and the router (replicated)."""


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _is_norm(module: nn.Module) -> bool:
    params = list(module.parameters(recurse=False))
    return bool(params) and all(p.dim() == 1 for p in params) and not list(module.children())


def _kind(block: BlockInfo, model: nn.Module, hidden: int) -> dict[str, Any]:
    """The kind-relative fields of ``Anatomy`` for one block kind (its GEMMs, norms, experts)."""
    first = block.names[0]
    splits = {lin.split for lin in block.linears}
    if splits - set(_SPLITS):
        raise ValueError(f"the runtime cannot split {', '.join(sorted(splits - set(_SPLITS)))} weights inside a block")
    rel: dict[str, list[str]] = {split: [] for split in _SPLITS}
    for lin in block.linears:
        rel[lin.split].append(_parent(lin.name).removeprefix(first + "."))  # the module owning the weight
    block_mod = model.get_submodule(first)
    every_norm = {n: m for n, m in block_mod.named_modules() if n and _is_norm(m)}
    # a low-rank GEMM's norm first: its width may equal a head's (GLM-4.7-Flash's twin)
    inner_norms = tuple(n for n in every_norm if f"{first}.{n}" in block.fed_by_replicated)
    head_norms = tuple(n for n, m in every_norm.items() if block.head_dim != hidden and n not in inner_norms
                       and all(p.numel() == block.head_dim for p in m.parameters()))
    width_norms = tuple(n for n in every_norm if n not in head_norms + inner_norms
                        and f"{first}.{n}" in block.fed_by_column)
    norms = tuple(n for n in every_norm if n not in head_norms + width_norms + inner_norms)
    return dict(column=tuple(rel.get("column", ())), row=tuple(rel.get("row", ())), norms=norms,
                post_norms=tuple(n for n in norms if f"{first}.{n}" in block.fed_by_row),
                packed=tuple((_parent(lin.name).removeprefix(first + "."),
                              lin.sections or (lin.out_features // lin.packed,) * lin.packed)
                             for lin in block.linears if lin.packed > 1 and lin.split == "column"),
                experts=tuple(dict.fromkeys(rel["expert-column"] + rel["expert-row"])),
                routers=tuple(dict.fromkeys(rel["router"])), head_norms=head_norms, width_norms=width_norms,
                replicated=tuple(rel["replicate"]), inner_norms=inner_norms,
                partial_outputs=tuple((_parent(lin.name).removeprefix(first + "."), part)
                                      for lin in block.linears if lin.split == "replicate" for part in lin.core_parts))


def anatomy(graph: ModelGraph, model: nn.Module, vocab: int) -> Anatomy:
    """The anatomy of ``model`` (the whole model, as traced into ``graph``): one kind of
    repeated block, or a few leading dense blocks of another kind before them (``Anatomy.lead``)."""
    if len(graph.blocks) not in (1, 2):
        raise ValueError(f"the runtime needs one kind of repeated block, the tracer found {len(graph.blocks)}")
    lead_info, block = leading_blocks(graph)  # a UserError (a ValueError) for kinds in another order
    names = (lead_info.names if lead_info else ()) + block.names
    block_set = set(names)
    inside = tuple(b + "." for b in names)
    top = [n for n in graph.nodes if n.params and n.module]
    pre = {n.module for n in graph.pre}
    order = [n.module for n in top if n.module not in block_set and not n.module.startswith(inside)]
    heads = [n.module for n in top if n.shape and n.shape[-1] == vocab and n.module not in block_set]
    embeds = [m for m in order if isinstance(model.get_submodule(m), nn.Embedding)
              and model.get_submodule(m).num_embeddings == vocab]
    if not heads or not embeds:
        raise ValueError("the tracer found no vocabulary embedding or output head in this model")
    head, embed = heads[-1], embeds[0]
    table = model.get_submodule(embed)
    assert isinstance(table, nn.Embedding)  # ``embeds`` holds embeddings only
    hidden = table.embedding_dim
    before = list(dict.fromkeys(order[:order.index(head)]))
    after_blocks = [m for m in before if m != embed and m not in pre and _is_norm(model.get_submodule(m))]
    first_extra = tuple(m for m in before if m != embed and m not in after_blocks)
    if not after_blocks:  # a final norm without weights (OLMo's LayerNorm without affine ones)
        after_blocks = [m for m in dict.fromkeys(n.module for n in graph.nodes if n.module and not n.params)
                        if m not in pre and m != head and m not in block_set and not m.startswith(inside)
                        and not list(model.get_submodule(m).children())
                        and "norm" in type(model.get_submodule(m)).__name__.lower()]
    container = _parent(block.names[0])
    top_fields: dict[str, Any] = dict(container=container, embed=embed, first_extra=first_extra,
                                      final_norm=after_blocks[-1] if after_blocks else "", head=head)
    lead = Anatomy(blocks=lead_info.names, **top_fields, **_kind(lead_info, model, hidden)) if lead_info else None
    return Anatomy(blocks=names, **top_fields, **_kind(block, model, hidden), lead=lead)
