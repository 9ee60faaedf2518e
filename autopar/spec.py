"""Model specs: presets and the ``--model`` forms of design.md.

- a preset name (``gpt3-175b``, ``llama3-405b``, ``mixtral-8x7b``, ``megatron-1t`` ...);
- ``gpt:layers=L,hidden=H,heads=A,vocab=V,seq=S[,tied=0|1]`` and
  ``llama:layers=L,hidden=H,heads=A,kv_heads=K,ffn=F,vocab=V,seq=S``: the built-in model;
- ``moe:<llama keys>,experts=E,topk=K`` (or the same keys after ``llama:``): a Mixtral-style
  mixture of experts, traced through HF transformers' ``MixtralForCausalLM``;
- ``hf:<transformers config class>:key=value,...``: any HF causal LM with random weights;
- ``path/to/file.py:factory``: a user factory returning ``(nn.Module, example_inputs)``.

A :class:`ModelSpec` is pure data (no torch, no transformers at import time). ``hf:`` specs read
their shape from the config class (transformers imported lazily); file specs are opaque here and
described by what the tracer finds.
"""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.errors import UserError
from autopar.limits import SPEC_LIMITS, check_count, shown

ARCHS = ("gpt", "llama", "hf", "module")
"""``gpt``/``llama``: the built-in model (or HF Mixtral when ``experts``); ``hf``: a transformers
config class; ``module``: a user factory."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A model's shape and where it comes from. Shape fields are 0 where unknown (``module``)."""

    arch: str
    """``gpt`` (LayerNorm, GELU MLP, learned positions), ``llama`` (RMSNorm, SwiGLU, RoPE, GQA),
    ``hf`` (a transformers config class) or ``module`` (a user factory)."""
    layers: int
    """Number of transformer blocks."""
    hidden: int
    """Hidden size h."""
    heads: int
    """Attention heads a; h must be divisible by a."""
    vocab: int
    """Vocabulary size V."""
    seq: int
    """Default (and maximum, for learned positions) sequence length s in tokens."""
    kv_heads: int = 0
    """Key/value heads (GQA); 0 means equal to ``heads``."""
    ffn: int = 0
    """MLP inner size (per expert); 0 means 4h."""
    tied: bool = False
    """Whether the output head shares the embedding weight."""
    name: str = ""
    """Preset name or the spec string it was parsed from."""
    experts: int = 0
    """Experts per MoE layer (0: dense)."""
    topk: int = 0
    """Experts each token is routed to (MoE only)."""
    capacity_factor: float = 0.0
    """Tokens an expert takes at most over its fair share (tokens x topk / experts); 0:
    dropless, every routed token computed (Mixtral, Qwen-MoE, DeepSeek-V3)."""
    source: str = ""
    """``hf``: the transformers config class name; ``module``: ``path/to/file.py:factory``."""
    options: tuple[tuple[str, str], ...] = ()
    """``hf``: the config's ``key=value`` overrides, as written (values parsed as Python literals)."""
    max_positions: int = 0
    """Rows of a learned position table the model keeps whatever ``seq`` (HF GPT-2, OPT ...):
    the longest sequence it can train on; 0: no such limit (RoPE, ALiBi, or the built-in GPT,
    whose table is built at ``seq``)."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise UserError(f"unknown architecture {self.arch!r}; use one of {', '.join(ARCHS)}")
        if self.arch == "module":
            return
        for field in ("layers", "hidden", "heads", "vocab", "seq"):
            check_count(f"model {field}", getattr(self, field), SPEC_LIMITS[field])
        for field in ("kv_heads", "ffn", "experts", "topk"):
            check_count(f"model {field}", getattr(self, field), SPEC_LIMITS[field], low=0)
        if not isinstance(self.tied, bool):
            raise UserError(f"model tied must be 0 or 1, got {shown(self.tied)}")
        if self.max_positions and self.seq > self.max_positions:
            raise UserError(f"{shown(self.name or 'the model')} learns {self.max_positions} positions; use a "
                            f"sequence length of at most {self.max_positions} (--seq-len, or seq= in the spec), "
                            f"got {self.seq}")
        if self.hidden % self.heads and self.arch != "hf":
            raise UserError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.num_kv_heads <= 0 or self.heads % self.num_kv_heads:
            raise UserError(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        if self.arch == "llama" and self.head_dim % 2:
            raise UserError(f"RoPE needs an even head size, got hidden/heads={self.head_dim}")
        if self.experts < 0 or (self.experts > 0) != (self.topk > 0) or self.topk > self.experts:
            raise UserError(f"a mixture of experts needs experts >= topk >= 1, got experts={self.experts} "
                            f"topk={self.topk}")
        if self.experts and self.arch == "gpt":
            raise UserError("experts on the gpt architecture are not supported; use "
                            "moe:layers=..,hidden=..,heads=..,kv_heads=..,ffn=..,vocab=..,seq=..,experts=E,topk=K "
                            "(Mixtral-style: RMSNorm, SwiGLU experts, RoPE)")

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn_hidden(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads if self.heads else 0

    @property
    def builtin(self) -> bool:
        """Built from ``autopar.model`` (dense gpt/llama), so the runtime can train it."""
        return self.arch in ("gpt", "llama") and not self.experts


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048,
         tied: bool = True) -> ModelSpec:
    return ModelSpec(arch="gpt", layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq,
                     tied=tied, name=name)


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
           vocab: int = 128256, seq: int = 8192, experts: int = 0, topk: int = 0) -> ModelSpec:
    return ModelSpec(arch="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     ffn=ffn, vocab=vocab, seq=seq, tied=False, name=name, experts=experts, topk=topk)


# Megatron-LM weak-scaling models: Narayanan et al. SC'21 Table 1 (V = 51,200, s = 2048).
_MEGATRON = [
    ("1.7b", 24, 2304, 24), ("3.6b", 30, 3072, 32), ("7.5b", 36, 4096, 32),
    ("18.4b", 40, 6144, 48), ("39.1b", 48, 8192, 64), ("76.1b", 60, 10240, 80),
    ("145.6b", 80, 12288, 96), ("310.1b", 96, 16384, 128), ("529.6b", 105, 20480, 128),
    ("1t", 128, 25600, 160),
]

PRESETS: dict[str, ModelSpec] = {
    # GPT-3 175B as trained with Megatron-LM (Narayanan Table 1 row "175B": V padded to 51,200).
    "gpt3-175b": _gpt("gpt3-175b", 96, 12288, 96),
    # GPT-2 family (Radford et al. 2019): V = 50,257, s = 1024, tied head.
    "gpt2": _gpt("gpt2", 12, 768, 12, vocab=50257, seq=1024),
    "gpt2-medium": _gpt("gpt2-medium", 24, 1024, 16, vocab=50257, seq=1024),
    "gpt2-large": _gpt("gpt2-large", 36, 1280, 20, vocab=50257, seq=1024),
    "gpt2-xl": _gpt("gpt2-xl", 48, 1600, 25, vocab=50257, seq=1024),
    # Llama 3 (Meta, "The Llama 3 Herd of Models", Table 3).
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 8, 14336),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 8, 28672),
    "llama3-405b": _llama("llama3-405b", 126, 16384, 128, 8, 53248),
    # Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts"): 46.7B parameters, 12.9B active;
    # V = 32,000, trained at up to 32k tokens (seq 4096 here as a training default).
    "mixtral-8x7b": _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, vocab=32000, seq=4096,
                           experts=8, topk=2),
    # DeepSeek-V3 (DeepSeek-AI 2024, arXiv 2412.19437, Sec. 4.2): 61 blocks, the first 3 dense
    # (MLP 18,432), then 58 MoE (256 routed experts of width 2,048 + 1 shared, top-8); MLA with
    # 128 heads (q rank 1,536, kv rank 512); V = 129,280; pre-trained at seq 4,096. Built as HF
    # transformers' DeepseekV3ForCausalLM (random weights on meta): 671B parameters, as
    # published; its multi-token-prediction module (14B, not in HF's model) is not priced.
    "deepseek-v3": ModelSpec(
        arch="hf", name="deepseek-v3", source="DeepseekV3Config", layers=61, hidden=7168, heads=128,
        kv_heads=128, ffn=18432, vocab=129280, seq=4096, experts=256, topk=8,
        options=(("num_hidden_layers", "61"), ("first_k_dense_replace", "3"), ("hidden_size", "7168"),
                 ("num_attention_heads", "128"), ("num_key_value_heads", "128"),
                 ("intermediate_size", "18432"), ("moe_intermediate_size", "2048"),
                 ("n_routed_experts", "256"), ("n_shared_experts", "1"), ("num_experts_per_tok", "8"),
                 ("n_group", "8"), ("topk_group", "4"), ("q_lora_rank", "1536"), ("kv_lora_rank", "512"),
                 ("qk_nope_head_dim", "128"), ("qk_rope_head_dim", "64"), ("v_head_dim", "128"),
                 ("vocab_size", "129280"), ("max_position_embeddings", "4096"),
                 ("tie_word_embeddings", "False"))),
    # A small model for the local CPU demo and tests.
    "gpt-tiny": _gpt("gpt-tiny", 4, 64, 4, vocab=256, seq=32, tied=False),
    **{f"megatron-{n}": _gpt(f"megatron-{n}", l, h, a) for n, l, h, a in _MEGATRON},
}

PUBLISHED_PARAMS: dict[str, float] = {
    # GPT-2: the released checkpoints' counts (the paper rounds XL to "1.5B").
    "gpt3-175b": 175e9, "gpt2": 124.44e6, "gpt2-medium": 354.82e6, "gpt2-large": 774.03e6, "gpt2-xl": 1.5576e9,
    "llama3-8b": 8.03e9, "llama3-70b": 70.6e9, "llama3-405b": 405.9e9, "mixtral-8x7b": 46.7e9,
    "deepseek-v3": 671e9,
    **{f"megatron-{n}": float(n[:-1]) * (1e12 if n.endswith("t") else 1e9) for n, *_ in _MEGATRON},
}
"""Published parameter counts of the presets (model cards and papers), for checks."""

_INT_KEYS = {"layers", "hidden", "heads", "vocab", "seq", "kv_heads", "ffn", "tied", "experts", "topk"}
_EXAMPLE = "gpt:layers=24,hidden=2048,heads=16,vocab=51200,seq=2048"


def _parse_items(text: str, rest: str) -> dict[str, int]:
    values: dict[str, int] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _INT_KEYS:
            raise UserError(f"malformed model spec item {shown(item)}; keys are {', '.join(sorted(_INT_KEYS))}")
        if key in values:
            raise UserError(f"model spec {shown(text)} gives {key} twice; give each key once")
        try:
            values[key] = int(value)
        except ValueError:
            raise UserError(f"model spec {key}={shown(value)} is not an integer") from None
        if key == "tied" and values[key] not in (0, 1):
            raise UserError(f"model spec tied={shown(value)} must be 0 or 1")
    missing = {"layers", "hidden", "heads", "vocab", "seq"} - values.keys()
    if missing:
        raise UserError(f"model spec {shown(text)} lacks {', '.join(sorted(missing))}")
    return values


def _top_level_items(rest: str) -> list[str]:
    """``rest`` cut at its commas outside brackets and quotes, so that a value may be a dict or
    a list literal (``rope_parameters={'rope_type': 'llama3', 'factor': 8.0}``)."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(rest):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            items.append(rest[start:i])
            start = i + 1
    return [*items, rest[start:]]


