"""The outer strategy space: every (dp, tp, pp, micro-batch, ZeRO, schedule, v, SP, offload,
axis order) the runtime can run, with the recompute modes the inner placement may mix (see
``autopar.solve``).

Axis orders (``axis_orders``): of the permutations of the axes, the cost model reads an
order only through the tier of each axis's group (``comm.axis_groups``), and every cost is
non-increasing in a group's bandwidths and non-decreasing in its latency. So an order whose
groups of degree > 1 are each no better than those of an order already kept (Megatron's first)
is dropped: exact, and on one node every order collapses to Megatron's. ``outer_candidates``
yields each candidate in Megatron's order (or the pinned one); the search adds the other kept
orders of a candidate lazily, behind ``order_free_hardware``'s bound (``search``).
Offload (CPU, ``Strategy.offload``) is tried with ZeRO >= 1 and dp > 1 where the profile gives
host figures; it is never faster, so the bound ordering prunes it unless memory binds."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Iterator

from autopar.plan import runtime_unsupported
from cost_models import HardwareProfile, ModelProfile, Strategy
from cost_models.axes import DEFAULT_ORDER, Axis, Degrees
from cost_models.comm import Group, axis_groups
from cost_models.recipe import ExecutionRecipe, load_recipe
from cost_models.strategy import RECOMPUTE


@dataclass(frozen=True, kw_only=True, slots=True)
class Pins:
    """Strategy dimensions fixed by the user; ``None`` means searched."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    zero: int | None = None
    micro_batch: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    """Model chunks per pipeline rank (interleaved schedule)."""
    sequence_parallel: bool | None = None
    recompute: str | None = None
    """One recompute mode for every block; unpinned, the solver picks a mode per block."""
    offload: bool | None = None
    """CPU offload of ZeRO's shards and the optimizer step."""
    axis_order: tuple[Axis, ...] | None = None
    """Mesh axes outermost first (``Strategy.axis_order``)."""
    recipe: ExecutionRecipe | None = None
    """The execution recipe every candidate is priced under (an input, never searched);
    None: ``autopar``, the program autopar's runtime generates."""
    refused: tuple[str, ...] = ()
    """Runtime features the model's twin failed (``autopar.verify.Check`` values: dp = ZeRO
    1-3 on FSDP2, tp, sp, pp, selective): never searched, like the recipe an input."""

    def base(self) -> "Pins":
        """No dimension pinned, the same recipe and refusals."""
        return Pins(recipe=self.recipe, refused=self.refused)


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One outer strategy and what its inner placement may choose."""

    strategy: Strategy
    """Everything but the placement (``stage_layers``/``stage_recompute`` empty)."""
    modes: tuple[int, ...]
    """Indices in ``RECOMPUTE`` of the modes blocks may use."""
    min_layers: int
    """Fewest blocks per stage (v under the interleaved schedule: one per chunk)."""


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, in O(√n)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _choices(pinned, default: list) -> list:
    return default if pinned is None else [pinned]


def _schedules(pins: Pins, pp: int, m: int, layers: int) -> Iterator[tuple[str, int]]:
    """(schedule, virtual stages): gpipe, 1f1b, interleaved with 2 ≤ v ≤ layers/pp
    (Megatron: m a multiple of pp), zero-bubble (ZB-H1, v = 1)."""
    if pp == 1:
        options = [("1f1b", 1)]
    else:
        options = [("1f1b", 1), ("gpipe", 1)]
        if m % pp == 0:
            options += [("interleaved", v) for v in range(2, layers // pp + 1)]
        options.append(("zero-bubble", 1))
    for sched, v in options:
        if pins.schedule is not None and sched != pins.schedule:
            continue
        if pins.virtual_stages is not None and v != pins.virtual_stages:
            continue
        yield sched, v


def _mode_sets(pins: Pins, schedule: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(nominal mode, modes the blocks may mix). Zero-bubble's fill fraction depends on the
    recompute mode (``cost_models.pipeline``), so it is planned with one mode on every block."""
    if pins.recompute is not None:
        yield pins.recompute, (RECOMPUTE.index(pins.recompute),)
    elif schedule == "zero-bubble":
        for i, mode in enumerate(RECOMPUTE):
            yield mode, (i,)
    else:
        yield "none", tuple(range(len(RECOMPUTE)))


def _no_better(a: Group, b: Group) -> bool:
    """Group ``a`` is nowhere faster than ``b`` (every collective takes at least as long)."""
    return a.bw_bytes_s <= b.bw_bytes_s and a.p2p_bytes_s <= b.p2p_bytes_s \
        and a.latency_s >= b.latency_s


