"""Whole (unsharded) parameters of a running program, by their single-process names."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from autopar.spec import parse_model_spec

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "module.")
"""Name parts that checkpoint_wrapper and DDP insert; FSDP2 and TP keep names unchanged."""


def clean_name(name: str) -> str:
    """A parameter name as the unwrapped single-process model spells it."""
    for part in WRAPPER_PREFIXES:
        name = name.replace(part, "")
    return name


def full_state(prog) -> dict[str, torch.Tensor] | None:
    """Full parameter values of this rank's stages, on CPU; ``None`` except on dp and tp rank 0.
    Collective over the tp and dp axes: every rank must call it."""
    tied = parse_model_spec(prog.plan.model).tied
    copy = f"{prog.anatomy.head}.weight"
    out: dict[str, torch.Tensor] = {}
    for module in prog.modules:
        for name, p in module.named_parameters():
            if tied and clean_name(name) == copy:
                continue  # the last stage's copy of the embedding, equal to it after every step
            full = p.full_tensor() if isinstance(p, DTensor) else p
            out[clean_name(name)] = full.detach().float().cpu().clone()
    return out if prog.ctx.dp_rank == 0 and prog.ctx.tp_rank == 0 else None
