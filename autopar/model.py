"""The built-in decoder-only transformer that autopar traces, plans and trains.

``gpt``: LayerNorm, GELU MLP of ``ffn`` (4h), learned positions, biases (Megatron's GPT).
``llama``: RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, no biases.

The layout is pipeline-friendly (as torchtitan's models): blocks live in a ``ModuleDict`` keyed by
their global index, so a pipeline stage deletes what it does not own and keeps every parameter's
fully-qualified name, and ``forward`` skips the parts (embedding, norm, output) a stage lacks.
The attention reshapes with ``-1`` heads, so the same code runs on tensor-parallel local shards.
"""

from __future__ import annotations

import math
import zlib
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from autopar.spec import ModelSpec

INIT_STD = 0.02


class Embedding(nn.Module):
    """Token embedding, plus learned positions for ``gpt``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        # ``_weight`` skips nn.Embedding's own init: Transformer.reset_parameters initialises all.
        self.tok = nn.Embedding(spec.vocab, spec.hidden, _weight=torch.empty(spec.vocab, spec.hidden))
        self.pos = (nn.Embedding(spec.seq, spec.hidden, _weight=torch.empty(spec.seq, spec.hidden))
                    if spec.arch == "gpt" else None)
        self.positions: torch.Tensor | None = None
        """Global position of each input token (int64 [s], on the module's device) when a rank
        holds only some tokens of every sequence (context parallelism,
        ``runtime.context_parallel``); None: 0 .. s-1. Not a buffer: it differs between ranks,
        and DDP broadcasts buffers from rank 0."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        if self.pos is not None:
            at = self.positions if self.positions is not None else torch.arange(tokens.shape[1], device=tokens.device)
            h = h + self.pos(at)
        return h


def rotary_tables(seq: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE angles, each [seq, head_dim / 2] (Su et al. 2021)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x [b, s, heads, head_dim] by the angles of its s positions:
    ``cos``, ``sin`` [s, d/2] (the model's tables, built for its training sequence length, or
    their rows at a context-parallel rank's positions)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class CoreAttention(nn.Module):
    """softmax(q kᵀ / √d) v with a causal mask: the part selective recompute re-runs
    (Korthikanti et al. 2022, Sec. 5). No parameters."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v projections (column-parallel) and an output
    projection (row-parallel). ``rope``: the model's (cos, sin) tables (``rotary_tables``),
    computed once for all blocks; computed here when not given."""

    cos: torch.Tensor
    sin: torch.Tensor
    """RoPE tables [s, d/2] (non-persistent buffers; llama only)."""

    def __init__(self, spec: ModelSpec, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__()
        bias = spec.arch == "gpt"
        kv = spec.num_kv_heads * spec.head_dim
        self.head_dim = spec.head_dim
        self.q = nn.Linear(spec.hidden, spec.hidden, bias=bias)
        self.k = nn.Linear(spec.hidden, kv, bias=bias)
        self.v = nn.Linear(spec.hidden, kv, bias=bias)
        self.o = nn.Linear(spec.hidden, spec.hidden, bias=bias)
        self.core = CoreAttention()
        self.rotary = spec.arch == "llama"
        if self.rotary:
            cos, sin = rope if rope is not None else rotary_tables(spec.seq, spec.head_dim)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        self.positions: torch.Tensor | None = None
        """Global position of each input token (int64 [s]) under context parallelism, whose
        RoPE rows are used; None: 0 .. s-1 (``Embedding.positions``)."""

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the RoPE tables in place (after ``to_empty`` from meta)."""
        if self.rotary and not self.cos.is_meta:
            cos, sin = rotary_tables(self.cos.shape[0], 2 * self.cos.shape[1])
            self.cos.copy_(cos)
            self.sin.copy_(sin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, -1, self.head_dim)
        k = self.k(x).view(b, s, -1, self.head_dim)
        v = self.v(x).view(b, s, -1, self.head_dim)
        if self.rotary:
            cos, sin = cast(torch.Tensor, self.cos), cast(torch.Tensor, self.sin)
            if self.positions is not None:
                cos, sin = cos[self.positions], sin[self.positions]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = self.core(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """GELU MLP (gpt: ``up`` then ``down``) or SwiGLU (llama: ``gate`` * ``up`` then ``down``)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        bias = spec.arch == "gpt"
        self.up = nn.Linear(spec.hidden, spec.ffn_hidden, bias=bias)
        self.gate = nn.Linear(spec.hidden, spec.ffn_hidden, bias=False) if spec.arch == "llama" else None
        self.down = nn.Linear(spec.ffn_hidden, spec.hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is None:
            return self.down(F.gelu(self.up(x), approximate="tanh"))
        return self.down(F.silu(self.gate(x)) * self.up(x))


def _norm(spec: ModelSpec) -> nn.Module:
    return nn.LayerNorm(spec.hidden) if spec.arch == "gpt" else nn.RMSNorm(spec.hidden, eps=1e-5)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, spec: ModelSpec, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.attn_norm = _norm(spec)
        self.attn = Attention(spec, rope)
        self.mlp_norm = _norm(spec)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """tokens [b, s] (int64) -> logits [b, s, vocab]; stages of a pipeline hold a subset."""

    def __init__(self, spec: ModelSpec, seed: int = 0) -> None:
        super().__init__()
        self.spec = spec
        self.embed: Embedding | None = Embedding(spec)
        # One RoPE table for every block (the same values; non-persistent buffers that
        # ``to``/``to_empty`` replace per module and ``reset_buffers`` rewrites in place).
        rope = rotary_tables(spec.seq, spec.head_dim) if spec.arch == "llama" else None
        self.layers = nn.ModuleDict({str(i): Block(spec, rope) for i in range(spec.layers)})
        self.norm: nn.Module | None = _norm(spec)
        self.output: nn.Linear | None = nn.Linear(spec.hidden, spec.vocab, bias=False)
        self.tie_weights()
        self.reset_parameters(seed)

    def tie_weights(self) -> None:
        """Share the embedding with the head when tied and both are here (again after
        ``to_empty``, which gives every parameter a new tensor)."""
        if self.spec.tied and self.embed is not None and self.output is not None:
            self.output.weight = self.embed.tok.weight

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """GPT-2 style init: N(0, 0.02), output projections scaled by 1/sqrt(2 L), zero biases,
        unit norm weights. Each parameter draws from its own generator seeded by ``seed`` and
        its fully-qualified name, so a pipeline stage that holds a subset of the blocks gets
        exactly the values of the whole model. Parameters on ``meta`` are left alone."""
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            if p.dim() == 1:
                if name.endswith("weight"):
                    p.fill_(1.0)
                else:
                    p.zero_()
            else:
                std = INIT_STD / math.sqrt(2 * self.spec.layers) if name.endswith(("o.weight", "down.weight")) else INIT_STD
                # A pipeline's last stage holds its own copy of a tied head: seed it as the embedding.
                key = "embed.tok.weight" if self.spec.tied and name == "output.weight" else name
                gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
                p.normal_(0.0, std, generator=gen)
        for layer in self.layers.values():
            attn = layer.attn
            assert isinstance(attn, Attention)  # each block's, through a checkpoint wrapper too
            attn.reset_buffers()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over all tokens of the (micro-)batch, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def build_model(spec: ModelSpec, device: str | torch.device = "cpu", seed: int = 0) -> Transformer:
    """The built-in model of ``spec`` on ``device`` (``meta`` allocates nothing)."""
    with torch.device(device):
        return Transformer(spec, seed)
