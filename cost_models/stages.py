"""The seam between the cost model and the solver: per-stage costs linear in the layer counts.

For a fixed outer strategy (everything but the placement), stage s holding n_{s,r} transformer
blocks with recompute mode r (none, selective, full) costs, per micro-batch and per step:

    T_s = Σ_r n_{s,r} layer_time_s[r] + [s = 0] first_time_s + [s = p-1] last_time_s + p2p_time_s
    D_s = Σ_r n_{s,r} layer_dp_time_s[r] + [s = 0] first_dp_time_s + [s = p-1] last_dp_time_s
    M_s = buffer_bytes + max_{r: n_{s,r} > 0} workspace_bytes[r]
          + Σ_r n_{s,r} (layer_static_bytes + inflight[s] layer_act_bytes[r]
                         + pending[s] layer_wgrad_bytes)
          + [s = 0] (first_static_bytes + inflight[0] first_act_bytes + first_workspace_bytes)
          + [s = p-1] (last_static_bytes + inflight[p-1] last_act_bytes + last_transient_bytes
                       - last_freed_bytes)
          + [s < p-1] backward_start_bytes + held_bytes[s]

and, with CPU offload, the host-memory row (offloaded shards, independent of recompute)

    H_s = Σ_r n_{s,r} layer_host_bytes + [s = 0] first_host_bytes + [s = p-1] last_host_bytes
          ≤ host_cap_bytes

and the step takes

    step = sum_weight * Σ_s T_s + max_weight * max_s T_s + max_s D_s

T_s is forward + recompute + backward of one micro-batch, D_s the part of the gradient
reduction and optimizer step not hidden behind compute, ``workspace_bytes[r]`` what recompute
mode r rebuilds during one block's backward (0 for none). The "first" terms are the embedding's
plus those of the model's leading blocks of another kind (``ModelProfile.lead``), whose
recompute workspace ``first_workspace_bytes`` is added to, not maxed with, the stage's own (a
bound above the peak by at most one block's workspace, which keeps every M_s linear). The schedule sets the weights (for
GPipe and 1F1B, sum 1 and max m - 1: the fill and drain pass every stage once, the steady state
runs at the slowest stage). ``estimate`` and the solver both evaluate exactly these formulas, so
the solver's optimum is the estimate's optimum.

A stage's load is either an int n (n blocks, all in the strategy's ``recompute`` mode,
``nominal``) or a tuple of counts per mode in ``RECOMPUTE`` order. ``pending[s]`` counts the
micro-batches whose weight pass stage s has deferred (``cost_models.pipeline.pending``; all 0
but under torch's zero-bubble schedule), each keeping its blocks' operators' output gradients;
``held_bytes[s]`` what else that schedule holds on stage s (``memory.zero_bubble_held_bytes``).
Where every stage peaks before making any gradient (``grads_absent``), each piece's
activations term a becomes max(a, g) - g, g the gradients its static bytes count; where a
stage runs all its forwards before its first backward (``forward_first``), each piece's
k a + g loses min(a, g) (one micro-batch's activations, or the gradients not yet made).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models.strategy import RECOMPUTE

Load = int | tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCosts:
    """Coefficients of the per-stage formulas above; seconds and bytes; per-mode tuples are in
    ``RECOMPUTE`` order (none, selective, full)."""

    pp: int
    nominal: int
    """Index in ``RECOMPUTE`` of the strategy's own recompute mode (the mode of an int load)."""
    mode_time_s: tuple[float, ...]
    first_time_s: float
    last_time_s: float
    p2p_time_s: float
    mode_dp_time_s: tuple[float, ...]
    first_dp_time_s: float
    last_dp_time_s: float
    layer_static_bytes: float
    mode_act_bytes: tuple[float, ...]
    mode_workspace_bytes: tuple[float, ...]
    first_static_bytes: float
    first_act_bytes: float
    last_static_bytes: float
    last_act_bytes: float
    inflight: tuple[float, ...]
    """Micro-batches whose activations stage s holds at its peak."""
    buffer_bytes: float
    """Communication buffers, workspace and allocator reserve on every device (recompute
    workspace apart: ``mode_workspace_bytes``)."""
    sum_weight: float
    max_weight: float
    layer_host_bytes: float = 0.0
    """Offloaded state of one block in host memory, bytes (0 without offload)."""
    first_host_bytes: float = 0.0
    last_host_bytes: float = 0.0
    host_cap_bytes: float = float("inf")
    """Host memory per device for offloaded state, bytes (inf without offload)."""
    first_workspace_bytes: float = 0.0
    """Recompute workspace of the leading blocks on the first stage, bytes (0 without them)."""
    pending: tuple[float, ...] = ()
    """Micro-batches whose weight pass stage s defers (``()``: none on any stage)."""
    layer_wgrad_bytes: float = 0.0
    """Output gradients one block keeps per deferred weight pass, bytes."""
    held_bytes: tuple[float, ...] = ()
    """What else stage s holds for its schedule's deferred passes, bytes (``()``: nothing;
    may be negative where that schedule frees what the per-piece terms count)."""
    last_transient_bytes: float = 0.0
    """What the loss's backward allocates beyond ``last_act_bytes`` while it runs, once at the
    last stage's peak (``memory.loss_backward_bytes``), bytes."""
    last_freed_bytes: float = 0.0
    """What the last stage has freed of its ``inflight`` micro-batches' ``last_act_bytes`` by
    its peak, bytes (at most all but one's)."""
    grads_absent: bool = False
    """Every stage peaks before it has made any gradient (``memory.grads_absent``): each
    piece holds the larger of its live activations and its gradients (made as they go)."""
    layer_grad_bytes: float = 0.0
    """The gradients inside ``layer_static_bytes`` (and the first and last pieces' below),
    bytes; set and read only with ``grads_absent``."""
    first_grad_bytes: float = 0.0
    last_grad_bytes: float = 0.0
    backward_start_bytes: float = 0.0
    """What a block's backward allocates as it starts, at every stage but the last (whose loss
    backward comes first: ``last_transient_bytes``) (``memory.backward_start_bytes``), bytes."""
    forward_first: tuple[bool, ...] = ()
    """Per stage, whether all its forwards precede its first backward, which makes its
    gradients (``memory.forward_first``; ``()``: none does). Such a stage holds, at the latest
    forward's end, its live activations and no gradient, and after that backward, its
    gradients and one micro-batch fewer: each piece's peak is its live activations and
    gradients less the smaller of one micro-batch's activations and its gradients (a piece at
    a time: never below the whole stage's peak). The grad fields above are set with it."""

    def pending_at(self, s: int) -> float:
        """Deferred weight passes on stage s."""
        return self.pending[s] if self.pending else 0.0

    def block_bytes(self, s: int, r: int) -> float:
        """Bytes one block in mode r adds to stage s: its states, ``inflight[s]`` micro-batches'
        activations and ``pending[s]`` weight passes' output gradients (with ``grads_absent``,
        ``_or_grads`` of the last two, inlined: the solver's hot path)."""
        live = self.inflight[s] * self.mode_act_bytes[r]
        if self.pending:
            live += self.pending[s] * self.layer_wgrad_bytes
        if self.grads_absent:
            return self.layer_static_bytes + max(live, self.layer_grad_bytes) - self.layer_grad_bytes
        if self.forward_first and self.forward_first[s]:
            return self.layer_static_bytes + live - min(self.mode_act_bytes[r], self.layer_grad_bytes)
        return self.layer_static_bytes + live

    def _or_grads(self, live: float, grads: float) -> float:
        """A piece's activations ``live`` at the peak, or with ``grads_absent`` the larger of
        them and its gradients, less the gradients its static bytes count."""
        return max(live, grads) - grads if self.grads_absent else live

    def memory_key(self, s: int) -> tuple:
        """What stage s's memory row depends on besides its load (``stage_fixed_bytes`` and
        ``block_bytes`` read nothing else of s): stages with equal keys hold the same blocks
        within any cap."""
        return (self.inflight[s], self.pending[s] if self.pending else 0.0,
                self.held_bytes[s] if self.held_bytes else 0.0, s == 0, s == self.pp - 1,
                bool(self.forward_first) and self.forward_first[s])

    @property
    def layer_time_s(self) -> float:
        """T of one block in the nominal mode."""
        return self.mode_time_s[self.nominal]

    @property
    def layer_dp_time_s(self) -> float:
        return self.mode_dp_time_s[self.nominal]

    @property
    def layer_act_bytes(self) -> float:
        return self.mode_act_bytes[self.nominal]

    def counts(self, load: Load) -> tuple[int, ...]:
        """Blocks per recompute mode of a stage load."""
        if isinstance(load, tuple):
            return load
        return tuple(load if r == self.nominal else 0 for r in range(len(RECOMPUTE)))

    def stage_time_s(self, s: int, load: Load) -> float:
        """T_s: one micro-batch through stage s."""
        t = sum(n * x for n, x in zip(self.counts(load), self.mode_time_s)) + self.p2p_time_s
        return (t + (self.first_time_s if s == 0 else 0.0)
                + (self.last_time_s if s == self.pp - 1 else 0.0))

    def stage_dp_time_s(self, s: int, load: Load) -> float:
        """D_s: exposed gradient reduction and optimizer time of stage s."""
        d = sum(n * x for n, x in zip(self.counts(load), self.mode_dp_time_s))
        return (d + (self.first_dp_time_s if s == 0 else 0.0)
                + (self.last_dp_time_s if s == self.pp - 1 else 0.0))

    def stage_workspace_bytes(self, load: Load) -> float:
        """Recompute workspace of the most demanding mode the stage uses."""
        return max((w for n, w in zip(self.counts(load), self.mode_workspace_bytes) if n > 0),
                   default=0.0)

    def stage_fixed_bytes(self, s: int) -> float:
        """M_s of an empty stage (no blocks, no recompute workspace)."""
        k = self.inflight[s]
        m = self.buffer_bytes + (self.held_bytes[s] if self.held_bytes else 0.0)
        if s == 0:
            m += (self.first_static_bytes + self._or_grads(k * self.first_act_bytes, self.first_grad_bytes)
                  + self.first_workspace_bytes)
        if s == self.pp - 1:
            m += self.last_static_bytes + self._or_grads(self.last_live_bytes(), self.last_grad_bytes)
        else:
            m += self.backward_start_bytes
        return m - sum(self.forward_first_savings(s, ()))

    def memory_rows(self, modes: tuple[int, ...]) -> list[tuple[float, tuple[float, ...]]]:
        """Per stage s, (``stage_fixed_bytes(s)``, ``block_bytes(s, r)`` for r in ``modes``),
        in one pass: the solver's hot path. Equal to those methods to the bit (the same sums
        in the same order)."""
        if self.grads_absent:
            return [(self.stage_fixed_bytes(s), tuple(self.block_bytes(s, r) for r in modes))
                    for s in range(self.pp)]
        last, static, acts = self.pp - 1, self.layer_static_bytes, [self.mode_act_bytes[r] for r in modes]
        first_extra = self.first_static_bytes + self.inflight[0] * self.first_act_bytes + self.first_workspace_bytes
        last_extra = self.last_static_bytes + self.last_live_bytes()
        freed = [min(a, self.layer_grad_bytes) for a in acts]  # a forward-first stage's, per block
        rows = []
        for s, k in enumerate(self.inflight):
            m = self.buffer_bytes + (self.held_bytes[s] if self.held_bytes else 0.0)
            if s == 0:
                m += first_extra
            m += last_extra if s == last else self.backward_start_bytes
            w = self.pending[s] * self.layer_wgrad_bytes if self.pending else None
            per = tuple(static + k * a for a in acts) if w is None else tuple(static + (k * a + w) for a in acts)
            if self.forward_first and self.forward_first[s]:
                if s in (0, last):  # the embedding's and head's savings (none from no blocks)
                    m -= sum(self.forward_first_savings(s, ()))
                per = tuple(b - f for b, f in zip(per, freed))
            rows.append((m, per))
        return rows

    def forward_first_savings(self, s: int, counts: tuple[int, ...]) -> tuple[float, float]:
        """(activations freed, gradients not yet made) at stage s's peak (``forward_first``) by
        its pieces: ``counts`` blocks per mode (``()``: none) and the embedding's and head's."""
        if self.grads_absent or not (self.forward_first and self.forward_first[s]):
            return 0.0, 0.0
        pieces = [(n, a, self.layer_grad_bytes) for n, a in zip(counts, self.mode_act_bytes) if n]
        if s == 0:
            pieces.append((1, self.first_act_bytes, self.first_grad_bytes))
        if s == self.pp - 1:
            pieces.append((1, self.last_act_bytes, self.last_grad_bytes))
        return sum(n * a for n, a, g in pieces if a <= g), sum(n * g for n, a, g in pieces if a > g)

    def last_live_bytes(self) -> float:
        """The head's activations at the last stage's peak, bytes."""
        return self.inflight[self.pp - 1] * self.last_act_bytes + self.last_transient_bytes - self.last_freed_bytes

    def stage_grad_bytes(self, s: int, load: Load) -> float:
        """With ``grads_absent``, the gradients live at stage s's peak, bytes: what each piece's
        exceed its live activations by (the static bytes count them whole otherwise)."""
        counts, k = self.counts(load), self.inflight[s]
        pieces = [(n, k * a + self.pending_at(s) * self.layer_wgrad_bytes, self.layer_grad_bytes)
                  for n, a in zip(counts, self.mode_act_bytes) if n]
        if s == 0:
            pieces.append((1, k * self.first_act_bytes, self.first_grad_bytes))
        if s == self.pp - 1:
            pieces.append((1, self.last_live_bytes(), self.last_grad_bytes))
        return sum(n * max(0.0, g - live) for n, live, g in pieces)

    def stage_pending_bytes(self, s: int, load: Load) -> float:
        """What stage s keeps for its deferred weight passes, bytes (inside ``stage_memory_bytes``)."""
        if not self.pending:
            return 0.0
        return (self.pending[s] * sum(self.counts(load)) * self.layer_wgrad_bytes + self.held_bytes[s]
                - (self.last_freed_bytes if s == self.pp - 1 else 0.0))

    def stage_host_bytes(self, s: int, load: Load) -> float:
        """H_s: offloaded state of stage s in host memory, bytes."""
        h = sum(self.counts(load)) * self.layer_host_bytes
        return (h + (self.first_host_bytes if s == 0 else 0.0)
                + (self.last_host_bytes if s == self.pp - 1 else 0.0))

    def host_upper_bound(self, s: int, layers: int) -> int:
        """Most blocks stage s holds within ``host_cap_bytes`` (at most ``layers``); -1 when
        even its embedding/head state overflows."""
        room = self.host_cap_bytes - self.stage_host_bytes(s, 0)
        if room < 0:
            return -1
        if self.layer_host_bytes <= 0 or room == float("inf"):
            return layers
        return min(layers, math.floor(room / self.layer_host_bytes))

    def stage_memory_bytes(self, s: int, load: Load) -> float:
        """M_s: peak bytes on a device of stage s."""
        counts = self.counts(load)
        return (self.stage_fixed_bytes(s) + self.stage_workspace_bytes(counts)
                + sum(n * self.block_bytes(s, r) for r, n in enumerate(counts) if n))

    def step_time_s(self, loads: tuple[Load, ...]) -> float:
        times = [self.stage_time_s(s, n) for s, n in enumerate(loads)]
        dp = max(self.stage_dp_time_s(s, n) for s, n in enumerate(loads))
        return self.sum_weight * sum(times) + self.max_weight * max(times) + dp
