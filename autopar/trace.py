"""trace: capture a transformer's graph with torch.fx on the meta device and count what it does.

Repeated blocks (children of a ``ModuleList``/``ModuleDict`` with the same class and parameter
shapes) are found first and kept as leaves of the top-level graph; one representative of each
distinct block is traced on its own. Shape propagation runs each distinct block once and reuses
its output shape for the repeats, so tracing costs grow with the number of distinct blocks, not
with depth. Nothing real is allocated: parameters and activations live on ``meta``.

FLOPs are forward FLOPs, 2 per multiply-add, of the matmul-like nodes (linear layers, matmuls,
attention's QKᵀ and AV counted in full as ``FlopCounterMode`` does); element-wise nodes count
0 FLOPs and are seen through their output bytes.
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from autopar.errors import UserError
from autopar.model import build_model
from autopar.spec import ModelSpec
from cost_models.model_profile import ModelProfile


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One node of a traced graph."""

    name: str
    op: str
    target: str
    shape: tuple[int, ...]
    """Output shape (empty for non-tensor outputs)."""
    out_bytes: int
    flops: float
    """Forward FLOPs of this node at the traced batch and sequence length."""
    params: int
    """Parameters owned by the module this node calls (0 for functions)."""


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """A kind of repeated block: traced once, instantiated ``len(names)`` times."""

    kind: str
    names: tuple[str, ...]
    """Fully-qualified names of the repeats, in model order."""
    params: int
    """Parameters of one repeat."""
    nodes: tuple[NodeInfo, ...]

    @property
    def count(self) -> int:
        return len(self.names)

    @property
    def flops(self) -> float:
        """Forward FLOPs of one repeat."""
        return sum(n.flops for n in self.nodes)


@dataclass(frozen=True, slots=True)
class ModelGraph:
    """What the tracer sees: the top-level graph (blocks as single nodes) and each block kind."""

    name: str
    input_shape: tuple[int, ...]
    nodes: tuple[NodeInfo, ...]
    blocks: tuple[BlockInfo, ...]
    params: int
    """Distinct trainable parameters (a tied weight counted once)."""

    def block_of(self, node: NodeInfo) -> BlockInfo | None:
        return next((b for b in self.blocks if node.target in b.names), None)

    @property
    def flops(self) -> float:
        """Forward FLOPs of the whole model at ``input_shape``."""
        total = 0.0
        for node in self.nodes:
            block = self.block_of(node)
            total += block.flops if block is not None else node.flops
        return total


def _signature(module: nn.Module) -> tuple:
    return (type(module).__qualname__,
            tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()))


def find_repeated_blocks(model: nn.Module) -> list[list[str]]:
    """Groups of fully-qualified names of structurally identical siblings in module containers."""
    groups: list[list[str]] = []
    for prefix, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
            continue
        by_sig: dict[tuple, list[str]] = defaultdict(list)
        for child_name, child in container.named_children():
            by_sig[_signature(child)].append(f"{prefix}.{child_name}" if prefix else child_name)
        groups.extend(names for names in by_sig.values() if len(names) > 1)
    return groups


class _LeafTracer(fx.Tracer):
    """Keeps the given modules (and torch's own) as ``call_module`` leaves."""

    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaves or super().is_leaf_module(m, qualname)


class _CachedShapeProp(ShapeProp):
    """ShapeProp that runs one repeat of each block kind and reuses its output for the others."""

    def __init__(self, gm: fx.GraphModule, kind_of: dict[str, int]) -> None:
        super().__init__(gm)
        self.kind_of = kind_of
        self.cache: dict[tuple, torch.Tensor] = {}

    def call_module(self, target, args, kwargs):
        kind = self.kind_of.get(target)
        if kind is None or not all(isinstance(a, torch.Tensor) for a in args) or kwargs:
            return super().call_module(target, args, kwargs)
        key = (kind, tuple((tuple(a.shape), a.dtype) for a in args))
        if key not in self.cache:
            out = super().call_module(target, args, kwargs)
            if not isinstance(out, torch.Tensor):
                return out
            self.cache[key] = out
        out = self.cache[key]
        return torch.empty(out.shape, dtype=out.dtype, device="meta")


def _module_params(gm: fx.GraphModule, target: str) -> int:
    return sum(p.numel() for p in gm.get_submodule(target).parameters())


def _node_flops(node: fx.Node, gm: fx.GraphModule) -> float:
    """Forward FLOPs of one node from its input and output shapes."""
    out = node.meta.get("tensor_meta")
    if out is None or not hasattr(out, "shape"):
        return 0.0
    out_numel = math.prod(out.shape)
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if isinstance(mod, nn.Linear):
            return 2.0 * out_numel * mod.in_features
        return 0.0
    if node.op in ("call_function", "call_method"):
        target = node.target
        if target is F.scaled_dot_product_attention:
            q, k = (a.meta["tensor_meta"].shape for a in node.args[:2])
            return 4.0 * math.prod(q[:-1]) * k[-2] * q[-1]
        if target in (torch.matmul, torch.bmm, torch.mm, operator.matmul, "matmul", "bmm", "mm"):
            inner = node.args[0].meta["tensor_meta"].shape[-1]
            return 2.0 * out_numel * inner
    return 0.0


