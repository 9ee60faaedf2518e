"""The seam between the cost model and the solver: per-stage costs linear in the layer counts.

For a fixed outer strategy (everything but ``stage_layers``), each pipeline stage s holding
n_s transformer blocks costs, per micro-batch and per step:

    T_s = n_s * layer_time_s + [s = 0] * first_time_s + [s = p-1] * last_time_s + p2p_time_s
    D_s = n_s * layer_dp_time_s + [s = 0] * first_dp_time_s + [s = p-1] * last_dp_time_s
    M_s = buffer_bytes + n_s * (layer_static_bytes + inflight[s] * layer_act_bytes)
          + [s = 0] * (first_static_bytes + inflight[0] * first_act_bytes)
          + [s = p-1] * (last_static_bytes + inflight[p-1] * last_act_bytes)

and the step takes

    step = sum_weight * sum_s T_s + max_weight * max_s T_s + max_s D_s

T_s is forward + backward (+ recompute) of one micro-batch, D_s is the part of the gradient
reduction and optimizer step not hidden behind compute. The schedule sets the weights (for
GPipe and 1F1B, sum 1 and max m - 1: the fill and drain pass every stage once, the steady state
runs at the slowest stage). ``estimate`` and the solver both evaluate exactly these formulas, so
the solver's optimum is the estimate's optimum.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCosts:
    """Coefficients of the per-stage formulas above; seconds and bytes."""

    pp: int
    layer_time_s: float
    first_time_s: float
    last_time_s: float
    p2p_time_s: float
    layer_dp_time_s: float
    first_dp_time_s: float
    last_dp_time_s: float
    layer_static_bytes: float
    layer_act_bytes: float
    first_static_bytes: float
    first_act_bytes: float
    last_static_bytes: float
    last_act_bytes: float
    inflight: tuple[int, ...]
    """Micro-batches whose activations stage s holds at its peak."""
    buffer_bytes: float
    """Communication buffers, workspace and allocator reserve on every device."""
    sum_weight: float
    max_weight: float

    def stage_time_s(self, s: int, n: int) -> float:
        """T_s: one micro-batch through stage s holding n blocks."""
        return (n * self.layer_time_s + self.p2p_time_s
                + (self.first_time_s if s == 0 else 0.0)
                + (self.last_time_s if s == self.pp - 1 else 0.0))

    def stage_dp_time_s(self, s: int, n: int) -> float:
        """D_s: exposed gradient reduction and optimizer time of stage s."""
        return (n * self.layer_dp_time_s
                + (self.first_dp_time_s if s == 0 else 0.0)
                + (self.last_dp_time_s if s == self.pp - 1 else 0.0))

    def stage_memory_bytes(self, s: int, n: int) -> float:
        """M_s: peak bytes on a device of stage s holding n blocks."""
        k = self.inflight[s]
        m = self.buffer_bytes + n * (self.layer_static_bytes + k * self.layer_act_bytes)
        if s == 0:
            m += self.first_static_bytes + k * self.first_act_bytes
        if s == self.pp - 1:
            m += self.last_static_bytes + k * self.last_act_bytes
        return m

    def step_time_s(self, stage_layers: tuple[int, ...]) -> float:
        times = [self.stage_time_s(s, n) for s, n in enumerate(stage_layers)]
        dp = max(self.stage_dp_time_s(s, n) for s, n in enumerate(stage_layers))
        return self.sum_weight * sum(times) + self.max_weight * max(times) + dp
