"""Collective and point-to-point times under the α-β law, and which tier each mesh axis uses.

Every collective costs ``call + steps * α + traffic / (bw * efficiency)`` (calculon's one-line
law, plus a fixed cost per call: NCCL's base latency, CPU ranks' arrival skew):
a ring all-reduce of ``n`` members moves ``2(n-1)/n`` of the buffer through each device in
``2(n-1)`` steps; reduce-scatter and all-gather move ``(n-1)/n`` in ``n-1`` steps; a
(double binary) tree all-reduce moves ``2`` buffers in ``2 log2 n`` steps (NCCL's choice for
small messages at scale); all-to-all sends ``(n-1)/n`` of the buffer in ``n-1`` steps
(pairwise exchange). ``nbytes`` is
always the full (unsharded) buffer size. Times in seconds, sizes in bytes.

Rank order is ``Strategy.axis_order`` (outermost first; Megatron's default: pp, dp, cp, tp,
i.e. tp innermost on consecutive ranks, cp next: ``cost_models.axes``). An axis of degree ``n`` whose ranks are ``k`` apart (``k``
the product of the degrees of the axes inside it) stays inside one node iff ``n * k`` is at most
``devices_per_node``; otherwise it crosses nodes with ``min(n, devices_per_node // k)`` (at
least 1) members on each node. A group crossing nodes with ``k`` members on
each node runs ``k`` rings side by side, one per NIC, so its bus bandwidth is
``min(intra bw, k * inter bw)`` (8 HDR NICs x 24 GB/s ~ the 192 GB/s NCCL reports for DGX A100).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models.axes import MESH_AXES, Axis, Degrees
from cost_models.hardware import HardwareProfile
from cost_models.strategy import Strategy


@dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    """One communicator as the α-β law sees it."""

    size: int
    bw_bytes_s: float
    """Effective bus bandwidth of a ring collective (efficiency applied), bytes/s."""
    p2p_bytes_s: float
    """Effective point-to-point bandwidth to a neighbour, bytes/s."""
    latency_s: float
    """α per collective step, s."""
    inter_node: bool
    call_s: float = 0.0
    """Fixed cost of one collective call, s (``LinkTier.call_latency_us``; not of a send)."""
    rs_factor: float = 1.0
    """A reduce-scatter's time over the ring formula's (``LinkTier.reduce_scatter_factor``)."""


def group(hw: HardwareProfile, size: int, inner: int = 1) -> Group:
    """The communicator of an axis of degree ``size`` whose ranks are ``inner`` apart."""
    intra, inter = hw.intra_node, hw.inter_node
    intra_bw = intra.bw_gbps * 1e9 * intra.efficiency
    intra_p2p = (intra.p2p_bw_gbps or intra.bw_gbps) * 1e9 * intra.efficiency
    if size * inner <= hw.devices_per_node:
        return Group(size=size, bw_bytes_s=intra_bw, p2p_bytes_s=intra_p2p,
                     latency_s=intra.latency_us * 1e-6, inter_node=False, rs_factor=intra.reduce_scatter_factor,
                     call_s=intra.call_latency_us * 1e-6)
    per_node = max(1, min(size, hw.devices_per_node // inner))
    inter_bw = inter.bw_gbps * 1e9 * inter.efficiency
    inter_p2p = (inter.p2p_bw_gbps or inter.bw_gbps) * 1e9 * inter.efficiency
    return Group(size=size, bw_bytes_s=min(intra_bw, per_node * inter_bw), p2p_bytes_s=inter_p2p,
                 latency_s=inter.latency_us * 1e-6, inter_node=True, rs_factor=inter.reduce_scatter_factor,
                 call_s=inter.call_latency_us * 1e-6)


def axis_groups(hw: HardwareProfile, strat: Strategy) -> dict[Axis, Group]:
    """The communicator of each axis of ``strat``, its ranks apart by the product of the
    degrees inside it in ``strat.axis_order``."""
    return mesh_groups(hw, strat.mesh, strat.axis_order)


def mesh_groups(hw: HardwareProfile, degrees: Degrees, order: tuple[Axis, ...]) -> dict[Axis, Group]:
    """``axis_groups`` of ``degrees`` in ``order`` (outermost first)."""
    stride = degrees.strides(order)
    out = {axis: group(hw, degrees[axis], stride[axis]) for axis in MESH_AXES}
    out[Axis.EP] = mesh_expert_group(hw, degrees, order)
    return out


def replica_group(hw: HardwareProfile, strat: Strategy) -> Group:
    """The communicator of the ranks holding the same weights, dp x cp (Megatron's "dp-cp"
    group: gradients reduce and ZeRO shards over it), its ranks as far apart as the inner of
    the two axes. Exact when dp and cp are adjacent in the order (Megatron's: cp just inside
    dp); otherwise it is priced as if they were (optimistic)."""
    return mesh_replica_group(hw, strat.mesh, strat.axis_order)


def mesh_replica_group(hw: HardwareProfile, degrees: Degrees, order: tuple[Axis, ...]) -> Group:
    """``replica_group`` of ``degrees`` in ``order``."""
    stride = degrees.strides(order)
    if degrees.cp == 1:
        return group(hw, degrees.dp, stride[Axis.DP])
    inner = min(stride[a] for a in (Axis.DP, Axis.CP) if degrees[a] > 1)
    return group(hw, degrees.dp * degrees.cp, inner)


def _replica_stride(degrees: Degrees, order: tuple[Axis, ...]) -> int:
    """Rank distance between neighbouring dp x cp replicas: the stride of the inner of dp and
    cp (of dp when neither is above 1)."""
    stride = degrees.strides(order)
    active = [a for a in (Axis.DP, Axis.CP) if degrees[a] > 1]
    return min(stride[a] for a in active) if active else stride[Axis.DP]


def mesh_expert_group(hw: HardwareProfile, degrees: Degrees, order: tuple[Axis, ...]) -> Group:
    """The expert-parallel group of ``degrees`` in ``order``: ``ep`` consecutive dp x cp
    replicas (dp_index = edp_index * ep + ep_index, ``cost_models.axes``), so its ranks are
    one replica stride apart and it stays inside a node when ep x that stride fits one."""
    return group(hw, degrees.ep, _replica_stride(degrees, order))


def mesh_expert_data_group(hw: HardwareProfile, degrees: Degrees, order: tuple[Axis, ...]) -> Group:
    """The expert-data-parallel group: the dp x cp / ep replicas holding the same experts,
    ep replicas apart (ZeRO shards and gradient reductions of the expert weights)."""
    return group(hw, degrees.edp, _replica_stride(degrees, order) * degrees.ep)


def expert_groups(hw: HardwareProfile, strat: Strategy) -> tuple[Group, Group]:
    """(ep group, edp group) of ``strat`` (``mesh_expert_group``, ``mesh_expert_data_group``)."""
    return (mesh_expert_group(hw, strat.mesh, strat.axis_order),
            mesh_expert_data_group(hw, strat.mesh, strat.axis_order))


def exposed_s(comm_s: float, window_s: float, hw: HardwareProfile) -> float:
    """Critical-path time of a collective of ``comm_s`` overlapped with ``window_s`` of
    compute: the part longer than the window, plus ``hw.overlap_penalty`` of the overlapped
    part (NCCL's kernels take SMs and HBM bandwidth from the compute they hide behind)."""
    hidden = min(comm_s, window_s)
    return max(0.0, comm_s - window_s) + hw.overlap_penalty * max(0.0, hidden)


def all_reduce_s(nbytes: float, g: Group) -> float:
    """Ring all-reduce of an ``nbytes`` buffer: call + 2(n-1)/n · bytes / bw + 2(n-1) α."""
    n = g.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    return g.call_s + 2 * (n - 1) / n * nbytes / g.bw_bytes_s + 2 * (n - 1) * g.latency_s


def tree_all_reduce_s(nbytes: float, g: Group) -> float:
    """Double-binary-tree all-reduce: reduce up and broadcast down, call + 2 · bytes / bw
    (pipelined) + 2 ⌈log2 n⌉ α."""
    n = g.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    return g.call_s + 2 * nbytes / g.bw_bytes_s + 2 * math.ceil(math.log2(n)) * g.latency_s


def best_all_reduce_s(nbytes: float, g: Group) -> float:
    """The faster of ring and tree, as NCCL's tuner picks per message size."""
    return min(all_reduce_s(nbytes, g), tree_all_reduce_s(nbytes, g))


def all_to_all_s(nbytes: float, g: Group) -> float:
    """Pairwise all-to-all of an ``nbytes`` buffer per device (expert dispatch or combine):
    each device keeps 1/n and sends (n-1)/n, call + (n-1) α."""
    n = g.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    return g.call_s + (n - 1) / n * nbytes / g.bw_bytes_s + (n - 1) * g.latency_s


def reduce_scatter_s(nbytes: float, g: Group) -> float:
    """Ring reduce-scatter of an ``nbytes`` buffer: call + (n-1)/n · bytes / bw + (n-1) α, times the
    tier's ``rs_factor`` (a backend whose reduce-scatter is no ring)."""
    return g.rs_factor * all_gather_s(nbytes, g)


def all_gather_s(nbytes: float, g: Group) -> float:
    """Ring all-gather producing an ``nbytes`` buffer: call + (n-1)/n · bytes / bw + (n-1) α."""
    n = g.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    return g.call_s + (n - 1) / n * nbytes / g.bw_bytes_s + (n - 1) * g.latency_s


def p2p_s(nbytes: float, g: Group) -> float:
    """One send of ``nbytes`` to a neighbour: α + bytes / p2p bw."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    return g.latency_s + nbytes / g.p2p_bytes_s