def _node_infos(gm: fx.GraphModule, leaves: set[str]) -> tuple[NodeInfo, ...]:
    infos = []
    for node in gm.graph.nodes:
        meta = node.meta.get("tensor_meta")
        shape = tuple(meta.shape) if hasattr(meta, "shape") else ()
        nbytes = math.prod(shape) * meta.dtype.itemsize if shape else 0
        params = _module_params(gm, node.target) if node.op == "call_module" else 0
        flops = 0.0 if node.target in leaves else _node_flops(node, gm)
        infos.append(NodeInfo(node.name, node.op, str(node.target) if not callable(node.target)
                              else getattr(node.target, "__name__", str(node.target)),
                              shape, nbytes, flops, params))
    return tuple(infos)


def _symbolic_trace(module: nn.Module, leaves: set[str], what: str) -> fx.GraphModule:
    try:
        return fx.GraphModule(module, _LeafTracer(leaves).trace(module))
    except Exception as exc:  # fx raises many types; the user needs the module and the reason
        raise UserError(f"torch.fx could not trace {what} ({type(module).__name__}): "
                        f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def trace_module(model: nn.Module, example: torch.Tensor, name: str = "") -> ModelGraph:
    """Trace ``model`` (on meta) called on ``example`` (a meta tensor)."""
    groups = find_repeated_blocks(model)
    leaves = {n for names in groups for n in names}
    gm = _symbolic_trace(model, leaves, "the model")
    kind_of = {n: i for i, names in enumerate(groups) for n in names}
    prop = _CachedShapeProp(gm, kind_of)
    prop.propagate(example)
    top = _node_infos(gm, leaves)

    blocks = []
    node_by_target = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    for names in groups:
        first = node_by_target.get(names[0])
        if first is None:
            continue  # a container entry the forward never calls
        inputs = [a.meta["tensor_meta"] for a in first.args]
        block = gm.get_submodule(names[0])
        bgm = _symbolic_trace(block, set(), f"block {names[0]}")
        ShapeProp(bgm).propagate(*(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in inputs))
        called = tuple(n for n in names if n in node_by_target)
        blocks.append(BlockInfo(type(block).__name__, called,
                                sum(p.numel() for p in block.parameters()), _node_infos(bgm, set())))
    params = sum(p.numel() for p in model.parameters())  # parameters() yields shared ones once
    return ModelGraph(name or type(model).__name__, tuple(example.shape), top, tuple(blocks), params)


def trace_spec(spec: ModelSpec, micro_batch: int = 1) -> ModelGraph:
    """Trace the built-in model of ``spec`` at its sequence length, on meta."""
    model = build_model(spec, device="meta")
    example = torch.zeros(micro_batch, spec.seq, dtype=torch.long, device="meta")
    return trace_module(model, example, spec.name)


def activation_bytes_per_token(spec: ModelSpec) -> tuple[float, float, float]:
    """Saved-for-backward bytes per token of one block, split as (replicated, TP-sharded,
    attention core), with 16-bit activations and 1-byte dropout masks.

    Korthikanti et al. 2022, Sec. 4.1, generalised to the MLP width f, kv heads and SwiGLU:
    replicated: the two norm inputs, the attention and MLP inputs and the two dropout masks
    (10h, Megatron GPT); sharded: Q, K, V, the attention output and the MLP's intermediates
    (4h + 4·kv·d + 4f for GELU — 24h at f = 4h — and 8f for SwiGLU's gate, up, SiLU and
    product); attention core: softmax output, its dropout mask and output (5·a·s; 2·a·s
    without dropout). The llama family trains without dropout.
    """
    h, a, s, f = spec.hidden, spec.heads, spec.seq, spec.ffn_hidden
    kv = spec.num_kv_heads * spec.head_dim
    if spec.arch == "gpt":
        return 10.0 * h, 4.0 * h + 4.0 * kv + 4.0 * f, 5.0 * a * s
    return 8.0 * h, 4.0 * h + 4.0 * kv + 8.0 * f, 2.0 * a * s


def profile_from_graph(graph: ModelGraph, spec: ModelSpec) -> ModelProfile:
    """Summarise a traced built-in model for the cost model (counts per block and per token)."""
    if len(graph.blocks) != 1:
        raise UserError(f"expected one kind of repeated transformer block in {graph.name}, "
                        f"found {len(graph.blocks)}")
    block = graph.blocks[0]
    tokens = math.prod(graph.input_shape)
    block_pos = [i for i, n in enumerate(graph.nodes) if n.target in block.names]
    before, after = graph.nodes[: block_pos[0]], graph.nodes[block_pos[-1] + 1:]
    matmul = sum(n.flops for n in block.nodes if n.op == "call_module")
    attn = sum(n.flops for n in block.nodes if n.op != "call_module")
    repl, sharded, core = activation_bytes_per_token(spec)
    return ModelProfile(
        name=graph.name, layers=block.count, hidden=spec.hidden, heads=spec.heads,
        kv_heads=spec.num_kv_heads, ffn=spec.ffn_hidden, vocab=spec.vocab, seq=spec.seq,
        tied=spec.tied, block_params=block.params,
        embed_params=sum(n.params for n in before), head_params=sum(n.params for n in after),
        block_matmul_flops_per_token=matmul / tokens, block_attn_flops_per_token=attn / tokens,
        head_flops_per_token=sum(n.flops for n in after) / tokens,
        block_act_bytes_replicated_per_token=repl, block_act_bytes_sharded_per_token=sharded,
        block_act_bytes_attn_per_token=core)


def profile_spec(spec: ModelSpec) -> ModelProfile:
    """Trace the built-in model of ``spec`` and summarise it for the cost model."""
    return profile_from_graph(trace_spec(spec), spec)
