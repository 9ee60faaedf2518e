"""Checkpoints with ``torch.distributed.checkpoint``: save on one plan, load on any other.

Every stage module's weights and AdamW state are keyed by the single-process parameter names
(``get_state_dict`` strips the DDP/FSDP/checkpoint wrappers; DTensor shards carry their
layout), so DCP reshards on load onto other tp/pp/dp degrees or onto one process. A tied head
copy on the last pipeline stage is saved and loaded under the embedding's name, as the
single-process model has it. The step counter and the data position (samples trained on,
``autopar.data``) travel with the weights, so a resumed run draws the same batches as an
uninterrupted one: the synthetic batch of its step, or the token file's next unseen samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from autopar.runtime.state import clean_name


def _tied_names(prog) -> tuple[str, str]:
    """(the head's weight, the embedding's weight): one tensor when the model ties them."""
    return f"{prog.anatomy.head}.weight", f"{prog.anatomy.embed}.weight"


def _aliases(prog, module) -> dict[str, str]:
    """Saved name of each local name that differs (the last stage's tied head copy)."""
    copy, name = _tied_names(prog)
    local = {clean_name(n, isinstance(module, DistributedDataParallel)) for n, _ in module.named_parameters()}
    return {copy: name} if prog.spec.tied and copy in local and name not in local else {}


def _rename(d: dict, names: dict[str, str]) -> dict:
    return {names.get(k, k): v for k, v in d.items()}


def _stages(prog) -> list[tuple[dict, dict, dict[str, str]]]:
    """Per local stage: weights and optimizer state (``get_state_dict`` initialises a fresh
    AdamW's state), keyed by saved names, and the renaming applied."""
    out = []
    for module, opt in zip(prog.modules, prog.optimizers):
        msd, osd = get_state_dict(module, opt)
        alias = _aliases(prog, module)
        out.append((_rename(msd, alias), {"state": _rename(osd["state"], alias),
                                          "param_groups": osd["param_groups"]}, alias))
    return out


def _merged(prog, stages) -> dict:
    """One dict for DCP; a whole tied model's head weight is the embedding, saved once."""
    copy, _ = _tied_names(prog)
    return {"model": {k: v for m, _, _ in stages for k, v in m.items() if not (prog.spec.tied and k == copy)},
            "optim": {k: v for _, o, _ in stages for k, v in o["state"].items()}}


@dataclass(frozen=True, kw_only=True, slots=True)
class Position:
    """Where a checkpoint was saved: after ``step`` optimizer steps, ``samples`` sequences
    into the data (None in a checkpoint written before autopar saved it)."""

    step: int
    samples: int | None


def save(prog, path: str | Path, step: int, samples: int) -> None:
    """Write the program's state after ``step`` optimizer steps and ``samples`` training
    sequences to directory ``path``."""
    dcp.save({**_merged(prog, _stages(prog)), "step": step, "samples": samples}, checkpoint_id=str(path))


def load(prog, path: str | Path) -> Position:
    """Load weights and optimizer states saved by any plan of this model (DCP reshards them
    in place into this program's tensors); returns where they were saved."""
    stages = _stages(prog)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    target = {**_merged(prog, stages), "step": -1, **({"samples": -1} if "samples" in saved else {})}
    dcp.load(target, checkpoint_id=str(path))
    for (module, opt), (msd, osd, alias) in zip(zip(prog.modules, prog.optimizers), stages):
        back = {v: k for k, v in alias.items()}
        set_state_dict(module, opt, model_state_dict=_rename(msd, back),
                       optim_state_dict={"state": _rename(osd["state"], back),
                                         "param_groups": osd["param_groups"]})
    return Position(step=int(target["step"]), samples=int(target["samples"]) if "samples" in target else None)
