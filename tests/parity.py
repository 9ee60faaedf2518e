"""Helpers of the gloo parity tests: the single-process reference and the weights a
multi-process run dumped (``RunSpec(dump=True)``)."""

from __future__ import annotations

from pathlib import Path

import torch

from autopar.plan import Plan
from autopar.runtime import TrainConfig
from autopar.runtime.context import ParallelContext
from autopar.runtime.state import full_state
from autopar.runtime.train import build_program, train


def single_process(plan: Plan, steps: int, cfg: TrainConfig) -> tuple[list[float], dict[str, torch.Tensor],
                                                                      dict[str, torch.Tensor]]:
    """``plan`` (one device) trained ``steps`` steps in this process: its losses, and the full
    weights before and after."""
    ctx = ParallelContext(mesh=None, device=torch.device("cpu"))
    prog = build_program(plan, ctx, cfg)
    initial = full_state(prog)
    result = train(plan, steps, ctx, cfg, program=prog)
    return result.losses, initial, full_state(prog)


def dumped(tmp: Path, name: str) -> dict[str, torch.Tensor]:
    """The full weights a run dumped, merged over the ranks that wrote a share."""
    state: dict[str, torch.Tensor] = {}
    for f in sorted(tmp.glob(f"{name}.rank*.pt")):
        state.update(torch.load(f))
    return state
