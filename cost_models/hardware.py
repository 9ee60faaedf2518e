"""Hardware profiles: one device kind, its node, and the two topology tiers, loaded from JSON.

Units are in the field names: ``_tflops`` is 10^12 FLOP/s, ``_gbps`` is 10^9 bytes/s,
``_us`` microseconds, ``_gib`` 2^30 bytes.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from cost_models.jsonfile import JsonFileError, decode_json


REF_HEAD_DIM = 128
"""Head dimension at which ``HardwareProfile.attention_efficiency`` is stated: that of every
training row it is fitted on (Llama and GPT shapes) and of the kernels' sequence law."""


class ProfileError(ValueError):
    """A hardware profile that cannot be found or read; the message names the fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkTier:
    """One topology tier (NVLink inside a node, InfiniBand across nodes) under the α-β law."""

    bw_gbps: float
    """Achievable per-device bus bandwidth of a ring collective over this tier, GB/s."""
    latency_us: float
    """α: fixed cost of one collective step over this tier, µs."""
    call_latency_us: float = 0.0
    """Fixed cost of one collective call over this tier whatever its steps, µs: its members'
    arrival skew and the call's own setup (NCCL's tuner's base latency beside its per-hop one;
    on CPU ranks sharing cores, the wait for a descheduled peer). 0: none measured."""
    efficiency: float = 1.0
    """Fraction of ``bw_gbps`` reached by the collectives the runtime issues (calibrated)."""
    p2p_bw_gbps: float = 0.0
    """Unidirectional point-to-point bandwidth per device, GB/s (0: use ``bw_gbps``)."""
    reduce_scatter_factor: float = 1.0
    """A reduce-scatter's time over what the ring formula gives it (1: NCCL's ring; gloo's
    reduce-scatter reduces the whole buffer, as slow as an all-reduce: about 2, measured)."""


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
    """Calibrated fraction of peak reached by large GEMMs (every dimension >> the half-dims)."""
    fp8_matmul_efficiency: float = 0.0
    """Calibrated fraction of the fp8 peak reached by large Float8 GEMMs (0: matmul_efficiency)."""
    matmul_half_dim: float = 0.0
    """GEMM shape law: an (m x k) @ (k x n) GEMM reaches ``matmul_efficiency · m / (m + H) ·
    n / (n + H) · k / (k + D)`` of peak, H this (the output's dimensions), D
    ``matmul_half_depth`` (the reduction's); 0: no shape dependence."""
    matmul_half_depth: float = 0.0
    """The reduction dimension's half-dim of the GEMM shape law (``matmul_half_dim``)."""
    fp8_matmul_half_depth: float = 0.0
    """The reduction half-dim of Float8 GEMMs (0: ``matmul_half_depth``)."""
    sustained_clock: float = 1.0
    """Tensor-core clock a training step sustains over the one ``peak_tflops`` is quoted at:
    below 1 where a power cap throttles the chip (Meta's Grand Teton H100 at 500 W of its 700 W
    TDP). It scales every compute-bound kernel (GEMMs, fused attention), not memory-bound ones;
    MFU stays against ``peak_tflops``, the datasheet convention."""
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
    Triton kernel as MPT/llm-foundry ran it): at long sequences where ``attention_half_seq``
    gives the family a half-length."""
    sdpa_kernel: str = "flash2"
    """The fused kernel family torch's ``scaled_dot_product_attention`` dispatches here (what
    the recipes' ``sdpa`` kernel means, unless ``attention_efficiency`` measured ``sdpa``
    itself): FlashAttention-2 on A100 and CPU flash on CPU; cuDNN on sm90/sm100 (H100, H200,
    B200), which torch puts first where cuDNN is 9.15 or newer (``sdp_utils.cpp``,
    ``check_prefer_cudnn_attention``; seen on an H100 with torch 2.11)."""
    attention_half_seq: dict[str, float] = field(default_factory=dict)
    """Sequence law of a fused attention kernel family: at s tokens per sequence (per context-
    parallel rank) it reaches ``attention_efficiency · s / (s + S)``, S its value here (a row
    block's fixed work amortised over the keys it visits); a family not listed has none."""
    attention_half_head_dim: dict[str, float] = field(default_factory=dict)
    """Head-dimension law of a fused attention kernel family: at head dim d it reaches
    ``d / (d + D)`` of its efficiency at ``REF_HEAD_DIM`` (D its value here: the softmax's
    exponentials and rescales per score, which a larger d amortises over more GEMM work); a
    family not listed has none."""
    overlap_penalty: float = 0.0
    """Fraction of a collective's time that still costs the compute it overlaps with (its
    kernels occupy SMs and HBM bandwidth): 0 is perfect overlap, 1 none."""
    kernel_dispatch_us: float = 0.0
    """Host time to dispatch one kernel from eager PyTorch (Python, dispatcher, launch), µs:
    a pass of k kernels takes at least k times this (0: never host-bound)."""
    optimizer_tensor_us: float = 0.0
    """Host time of the optimizer step per parameter tensor, µs: the per-tensor operators'
    dispatch where the step loops over tensors (torch's AdamW on CPU: about ten operators a
    tensor; 0: not measured, or multi-tensor kernels whose host time the device hides)."""
    dtensor_optimizer_us: float = 0.0
    """Host time a DTensor parameter adds to the optimizer step over a plain tensor's, µs per
    parameter tensor (DTensor's dispatch of each of the step's operators; 0: not measured).
    The autopar runtime's parameters are DTensors under FSDP2 and tensor parallelism."""
    tp_linear_us: float = 0.0
    """Host time tensor parallelism adds to one split Linear's forward and backward per
    micro-batch where its weights are DTensors (``recipe.dtensor_parameters``: DTensor's
    dispatch, sharding propagation and redistribution around each ColwiseParallel and
    RowwiseParallel module; collectives excluded), µs; it adds to the passes where the host runs
    the operators (``host_overlaps_device`` false) and bounds them from below where it does
    not. 0: not measured."""
    tp_loss_us: float = 0.0
    """The same for the vocab-parallel head and loss (``loss_parallel``), µs per micro-batch."""
    fsdp_hook_us: float = 0.0
    """Host time of FSDP2's hooks around one parameter group's forward and backward (unshard,
    reshard, gradient hand-off; collectives excluded), µs per group and micro-batch: it adds
    to the passes where the host runs the operators (``host_overlaps_device`` false); 0: not
    measured. The autopar runtime wraps each block, the embedding and the head in a group
    under ZeRO 1-3, and under FSDP2's ``replicate`` when ZeRO 0 meets tp, pp or ep."""
    pp_chunk_us: float = 0.0
    """Host time ``torch.distributed.pipelining``'s schedule adds to one model chunk's forward
    and backward per micro-batch (the stage's input and output bookkeeping, the schedule's
    actions; the transfers excluded), µs; it adds to a stage's time per micro-batch where the
    host runs the operators (``host_overlaps_device`` false). 0: not measured."""
    zb_block_us: float = 0.0
    """Host time the zero-bubble schedule's split backward adds per block and micro-batch
    (``stage_backward_input`` and ``stage_backward_weight`` walk the micro-batch's autograd
    graph in Python), µs; as ``pp_chunk_us``. 0: not measured."""
    checkpoint_us: dict[str, float] = field(default_factory=dict)
    """Host time ``torch.utils.checkpoint``'s machinery (non-reentrant: a saved-tensor hook
    per saved tensor, the recompute's frame and replay; under per-op recompute its policy's
    dispatch mode around every operator) adds to one block's forward and backward per
    micro-batch, beyond the recomputed kernels' own dispatch, µs, per recompute mode
    (``selective``, ``full``, ``op``) as the autopar runtime wraps the block; it adds to the
    recompute pass where the host runs the operators (``host_overlaps_device`` false) and
    bounds it from below where it does not. A mode not listed: 0, not measured."""
    ranks_per_core: float = 1.0
    """Ranks sharing one compute unit (CPU ranks outnumbering the cores: 2 for 4 ranks on 2
    cores; 1 on GPUs). The compute rates are measured with every rank busy, so a rank idle in a
    pipeline's fill or drain lends its share to the busy ones (``pipeline.weights``)."""
    host_overlaps_device: bool = True
    """Whether the device runs kernels while the host dispatches the next ones (CUDA streams): a
    pass then takes the larger of its host and device times. False (CPU ranks): each operator
    runs on the thread that dispatched it, so a pass takes their sum."""
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
        if any(not 0.0 <= x < math.inf for x in self.attention_half_seq.values()):
            raise ProfileError(f"profile {self.name!r}: attention_half_seq values must be tokens >= 0")
        if any(not 0.0 <= x < math.inf for x in self.attention_half_head_dim.values()):
            raise ProfileError(f"profile {self.name!r}: attention_half_head_dim values must be >= 0")

    @property
    def memory_bytes(self) -> float:
        """What a plan may fill with tensors: the device memory less the allocator headroom."""
        return self.memory_gib * 2**30 * (1.0 - self.allocator_headroom)

    def attention_eff(self, kernel: str, seq: float = math.inf, head_dim: float = REF_HEAD_DIM) -> float:
        """``attention_efficiency`` of a fused kernel family at ``seq`` tokens per sequence
        (``attention_half_seq``; the default: its long-sequence value) and heads of
        ``head_dim`` (``attention_half_head_dim``); a profile without it prices fused
        attention at ``matmul_efficiency``."""
        if kernel == "sdpa" and kernel not in self.attention_efficiency:
            kernel = self.sdpa_kernel
        eff = self.attention_efficiency.get(kernel, self.matmul_efficiency)
        half = self.attention_half_seq.get(kernel, 0.0)
        if half and seq < math.inf:
            eff *= seq / (seq + half)
        dim = self.attention_half_head_dim.get(kernel, 0.0)
        return eff * (head_dim / (head_dim + dim)) / (REF_HEAD_DIM / (REF_HEAD_DIM + dim))

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

    def compute_flops(self, dtype: str) -> float:
        """What compute-bound kernels run against: the dense peak at the sustained clock, FLOP/s."""
        return self.peak_flops(dtype) * self.sustained_clock


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


MAX_PROFILE_BYTES = 16 << 20
"""A profile file larger than this is refused unread (the shipped ones are a few KiB)."""
DTYPE_KEYS = ("bf16", "fp16", "fp32", "fp8")
"""The dtypes a profile may give a peak for."""
LAUNCHERS = ("nccl", "gloo")
CHECKPOINTED = ("selective", "full", "op")
"""The recompute modes that run under ``torch.utils.checkpoint`` (``checkpoint_us``'s keys)."""
_LO = 1e-6
"""Least rate, size or peak in its unit: a profile figure below it is a wrong unit, and the
cost model's times stay finite above it."""
_EFF = 1e-3
"""Least efficiency fraction (the same reason)."""
_RANGES: dict[str, tuple[float, float, str]] = {
    # field: (least, most, unit); least 0 means "0 = not given", a plain lower bound otherwise
    "memory_gib": (_LO, 1 << 16, "GiB"),
    "hbm_bw_gbps": (_LO, 1e6, "GB/s"),
    "matmul_efficiency": (_EFF, 1.0, "(a fraction)"),
    "fp8_matmul_efficiency": (0.0, 1.0, "(a fraction; 0: matmul_efficiency)"),
    "matmul_half_dim": (0.0, 1e6, "(a GEMM dimension)"),
    "matmul_half_depth": (0.0, 1e6, "(a GEMM dimension)"),
    "fp8_matmul_half_depth": (0.0, 1e6, "(a GEMM dimension; 0: matmul_half_depth)"),
    "memory_efficiency": (_EFF, 1.0, "(a fraction)"),
    "sustained_clock": (0.1, 1.0, "(a fraction of the quoted peak's clock)"),
    "optimizer_memory_efficiency": (0.0, 1.0, "(a fraction; 0: memory_efficiency)"),
    "reserve_gib": (0.0, 1 << 16, "GiB"),
    "nccl_gib_per_group": (0.0, 1 << 16, "GiB"),
    "allocator_headroom": (0.0, 0.99, "(a fraction)"),
    "overlap_penalty": (0.0, 1.0, "(a fraction)"),
    "kernel_dispatch_us": (0.0, 1e6, "µs"),
    "optimizer_tensor_us": (0.0, 1e6, "µs"),
    "dtensor_optimizer_us": (0.0, 1e6, "µs"),
    "fsdp_hook_us": (0.0, 1e6, "µs"),
    "tp_linear_us": (0.0, 1e6, "µs"),
    "tp_loss_us": (0.0, 1e6, "µs"),
    "pp_chunk_us": (0.0, 1e6, "µs"),
    "zb_block_us": (0.0, 1e6, "µs"),
    "host_memory_gib": (0.0, 1 << 20, "GiB"),
    "host_link_bw_gbps": (0.0, 1e6, "GB/s"),
    "host_optimizer_gbps": (0.0, 1e6, "GB/s"),
    "price_per_gpu_hour": (0.0, 1e6, "USD per device-hour"),
    "ranks_per_core": (1.0, 1024.0, "(ranks per compute unit)"),
    "bw_gbps": (_LO, 1e6, "GB/s"),
    "latency_us": (0.0, 1e7, "µs"),
    "call_latency_us": (0.0, 1e7, "µs"),
    "efficiency": (_EFF, 1.0, "(a fraction)"),
    "p2p_bw_gbps": (0.0, 1e6, "GB/s (0: bw_gbps)"),
    "reduce_scatter_factor": (0.1, 10.0, "(a ratio to the ring formula)"),
}
_PEAK = (_LO, 1e6, "TFLOP/s")
_NODE = 1024
"""Most devices per node."""


def _number(name: str, where: str, value: Any, rng: tuple[float, float, str]) -> float:
    """``value`` as a float within ``rng`` (0 allowed where the range starts at 0)."""
    low, high, unit = rng
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        number = float(value) if ok else math.nan
    except OverflowError:
        number = math.inf
    if not (math.isfinite(number) and low <= number <= high and (number > 0 or low == 0)):
        raise ProfileError(f"profile {where}: {name} must be a number in [{low:g}, {high:g}] {unit}, "
                           f"got {_shown(value)}")
    return number


def _shown(value: Any) -> str:
    """A user value on one short line."""
    if isinstance(value, int) and abs(value).bit_length() > 128:
        return f"an integer of about {int(abs(value).bit_length() * math.log10(2)) + 1:,} digits"
    try:
        text = " ".join(repr(value).split())
    except RecursionError:
        text = f"a deeply nested {type(value).__name__}"
    return text if len(text) <= 60 else text[:59] + "…"


def _object(value: Any, what: str, where: str) -> dict:
    if not isinstance(value, dict):
        raise ProfileError(f"profile {where}: {what} must be a JSON object, got {_shown(value)}")
    return value


def _fields(cls: type, data: dict, where: str, prefix: str) -> dict[str, Any]:
    """``data``'s known keys checked against ``cls``'s fields: none unknown, none required missing."""
    known = {f.name: f for f in fields(cls)}
    unknown = set(data) - set(known)
    if unknown:
        raise ProfileError(f"profile {where} has unknown keys {_shown(sorted(map(str, unknown)))}; remove them")
    missing = [f"{prefix}{n}" for n, f in known.items()
               if n not in data and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ProfileError(f"profile {where} lacks {', '.join(missing)}; see hardware_profiles/*.json")
    return data


def _tier(data: Any, key: str, where: str) -> LinkTier:
    tier = _fields(LinkTier, _object(data, key, where), where, f"{key}.")
    return LinkTier(**{k: _number(f"{key}.{k}", where, v, _RANGES[k]) for k, v in tier.items()})


def profile_from_dict(data: Any) -> HardwareProfile:
    """A profile from parsed JSON, every figure checked: kinds, finite, positive where a rate
    or a size, within plausible bounds of its unit; anything wrong is one ``ProfileError`` line."""
    if not isinstance(data, dict):
        raise ProfileError(f"a hardware profile is a JSON object, got {_shown(data)}; see hardware_profiles/*.json")
    name = data.get("name", "?")
    where = _shown(name if isinstance(name, str) else "?")
    _fields(HardwareProfile, data, where, "")
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("name", "device"):
            if not isinstance(value, str) or not value.strip() or "\n" in value:
                raise ProfileError(f"profile {where}: {key} must be a non-empty one-line string, got {_shown(value)}")
            out[key] = value
        elif key == "sdpa_kernel":
            if not isinstance(value, str) or not value.strip() or value == "sdpa":
                raise ProfileError(f"profile {where}: sdpa_kernel must name a fused attention kernel family "
                                   f"(flash2, cudnn, ...), got {_shown(value)}")
            out[key] = value
        elif key == "launcher":
            if value not in LAUNCHERS:
                raise ProfileError(f"profile {where}: launcher must be one of {', '.join(LAUNCHERS)}, got {_shown(value)}")
            out[key] = value
        elif key == "host_overlaps_device":
            if not isinstance(value, bool):
                raise ProfileError(f"profile {where}: host_overlaps_device must be true or false, got {_shown(value)}")
            out[key] = value
        elif key == "devices_per_node":
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _NODE:
                raise ProfileError(f"profile {where}: devices_per_node must be an integer in [1, {_NODE}], "
                                   f"got {_shown(value)}")
            out[key] = value
        elif key in ("intra_node", "inter_node"):
            out[key] = _tier(value, key, where)
        elif key == "peak_tflops":
            peaks = _object(value, key, where)
            if not peaks or any(k not in DTYPE_KEYS for k in peaks):
                raise ProfileError(f"profile {where}: peak_tflops must give the peak of one or more of "
                                   f"{', '.join(DTYPE_KEYS)}, got keys {_shown(sorted(map(str, peaks)))}")
            out[key] = {k: _number(f"peak_tflops.{k}", where, v, _PEAK) for k, v in peaks.items()}
        elif key == "attention_efficiency":
            effs = _object(value, key, where)
            out[key] = {k: _number(f"attention_efficiency[{_shown(k)}]", where, v, (_EFF, 1.0, "(a fraction)"))
                        for k, v in effs.items()}
        elif key in ("attention_half_seq", "attention_half_head_dim"):
            halves = _object(value, key, where)
            unit = "tokens" if key == "attention_half_seq" else "head dims"
            out[key] = {k: _number(f"{key}[{_shown(k)}]", where, v, (0.0, 1e7, unit))
                        for k, v in halves.items()}
        elif key == "checkpoint_us":
            modes = _object(value, key, where)
            if any(k not in CHECKPOINTED for k in modes):
                raise ProfileError(f"profile {where}: checkpoint_us must map recompute modes "
                                   f"({', '.join(CHECKPOINTED)}) to µs, got keys {_shown(sorted(map(str, modes)))}")
            out[key] = {k: _number(f"checkpoint_us.{k}", where, v, (0.0, 1e6, "µs")) for k, v in modes.items()}
        elif key == "notes":
            notes = _object(value, key, where)
            if any(not isinstance(v, str) for v in notes.values()):
                raise ProfileError(f"profile {where}: notes must map names to strings")
            out[key] = dict(notes)
        else:
            out[key] = _number(key, where, value, _RANGES[key])
    for key in ("reserve_gib", "nccl_gib_per_group"):
        if out.get(key, 0.0) >= out["memory_gib"]:
            raise ProfileError(f"profile {where}: {key} must be below memory_gib ({out['memory_gib']:g} GiB)")
    return HardwareProfile(**out)


def load_profile(name_or_path: str) -> HardwareProfile:
    """A shipped profile by name (``dgx-a100-80g``) or a JSON file by path; any bytes that are
    not a profile give a ``ProfileError`` (not UTF-8, not JSON, too deep, a figure out of range)."""
    try:
        path = Path(name_or_path)
        if not path.suffix:
            path = _profile_dir() / f"{name_or_path}.json"
        found = path.is_file()
        size = path.stat().st_size if found else 0
        raw = path.read_bytes() if found and size <= MAX_PROFILE_BYTES else b""
    except (OSError, ValueError) as exc:  # unreadable, a name the OS refuses
        raise ProfileError(f"cannot read cluster profile {_shown(name_or_path)}: "
                           f"{' '.join(str(exc).split())[:200]}") from None
    if not found:
        raise ProfileError(f"unknown cluster {_shown(name_or_path)}; use a profile "
                           f"({', '.join(available_profiles())}) or a path to a profile .json file")
    if size > MAX_PROFILE_BYTES:
        raise ProfileError(f"cluster profile {path} is {size:,} bytes, not a profile; see hardware_profiles/*.json")
    try:
        data = decode_json(raw, "profile")
    except JsonFileError as exc:
        raise ProfileError(f"cluster profile {path} {exc}") from None
    return profile_from_dict(data)
