"""A plain-data summary of a :class:`ModelGraph` (``autopar inspect``): per model, per block
and per token, with activation bytes as measured (fused kernels) and under the Megatron recipe,
and the shape the cost model prices (``traced_spec``), or why it cannot."""

from __future__ import annotations

from dataclasses import asdict

from autopar.errors import UserError
from autopar.spec import ModelSpec
from autopar.trace.graph import ActivationBytes, ModelGraph
from autopar.trace.shape import traced_spec

SHAPE_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "tied")


def _per_token(act: ActivationBytes, tokens: int) -> dict[str, float]:
    return {"replicated": act.replicated / tokens, "sharded": act.sharded / tokens,
            "attn": act.attn / tokens, "total": act.total / tokens}


def graph_summary(graph: ModelGraph, spec: ModelSpec) -> dict:
    """JSON-ready summary; FLOPs are forward (training = 3x), bytes at the traced dtype."""
    tokens = graph.tokens
    outside = sum(n.flops for n in graph.nodes)
    try:
        shaped = traced_spec(graph, spec)
        shape: dict | None = {k: getattr(shaped, k) for k in SHAPE_FIELDS}
        shape_error = ""
    except UserError as exc:
        shape, shape_error = None, str(exc)
    return {
        "model": graph.name, "capture": graph.capture, "input_shape": list(graph.input_shape),
        "seq_len": spec.seq or (graph.input_shape[1] if len(graph.input_shape) > 1 else 0),
        "dtype": "bf16", "params": graph.params, "param_bytes": graph.param_bytes,
        "forward_flops_per_token": graph.flops / tokens,
        "training_flops_per_token": graph.training_flops / tokens,
        "vocab_parallel": list(graph.vocab_parallel),
        "shape": shape, "shape_error": shape_error,
        "outside_blocks": {"params": graph.params - sum(b.count * b.params for b in graph.blocks),
                           "forward_flops_per_token": outside / tokens,
                           "activation_bytes_per_token": _per_token(graph.top_activations, tokens)},
        "blocks": [{
            "kind": b.kind, "repeats": b.count, "first": b.names[0], "params": b.params,
            "param_bytes": b.param_bytes, "forward_flops_per_token": b.flops / tokens,
            "bytes_read_per_token": b.bytes_read / tokens, "bytes_written_per_token": b.bytes_written / tokens,
            "activation_bytes_per_token": _per_token(b.activations, tokens),
            "recipe_activation_bytes_per_token": _per_token(b.recipe_activations, tokens),
            "heads": b.heads, "kv_heads": b.kv_heads, "head_dim": b.head_dim, "experts": b.experts,
            "linears": [asdict(lin) for lin in b.linears], "nodes": len(b.nodes),
        } for b in graph.blocks],
    }