def axis_orders(hw: HardwareProfile, degrees: Degrees,
                pins: Pins = Pins()) -> list[tuple[Axis, ...]]:
    """The axis orders worth costing for these degrees, Megatron's first: an order is dropped
    when an order kept earlier has every group of degree > 1 at least as fast (see module)."""
    if pins.axis_order is not None:
        return [tuple(pins.axis_order)]
    kept: list[tuple[tuple[Axis, ...], dict[Axis, Group]]] = []
    perms = [DEFAULT_ORDER] + [o for o in itertools.permutations(DEFAULT_ORDER) if o != DEFAULT_ORDER]
    for order in perms:
        g = axis_groups(hw, Strategy(mesh=degrees, axis_order=order))
        groups = {ax: g[ax] for ax in degrees.active()}
        if any(all(_no_better(groups[ax], other[ax]) for ax in groups) for _, other in kept):
            continue
        kept.append((order, groups))
    return [order for order, _ in kept]


def order_free_hardware(hw: HardwareProfile, degrees: Degrees) -> tuple[HardwareProfile, tuple[Axis, ...]]:
    """(profile, order) under which every axis of degree > 1 gets the best group any order
    gives it on ``hw``, so costs under them bound those of every order from below.

    The best group of an axis is its group with ranks adjacent (``comm.group`` is monotone in
    the stride): on NVLink when its degree n ≤ devices_per_node (D), else across nodes with
    D members per node, bus bandwidth min(intra, D · inter). The order puts the axes with
    n ≤ D innermost and the profile has nodes of S devices, S the product of their degrees,
    so they stay on NVLink; each larger axis (stride ≥ S) crosses nodes with 1 member per
    node, and its bus bandwidth is D times the NIC's, its p2p and latency the NIC's."""
    small = [ax for ax in degrees.active() if degrees[ax] <= hw.devices_per_node]
    order = tuple([ax for ax in DEFAULT_ORDER if ax not in small] + small)
    inter = hw.inter_node
    wide = replace(inter, bw_gbps=hw.devices_per_node * inter.bw_gbps,
                   p2p_bw_gbps=inter.p2p_bw_gbps or inter.bw_gbps)
    nodes = math.prod(degrees[ax] for ax in small)
    return replace(hw, devices_per_node=nodes, inter_node=wide), order


def _offloads(pins: Pins, hw: HardwareProfile) -> list[bool]:
    return _choices(pins.offload, [False, True] if hw.supports_offload else [False])


def outer_candidates(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int,
                     dtype: str, pins: Pins = Pins()) -> Iterator[Candidate]:
    """Every outer candidate the runtime can run, in a fixed order."""
    recipe = pins.recipe or load_recipe()
    refused = set(pins.refused)
    for tp in _choices(pins.tp, _divisors(gpus)):
        if hw.devices_per_node % tp or model.heads % tp or model.kv_heads % tp or gpus % tp \
                or (tp > 1 and "tp" in refused):
            continue
        for pp in _choices(pins.pp, _divisors(gpus // tp)):
            if pp > model.layers or (gpus // tp) % pp or (pp > 1 and "pp" in refused):
                continue
            dp = gpus // (tp * pp)
            if (pins.dp is not None and dp != pins.dp) or global_batch % dp:
                continue
            orders = [tuple(pins.axis_order or DEFAULT_ORDER)]
            for b in _choices(pins.micro_batch, _divisors(global_batch // dp)):
                m, rem = divmod(global_batch // dp, b)
                if rem or (pp > 1 and m < pp):
                    continue
                for zero in _choices(pins.zero, [0, 1, 2, 3] if dp > 1 else [0]):
                    if zero and "dp" in refused:
                        continue
                    for sched, v in _schedules(pins, pp, m, model.layers):
                        if runtime_unsupported(dp=dp, pp=pp, zero=zero, schedule=sched,
                                               virtual_stages=v):
                            continue
                        for sp in _choices(pins.sequence_parallel, [False, True] if tp > 1 else [False]):
                            if sp and (tp == 1 or "sp" in refused):
                                continue  # SP splits what TP replicates: nothing at tp = 1
                            for nominal, modes in _mode_sets(pins, sched):
                                if "selective" in refused:
                                    modes = tuple(i for i in modes if RECOMPUTE[i] != "selective")
                                    if not modes or nominal == "selective":
                                        continue
                                for order, off in itertools.product(orders, _offloads(pins, hw)):
                                    if off and runtime_unsupported(
                                            dp=dp, pp=pp, zero=zero, schedule=sched,
                                            virtual_stages=v, offload=True):
                                        continue
                                    strat = Strategy(
                                        mesh=Degrees(dp=dp, tp=tp, pp=pp), zero=zero, micro_batch=b,
                                        num_microbatches=m, schedule=sched, virtual_stages=v,
                                        sequence_parallel=sp, recompute=nominal, dtype=dtype,
                                        offload=off, axis_order=order, recipe=recipe)
                                    yield Candidate(strategy=strat, modes=modes, min_layers=v)


def candidates(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int,
               dtype: str, pins: Pins = Pins()) -> Iterator[Strategy]:
    """The outer strategies of ``outer_candidates`` (placement left empty)."""
    for cand in outer_candidates(model, hw, gpus, global_batch, dtype, pins):
        yield cand.strategy
