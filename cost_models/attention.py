"""What one block's fused attention kernel executes of the full QKᵀ and AV FLOPs (a share of
4 s² d per head and sequence): the causal triangle, a window's band, or all of it where the
kernel is handed a mask; and its backward's FLOPs over its forward's. ``cost_models.compute``
prices the kernel's time from them."""

from __future__ import annotations

from cost_models.model_profile import ModelProfile
from cost_models.strategy import Strategy

FLASH_TILE = 128
"""Query/key tile of FlashAttention-2's causal kernels: the diagonal tiles run whole."""
FLASH_BWD_RATIO = 2.5
"""FlashAttention's backward FLOPs over its forward's (Dao 2023, Sec. 3.1: five GEMMs vs two)."""


def causal_fraction(seq: int) -> float:
    """Share of the full QKᵀ/AV FLOPs a causal FlashAttention kernel executes."""
    return min(1.0, (seq + FLASH_TILE) / (2.0 * seq))


def window_fraction(seq: int, window: int) -> float:
    """Share of the full QKᵀ/AV FLOPs a causal kernel executes on a layer whose queries see
    the last ``window`` keys: the band, w (s - w / 2) of the s² pairs, and the tiles it cuts
    along its two edges, a tile per query (``causal_fraction`` where no window is shorter)."""
    causal = causal_fraction(seq)
    if window <= 0 or window >= seq:
        return causal
    return min(causal, window * (seq - window / 2) / seq**2 + FLASH_TILE / seq)


def executed_fraction(model: ModelProfile, strat: Strategy) -> float:
    """Share of the full QKᵀ/AV FLOPs one block's fused kernel executes on average: the causal
    kernel's (``causal_fraction``); all of them on the blocks whose own code passes SDPA an
    explicit mask, where the program runs the module as written (``masked_attention_share``);
    each layer's window band where the program's kernel runs windows (``recipe.sliding_window``)."""
    causal = causal_fraction(model.seq)
    if strat.recipe.runs_module_as_written:
        return causal + (1.0 - causal) * model.masked_attention_share
    if strat.recipe.sliding_window and model.attention_windows:
        w = model.attention_windows
        return sum(window_fraction(model.seq, x) for x in w) / len(w)
    return causal
