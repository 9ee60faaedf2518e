"""Hardware profiles: one device kind, its node, and the two topology tiers, loaded from JSON.

Units are in the field names: ``_tflops`` is 10^12 FLOP/s, ``_gbps`` is 10^9 bytes/s,
``_us`` microseconds, ``_gib`` 2^30 bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path


class ProfileError(ValueError):
    """A hardware profile that cannot be found or read; the message names the fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkTier:
    """One topology tier (NVLink inside a node, InfiniBand across nodes) under the α-β law."""

    bw_gbps: float
    """Achievable per-device bus bandwidth of a ring collective over this tier, GB/s."""
    latency_us: float
    """α: fixed cost of one collective step over this tier, µs."""
    efficiency: float = 1.0
    """Fraction of ``bw_gbps`` reached by the collectives the runtime issues (calibrated)."""
    p2p_bw_gbps: float = 0.0
    """Unidirectional point-to-point bandwidth per device, GB/s (0: use ``bw_gbps``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    """A cluster's device and interconnect, as the cost model sees them."""

    name: str
    device: str
    """Device model, e.g. ``A100-SXM4-80GB``."""
    devices_per_node: int
    memory_gib: float
    """Device memory usable by the training process, GiB."""
    peak_tflops: dict[str, float]
    """Dense peak per dtype (``bf16``, ``fp16``, ``fp32``), TFLOP/s."""
    hbm_bw_gbps: float
    """Device memory bandwidth, GB/s."""
    intra_node: LinkTier
    inter_node: LinkTier
    matmul_efficiency: float = 1.0
    """Calibrated fraction of peak reached by large GEMMs (all dimensions >> matmul_half_dim)."""
    fp8_matmul_efficiency: float = 0.0
    """Calibrated fraction of the fp8 peak reached by large Float8 GEMMs (0: matmul_efficiency)."""
    matmul_half_dim: float = 0.0
    """GEMM shape law: a GEMM whose smallest dimension is n reaches
    ``matmul_efficiency · n / (n + matmul_half_dim)`` of peak (0: no shape dependence)."""
    memory_efficiency: float = 1.0
    """Calibrated fraction of ``hbm_bw_gbps`` reached by element-wise kernels."""
    optimizer_memory_efficiency: float = 0.0
    """Calibrated fraction of ``hbm_bw_gbps`` reached by the optimizer step's fused
    multi-tensor kernels (Adam, gradient-norm, clipping scale); 0: ``memory_efficiency``."""
    reserve_gib: float = 0.0
    """Device memory no tensor gets: CUDA context, cuBLAS/cuDNN workspaces, GiB."""
    nccl_gib_per_group: float = 0.0
    """Device memory of one collective communicator (NCCL channel buffers), GiB; a rank
    holds one per mesh axis of degree > 1 plus the default group."""
    allocator_headroom: float = 0.0
    """Fraction of the device memory left to the caching allocator's fragmentation and
    rounding: plans keep their peak of live tensors below ``memory_bytes``."""
    attention_efficiency: dict[str, float] = field(default_factory=dict)
    """Fraction of dense peak a fused attention kernel family reaches on its executed FLOPs,
    forward and backward alike (``flash2``: FlashAttention-2 as torch SDPA dispatches it,
    ``cudnn``: cuDNN / FlashAttention-3-class fused attention, ``triton``: FlashAttention's
    Triton kernel as MPT/llm-foundry ran it)."""
    overlap_penalty: float = 0.0
    """Fraction of a collective's time that still costs the compute it overlaps with (its
    kernels occupy SMs and HBM bandwidth): 0 is perfect overlap, 1 none."""
    kernel_dispatch_us: float = 0.0
    """Host time to dispatch one kernel from eager PyTorch (Python, dispatcher, launch), µs:
    a pass of k kernels takes at least k times this (0: never host-bound)."""
    host_memory_gib: float = 0.0
    """Host (CPU) memory available per device for offloaded training state, GiB: the node's
    memory divided by ``devices_per_node``, less what the OS and the process need; 0: no
    offload (datasheet figure, see ``notes``)."""
    host_link_bw_gbps: float = 0.0
    """Host<->device copy bandwidth per device (its PCIe link), GB/s each way; datasheet."""
    host_optimizer_gbps: float = 0.0
    """Host-memory bandwidth per device reached by the optimizer step on the CPU (memory-bound
    Adam), GB/s; assumed, not measured."""
    price_per_gpu_hour: float = 0.0
    """What one device-hour costs, USD, for cost per token (``autopar plan --what-if``); 0:
    unknown (the shipped profiles state none: prices vary by provider and contract)."""
    launcher: str = "nccl"
    """Process-group backend the runtime uses on this cluster: ``nccl`` or ``gloo``."""
    notes: dict[str, str] = field(default_factory=dict)
    """Where each figure comes from (datasheet, measurement command)."""

    def __post_init__(self) -> None:
        if self.devices_per_node <= 0:
            raise ProfileError(f"profile {self.name!r}: devices_per_node must be positive")
        if not self.peak_tflops:
            raise ProfileError(f"profile {self.name!r}: peak_tflops needs at least one dtype")
        if not 0.0 <= self.allocator_headroom < 1.0:
            raise ProfileError(f"profile {self.name!r}: allocator_headroom must be in [0, 1)")
        if not 0.0 <= self.overlap_penalty <= 1.0:
            raise ProfileError(f"profile {self.name!r}: overlap_penalty must be in [0, 1]")
        if self.price_per_gpu_hour < 0:
            raise ProfileError(f"profile {self.name!r}: price_per_gpu_hour must be >= 0")
        if any(not 0.0 < e <= 1.0 for e in self.attention_efficiency.values()):
            raise ProfileError(f"profile {self.name!r}: attention_efficiency values must be in (0, 1]")

    @property
    def memory_bytes(self) -> float:
        """What a plan may fill with tensors: the device memory less the allocator headroom."""
        return self.memory_gib * 2**30 * (1.0 - self.allocator_headroom)

    def attention_eff(self, kernel: str) -> float:
        """``attention_efficiency`` of a fused kernel family; a profile without it prices
        fused attention at ``matmul_efficiency``."""
        return self.attention_efficiency.get(kernel, self.matmul_efficiency)

    @property
    def host_memory_bytes(self) -> float:
        return self.host_memory_gib * 2**30

    @property
    def supports_offload(self) -> bool:
        """The profile gives the host memory, link and CPU optimizer figures offload needs."""
        return min(self.host_memory_gib, self.host_link_bw_gbps, self.host_optimizer_gbps) > 0

    def peak_flops(self, dtype: str) -> float:
        """Dense peak of ``dtype`` in FLOP/s."""
        if dtype not in self.peak_tflops:
            raise ProfileError(f"profile {self.name!r} has no peak for dtype {dtype!r}; "
                               f"it lists {', '.join(sorted(self.peak_tflops))}")
        return self.peak_tflops[dtype] * 1e12


