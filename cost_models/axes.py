"""The parallel axes: one vocabulary for the cost model, the search, the Plan, the CLI and the
runtime's device mesh (a leaf module: it imports nothing of the project).

Vocabulary (torchtitan's): an *axis* is a dimension of the device mesh, a *dim* a dimension of a
tensor. Each axis has a degree (``Degrees``); the devices are the product of the degrees. The
*rank order* of the axes lists them outermost first: ranks that differ only in the last axis are
consecutive (they share a node first). An axis of degree 1 splits nothing, so its place in an
order does not matter (``Degrees.active``).

A new axis is one ``Axis`` member (in Megatron's place for its default order) and its field in
``Degrees``; its cost terms and its runtime applier read ``degrees.<axis>``. An axis added after
plans were first written is ``OPTIONAL``: an order may leave it out while its degree is 1, and
the canonical order (``canonical_order``, what a Strategy and a Plan hold) lists it only when
its degree is above 1, so plans without it stay byte-identical to those written before it.

Expert parallelism (``Axis.EP``) is not a mesh dimension: as in Megatron-Core and torchtitan
it regroups the dp x cp ranks of the expert layers into ep x edp (ep dividing dp x cp and the
routed experts), so it multiplies no device count (``Degrees.size`` leaves it out) and has no
place in a rank order: an ep group is ``ep`` consecutive indices of the dp x cp replicas
(dp_index = edp_index * ep + ep_index, the innermost part of dp x cp; ``comm.expert_group``).
Expert tensor parallelism equals tp (each expert's GEMMs split like the dense MLP's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from typing import Iterable


class Axis(StrEnum):
    """A device-mesh axis, by its name in plans, on the command line and on the DeviceMesh.
    Members are declared in Megatron's rank order, outermost (largest rank stride) first."""

    PP = "pp"
    """Pipeline stages."""
    DP = "dp"
    """Data-parallel replicas (ZeRO shards over it)."""
    CP = "cp"
    """Context-parallel shards of every sequence (ring or all-gather attention; the weights are
    replicated over it, so gradients reduce and ZeRO shards over dp x cp)."""
    TP = "tp"
    """Tensor-parallel shards of each block (and sequence parallelism beside it)."""
    EP = "ep"
    """Expert-parallel shards of each MoE layer's routed experts: a regrouping of the dp x cp
    ranks (``REGROUPED``), not a mesh dimension of its own."""


_NAMES: tuple[str, ...] = tuple(a.value for a in Axis)

REGROUPED: frozenset[Axis] = frozenset({Axis.EP})
"""Axes that regroup the ranks of other axes instead of multiplying them: no device count,
no place in a rank order."""

MESH_AXES: tuple[Axis, ...] = tuple(a for a in Axis if a not in REGROUPED)
"""The device-mesh dimensions, in Megatron's rank order (outermost first)."""

DEFAULT_ORDER: tuple[Axis, ...] = MESH_AXES
"""Megatron's rank order, outermost first: pp, dp, cp, tp (tp on consecutive ranks, cp next:
Megatron-Core's default ``order="tp-cp-ep-dp-pp"``, innermost first)."""

OPTIONAL: frozenset[Axis] = frozenset({Axis.CP})
"""Axes an order may leave out while their degree is 1 (added after plans listed pp, dp, tp)."""

_REQUIRED = tuple(a for a in MESH_AXES if a not in OPTIONAL)
_OPTIONAL = tuple(a for a in MESH_AXES if a in OPTIONAL)


def parse_order(names: Iterable[str], degrees: Degrees | None = None) -> tuple[Axis, ...]:
    """An axis order from names, outermost first, in canonical form for ``degrees`` when given
    (``canonical_order``: an optional axis it leaves out takes Megatron's place); ``ValueError``
    unless it lists each of pp, dp, tp once and an optional axis (cp) at most once (the message
    names them)."""
    names = tuple(names)
    if not all(isinstance(n, str) for n in names):
        raise ValueError(f"must list {', '.join(_REQUIRED)} once each (names), outermost first")
    optional = None if degrees is None else tuple(degrees[a] > 1 for a in _OPTIONAL)
    return _parse_order(names, optional)


