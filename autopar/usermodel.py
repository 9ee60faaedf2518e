"""User models: ``path/to/file.py:factory``.

The file is imported as Python runs a script: its directory is on ``sys.path`` (so it can
import the modules next to it, ``from model import GPT``). The factory is called with no
arguments inside ``torch.device("meta")`` and returns ``(module, example_inputs)``: an
``nn.Module`` and a tensor or tuple of tensors it is called on (built on meta too, or they are
moved there). Nothing real is allocated.

The inputs are what a training step passes: the tracer calls ``module(*example_inputs)`` once
and counts that computation. A forward that computes the loss (and the logits of every
position) only when given targets, like nanoGPT's, needs ``(tokens, targets)``; the first input
is the tokens, ``[batch, seq]``. What the file prints goes to stderr (stdout carries ``--json``).

The runtime needs the buffers' values (a causal mask, rotary frequencies), which meta does not
hold: ``load_user_model(spec, buffers=True)`` runs the factory on the CPU with every parameter
moved to meta as it is registered (accelerate's ``init_empty_weights(include_buffers=False)``),
so only buffers are computed (a parameter's ``torch.empty`` is allocated and dropped unused).
"""

from __future__ import annotations

import importlib.util
import sys
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from autopar.errors import UserError
from autopar.spec import ModelSpec


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


@contextmanager
def _as_script(directory: Path) -> Iterator[None]:
    """``directory`` first on ``sys.path`` and ``print`` on stderr, while the user's code runs."""
    entry = str(directory)
    sys.path.insert(0, entry)
    try:
        with redirect_stdout(sys.stderr):
            yield
    finally:
        sys.path.remove(entry)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Factories run on the CPU, but each parameter moves to meta as a module registers it."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign, assignment]
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def load_user_model(spec: ModelSpec, *, buffers: bool = False) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Import the file of ``spec.source``, call its factory on meta, check what it returns.
    ``buffers``: the module's buffers are computed on the CPU (its parameters stay on meta)."""
    path, _, factory = spec.source.rpartition(":")
    file = Path(path)
    name = f"autopar_user_{abs(hash(str(file.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(name, file)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"cannot import {path!r} as Python; write path/to/file.py:factory")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up here
    with _as_script(file.resolve().parent):
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:  # the user's file: report its error on one line
            raise UserError(f"importing {path} failed: {_one_line(exc)}") from None
        fn = getattr(module, factory, None)
        if not callable(fn):
            raise UserError(f"{path} has no function {factory!r}")
        try:
            with _parameters_on_meta() if buffers else torch.device("meta"):
                result = fn()
        except Exception as exc:
            raise UserError(f"{path}:{factory}() failed: {_one_line(exc)}") from None
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise UserError(f"{path}:{factory}() must return (nn.Module, example_inputs), "
                        f"got {type(result).__name__}")
    model, inputs = result
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise UserError(f"{path}:{factory}() must return example inputs as a tensor or tuple of tensors")
    if buffers:
        moved: dict[int, nn.Parameter] = {}
        for module in model.modules():  # a factory that placed tensors itself (tied ones stay tied)
            for key, param in module._parameters.items():
                if param is not None and not param.is_meta:
                    if id(param) not in moved:
                        moved[id(param)] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
                    module._parameters[key] = moved[id(param)]
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = buf.to("cpu")
        return model, tuple(t.to("meta") for t in inputs)
    return model.to("meta"), tuple(t.to("meta") for t in inputs)
