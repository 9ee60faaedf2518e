"""Host time of a pass: dispatching its kernels from eager PyTorch, what DTensor tensor
parallelism adds around its modules, what activation checkpointing's machinery adds to a
recompute, and how that time meets the kernels' own (seconds).
``compute`` adds them to the passes it prices."""

from __future__ import annotations

from cost_models.hardware import HardwareProfile
from cost_models.strategy import Strategy


def dispatch_s(hw: HardwareProfile, strat: Strategy) -> float:
    """Host time to dispatch one block's forward kernels, s."""
    return strat.recipe.kernels_per_block * hw.kernel_dispatch_us * 1e-6


def tp_host_s(strat: Strategy, us: float) -> float:
    """``us`` µs of host time that tensor parallelism adds to a forward and backward per
    micro-batch where its modules are DTensor modules (``recipe.dtensor_parameters``), s; 0
    without tp. The passes take a third in the forward, two in the backward, as
    ``dispatch_s``'s kernels."""
    if strat.mesh.tp == 1 or not strat.recipe.dtensor_parameters:
        return 0.0
    return us * 1e-6


def checkpoint_s(hw: HardwareProfile, mode: str) -> float:
    """Host time ``torch.utils.checkpoint``'s machinery adds to one block's passes per
    micro-batch in recompute ``mode`` (``HardwareProfile.checkpoint_us``; 0 where not
    measured or not checkpointed), s."""
    return hw.checkpoint_us.get(mode, 0.0) * 1e-6


def with_host(host_s: float, device_s: float, hw: HardwareProfile) -> float:
    """A pass of ``device_s`` of kernels dispatched in ``host_s``: the larger where the device
    runs behind the host (``host_overlaps_device``), their sum where it runs on the host, s."""
    return max(host_s, device_s) if hw.host_overlaps_device else host_s + device_s