def parse_hf_options(text: str, rest: str) -> tuple[tuple[str, str], ...]:
    """``key=value,...`` of an ``hf:`` spec, kept as strings (see :func:`hf_option_values`); a
    value may be a bracketed literal holding commas."""
    items = []
    for item in filter(None, _top_level_items(rest)):
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise UserError(f"malformed item {shown(item)} in {shown(text)}; write hf:ConfigClass:key=value,...")
        items.append((key.strip(), value.strip()))
    return tuple(items)


def hf_option_values(options: tuple[tuple[str, str], ...]) -> dict[str, object]:
    """``hf:`` overrides as Python values (``1e-5``, ``True``, ``'silu'``; bare words are strings)."""
    values: dict[str, object] = {}
    for key, value in options:
        try:
            values[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError):  # a deep or huge literal
            values[key] = value
    return values


def parse_model_spec(text: str) -> ModelSpec:
    """Parse ``--model``: a preset, ``gpt:``/``llama:``/``moe:``/``hf:`` spec or ``file.py:factory``."""
    text = text.strip()
    if text in PRESETS:
        return PRESETS[text]
    arch, sep, rest = text.partition(":")
    if not sep:
        raise UserError(f"unknown model {shown(text)}; use a preset ({', '.join(sorted(PRESETS))}) "
                        f"or a spec like {_EXAMPLE}")
    if arch == "hf":
        from autopar.hf import spec_from_hf  # lazy: transformers is optional
        cls, _, items = rest.partition(":")
        return spec_from_hf(text, cls.strip(), parse_hf_options(text, items))
    if arch.endswith(".py") or ".py:" in text:
        path, _, factory = text.rpartition(":")
        if not _is_file(path):
            raise UserError(f"model file {shown(path)} does not exist; write path/to/file.py:factory")
        if not factory.isidentifier():
            raise UserError(f"{shown(factory)} in {shown(text)} is not a function name; write path/to/file.py:factory")
        return ModelSpec(arch="module", layers=0, hidden=0, heads=0, vocab=0, seq=0, name=text,
                         source=text)
    if arch == "moe":
        arch = "llama"
        values = _parse_items(text, rest)
        if "experts" not in values or "topk" not in values:
            raise UserError(f"moe spec {shown(text)} needs experts=E and topk=K")
    elif arch in ("gpt", "llama"):
        values = _parse_items(text, rest)
    else:
        raise UserError(f"unknown model architecture {shown(arch)} in {shown(text)}; use gpt, llama, moe, hf "
                        "or path/to/file.py:factory")
    if arch == "gpt":
        values.setdefault("tied", 1)
    fields: dict[str, Any] = {k: (bool(v) if k == "tied" else v) for k, v in values.items()}
    return ModelSpec(arch=arch, name=text, **fields)


def _is_file(path: str) -> bool:
    """``path`` names a file (False for a name the OS refuses: too long, a NUL byte)."""
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False


def with_seq(spec: ModelSpec, seq: int) -> ModelSpec:
    """The same model trained at another sequence length (``--seq-len``: positive, within the
    limits and within a learned position table)."""
    check_count("--seq-len", seq, SPEC_LIMITS["seq"])
    return dataclasses.replace(spec, seq=seq)
