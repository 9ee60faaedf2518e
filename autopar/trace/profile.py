"""The cost model's view of a traced model (``cost_models.ModelProfile``), and the published
activation formula it is checked against.

Activation bytes come in both accountings the execution recipes choose between. The
``block_act_bytes_*`` fields are the *Megatron-recipe* measurement of one block
(``BlockInfo.recipe_activations``): unfused core attention with its softmax, dropout mask and
dropped probabilities kept, hidden dropout after each row-parallel GEMM (gpt models: p = 0.1),
the accounting of Korthikanti et al. 2022; for the built-in GPT it equals Table 2's
``sbh(34 + 5as/h)`` up to the LayerNorm statistics (16 bytes per token). The ``fused_*``
fields are what the model keeps when run as written with FlashAttention
(``BlockInfo.activations``, shown by ``autopar inspect``): a float32 log-sum-exp per head
instead of ``5as`` per token.
"""

from __future__ import annotations

import math
from functools import lru_cache

from autopar.layout import Anatomy
from autopar.spec import ModelSpec
from autopar.trace.graph import ActivationBytes, BlockInfo, ModelGraph, NodeInfo
from autopar.trace.shape import leading_blocks, traced_spec
from autopar.trace.anatomy import anatomy
from autopar.trace.tracer import trace_spec, trace_spec_model
from cost_models.model_profile import ModelProfile


def korthikanti_bytes_per_token(spec: ModelSpec) -> float:
    """Korthikanti et al. 2022, Table 2, no parallelism: ``sbh(34 + 5as/h)`` bytes per layer for
    16-bit activations and 1-byte dropout masks, divided by the s·b tokens: ``34h + 5as``."""
    return 34.0 * spec.hidden + 5.0 * spec.heads * spec.seq


def profile_from_graph(graph: ModelGraph, spec: ModelSpec) -> ModelProfile:
    """Summarise a traced decoder-only transformer for the cost model (per block, per token).
    A user module's shape (layers, hidden, heads ...) is read off the graph (``traced_spec``)."""
    if spec.arch == "module":
        spec = traced_spec(graph, spec)
    lead_block, block = leading_blocks(graph)
    tokens = graph.tokens
    lead: ModelProfile | None = None
    if lead_block is not None:
        # The leading dense blocks as a profile of their own: their MLP width is the input of
        # their last GEMM back to the hidden width (the down projection; read off shapes, not
        # split labels, which MLA's low-rank pairs confuse); no embedding, no head.
        downs = [lin.in_features for lin in lead_block.linears if lin.out_features == spec.hidden]
        lead = ModelProfile(
            name=f"{graph.name} {lead_block.kind} x{lead_block.count}", layers=lead_block.count, hidden=spec.hidden,
            heads=spec.heads, kv_heads=spec.num_kv_heads, ffn=downs[-1] if downs else spec.ffn_hidden, vocab=spec.vocab, seq=spec.seq,
            tied=False, embed_params=0, head_params=0, head_flops_per_token=0.0,
            **_block_fields(lead_block, tokens))
    fields = _block_fields(block, tokens)
    if graph.runtime_masked_layers >= 0:
        fields.update(_runtime_sdpa_fields(graph, block, lead_block, tokens))
    return ModelProfile(
        **_moe_fields(block, spec, tokens), **fields, lead=lead,
        name=graph.name, layers=block.count, hidden=spec.hidden, heads=spec.heads,
        kv_heads=spec.num_kv_heads, ffn=spec.ffn_hidden, vocab=spec.vocab, seq=spec.seq,
        tied=spec.tied,
        embed_params=sum(n.params for n in graph.pre), head_params=sum(n.params for n in graph.post),
        head_flops_per_token=sum(n.flops for n in graph.post) / tokens,
        embed_param_tensors=len(graph.embeddings),
        head_param_tensors=max(0, graph.param_tensors - len(graph.embeddings)
                               - sum(b.param_tensors * b.count for b in graph.blocks)))


def _is_norm(n: NodeInfo) -> bool:
    """A norm with weights: a module call with weights and no split (the built-in models'
    LayerNorm and RMSNorm), or an exported ``layer_norm`` / ``rms_norm`` / ``group_norm`` op
    (a user module's). A norm written out op by op (HF's RMSNorm upcasts inside) is not one:
    it keeps its fp32 input under autocast and without it alike."""
    return bool(n.params) and not n.split and (
        n.op == "call_module" or any(k in n.target for k in ("layer_norm", "rms_norm", "group_norm")))


