"""What the cost model knows of a model: the tracer's counts, summarised per kind of block.

A model is an embedding (first pipeline stage), ``layers`` identical transformer blocks, and a
head (final norm, output projection and loss; last stage). A model may lead with a few blocks
of another kind (``lead``: DeepSeek-V2/V3's first dense blocks before the MoE ones): they are
priced with the first stage, like the embedding, and ``layers`` counts the repeated blocks
only (a plan's ``stage_layers`` counts both: the leading blocks are its first stage's first). Counts are per block and per token at
sequence length ``seq``; bytes of activations assume 16-bit activations and 1-byte dropout masks,
in two accountings: unfused core attention with Megatron's dropout (Korthikanti et al. 2022) and
a fused attention kernel (``fused_*``), which the execution recipe chooses between.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.hardware import REF_HEAD_DIM


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelProfile:
    """Per-block counts of a decoder-only transformer, filled by ``autopar.trace``."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    tied: bool
    """The head reuses the embedding weight (a copy lives on the last stage when pp > 1)."""
    block_params: int
    """Parameters of one transformer block."""
    embed_params: int
    """Token (and learned position) embedding parameters."""
    head_params: int
    """Final norm plus output projection parameters (the projection counted even when tied)."""
    block_matmul_flops_per_token: float
    """Forward FLOPs of one block's weight GEMMs per token (2 per multiply-add)."""
    block_attn_flops_per_token: float
    """Forward FLOPs of one block's QKᵀ and AV per token at ``seq`` (full, not causal-halved)."""
    head_flops_per_token: float
    """Forward FLOPs of the output projection per token."""
    block_act_bytes_replicated_per_token: float
    """Saved-for-backward bytes per token that tensor parallelism does not split (SP does)."""
    block_act_bytes_sharded_per_token: float
    """Saved-for-backward bytes per token inside the column/row-parallel region (split by TP)."""
    block_act_bytes_attn_per_token: float
    """Saved-for-backward bytes per token of the attention core (scores, softmax, dropout):
    split by TP, dropped by selective recompute."""
    fused_act_bytes_replicated_per_token: float
    """The three figures above when attention runs as one fused kernel (FlashAttention: no
    scores kept, a float32 log-sum-exp per head instead) and the model's own dropout."""
    fused_act_bytes_sharded_per_token: float
    fused_act_bytes_attn_per_token: float
    written_attention: bool = False
    """The blocks' attention core is written out op by op, not an SDPA call (GPT-OSS's
    learned sinks, a hand-written ``q @ k.T``): run as written it keeps its scores, which the
    fused figures then count; a framework that builds its own blocks runs its fused kernel
    instead (``act_bytes_per_token``'s ``own_blocks``)."""
    masked_attention_share: float = 0.0
    """Share of the blocks whose own code calls SDPA with an explicit mask at ``seq`` (HF's
    sliding and chunked windows no longer than the sequence, ``autopar.hf``): run as written,
    their kernel executes all of QKᵀ and AV, no causal block skipped, and keeps the mask as an
    additive bias in the activations' dtype, ``seq`` elements per token per block, which
    tensor and sequence parallelism do not split (``masked_bias_bytes_per_token``). A
    framework that builds its own blocks runs its causal or windowed kernel instead."""
    attention_windows: tuple[int, ...] = ()
    """The model's local attention window on each layer, tokens (0: none; HF's sliding and
    chunked windows): a framework kernel that runs windows (``ExecutionRecipe.sliding_window``)
    executes each windowed layer's band of QKᵀ and AV tiles only. (): none on any layer."""
    sdpa_mask_bytes_per_token: float = 0.0
    """Replicated bytes per token the traced block keeps for the mask an exported HF model
    passes SDPA (``autopar.trace``: HF always masks when exported); no program keeps that
    tensor: a block run as written with a mask keeps its bias (``masked_bias_bytes_per_token``)."""
    sdpa_repeat_kv_bytes_per_token: float = 0.0
    """Sharded bytes per token of K and V the traced block's SDPA call keeps repeated to the
    query heads (HF repeats them where it passes a mask): run as written, only the masked blocks
    keep them (the others run GQA in the kernel); a framework's own blocks where its recipe
    repeats K, V (``ExecutionRecipe.kv_repeated``)."""
    written_norm_replicated_per_token: float = 0.0
    """Bytes per token that the blocks' RMSNorms written out op by op keep beyond a fused norm
    kernel, of the replicated figures: the float32 copy of each norm's input its variance reads
    (HF's ``LlamaRMSNorm`` and kin upcast first); a fused kernel keeps the 16-bit input and a
    float32 rstd, as many bytes as the written one keeps besides. A framework that builds its
    own blocks does not keep it (``own_blocks``)."""
    written_norm_sharded_per_token: float = 0.0
    """The same of the sharded figures (per-head q/k norms on a column-parallel output)."""
    autocast_act_bytes_per_token: float = 0.0
    """What one block keeps beyond the above per token when it runs under ``torch.autocast``
    (``ExecutionRecipe.autocast``), replicated bytes: a norm module (an fp32 op there) keeps
    its input in fp32, 2 more bytes per element, and each GEMM reading a norm's output beyond
    the first keeps its own 16-bit cast of it (autocast casts per call), 2 bytes per element."""
    experts: int = 0
    """Routed experts of each block's MoE layer (0: a dense model). The routed experts'
    weights are in ``block_params`` (``expert_params``), their GEMMs' FLOPs of the routed
    tokens in ``block_matmul_flops_per_token`` (``expert_flops_per_token``); shared experts
    and the router are dense parts of the block."""
    topk: int = 0
    """Routed experts each token goes to."""
    expert_ffn: int = 0
    """Inner width of one routed expert's MLP."""
    expert_params: int = 0
    """Parameters of one block's routed experts, all of them (split over ep, then tp)."""
    expert_flops_per_token: float = 0.0
    """Forward FLOPs per token of one block's routed-expert GEMMs as the model's code runs
    them: the token's copies (``expert_copies``: top-k where it routes) through their experts'
    up/gate and down projections."""
    expert_copies: float = 0.0
    """Copies of each token the model's own code runs through its routed experts: top-k where
    it routes, the expert count where it runs every expert on every token and weights the
    results (HF's Llama 4); ``expert_flops_per_token`` and the traced activations count that
    many. A framework that builds its own blocks routes top-k (``routed_expert_flops_per_token``).
    0: top-k (not traced)."""
    capacity_factor: float = 0.0
    """Tokens an expert takes at most, over its fair share (tokens x topk / experts); 0:
    dropless (every routed token is computed, however uneven)."""
    expert_act_bytes_traced_per_token: float = 0.0
    """Saved-for-backward bytes per token of one block's routed-expert region as the model's
    own code keeps them (the nodes over its tokens x topk routed rows: dispatched copies, the
    experts' GEMM inputs and activations, the weighted outputs), part of the figures above;
    a framework that builds its own grouped MLP keeps ``expert_act_bytes_per_token`` instead.
    0: a dense block, or not traced."""

    wgrad_bytes_replicated_per_token: float = 0.0
    """Bytes per token of the output gradients of one block's parameterised ops outside the
    column-parallel region (norms, row-parallel GEMMs, router: TP does not split them, SP
    does), 16-bit: what a deferred weight pass keeps for each micro-batch (torch's
    zero-bubble W, ``pipeline.pending``). 0: not traced."""
    wgrad_bytes_sharded_per_token: float = 0.0
    """The same for the block's column-parallel GEMMs' outputs (split by TP)."""

    op_kept_sharded_bytes_per_token: float = 0.0
    """Per-op selective recompute (``op``: torchtitan's ``selective_ac_option = "op"``, which
    keeps the output of every second weight GEMM of a block, the 1st, 3rd, ..., and of the
    attention kernel, and recomputes the rest in the backward): bytes per token of what it
    keeps inside the column-parallel region (the kept column GEMMs' outputs, the attention
    output and its float32 log-sum-exp; split by TP). 0 with the two below: not priced (a
    mixture of experts, or not traced)."""
    op_kept_partial_bytes_per_token: float = 0.0
    """The kept row-parallel GEMMs' outputs per token: the full-width partial sums every tp
    rank holds before their reduction (TP does not split them, nor does SP)."""
    op_reduced_bytes_per_token: float = 0.0
    """Every row-parallel GEMM's output per token: under SP its reduce-scatter's output, which
    per-op recompute keeps too (a collective is not recomputed), split by TP."""
    op_recompute_flops_per_token: float = 0.0
    """Forward FLOPs per token of the weight GEMMs per-op recompute repeats (the 2nd, 4th, ...)."""

    block_param_tensors: int = 0
    """Parameter tensors of one block (the optimizer steps each on its own; 0: not traced)."""
    embed_param_tensors: int = 0
    """Parameter tensors of the embedding side: the tables its lookups read."""
    head_param_tensors: int = 0
    """Parameter tensors outside the blocks and the embedding tables (final norm, head)."""
    block_tp_linears: int = 0
    """Linear modules of one block that tensor parallelism splits (column- and row-parallel:
    4 to 7 in a dense block), each a DTensor module under the autopar runtime (0: not traced)."""

    block_tp_whole_params: int = 0
    """Parameters of one block's low-rank GEMMs that tensor parallelism keeps whole on every
    rank (DeepSeek's ``q_a_proj`` and ``kv_a_proj_with_mqa``: the tracer's ``replicate``)."""

    lead: ModelProfile | None = None
    """The dense blocks before the repeated ones, as a profile of their own (``layers``: how
    many; per-block fields as above; no embedding or head), or None. They run on the first
    pipeline stage, like the embedding (``cost_models.estimate``)."""

    @property
    def lead_layers(self) -> int:
        """Leading blocks of another kind (0: every block is one of the ``layers``)."""
        return self.lead.layers if self.lead is not None else 0

    @property
    def head_dim(self) -> float:
        """Width of one attention head as QKᵀ and AV see it, read off their FLOPs (4 s heads d
        per token; MLA: the mean of its query-key and value widths); ``REF_HEAD_DIM`` (no head
        law applies) for a block with no attention core."""
        if self.block_attn_flops_per_token <= 0:
            return float(REF_HEAD_DIM)
        return self.block_attn_flops_per_token / (4.0 * self.seq * self.heads)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def op_priced(self) -> bool:
        """Whether per-op selective recompute (``op``) can be priced: a dense block whose
        trace gave its weight GEMMs in order."""
        return not self.moe and self.op_recompute_flops_per_token > 0 and \
            (self.lead is None or self.lead.op_priced)

    @property
    def dense_block_params(self) -> int:
        """Parameters of one block outside its routed experts (attention, norms, router,
        shared experts)."""
        return self.block_params - self.expert_params

    def routed_expert_flops_per_token(self) -> float:
        """``expert_flops_per_token`` of top-k routing: the model's own code's scaled from its
        ``expert_copies`` to ``topk`` copies (the same where it routes)."""
        if self.expert_copies > self.topk > 0:
            return self.expert_flops_per_token * self.topk / self.expert_copies
        return self.expert_flops_per_token

    def expert_act_bytes_per_token(self) -> float:
        """Saved-for-backward bytes per token of the routed-expert region in 16-bit
        activations: per top-k copy, the dispatched input (h) and the combine's weighted
        output (h), the gate and up outputs (2 f) and their product feeding the down
        projection (f): 2 (2h + 3f) bytes. Part of the traced activations (the tracer routes
        top-k copies); ``cost_models.memory`` scales it by the load imbalance."""
        return self.topk * 2.0 * (2 * self.hidden + 3 * self.expert_ffn)

    @property
    def params(self) -> int:
        """Total trainable parameters (a tied head counted once)."""
        tied = self.vocab * self.hidden if self.tied else 0
        lead = self.lead_layers * self.lead.block_params if self.lead is not None else 0
        return self.embed_params + lead + self.layers * self.block_params + self.head_params - tied

    def act_bytes_per_token(self, fused: bool, own_blocks: bool = False,
                            kv_repeated: bool = False) -> tuple[float, float, float]:
        """(replicated, sharded, attention core) saved bytes per token in one accounting;
        ``own_blocks``: of a framework that builds its own blocks, whose fused norms keep no
        float32 copies (``written_norm_*_per_token``) and whose fused attention kernel
        keeps a float32 log-sum-exp per head of a core the model writes out by hand
        (``written_attention``) instead of its scores, and K, V repeated only where
        ``kv_repeated``. Fused, no program keeps the exported mask (``sdpa_mask_bytes_per_token``),
        and run as written, only the masked blocks keep K, V repeated."""
        repl = self.written_norm_replicated_per_token if own_blocks else 0.0
        sharded = self.written_norm_sharded_per_token if own_blocks else 0.0
        if fused:
            attn = 4.0 * self.heads if own_blocks and self.written_attention \
                else self.fused_act_bytes_attn_per_token
            kept = (1.0 if kv_repeated else 0.0) if own_blocks else self.masked_attention_share
            sharded += self.sdpa_repeat_kv_bytes_per_token * (1.0 - kept)
            return (self.fused_act_bytes_replicated_per_token - repl - self.sdpa_mask_bytes_per_token,
                    self.fused_act_bytes_sharded_per_token - sharded, attn)
        return (self.block_act_bytes_replicated_per_token - repl, self.block_act_bytes_sharded_per_token - sharded,
                self.block_act_bytes_attn_per_token)

    def masked_bias_bytes_per_token(self) -> float:
        """16-bit bytes per token one block keeps on average for its SDPA mask's bias, run as
        written (``masked_attention_share``): the (b, 1, s, s) bias is s elements per token."""
        return 2.0 * self.seq * self.masked_attention_share

    def model_flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward = 3x forward, no recompute), the routed
        experts' at top-k whatever the model's code runs (``routed_expert_flops_per_token``)."""
        routed = self.routed_expert_flops_per_token() - self.expert_flops_per_token
        fwd = self.layers * (self.block_matmul_flops_per_token + routed + self.block_attn_flops_per_token)
        if self.lead is not None:
            fwd += self.lead.layers * (self.lead.block_matmul_flops_per_token + self.lead.block_attn_flops_per_token)
        return 3.0 * (fwd + self.head_flops_per_token)
