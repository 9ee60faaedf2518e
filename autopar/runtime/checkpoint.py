"""Checkpoints with ``torch.distributed.checkpoint``: save on one plan, load on any other.

Every stage module's weights and AdamW state are keyed by the single-process parameter names
(``get_state_dict`` strips the DDP/FSDP/checkpoint wrappers; DTensor shards carry their
layout), so DCP reshards on load onto other tp/pp/dp degrees or onto one process. A tied head
copy on the last pipeline stage is saved and loaded under the embedding's name, as the
single-process model has it. The step counter and the data position (samples trained on,
``autopar.data``) travel with the weights, so a resumed run draws the same batches as an
uninterrupted one: the synthetic batch of its step, or the token file's next unseen samples.

Where the files go, the manifest of checksums and the atomic rename are
``autopar.checkpoint_dir``'s. Loading checks the model (names and shapes against DCP's
metadata: a checkpoint of another model is one line) and reads an autopar checkpoint's
``.metadata`` pickle with an allow-list of DCP's own classes, so loading it runs no code.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from autopar.checkpoint_dir import DCP_METADATA, TMP_PREFIX, Found, Manifest, RunRecord, prepare, publish, step_name
from autopar.errors import UserError
from autopar.runtime.faults import Fault, kill_if
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
        # "state" maps names to dicts (torch types every value as dict or list of dicts)
        out.append((_rename(msd, alias), {"state": _rename(cast(dict, osd["state"]), alias),
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


_DCP_METADATA_CLASSES = frozenset({"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                   "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                   "_MEM_FORMAT_ENCODING"})
_PATHS = frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"})


class _DataOnly(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else: its dataclasses, ``torch.Size``, dtypes
    and layouts, paths, ``OrderedDict``. Any other global (a function a crafted pickle would
    call) is a ``UserError``, so an autopar checkpoint runs no code when it is loaded."""

    def __init__(self, file, where: Path):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        allowed = ((module == "torch.distributed.checkpoint.metadata" and name in _DCP_METADATA_CLASSES)
                   or (module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo")
                   or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
                   or (module == "torch.serialization" and name == "_get_layout")
                   or (module == "pathlib" and name in _PATHS)
                   or (module == "collections" and name == "OrderedDict"))
        if not allowed:
            raise UserError(f"checkpoint {self.where}: {DCP_METADATA} names {module}.{name}, which is not DCP "
                            "metadata (a pickle that could run code): not loaded; resume from a checkpoint autopar wrote")
        return super().find_class(module, name)


class _DataOnlyReader(dcp.FileSystemReader):
    """DCP's file reader, its metadata read by ``_DataOnly``."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _DataOnly(f, Path(str(self.path))).load()
            except UserError:
                raise
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
                raise UserError(f"checkpoint {self.path}: {DCP_METADATA} is not DCP metadata ({exc}); resume from "
                                "an earlier checkpoint") from None
        if not isinstance(metadata, Metadata):
            raise UserError(f"checkpoint {self.path}: {DCP_METADATA} is not DCP metadata; resume from an earlier one")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _reader(found: Found) -> dcp.FileSystemReader:
    """A checkpoint autopar wrote is read as data only; one without a manifest (loaded on
    ``--trust-code``) with DCP's own unpickler."""
    return _DataOnlyReader(str(found.path)) if found.manifest is not None else dcp.FileSystemReader(str(found.path))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(prog, store: str | Path, step: int, samples: int, run: RunRecord = RunRecord()) -> Path:
    """Write the program's state after ``step`` optimizer steps and ``samples`` training
    sequences as the checkpoint ``store/step-N`` (``autopar.checkpoint_dir``: a temporary
    directory, renamed into place once complete); collective. Returns its path."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    store = Path(store)
    tmp = store / f"{TMP_PREFIX}{step_name(step)}"
    if rank == 0:
        prepare(store, step)
    _barrier()
    dcp.save({**_merged(prog, _stages(prog)), "step": step, "samples": samples}, checkpoint_id=str(tmp))
    kill_if(Fault.SAVE, rank, step)
    _barrier()  # every rank's shards are on disk
    if rank == 0:
        publish(tmp, Manifest(step=step, samples=samples, model=prog.plan.model, run=run))
    _barrier()
    return store / step_name(step)


def check_model(prog, found: Found, saved: dict) -> None:
    """A ``UserError`` unless the checkpoint holds this model's weights, name for name and
    shape for shape (a checkpoint of any plan of the model does). DTensor shapes are global;
    the ranks' names are gathered, so a pipeline stage also sees the whole model's."""
    ours = {k: list(v.shape) for k, v in _merged(prog, _stages(prog))["model"].items()}
    if dist.is_initialized():
        gathered: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, ours)
        ours = {k: v for part in gathered if part for k, v in part.items()}
    theirs = {k[len("model."):]: list(m.size) for k, m in saved.items()
              if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    shaped = [k for k in sorted(ours) if k in theirs and ours[k] != theirs[k]]
    diff = (f"it has no {missing[0]}" if missing else f"{shaped[0]} is {theirs[shaped[0]]} there, "
            f"{ours[shaped[0]]} here" if shaped else f"it has {extra[0]}, which this model has not" if extra else "")
    if diff:
        model = f" ({found.manifest.model})" if found.manifest is not None and found.manifest.model else ""
        raise UserError(f"checkpoint {found.path}{model} is not of this plan's model {prog.plan.model}: {diff}; "
                        "resume from a checkpoint of this model, or start without --resume")


def load(prog, found: Found) -> Position:
    """Load weights and optimizer states saved by any plan of this model (DCP reshards them
    in place into this program's tensors); returns where they were saved. ``found``'s
    checksums are verified by the caller (``checkpoint_dir.resolve``)."""
    reader = _reader(found)
    saved = reader.read_metadata().state_dict_metadata
    check_model(prog, found, saved)
    stages = _stages(prog)
    target = {**_merged(prog, stages), "step": -1, **({"samples": -1} if "samples" in saved else {})}
    dcp.load(target, storage_reader=reader)
    for (module, opt), (msd, osd, alias) in zip(zip(prog.modules, prog.optimizers), stages):
        back = {v: k for k, v in alias.items()}
        set_state_dict(module, opt, model_state_dict=_rename(msd, back),
                       optim_state_dict={"state": _rename(osd["state"], back),
                                         "param_groups": osd["param_groups"]})
    return Position(step=int(target["step"]), samples=int(target["samples"]) if "samples" in target else None)
