"""Checkpoints with ``torch.distributed.checkpoint``: save on one plan, load on any other.

Every stage module's weights and AdamW state are keyed by the single-process parameter names
(``get_state_dict`` strips the DDP/FSDP/checkpoint wrappers; DTensor shards carry their
layout), so DCP reshards on load onto other tp/pp/dp degrees or onto one process. A tied head
copy on the last pipeline stage is saved and loaded under the embedding's name, as the
single-process model has it. The step counter travels with the weights, so a resumed run
draws the same synthetic batches as an uninterrupted one.
"""

from __future__ import annotations

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


def save(prog, path: str | Path, step: int) -> None:
    """Write the program's state after ``step`` optimizer steps to directory ``path``."""
    dcp.save({**_merged(prog, _stages(prog)), "step": step}, checkpoint_id=str(path))


def load(prog, path: str | Path) -> int:
    """Load weights and optimizer states saved by any plan of this model (DCP reshards them
    in place into this program's tensors); returns the step they were saved after."""
    stages = _stages(prog)
    target = {**_merged(prog, stages), "step": -1}
    dcp.load(target, checkpoint_id=str(path))
    for (module, opt), (msd, osd, alias) in zip(zip(prog.modules, prog.optimizers), stages):
        back = {v: k for k, v in alias.items()}
        set_state_dict(module, opt, model_state_dict=_rename(msd, back),
                       optim_state_dict={"state": _rename(osd["state"], back),
                                         "param_groups": osd["param_groups"]})
    return int(target["step"])