def autocast_extra_bytes(block: BlockInfo) -> int:
    """What ``block`` keeps beyond its 16-bit trace when run under CUDA autocast with a 16-bit
    dtype, bytes (``ModelProfile.autocast_act_bytes_per_token``): each norm module (a module
    call or norm op with weights, ``_is_norm``: LayerNorm and RMSNorm are fp32 ops there) keeps
    its input in fp32, 2 more bytes per element; the column GEMMs between two norms or row
    GEMMs read one norm output, and autocast casts it to 16 bits once per GEMM, each kept: 2
    bytes per element of each beyond the first (q, k, v: 2; gate, up: 1). Measured on an H100
    (torch 2.11): the built-in GPT block 8 h, Llama block 10 h bytes per token
    (tests/data/gpu_saved_tensors.json)."""
    extra, readers, width = 0, 0, 0
    for n in [*block.nodes, None]:
        if n is None or n.split == "row" or _is_norm(n):
            extra += 2 * max(0, readers - 1) * width
            readers = 0
        if n is None:
            break
        if _is_norm(n):
            extra += 2 * math.prod(n.shape)
            width = math.prod(n.shape)
        elif n.split == "column":
            readers += 1
    return extra


def op_recompute_fields(block: BlockInfo, tokens: int) -> dict:
    """What per-op selective recompute keeps and repeats in ``block``, per token
    (``ModelProfile.op_*``): its weight GEMMs in the order they run, the 1st, 3rd, ... kept
    (column-parallel ones split by TP, row-parallel ones as full-width partial sums), the
    others recomputed; the attention kernel's output and its float32 log-sum-exp per head
    kept. Empty (not priced) for a mixture of experts or a block with no weight GEMM."""
    gemms = [n for n in block.nodes if n.split in ("column", "row")]
    if block.experts or not gemms:
        return {}
    kept, again = gemms[0::2], gemms[1::2]
    core = [n for n in block.nodes if not n.split and n.flops > 0]
    lse = 4 * block.heads * tokens if core else 0
    return dict(
        op_kept_sharded_bytes_per_token=(sum(n.out_bytes for n in kept if n.split == "column")
                                         + sum(n.out_bytes for n in core) + lse) / tokens,
        op_kept_partial_bytes_per_token=sum(n.out_bytes for n in kept if n.split == "row") / tokens,
        op_reduced_bytes_per_token=sum(n.out_bytes for n in gemms if n.split == "row") / tokens,
        op_recompute_flops_per_token=sum(n.flops for n in again) / tokens)


def _block_fields(block: BlockInfo, tokens: int) -> dict:
    """The per-block fields of ``ModelProfile`` read off one traced block kind, per token."""
    matmul = sum(n.flops for n in block.nodes if n.split)
    act, fused = block.recipe_activations, block.activations
    norms = block.written_norms or ActivationBytes(replicated=0, sharded=0, attn=0)
    weighted = [n for n in block.nodes if n.params]
    sharded = sum(n.out_bytes for n in weighted if n.split in ("column", "expert-column"))
    return dict(
        wgrad_bytes_replicated_per_token=(sum(n.out_bytes for n in weighted) - sharded) / tokens,
        wgrad_bytes_sharded_per_token=sharded / tokens,
        block_params=block.params,
        block_param_tensors=block.param_tensors,
        block_tp_linears=sum(lin.split in ("column", "row") for lin in block.linears),
        block_tp_whole_params=sum(lin.in_features * lin.out_features for lin in block.linears
                                  if lin.split == "replicate"),
        block_matmul_flops_per_token=matmul / tokens,
        block_attn_flops_per_token=(block.flops - matmul) / tokens,
        block_act_bytes_replicated_per_token=act.replicated / tokens,
        block_act_bytes_sharded_per_token=act.sharded / tokens,
        block_act_bytes_attn_per_token=act.attn / tokens,
        fused_act_bytes_replicated_per_token=fused.replicated / tokens,
        fused_act_bytes_sharded_per_token=fused.sharded / tokens,
        fused_act_bytes_attn_per_token=fused.attn / tokens,
        written_attention=fused.attn > 0 and not any("scaled_dot_product_attention" in n.target
                                                     for n in block.nodes),
        written_norm_replicated_per_token=norms.replicated / tokens,
        written_norm_sharded_per_token=norms.sharded / tokens,
        autocast_act_bytes_per_token=autocast_extra_bytes(block) / tokens,
        **op_recompute_fields(block, tokens))