@lru_cache(maxsize=1024)
def _parse_order(names: tuple[str, ...], optional: tuple[bool, ...] | None) -> tuple[Axis, ...]:
    """``parse_order`` of ``names`` when the optional axes (``_OPTIONAL`` order) have degree
    > 1 where ``optional`` says (None: not canonicalised); cached, as every Strategy parses
    its order."""
    valid = {a.value for a in MESH_AXES}
    if len(set(names)) != len(names) or not set(names) <= valid \
            or not {a.value for a in _REQUIRED} <= set(names):
        raise ValueError(f"must list {', '.join(_REQUIRED)} once each (and {', '.join(sorted(OPTIONAL))} "
                         "where its degree is above 1), outermost first")
    order = tuple(Axis(n) for n in names)
    return order if optional is None else canonical_order(
        order, Degrees(**{a.value: 2 for a, above in zip(_OPTIONAL, optional) if above}))


def canonical_order(order: Iterable[Axis], degrees: Degrees) -> tuple[Axis, ...]:
    """``order`` listing the required axes and exactly the optional axes of degree > 1: an
    optional axis of degree 1 is dropped (its place changes no rank), one of degree > 1 that
    ``order`` leaves out goes to Megatron's place: just inside the axis before it in
    ``DEFAULT_ORDER`` (cp just inside dp)."""
    out = [a for a in order if a not in OPTIONAL or degrees[a] > 1]
    for axis in DEFAULT_ORDER:
        if axis in OPTIONAL and degrees[axis] > 1 and axis not in out:
            i = DEFAULT_ORDER.index(axis)
            outer = DEFAULT_ORDER[i - 1] if i else None
            out.insert(out.index(outer) + 1 if outer in out else 0, axis)
    return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class Degrees:
    """The degree of each axis (1: the axis splits nothing); one field per ``Axis`` member,
    named by its value. Plain data: who reads the degrees checks their range."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    """Expert-parallel degree: a regrouping of the dp x cp ranks (not in ``size``)."""

    def __getitem__(self, axis: Axis) -> int:
        return getattr(self, axis)  # a StrEnum member is its name

    def values(self) -> tuple[int, ...]:
        """Every axis's degree, in ``Axis`` order."""
        return tuple(getattr(self, name) for name in _NAMES)

    @property
    def size(self) -> int:
        """Devices the degrees span: the product of the mesh axes' degrees (ep regroups the
        dp x cp ranks: it multiplies nothing)."""
        return math.prod(self[a] for a in MESH_AXES)

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: the dp x cp ranks holding the same experts, dp x cp / ep
        (ZeRO shards and gradients of the expert weights reduce over them)."""
        return self.dp * self.cp // self.ep

    def active(self, order: Iterable[Axis] = DEFAULT_ORDER) -> tuple[Axis, ...]:
        """The axes of degree > 1, in ``order``: the dimensions of the device mesh."""
        return tuple(a for a in order if a not in REGROUPED and self[a] > 1)

    def strides(self, order: Iterable[Axis] = DEFAULT_ORDER) -> dict[Axis, int]:
        """Rank distance between neighbours along each axis (``order`` outermost first; an
        axis it leaves out has degree 1, and stride 1): the product of the degrees of the
        axes inside it."""
        stride, out = 1, {axis: 1 for axis in MESH_AXES}
        for axis in reversed(tuple(order)):
            out[axis] = stride
            stride *= self[axis]
        return out

    def default_order(self) -> tuple[Axis, ...]:
        """Megatron's order in canonical form for these degrees (``canonical_order``)."""
        return canonical_order(DEFAULT_ORDER, self)