PROFILE_DIR = Path(__file__).resolve().parent.parent / "hardware_profiles"


def _profile_dir() -> Path:
    """The shipped profiles: the ``hardware_profiles`` package beside this one."""
    try:
        import hardware_profiles
    except ImportError:
        return PROFILE_DIR
    return Path(hardware_profiles.__file__).resolve().parent


def available_profiles() -> list[str]:
    return sorted(p.stem for p in _profile_dir().glob("*.json"))


def profile_from_dict(data: dict) -> HardwareProfile:
    known = {f.name for f in fields(HardwareProfile)}
    unknown = set(data) - known
    if unknown:
        raise ProfileError(f"profile {data.get('name', '?')!r} has unknown keys {sorted(unknown)}")
    try:
        tiers = {k: LinkTier(**data[k]) for k in ("intra_node", "inter_node")}
        return HardwareProfile(**{**data, **tiers})
    except (KeyError, TypeError) as exc:
        raise ProfileError(f"profile {data.get('name', '?')!r} is malformed: {exc}") from None


def load_profile(name_or_path: str) -> HardwareProfile:
    """A shipped profile by name (``dgx-a100-80g``) or a JSON file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = _profile_dir() / f"{name_or_path}.json"
    if not path.is_file():
        raise ProfileError(f"unknown cluster {name_or_path!r}; use a profile "
                           f"({', '.join(available_profiles())}) or a path to a profile .json file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ProfileError(f"cluster profile {path} is not valid JSON: {exc}") from None
    return profile_from_dict(data)
