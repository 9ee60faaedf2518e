"""Run torch's Python meta kernels without importing ``torch._dynamo`` (about 1 s of a plan).

Many of torch's Python op implementations (the ``torch._refs`` behind meta kernels, and every
``TorchDispatchMode.__torch_dispatch__``, ``FlopCounterMode``'s included) are wrapped by
``torch._disable_dynamo``: on its first call the wrapper imports ``torch._dynamo`` to wrap the
function in ``torch._dynamo.disable``, and caches that in the function's ``__dynamo_disable``
attribute. ``dynamo.disable`` only matters while dynamo evaluates frames, which needs dynamo
imported; before that, the disabled function and the function are the same call.

``without_dynamo()`` lends the wrapped functions it can find (in the modules below) the
function itself as that cache while ``torch._dynamo`` is not imported, and takes it back on
exit, so a later real import (``torch.compile``, ``torch.export``) wraps them as usual. A wrapper
it did not find imports dynamo as before: slower, never different. Used around the built-in
model's build and fx tracing on meta only (``torch.export`` imports dynamo anyway).
"""

from __future__ import annotations

import functools
import importlib
import sys
from contextlib import contextmanager
from typing import Iterator

import torch

_MODULES = ("torch._refs", "torch._refs.nn.functional", "torch._refs.special", "torch._refs.linalg",
            "torch._refs.fft", "torch._prims", "torch._decomp.decompositions", "torch._meta_registrations",
            "torch.utils.flop_counter", "torch.nn.functional")
_ATTR = "__dynamo_disable"


def _inner_code():
    return torch._disable_dynamo(lambda: None).__code__


@functools.cache
def _wrapped_functions() -> tuple:
    """The functions wrapped by ``torch._disable_dynamo`` reachable from ``_MODULES``
    (module and class attributes, along ``__wrapped__`` and closures)."""
    code, found = _inner_code(), {}

    seen: set[int] = set()

    def visit(obj, depth: int = 0) -> None:
        """Follow ``__wrapped__`` and the functions a closure holds (decorators nest both ways)."""
        if depth > 8 or id(obj) in seen or not callable(obj):
            return
        seen.add(id(obj))
        fn_code = getattr(obj, "__code__", None)
        cells = dict(zip(fn_code.co_freevars, obj.__closure__ or ())) if fn_code is not None else {}
        if fn_code is code and "fn" in cells:
            found[id(cells["fn"].cell_contents)] = cells["fn"].cell_contents
        for cell in cells.values():
            try:
                visit(cell.cell_contents, depth + 1)
            except ValueError:  # an empty cell
                pass
        visit(getattr(obj, "__wrapped__", None), depth + 1)

    for name in _MODULES:
        mod = sys.modules.get(name)
        if mod is None:
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
        for value in list(vars(mod).values()):
            if isinstance(value, type) and value.__module__ == name:
                for attr in list(vars(value).values()):
                    visit(attr)
            elif callable(value):
                visit(value)
    return tuple(found.values())


@contextmanager
def without_dynamo() -> Iterator[None]:
    """While ``torch._dynamo`` is not imported, run ``torch._disable_dynamo``-wrapped functions
    directly (see module); a no-op once it is."""
    if "torch._dynamo" in sys.modules:
        yield
        return
    lent = []
    for fn in _wrapped_functions():
        if getattr(fn, _ATTR, None) is None:
            try:
                setattr(fn, _ATTR, fn)
            except (AttributeError, TypeError):
                continue
            lent.append(fn)
    try:
        yield
    finally:
        for fn in lent:
            if getattr(fn, _ATTR, None) is fn:
                delattr(fn, _ATTR)
