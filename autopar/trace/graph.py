"""What the tracer sees: frozen records of nodes, repeated blocks and the whole model.

Units: FLOPs are forward FLOPs (2 per multiply-add) at the traced micro-batch and sequence
length; bytes are at the traced dtype (bf16 unless the model says otherwise). Backward FLOPs are
2x forward (``ModelGraph.training_flops``), the convention of Narayanan et al. and design.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SPLITS = ("column", "row", "vocab", "expert-column", "expert-row", "router", "replicate")
"""How a weight can be split for tensor (or expert) parallelism, Megatron-style: a ``column``
GEMM reads a replicated input and writes a sharded output, the following ``row`` GEMM reads the
sharded activation and all-reduces its output; ``vocab``: a vocabulary-parallel embedding or
output head; ``expert-*``: the same inside each expert of an MoE layer (or split by experts); ``router``: an MoE gate, kept replicated;
``replicate``: a low-rank projection whose output a norm hands to another GEMM (DeepSeek's
latent attention), kept whole on every tp rank."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeInfo:
    """One node of a traced graph, counted at the traced shapes."""

    name: str
    op: str
    """fx opcode: ``call_function``, ``call_module``, ``call_method``, ``placeholder`` ..."""
    target: str
    """The function (``aten.linear.default``, ``scaled_dot_product_attention``) or module path."""
    module: str
    """Qualified name of the innermost module the node belongs to ("" at the top)."""
    shape: tuple[int, ...]
    """Shape of the (first) tensor output; empty for non-tensor outputs."""
    out_bytes: int
    """Bytes written: all tensor outputs."""
    in_bytes: int
    """Bytes read: all tensor inputs, weights included."""
    flops: float
    """Forward FLOPs, as ``torch.utils.flop_counter.FlopCounterMode`` counts them."""
    params: int
    """Parameters this node reads (a module call: the module's own)."""
    saved_bytes: int
    """Bytes autograd keeps for backward that this node saves first (deduplicated by storage)."""
    split: str = ""
    """How this node's weight can be split (one of ``SPLITS``), "" when it has none."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationBytes:
    """Bytes autograd keeps for backward, per micro-batch, by tensor-parallel role."""

    replicated: int
    """Outside the column/row-parallel region (norm inputs, GEMM inputs, dropout masks): TP does
    not split these, sequence parallelism does."""
    sharded: int
    """Inside the column/row-parallel region (Q, K, V, MLP intermediates): split by TP."""
    attn: int
    """The attention core beyond Q/K/V/output (scores, softmax, masks, logsumexp): split by TP,
    dropped by selective recompute."""

    @property
    def total(self) -> int:
        return self.replicated + self.sharded + self.attn


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearInfo:
    """A weight GEMM of a block and how it can be split."""

    name: str
    """The weight's full parameter name in the block's first repeat
    (``model.layers.0.self_attn.q_proj.weight``)."""
    in_features: int
    out_features: int
    split: str
    """One of ``SPLITS``."""
    experts: int = 0
    """Experts stacked in the weight's leading dimension (0: a dense weight)."""
    packed: int = 1
    """Projections the model cuts this GEMM's output into along its last dimension (GPT-2's
    fused Q/K/V: 3): a column split must shard each one."""
    sections: tuple[int, ...] = ()
    """Their widths in output order when packed (Phi-3's GQA ``qkv_proj``: q, k, v widths)."""
    core_parts: tuple[tuple[int, int], ...] = ()
    """A ``replicate`` GEMM's output columns [start, end) that reach the attention core before
    any other weight GEMM (DeepSeek's RoPE key, read by every head): under TP each rank's
    heads read them, so their gradient is a partial sum over the ranks."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockInfo:
    """A kind of repeated block: traced once, instantiated ``count`` times."""

    kind: str
    """Class name of the block module."""
    names: tuple[str, ...]
    """Fully-qualified names of the repeats, in model order."""
    params: int
    """Parameters of one repeat."""
    param_bytes: int
    nodes: tuple[NodeInfo, ...]
    """The representative's nodes."""
    activations: ActivationBytes
    """What autograd keeps for one repeat running as written, with fused kernels where a GPU has
    them (FlashAttention for SDPA, 1-byte dropout masks)."""
    recipe_activations: ActivationBytes
    """The same under the Megatron-LM recipe (Korthikanti et al. 2022): unfused core attention
    with its softmax and dropout kept, hidden dropout after each row-parallel GEMM."""
    linears: tuple[LinearInfo, ...]
    heads: int = 0
    """Query heads of the block's attention (0: no attention found)."""
    kv_heads: int = 0
    head_dim: int = 0
    experts: int = 0
    """Experts of the block's MoE layer (0: dense)."""
    fed_by_row: tuple[str, ...] = ()
    """Modules of the first repeat whose input is a row-parallel GEMM's output (Gemma-2's
    post-norms): with sequence parallelism they stay on sequence shards."""
    fed_by_column: tuple[str, ...] = ()
    """Modules of the first repeat whose input is a column-parallel GEMM's output (OLMo 2's
    q/k norms, Qwen3's per-head ones): under tensor parallelism they see the rank's shard."""
    fed_by_replicated: tuple[str, ...] = ()
    """Modules of the first repeat whose input is a low-rank (``replicate``) GEMM's output
    (DeepSeek's ``q_a_layernorm``, ``kv_a_layernorm``): whole on every tp rank."""
    param_tensors: int = 0
    """Parameter tensors of one repeat (an optimizer steps each on its own)."""
    written_norms: ActivationBytes | None = None
    """Part of ``activations``: what the float32 squares of RMSNorms written out op by op save
    (their upcast inputs, which a fused norm kernel does not keep), by role."""
    sdpa_extras: ActivationBytes | None = None
    """Part of ``activations``: what the block's SDPA call keeps for an explicit mask, the mask
    itself (replicated) and K, V repeated to the query heads (sharded: HF repeats them
    wherever it passes a mask, ``transformers.integrations.sdpa_attention``)."""

    @property
    def count(self) -> int:
        return len(self.names)

    @property
    def flops(self) -> float:
        """Forward FLOPs of one repeat."""
        return sum(n.flops for n in self.nodes)

    @property
    def bytes_read(self) -> int:
        return sum(n.in_bytes for n in self.nodes)

    @property
    def bytes_written(self) -> int:
        return sum(n.out_bytes for n in self.nodes)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelGraph:
    """What the tracer sees: the top-level nodes (outside repeated blocks) and each block kind."""

    name: str
    capture: str
    """How the graph was captured: ``torch.fx`` or ``torch.export``."""
    input_shape: tuple[int, ...]
    """Shape of the first example input (tokens: [micro-batch, seq])."""
    nodes: tuple[NodeInfo, ...]
    """Top-level nodes, in order; blocks are not among them."""
    pre_nodes: int
    """How many of ``nodes`` run before the first block (the embedding side)."""
    blocks: tuple[BlockInfo, ...]
    params: int
    """Distinct trainable parameters (a tied weight counted once)."""
    param_bytes: int
    top_activations: ActivationBytes
    """Saved-for-backward bytes outside the blocks (embedding, final norm, head, loss)."""
    vocab_parallel: tuple[str, ...] = ()
    """Top-level weights that can be split over the vocabulary (embedding, output head)."""
    linears: tuple[LinearInfo, ...] = ()
    """Weight GEMMs outside the blocks, in order (the output head last)."""
    embeddings: tuple[str, ...] = ()
    """Parameter names of the tables read by embedding lookups outside the blocks, in order; a
    table shared with a GEMM (a tied head) has the name it has in ``linears``."""
    param_tensors: int = 0
    """Distinct trainable parameter tensors of the whole model."""
    runtime_masked_layers: int = -1
    """An HF model's blocks whose SDPA call gets an explicit mask when the model runs eagerly at
    this sequence length (``autopar.hf.masked_attention_layers``: sliding and chunked windows no
    longer than the sequence); the others call it with ``is_causal`` and GQA in the kernel, no
    mask and K, V not repeated. Exported, HF always passes a mask (``BlockInfo.sdpa_extras``).
    -1: not an HF model; its SDPA calls run as traced."""
    attention_windows: tuple[int, ...] = ()
    """An HF model's local attention window per layer, tokens (0: none;
    ``autopar.hf.attention_windows``); () for other models."""

    @property
    def tokens(self) -> int:
        return math.prod(self.input_shape[:2]) if self.input_shape else 0

    @property
    def flops(self) -> float:
        """Forward FLOPs of the whole model at ``input_shape``."""
        return sum(n.flops for n in self.nodes) + sum(b.count * b.flops for b in self.blocks)

    @property
    def training_flops(self) -> float:
        """Forward + backward FLOPs (backward = 2x forward), no recomputation."""
        return 3.0 * self.flops

    @property
    def pre(self) -> tuple[NodeInfo, ...]:
        return self.nodes[: self.pre_nodes]

    @property
    def post(self) -> tuple[NodeInfo, ...]:
        return self.nodes[self.pre_nodes:]
