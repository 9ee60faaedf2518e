"""trace: capture a transformer's graph on the meta device and count what it does.

``trace_spec``/``trace_module`` -> :class:`ModelGraph` (per node and per repeated block: FLOPs,
bytes, parameters, saved-for-backward bytes, how weights can be split); ``traced_spec`` reads a
model's shape (layers, hidden, heads ...) off it; ``profile_from_graph`` summarises it for the
cost model. Modules: ``capture`` (torch.fx / torch.export), ``measure`` (running a graph on
meta), ``tracer`` (putting it together), ``shape`` (the shape), ``profile`` (the cost-model view).
"""

from autopar.trace.capture import find_repeated_blocks
from autopar.trace.graph import ActivationBytes, BlockInfo, LinearInfo, ModelGraph, NodeInfo
from autopar.trace.profile import (korthikanti_bytes_per_token, profile_and_layout, profile_from_graph, profile_spec,
                                   shaped_spec)
from autopar.trace.shape import traced_spec
from autopar.trace.tracer import MEGATRON_GPT_DROPOUT, build_spec_model, trace_module, trace_spec

__all__ = ["ActivationBytes", "BlockInfo", "LinearInfo", "MEGATRON_GPT_DROPOUT", "ModelGraph", "NodeInfo",
           "build_spec_model", "find_repeated_blocks", "korthikanti_bytes_per_token", "profile_from_graph",
           "profile_and_layout", "profile_spec", "shaped_spec", "trace_module", "trace_spec", "traced_spec"]
