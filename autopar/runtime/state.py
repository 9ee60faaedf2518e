"""Whole (unsharded) parameters of a running program, by their single-process names."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from cost_models.axes import Axis

CHECKPOINT_PART = "_checkpoint_wrapped_module"
"""The name component checkpoint_wrapper inserts; DDP prefixes ``module``; FSDP2 and TP keep
names unchanged."""


def clean_name(name: str, ddp: bool = False) -> str:
    """A parameter name as the unwrapped single-process model spells it."""
    parts = [p for p in name.split(".") if p != CHECKPOINT_PART]
    return ".".join(parts[1:] if ddp and parts[0] == "module" else parts)


def full_state(prog) -> dict[str, torch.Tensor] | None:
    """Full parameter values of this rank's stages, on CPU; ``None`` except on dp, cp and tp
    rank 0. Collective over the tp, dp and cp axes: every rank must call it."""
    tied = prog.spec.tied
    copy = f"{prog.anatomy.head}.weight"
    out: dict[str, torch.Tensor] = {}
    for module in prog.modules:
        ddp = isinstance(module, DistributedDataParallel)
        for name, p in module.named_parameters():
            key = clean_name(name, ddp)
            if tied and key == copy:
                continue  # the last stage's copy of the embedding, equal to it after every step
            full = p.full_tensor() if isinstance(p, DTensor) else p
            out[key] = full.detach().float().cpu().clone()
    first = all(prog.ctx.rank(axis) == 0 for axis in (Axis.DP, Axis.CP, Axis.TP))
    return out if first else None
