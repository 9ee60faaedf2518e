"""A decoder-only LM's shape read off its trace: what a ``gpt:``/``llama:`` spec states, for
a model that states nothing (a user module, ``path/to/file.py:factory``).

Everything comes from the graph's structure and shapes, none from attribute or module names:

- layers: the repeats of the one kind of repeated block;
- hidden: the input width of the block's first weight GEMM; ffn: the input width of its last
  one (the MLP's down projection);
- heads and head size: the attention core's Q, ``[batch, heads, seq, head_dim]`` at the SDPA
  call or at a hand-written ``q @ k.transpose(-2, -1)``; kv heads: the narrowest projection
  feeding it, in head sizes (GQA repeats KV heads before the kernel);
- vocab: the output width of the last weight GEMM after the blocks (the head), which must
  produce a logit for every position (a forward that computes the last position's only is an
  inference path, not the training step the cost model prices);
- tied: the head's weight is a table an embedding lookup reads;
- seq: the traced tokens' length.
"""

from __future__ import annotations

import dataclasses
import math

from autopar.errors import UserError
from autopar.spec import ModelSpec
from autopar.trace.graph import BlockInfo, ModelGraph


def priced_block(graph: ModelGraph) -> BlockInfo:
    """The graph's one kind of repeated block (dense or mixture-of-experts); a ``UserError``
    saying what else it has."""
    if len(graph.blocks) != 1:
        raise UserError(f"the cost model needs one kind of repeated transformer block; {graph.name} has "
                        f"{len(graph.blocks)} ({', '.join(b.kind for b in graph.blocks) or 'none'})")
    return graph.blocks[0]


def _position(name: str) -> tuple[str, int] | None:
    """(container, index) of a block named ``container.<index>`` (a ModuleList member)."""
    parent, _, index = name.rpartition(".")
    return (parent, int(index)) if index.isdigit() else None


def leading_blocks(graph: ModelGraph) -> tuple[BlockInfo | None, BlockInfo]:
    """(leading kind or None, repeated kind) of the graph's blocks: one kind, or two kinds of
    one list where every repeat of a dense kind comes before every repeat of the other
    (DeepSeek-V2/V3's ``first_k_dense_replace`` dense blocks before the MoE ones); a
    ``UserError`` naming what else the graph has (interleaved kinds, a third kind)."""
    if len(graph.blocks) != 2:
        return None, priced_block(graph)
    a, b = sorted(graph.blocks, key=lambda blk: [_position(n) or ("", -1) for n in blk.names])
    pos_a, pos_b = [_position(n) for n in a.names], [_position(n) for n in b.names]
    known_a, known_b = [p for p in pos_a if p is not None], [p for p in pos_b if p is not None]
    ordered = (None not in pos_a and None not in pos_b and len({p[0] for p in known_a + known_b}) == 1
               and max(p[1] for p in known_a) < min(p[1] for p in known_b))
    if not ordered or a.experts:
        raise UserError(f"the cost model prices one kind of repeated transformer block, after at most a few "
                        f"dense blocks of another kind (DeepSeek's first_k_dense_replace); {graph.name} has "
                        f"{a.kind} x{a.count} and {b.kind} x{b.count}"
                        + (" interleaved" if not ordered else " with experts in the first") + "; use a model "
                        "whose blocks are alike after its leading dense ones")
    return a, b


def dense_block(graph: ModelGraph) -> BlockInfo:
    """The graph's one kind of repeated block, dense; a ``UserError`` saying what else it is."""
    block = priced_block(graph)
    if block.experts:
        raise UserError(f"the cost model reads a model's shape off its trace only for dense blocks ({graph.name}: "
                        f"{block.experts} experts per {block.kind}); give it as a moe: or hf: spec")
    return block


def traced_spec(graph: ModelGraph, spec: ModelSpec) -> ModelSpec:
    """``spec`` with its shape fields (layers, hidden, heads, kv_heads, ffn, vocab, seq, tied)
    read off ``graph``; a ``UserError`` naming what is missing when the graph is not a dense
    decoder-only transformer LM."""
    name = graph.name
    block = dense_block(graph)
    if not block.heads:
        raise UserError(f"found no attention in {name}'s {block.kind} (no scaled_dot_product_attention "
                        "call, no product of two projected activations); the cost model prices "
                        "transformer blocks")
    if len(block.linears) < 2 or block.linears[-1].split != "row":
        raise UserError(f"{name}'s {block.kind} does not end in an MLP down projection "
                        f"(weight GEMMs: {', '.join(lin.name for lin in block.linears) or 'none'})")
    post = [n for n in graph.post if n.split == "column" and n.shape]
    if not post or not graph.linears:
        raise UserError(f"{name} has no output projection after its {block.kind} blocks")
    head, head_weight = post[-1], graph.linears[-1]
    vocab = head.shape[-1]
    positions = math.prod(head.shape[:-1])
    if positions != graph.tokens:
        raise UserError(f"{name}'s output head computes logits for {positions} of the {graph.tokens} "
                        "traced positions (an inference path); make the factory return the inputs a "
                        "training step passes, e.g. (tokens, targets)")
    return dataclasses.replace(
        spec, layers=block.count, hidden=block.linears[0].in_features, heads=block.heads,
        kv_heads=block.kv_heads, ffn=block.linears[-1].in_features, vocab=vocab,
        seq=graph.input_shape[1] if len(graph.input_shape) > 1 else 0,
        tied=head_weight.name in graph.embeddings)
