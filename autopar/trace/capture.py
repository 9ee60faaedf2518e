"""Capture a module's graph on the meta device: torch.fx first where it works, torch.export
(non-strict) otherwise, with repeated blocks kept out of the expensive part.

- torch.fx (the built-in model, fx-friendly user modules): repeated blocks are leaves of the
  top-level graph and one representative of each kind is traced on its own.
- torch.export (HF transformers and other modules fx cannot trace): the module is exported with
  each container of repeated blocks shrunk to one representative per kind, so export time grows
  with the number of distinct blocks, not with depth; a model whose forward needs every repeat
  (it indexes them by position) is exported whole.

When no capture works the error is one line naming the module, the source line and the op.
"""

from __future__ import annotations

import io
import linecache
import logging
import traceback
from collections import defaultdict
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import fx, nn

from autopar.errors import UserError


def _signature(module: nn.Module) -> tuple:
    return (type(module).__qualname__,
            tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()))


def find_repeated_blocks(model: nn.Module) -> list[list[str]]:
    """Groups of fully-qualified names of structurally identical siblings in module containers
    (same class and parameter shapes), outer containers first. Children alike that come before
    every member of a container's largest group are a group even when there is one of them
    (GLM-4.5's one dense block before its mixture-of-experts ones)."""
    groups: list[list[str]] = []
    for prefix, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
            continue
        by_sig: dict[tuple, list[str]] = defaultdict(list)
        order = []
        for child_name, child in container.named_children():
            order.append(f"{prefix}.{child_name}" if prefix else child_name)
            by_sig[_signature(child)].append(order[-1])
        repeated = [names for names in by_sig.values() if len(names) > 1]
        if repeated and order.index(max(repeated, key=len)[0]) == 1:
            repeated.insert(0, order[:1])  # one block before the largest group
        groups.extend(repeated)
    return groups


def outer_groups(groups: list[list[str]]) -> list[list[str]]:
    """The groups not nested inside a member of another group (decoder layers, not experts)."""
    members = [n for names in groups for n in names]
    return [names for names in groups
            if not any(names[0].startswith(m + ".") for m in members)]


@dataclass(frozen=True, kw_only=True, slots=True)
class Capture:
    """A captured top-level graph and, for fx, one graph per block kind."""

    how: str
    """``torch.fx`` or ``torch.export``."""
    gm: fx.GraphModule
    blocks: tuple[tuple[str, ...], ...]
    """Repeat names per block kind; the first is the representative."""
    block_gms: dict[str, fx.GraphModule]
    """fx only: the representative's own graph."""


class _LeafTracer(fx.Tracer):
    """Keeps the given modules (and torch's own) as ``call_module`` leaves; remembers where it is."""

    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves
        self.path: list[str] = []

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaves or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        self.path.append(self.path_of_module(m))
        result = super().call_module(m, forward, args, kwargs)
        self.path.pop()
        return result


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def _culprit(exc: BaseException, model: nn.Module) -> str:
    """``name (Class), file:line `source``` of the innermost frame of one of ``model``'s modules."""
    names = {id(m): n for n, m in model.named_modules()}
    found = ""
    for frame, line in traceback.walk_tb(exc.__traceback__):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            src = linecache.getline(frame.f_code.co_filename, line).strip()
            name = names[id(owner)] or "the model"
            found = f"{name} ({type(owner).__name__})" + (f" at `{src}`" if src else "")
    return found or f"the model ({type(model).__name__})"


def fx_capture(model: nn.Module, groups: list[list[str]]) -> Capture:
    """torch.fx with repeated blocks as leaves; raises UserError naming module and op."""
    leaves = {n for names in groups for n in names}
    tracer = _LeafTracer(leaves)
    try:
        gm = fx.GraphModule(model, tracer.trace(model))
    except Exception as exc:  # fx raises many types; the user needs the module and the reason
        where = tracer.path[-1] if tracer.path else ""
        mod = model.get_submodule(where) if where else model
        raise UserError(f"torch.fx could not trace {where or 'the model'} ({type(mod).__name__}): "
                        f"{_first_line(exc)}") from None
    called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    blocks, block_gms = [], {}
    for group in groups:
        names = tuple(n for n in group if n in called)
        if not names:
            continue  # a container the forward never calls
        block = model.get_submodule(names[0])
        sub = _LeafTracer(set())
        try:
            block_gms[names[0]] = fx.GraphModule(block, sub.trace(block))
        except Exception as exc:
            where = ".".join(filter(None, [names[0], sub.path[-1] if sub.path else ""]))
            raise UserError(f"torch.fx could not trace block {where} ({type(block).__name__}): "
                            f"{_first_line(exc)}") from None
        blocks.append(names)
    return Capture(how="torch.fx", gm=gm, blocks=tuple(blocks), block_gms=block_gms)


@contextmanager
def _shrunk(model: nn.Module, groups: list[list[str]]) -> Iterator[None]:
    """Temporarily keep only the first member of each group in its container."""
    drop = {n for names in groups for n in names[1:]}
    saved = []
    for prefix, container in list(model.named_modules()):
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
            continue
        full = dict(container.named_children())
        keep = {k: m for k, m in full.items() if (f"{prefix}.{k}" if prefix else k) not in drop}
        if len(keep) == len(full):
            continue
        parent_name, _, attr = prefix.rpartition(".")
        parent = model.get_submodule(parent_name)
        if isinstance(container, nn.ModuleList):
            # Keep each member's own index (model.layers.3 stays model.layers.3), so a block kind
            # that does not start the list is still found under its name; iteration and slicing
            # read the values in order, indexing a dropped member fails (and exports it whole).
            small: nn.ModuleList | nn.ModuleDict = nn.ModuleList()
            small._modules.update(keep)
        else:
            small = nn.ModuleDict(keep)
        saved.append((parent, attr, container))
        setattr(parent, attr, small)
    try:
        yield
    finally:
        for parent, attr, container in reversed(saved):
            setattr(parent, attr, container)


@contextmanager
def _quiet_torch() -> Iterator[None]:
    """Keep torch's own warnings (graph dumps on a failed export) off the user's terminal; the
    failure is reported as one UserError line instead."""
    loggers = [logging.getLogger(n) for n in ("torch", "torch.fx.experimental.symbolic_shapes",
                                               "torch._dynamo", "torch.export", "torch._subclasses.fake_tensor")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)  # the fake-tensor logger prints a failed op's traceback as an error
    try:
        with redirect_stderr(io.StringIO()):  # export prints its partial graph on failure
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _export(model: nn.Module, inputs: tuple) -> fx.GraphModule:
    with _quiet_torch():
        return torch.export.export(model, inputs, strict=False).module()


def export_capture(model: nn.Module, inputs: tuple, groups: list[list[str]]) -> Capture:
    """torch.export (non-strict) of ``model`` with repeated blocks shrunk to one per kind."""
    reps = [names[0] for names in groups]
    try:
        with _shrunk(model, groups):
            gm = _export(model, inputs)
        seen = {p for n in gm.graph.nodes for p, _ in (n.meta.get("nn_module_stack") or {}).values()}
        if all(r in seen for r in reps):
            return Capture(how="torch.export", gm=gm, blocks=tuple(tuple(g) for g in groups), block_gms={})
    except Exception:  # noqa: BLE001 - the forward may need every repeat; export it whole
        pass
    try:
        gm = _export(model, inputs)
    except Exception as exc:
        raise UserError(f"torch.export could not capture {_culprit(exc, model)}: {_first_line(exc)}") from None
    return Capture(how="torch.export", gm=gm, blocks=tuple(tuple(g) for g in groups), block_gms={})
