"""Bounds on every size autopar accepts: far above any model or cluster trained today, low
enough that tracing (one module per block, on meta), the search (divisors of the device count
and of the batch) and the cost model answer in bounded time and memory, and that no tensor
shape on meta overflows int64 (heads x seq² ≤ 2^58)."""

from __future__ import annotations

import math

from autopar.errors import UserError

MAX_LAYERS = 1024
"""Transformer blocks (Llama-3 405B has 126, Megatron's 1T 128); each is traced on meta."""
MAX_HIDDEN = 1 << 18
MAX_HEADS = 1 << 14
MAX_FFN = 1 << 20
MAX_VOCAB = 1 << 24
MAX_SEQ = 1 << 20
"""Tokens per training sequence (1,048,576)."""
MAX_EXPERTS = 1 << 12
MAX_GPUS = 1 << 20
"""Devices of one job (1,048,576)."""
MAX_GLOBAL_BATCH = 1 << 24
"""Sequences per optimizer step (16,777,216)."""
MAX_LOCAL_RANKS = 64
"""Processes ``autopar run`` and ``demo`` start on this machine (torchrun --standalone)."""

SPEC_LIMITS = {"layers": MAX_LAYERS, "hidden": MAX_HIDDEN, "heads": MAX_HEADS, "kv_heads": MAX_HEADS,
               "ffn": MAX_FFN, "vocab": MAX_VOCAB, "seq": MAX_SEQ, "experts": MAX_EXPERTS,
               "topk": MAX_EXPERTS}
"""Upper bound of each integer field of a model spec."""


def is_int(value: object) -> bool:
    """An integer that is not a bool (``True`` is an int in Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_count(name: str, value: object, limit: int, low: int = 1) -> int:
    """``value`` as an int in [low, limit], else a ``UserError`` naming ``name`` and the range."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise UserError(f"{name} must be an integer, got {shown(value)}")
    if value < low:
        need = {0: "0 or more", 1: "positive"}.get(low, f"at least {low}")
        raise UserError(f"{name} must be {need}, got {shown(value)}")
    if value > limit:
        raise UserError(f"{name} {shown(value)} is above autopar's limit of {limit:,}; use a smaller value")
    return value


def check_seconds(name: str, value: float) -> float:
    """A finite, positive number of seconds."""
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"{name} must be a finite, positive number of seconds, got {value}")
    return value


def shown(value: object) -> str:
    """``repr`` of a user value on one line, at most 60 characters (an integer too long for
    ``repr``, over 4,300 digits, by its size)."""
    if is_int(value) and abs(value).bit_length() > 128:  # type: ignore[arg-type]
        text = f"an integer of about {int(abs(value).bit_length() * math.log10(2)) + 1:,} digits"  # type: ignore[arg-type]
    else:
        try:
            text = " ".join(repr(value).split())
        except RecursionError:
            text = f"a deeply nested {type(value).__name__}"
    return text if len(text) <= 60 else text[:59] + "…"