def _runtime_sdpa_fields(graph: ModelGraph, block: BlockInfo, lead: BlockInfo | None, tokens: int) -> dict:
    """An HF model's SDPA as it runs (``ModelGraph.runtime_masked_layers``), per token: the
    share of its blocks that get a mask, and what the exported graph's mask makes the block
    keep (``BlockInfo.sdpa_extras``), which the blocks without one do not."""
    extras = block.sdpa_extras or ActivationBytes(replicated=0, sharded=0, attn=0)
    layers = block.count + (lead.count if lead is not None else 0)
    share = graph.runtime_masked_layers / layers if any("scaled_dot_product_attention" in n.target
                                                       for n in block.nodes) else 0.0
    return dict(masked_attention_share=min(1.0, share), sdpa_mask_bytes_per_token=extras.replicated / tokens,
                sdpa_repeat_kv_bytes_per_token=extras.sharded / tokens,
                attention_windows=graph.attention_windows if any(graph.attention_windows) else ())


def _moe_fields(block: BlockInfo, spec: ModelSpec, tokens: int) -> dict:
    """The MoE fields of ``ModelProfile`` read off the traced block: its routed experts' stacked
    weights (``LinearInfo.experts``), the FLOPs of their grouped GEMMs (the tracer counts the
    routed rows: tokens x topk), the expert width (the input of the projection back to the
    hidden size), top-k and the capacity factor from the spec (0: dropless, as Mixtral,
    Qwen-MoE and DeepSeek-V3 train). Empty for a dense block."""
    routed = [lin for lin in block.linears if lin.experts]
    if not block.experts or not routed:
        return {}
    down = [lin for lin in routed if lin.out_features == spec.hidden] or routed
    first = next((n for n in block.nodes if n.split == "expert-column" and n.shape), None)
    copies = math.prod(first.shape[:-1]) / tokens if first is not None else 0.0
    return dict(experts=block.experts, topk=spec.topk or 1, expert_copies=copies,
                expert_act_bytes_traced_per_token=_routed_saved_bytes(block, tokens) / tokens,
                expert_ffn=down[-1].in_features,
                expert_params=sum(lin.experts * lin.in_features * lin.out_features for lin in routed),
                expert_flops_per_token=sum(n.flops for n in block.nodes if n.split.startswith("expert-")) / tokens,
                capacity_factor=spec.capacity_factor)


def _routed_saved_bytes(block: BlockInfo, tokens: int) -> int:
    """Bytes the nodes over the routed rows save (outputs whose leading size is the row count
    of the experts' GEMMs: tokens x topk on meta, where routing is even): the expert region as
    the model's own code keeps it. 0 where those rows cannot be told from the tokens (top-1)."""
    rows = {n.shape[0] for n in block.nodes if n.split.startswith("expert-") and n.shape}
    if len(rows) != 1 or tokens in rows:
        return 0
    (r,) = rows
    return sum(n.saved_bytes for n in block.nodes if n.shape and n.shape[0] == r)


def profile_spec(spec: ModelSpec) -> ModelProfile:
    """Trace the model of ``spec`` and summarise it for the cost model. Specs are frozen data,
    so the profiles of built-in and HF models are kept (a CLI command or a test that prices one
    model many times traces it once); a user module's file may change, so it is traced anew."""
    if spec.arch == "module":
        return profile_from_graph(trace_spec(spec), spec)
    return _cached_profile(spec)


@lru_cache(maxsize=32)
def _cached_profile(spec: ModelSpec) -> ModelProfile:
    return profile_from_graph(trace_spec(spec), spec)


def profile_and_layout(spec: ModelSpec) -> tuple[ModelProfile, Anatomy | None]:
    """One trace of ``spec``: the cost model's profile and the layout the runtime shards (None
    where the runtime cannot take the model, e.g. mixture-of-experts blocks)."""
    graph, model = trace_spec_model(spec)
    try:
        layout = anatomy(graph, model, spec.vocab)
    except ValueError:
        layout = None
    return profile_from_graph(graph, spec), layout


def shaped_spec(spec: ModelSpec) -> ModelSpec:
    """``spec`` with every shape field known: a user module's traced (``traced_spec``), any
    other returned as it is (its spec states them)."""
    if spec.arch != "module":
        return spec
    return traced_spec(trace_spec(spec), spec)
