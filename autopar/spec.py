"""Model specs: presets and the ``gpt:``/``llama:`` spec strings of ``--model`` (design.md).

A :class:`ModelSpec` is pure data (no torch): the built-in model (``autopar.model``) is built
from it, the tracer traces that model, and the cost model reads what the tracer found.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.errors import UserError

ARCHS = ("gpt", "llama")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A decoder-only transformer's shape."""

    arch: str
    """``gpt`` (LayerNorm, GELU MLP, learned positions) or ``llama`` (RMSNorm, SwiGLU, RoPE, GQA)."""
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
    """MLP inner size; 0 means 4h."""
    tied: bool = False
    """Whether the output head shares the embedding weight."""
    name: str = ""
    """Preset name or the spec string it was parsed from."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise UserError(f"unknown architecture {self.arch!r}; use one of {', '.join(ARCHS)}")
        for field in ("layers", "hidden", "heads", "vocab", "seq"):
            if getattr(self, field) <= 0:
                raise UserError(f"model {field} must be a positive integer, got {getattr(self, field)}")
        if self.hidden % self.heads:
            raise UserError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.num_kv_heads <= 0 or self.heads % self.num_kv_heads:
            raise UserError(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        if self.arch == "llama" and self.head_dim % 2:
            raise UserError(f"RoPE needs an even head size, got hidden/heads={self.head_dim}")

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn_hidden(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048,
         tied: bool = True) -> ModelSpec:
    return ModelSpec(arch="gpt", layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq,
                     tied=tied, name=name)


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
           vocab: int = 128256, seq: int = 8192) -> ModelSpec:
    return ModelSpec(arch="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     ffn=ffn, vocab=vocab, seq=seq, tied=False, name=name)


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
    # A small model for the local CPU demo and tests.
    "gpt-tiny": _gpt("gpt-tiny", 4, 64, 4, vocab=256, seq=32, tied=False),
    **{f"megatron-{n}": _gpt(f"megatron-{n}", l, h, a) for n, l, h, a in _MEGATRON},
}

_INT_KEYS = {"layers", "hidden", "heads", "vocab", "seq", "kv_heads", "ffn", "tied"}


def parse_model_spec(text: str) -> ModelSpec:
    """Parse ``--model``: a preset name or ``arch:key=value,...`` (design.md)."""
    text = text.strip()
    if text in PRESETS:
        return PRESETS[text]
    arch, sep, rest = text.partition(":")
    if not sep:
        raise UserError(f"unknown model {text!r}; use a preset ({', '.join(sorted(PRESETS))}) "
                        "or a spec like gpt:layers=24,hidden=2048,heads=16,vocab=51200,seq=2048")
    if arch not in ARCHS:
        raise UserError(f"unknown model architecture {arch!r} in {text!r}; use one of {', '.join(ARCHS)}")
    values: dict[str, int] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _INT_KEYS:
            raise UserError(f"malformed model spec item {item!r}; keys are {', '.join(sorted(_INT_KEYS))}")
        try:
            values[key] = int(value)
        except ValueError:
            raise UserError(f"model spec {key}={value!r} is not an integer") from None
    missing = {"layers", "hidden", "heads", "vocab", "seq"} - values.keys()
    if missing:
        raise UserError(f"model spec {text!r} lacks {', '.join(sorted(missing))}")
    if arch == "gpt":
        values.setdefault("tied", 1)
    return ModelSpec(arch=arch, name=text, **{k: (bool(v) if k == "tied" else v) for k, v in values.items()})


def with_seq(spec: ModelSpec, seq: int) -> ModelSpec:
    """The same model trained at another sequence length."""
    return dataclasses.replace(spec, seq=seq)
