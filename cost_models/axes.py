"""The parallel axes: one vocabulary for the cost model, the search, the Plan, the CLI and the
runtime's device mesh (a leaf module: it imports nothing of the project).

Vocabulary (torchtitan's): an *axis* is a dimension of the device mesh, a *dim* a dimension of a
tensor. Each axis has a degree (``Degrees``); the devices are the product of the degrees. The
*rank order* of the axes lists them outermost first: ranks that differ only in the last axis are
consecutive (they share a node first). An axis of degree 1 splits nothing, so its place in an
order does not matter (``Degrees.active``).

A new axis is one ``Axis`` member (in Megatron's place for its default order) and its field in
``Degrees``; its cost terms and its runtime applier read ``degrees.<axis>``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Iterable


class Axis(StrEnum):
    """A device-mesh axis, by its name in plans, on the command line and on the DeviceMesh.
    Members are declared in Megatron's rank order, outermost (largest rank stride) first."""

    PP = "pp"
    """Pipeline stages."""
    DP = "dp"
    """Data-parallel replicas (ZeRO shards over it)."""
    TP = "tp"
    """Tensor-parallel shards of each block (and sequence parallelism beside it)."""


DEFAULT_ORDER: tuple[Axis, ...] = tuple(Axis)
"""Megatron's rank order, outermost first: pp, dp, tp (tp on consecutive ranks)."""


def parse_order(names: Iterable[str]) -> tuple[Axis, ...]:
    """An axis order from names, outermost first; ``ValueError`` unless it lists every axis
    once (the message names them)."""
    names = tuple(names)
    if sorted(names) != sorted(a.value for a in Axis):
        raise ValueError(f"must list {', '.join(Axis)} once each, outermost first")
    return tuple(Axis(n) for n in names)


@dataclass(frozen=True, kw_only=True, slots=True)
class Degrees:
    """The degree of each axis (1: the axis splits nothing); one field per ``Axis`` member,
    named by its value. Plain data: who reads the degrees checks their range."""

    pp: int = 1
    dp: int = 1
    tp: int = 1

    def __getitem__(self, axis: Axis) -> int:
        return getattr(self, axis.value)

    @property
    def size(self) -> int:
        """Devices the degrees span: the product of every field."""
        return math.prod(getattr(self, f.name) for f in dataclasses.fields(self))

    def active(self, order: Iterable[Axis] = DEFAULT_ORDER) -> tuple[Axis, ...]:
        """The axes of degree > 1, in ``order``: the dimensions of the device mesh."""
        return tuple(a for a in order if self[a] > 1)

    def strides(self, order: Iterable[Axis] = DEFAULT_ORDER) -> dict[Axis, int]:
        """Rank distance between neighbours along each axis of ``order`` (outermost first):
        the product of the degrees of the axes inside it."""
        stride, out = 1, {}
        for axis in reversed(tuple(order)):
            out[axis] = stride
            stride *= self[axis]
        return out
