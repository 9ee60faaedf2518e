"""Run a captured graph on meta tensors and measure each node: FLOPs, bytes, parameters, what
autograd keeps for backward, and how its weight can be split.

One :class:`Recorder` per run holds the measurements; :class:`MeasureRun` (an
``fx.Interpreter``) executes nodes under ``FlopCounterMode`` (FLOPs) and
``torch.autograd.graph.saved_tensors_hooks`` (every tensor autograd saves, deduplicated by
storage; parameters and buffers are not activations). Nothing is computed: all tensors are meta.

Where the meta/CPU implementation of an op keeps different tensors than the GPU kernel training
uses, the op runs as that kernel would, and only there:

- ``scaled_dot_product_attention``, ``attention="fused"``: FlashAttention-2 keeps Q, K, V, the
  output (stored [b, s, heads, d], so the output projection's input is a view of it) and a
  float32 logsumexp [b, heads, s]; its dropout is regenerated from a seed, no mask.
  ``attention="unfused"``: Megatron-LM's core attention, op by op: scaled Q, K (KV heads
  repeated for GQA), the softmax output, a 1-byte dropout mask, the dropped probabilities, V.
- dropout keeps a 1-byte mask (CUDA ``native_dropout``), not a 16-bit one;
- ``rms_norm`` keeps its input and a float32 rstd (the fused CUDA kernel), not float32 copies.

Tensor-parallel roles follow Megatron-LM: a weight GEMM whose input is replicated is
column-parallel (its output is sharded), one whose input is sharded is row-parallel (its output
is all-reduced, replicated); other ops are sharded when an input is.

Attention written out by hand (minGPT: ``q @ k.transpose(-2, -1)``, mask, softmax, dropout,
``@ v``) is found by its structure, not by names: inside a block, a product of two activations
(no weight) starts the core, and what is computed from its output up to the next such product
(probabilities times V) is the core; its heads and head size are read off Q's shape.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from autopar.trace.lowrank import RMS_NORM, SDPA, core_parts, low_rank
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from autopar.trace.graph import ActivationBytes, LinearInfo, NodeInfo
from autopar.trace.kernels import attention, dropout, rms_norm

REP, SHARD = "rep", "shard"


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    """How a run treats attention and dropout."""

    attention: str = "fused"
    """``fused`` (FlashAttention) or ``unfused`` (Megatron-LM core attention)."""
    dropout: float = 0.0
    """Extra dropout probability: attention dropout and hidden dropout after every row-parallel
    GEMM not already followed by one (0: dropout only where the model has it)."""


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


_SDPA_ARGS = ("q", "k", "v", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DROPOUT = {F.dropout, torch.ops.aten.dropout.default, torch.ops.aten.native_dropout.default}


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """[S, in] x [E, in, out] grouped by expert: each routed row meets one expert."""
    return 2 * a_shape[0] * a_shape[-1] * b_shape[-1]


def flop_mapping() -> dict:
    """FLOP formulas beyond torch's registry: grouped expert GEMMs (torch and transformers)."""
    mapping = {}
    ops = [getattr(torch.ops.aten, "_grouped_mm", None)]
    try:
        ops.append(torch.ops.transformers.grouped_mm_fallback)
    except (AttributeError, RuntimeError):
        pass
    for op in ops:
        if op is not None and op not in flop_registry:
            mapping[op] = _grouped_mm_flops
    return mapping


@dataclass(kw_only=True, slots=True)
class Saved:
    """A storage autograd keeps, attributed to the segment and node that saved it first."""

    segment: str
    node: str
    role: str
    """``replicated``, ``sharded`` or ``attn``."""
    nbytes: int
    shape: tuple[int, ...] = ()
    dtype: str = ""


@dataclass(kw_only=True, slots=True)
class Recorder:
    """Measurements of one run (mutable while it runs; summarised by the tracer)."""

    recipe: Recipe
    params: dict[int, tuple[str, torch.Tensor]]
    """Storage key -> (qualified name, parameter) of every parameter and buffer."""
    nodes: dict[str, list[NodeInfo]] = field(default_factory=lambda: defaultdict(list))
    saved: dict[int, Saved] = field(default_factory=dict)
    state: dict[int, str] = field(default_factory=dict)
    producer: dict[int, str] = field(default_factory=dict)
    alive: list[torch.Tensor] = field(default_factory=list)
    """Every tensor keyed in ``state`` (meta: no data), held so its storage outlives the run: a
    freed storage's address is reused by a later one, which would inherit its key's state
    (a head read as row-parallel after a block's sharded intermediate, in some runs only)."""
    linears: dict[str, list[LinearInfo]] = field(default_factory=lambda: defaultdict(list))
    linear_at: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Node name -> (segment, index in ``linears``) of each weight GEMM."""
    slices: dict[str, set[tuple[int, int]]] = field(default_factory=dict)
    """Producer node -> (start, end) of each last-dimension slice taken of its output."""
    attention: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    """Segment -> (heads, kv heads seen by the kernel, head dim, GEMMs before it) of its attention."""
    sdpa: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Segment -> (storage key of its first SDPA call's mask, 0: none; its K's element size)."""
    batch: int = 1
    """Sequences in the traced micro-batch (the first input's leading size)."""
    core: set[int] = field(default_factory=set)
    """Storage keys of a hand-written attention core's tensors (scores, mask-added, softmax,
    dropped probabilities): kept as ``attn``."""
    node_core: bool = False
    """The node running now computes on the attention core (what it saves first is ``attn``)."""
    embeddings: list[str] = field(default_factory=list)
    """Names of the tables read by embedding lookups, in order (a weight shared with a GEMM
    carries the name ``linears`` gives it)."""
    seen_modules: set[str] = field(default_factory=set)
    fed_by_row: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    """Segment -> modules whose first operation reads a row-parallel GEMM's output."""
    fed_by_column: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    fed_by_replicated: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    """Segment -> modules whose first operation reads a low-rank (``replicate``) GEMM's output."""
    """Segment -> modules whose first operation reads a column-parallel GEMM's output."""
    stacked: tuple[tuple[str, int], ...] = ()
    """(name, leading size) of each stacked expert weight: a GEMM of a block holding such
    weights, with that many outputs, is its router (``expert_counts``)."""
    segment: str = ""
    node: str = ""
    node_state: str = REP
    in_attention: bool = False
    attention_shape: tuple[int, int, int] = (0, 0, 0)
    """(query length, key length, logsumexp elements) of the attention running now."""
    pre_nodes: int = 0
    """Top-level nodes recorded before the first block ran (the embedding side)."""
    blocks_started: bool = False

    @classmethod
    def for_module(cls, module: nn.Module, recipe: Recipe,
                   like: "Recorder | None" = None, batch: int = 1) -> "Recorder":
        """A recorder of ``module``'s run on ``batch`` sequences; ``like``: an earlier one of the
        same module, whose parameter and buffer lookup it shares (read-only; storage keys are
        slow to take)."""
        if like is not None:
            return cls(recipe=recipe, params=like.params, stacked=like.stacked, batch=batch)
        params: dict[int, tuple[str, torch.Tensor]] = {
            _key(p): (n, p) for n, p in module.named_parameters(remove_duplicate=False)}
        params.update({_key(b): (n, b) for n, b in module.named_buffers(remove_duplicate=False)})
        stacked = tuple((n, p.shape[0]) for n, p in module.named_parameters() if p.dim() == 3)
        return cls(recipe=recipe, params=params, stacked=stacked, batch=batch)

    def expert_counts(self, segment: str) -> frozenset[int]:
        """Leading sizes of the stacked expert weights inside block ``segment`` (none outside
        a block, nor in a dense block beside mixture-of-experts ones: GLM-4.5's first)."""
        return frozenset(c for n, c in self.stacked if segment and n.startswith(segment + "."))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            key = _key(t)
        except (RuntimeError, NotImplementedError):
            return t
        if key in self.params or key in self.saved:
            return t
        if key in self.core:
            role = "attn"
        elif key in self.producer:
            role = "sharded" if self.state.get(key, REP) == SHARD else "replicated"
        elif self.in_attention:  # scores-shaped, or the logsumexp: the core; else Q/K/V/output copies
            s_q, s_k, lse = self.attention_shape
            core = (t.dim() >= 2 and tuple(t.shape[-2:]) == (s_q, s_k)) or t.numel() == lse
            role = "attn" if core else "sharded"
        elif self.node_core:  # made by a core op while it runs (a dropout mask)
            role = "attn"
        else:
            role = "sharded" if self.node_state == SHARD else "replicated"
        self.saved[key] = Saved(segment=self.segment, node=self.node, role=role, nbytes=_nbytes(t),
                                shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
        return t

    def activations(self, segment: str, nodes: frozenset[str] | None = None) -> ActivationBytes:
        """What ``segment`` keeps by role (``nodes``: only what those nodes save first)."""
        totals: defaultdict[str, int] = defaultdict(int)
        for s in self.saved.values():
            if s.segment == segment and (nodes is None or s.node in nodes):
                totals[s.role] += s.nbytes
        return ActivationBytes(replicated=totals["replicated"], sharded=totals["sharded"], attn=totals["attn"])

    def saved_by(self, segment: str, node: str) -> int:
        return sum(s.nbytes for s in self.saved.values() if s.segment == segment and s.node == node)


class MeasureRun(fx.Interpreter):
    """Executes a GraphModule on meta tensors, recording each node into a :class:`Recorder`.

    ``segment_of`` names the segment (a block representative or "" for the top) of a node;
    ``leaves`` maps ``call_module`` targets to callables that run them instead (repeated blocks
    of an fx capture); ``prefix`` is the qualified name of the traced module inside the model.
    """

    def __init__(self, gm: fx.GraphModule, rec: Recorder, counter: FlopCounterMode,
                 segment_of: Callable[[fx.Node], str], prefix: str = "",
                 leaves: dict[str, Callable[..., Any]] | None = None) -> None:
        super().__init__(gm, garbage_collect_values=False)  # storages stay unique while we look
        self.rec, self.counter, self.segment_of = rec, counter, segment_of
        self.prefix, self.leaves = prefix, leaves or {}

    def _module(self, n: fx.Node) -> nn.Module | None:
        if n.op != "call_module":
            return None
        assert isinstance(n.target, str)  # a call_module target is the module's qualified name
        return self.module.get_submodule(n.target)

    def _call(self, n: fx.Node, args: tuple, kwargs: dict) -> tuple[Any, float]:
        """Run one node; returns (result, FLOPs FlopCounterMode does not see)."""
        rec, mod, target = self.rec, self._module(n), n.target
        if target in SDPA:
            q, k = args[0], args[1]
            rec.in_attention = True
            rec.attention_shape = (q.shape[-2], k.shape[-2], q.shape[0] * q.shape[1] * q.shape[-2])
            rec.attention.setdefault(rec.segment, (q.shape[1], k.shape[1], q.shape[-1],
                                                   len(rec.linears[rec.segment])))
            call = dict(zip(_SDPA_ARGS, args), **kwargs)
            mask = call.get("attn_mask")
            rec.sdpa.setdefault(rec.segment, (_key(mask) if isinstance(mask, torch.Tensor) else 0, k.element_size()))
            if rec.recipe.attention == "unfused":
                call["dropout_p"] = max(call.get("dropout_p", 0.0), rec.recipe.dropout)
            try:
                return attention(**call, mode=rec.recipe.attention)
            finally:
                rec.in_attention = False
        if target in _DROPOUT or isinstance(mod, nn.Dropout):
            p = mod.p if isinstance(mod, nn.Dropout) else (kwargs.get("p", args[1] if len(args) > 1 else 0.5))
            train = mod.training if mod is not None else kwargs.get("train", kwargs.get("training", args[2] if len(args) > 2 else True))
            out = dropout(args[0], p if train else 0.0)
            return ((out, None) if target is torch.ops.aten.native_dropout.default else out), 0.0
        if target in RMS_NORM or isinstance(mod, nn.RMSNorm):
            if isinstance(mod, nn.RMSNorm):
                return rms_norm(args[0], list(mod.normalized_shape), mod.weight, mod.eps), 0.0
            return rms_norm(*args, **kwargs), 0.0
        return getattr(self, n.op)(target, args, kwargs), 0.0

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "output", "get_attr"):
            return super().run_node(n)
        rec = self.rec
        rec.segment, rec.node = self.segment_of(n), n.name
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if n.op == "call_module" and n.target in self.leaves:  # a repeated block: counted apart
            rec.blocks_started = True
            result = self.leaves[n.target](*args, **kwargs)
            for t in _tensors(result):
                rec.state.setdefault(_key(t), REP)
                rec.alive.append(t)
            return result
        if rec.segment:
            rec.blocks_started = True
        elif not rec.blocks_started:
            rec.pre_nodes += 1
        inputs = _tensors((args, kwargs))
        mod = self._module(n)
        weights = [t for t in inputs if _key(t) in rec.params]
        if mod is not None:
            weights += list(mod.parameters())
        acts = [t for t in inputs if _key(t) not in rec.params and t.is_floating_point()]
        _note_first_input(rec, _module_of(n, self.prefix), acts)
        in_state = [rec.state.get(_key(t), REP) for t in acts]
        rec.node_state = SHARD if SHARD in in_state else REP
        rec.node_core = bool(rec.segment) and any(_key(t) in rec.core for t in acts)
        before = self.counter.get_total_flops()
        try:
            result, extra = self._call(n, args, kwargs)
        finally:
            rec.node_core = False
        flops = self.counter.get_total_flops() - before + extra
        outputs = _tensors(result)
        split, out_state = "", rec.node_state
        core: tuple[tuple[int, int], ...] = ()

        def inside(u: fx.Node) -> bool:
            return self.segment_of(u) == rec.segment
        gemm_weights = [w for w in weights if w.dim() >= 2 and w.is_floating_point()]
        if rec.segment and not (flops > 0 and gemm_weights) and n.target not in SDPA:  # no weight GEMM
            _follow_core(rec, acts, outputs, flops)
        if flops > 0 and gemm_weights:
            w = max(gemm_weights, key=lambda t: t.numel())
            first = in_state[0] if in_state else REP
            split = "column" if first == REP else "row"
            out_state = SHARD if split == "column" else REP
            out_f = outputs[0].shape[-1] if outputs else w.shape[0]
            in_f = acts[0].shape[-1] if acts else w.shape[-1]
            if w.dim() == 3:
                split = "expert-" + split
            elif out_f in (counts := rec.expert_counts(rec.segment)) or (out_f == 1 and counts):
                # the MoE router, or a one-output gate beside it (Qwen2-MoE's shared-expert
                # gate): replicated, not split
                split, out_state = "router", REP
            elif split == "column" and rec.segment and out_f < in_f and low_rank(n, self.module, inside):
                split, out_state = "replicate", REP
                core = core_parts(n, int(out_f), outputs[0].dim() if outputs else 2, self.module, inside)
            if rec.recipe.dropout > 0 and split == "row" and rec.segment and not any(
                    u.target in _DROPOUT for u in n.users):
                rec.node_state = out_state  # the mask is of the replicated output
                result = dropout(result, rec.recipe.dropout)
                outputs = _tensors(result)
            name = rec.params[_key(w)][0] if _key(w) in rec.params else ""
            rec.linear_at[n.name] = (rec.segment, len(rec.linears[rec.segment]))
            rec.linears[rec.segment].append(LinearInfo(
                name=name, in_features=int(in_f), out_features=int(out_f), split=split,
                experts=int(w.shape[0]) if w.dim() == 3 else 0, core_parts=core))
        elif n.target in (F.embedding, torch.ops.aten.embedding.default) or isinstance(mod, nn.Embedding):
            split = "vocab"
            tables = [w for w in weights if w.dim() == 2]
            if tables and _key(tables[0]) in rec.params and not rec.segment:
                rec.embeddings.append(rec.params[_key(tables[0])][0])
        elif len(acts) == 1 and len(outputs) > 1:
            _mark_packed(rec, acts[0], [t.shape[-1] for t in outputs if t.shape[:-1] == acts[0].shape[:-1]])
        elif n.target is torch.ops.aten.slice.Tensor and acts:
            _note_slice(rec, acts[0], args)
        for t in outputs:
            key = _key(t)
            rec.producer.setdefault(key, n.name)
            rec.state.setdefault(key, out_state)
            rec.alive.append(t)
        shape = tuple(outputs[0].shape) if outputs else ()
        rec.nodes[rec.segment].append(NodeInfo(
            name=n.name, op=n.op, target=_target_name(n.target), module=_module_of(n, self.prefix),
            shape=shape, out_bytes=sum(t.numel() * t.element_size() for t in outputs),
            in_bytes=sum(t.numel() * t.element_size() for t in inputs) + sum(
                p.numel() * p.element_size() for p in weights if all(p is not t for t in inputs)),
            flops=float(flops), params=sum(p.numel() for p in weights if isinstance(p, nn.Parameter)),
            saved_bytes=rec.saved_by(rec.segment, n.name), split=split))
        return result


def _follow_core(rec: Recorder, acts: list[torch.Tensor], outputs: list[torch.Tensor], flops: float) -> None:
    """Track a hand-written attention core through a block node with no weight GEMM: a product
    of two activations that are not core (Q Kᵀ) starts it, and records the block's heads and
    head size from Q ([..., heads, s, d] or [batch * heads, s, d]); ops on core tensors stay in
    it (a weight joined to them too: GPT-OSS's sinks); the product of the probabilities and V
    leaves it."""
    core_in = any(_key(t) in rec.core for t in acts)
    if flops > 0 and len(acts) >= 2 and not core_in and outputs and outputs[0].dim() >= 3:
        q, k = acts[0], acts[1]
        d, s_q = q.shape[-1], outputs[0].shape[-2]
        s_k = outputs[0].shape[-1]
        heads = q.numel() // max(1, rec.batch * s_q * d)
        kv_heads = k.numel() // max(1, rec.batch * s_k * d)
        if heads and q.numel() == rec.batch * heads * s_q * d:
            rec.attention.setdefault(rec.segment, (heads, kv_heads or heads, int(d),
                                                   len(rec.linears[rec.segment])))
            rec.core.update(_key(t) for t in outputs)
    elif core_in and flops == 0:
        rec.core.update(_key(t) for t in outputs)


def _mark_packed(rec: Recorder, x: torch.Tensor, widths: list[int]) -> None:
    """``x`` cut along its last dimension into consecutive parts of ``widths``: if ``x`` is (a
    view of) a column-parallel GEMM's output, that GEMM packs ``len(widths)`` projections
    (GPT-2's fused Q/K/V, a fused gate/up, Phi-3's GQA Q/K/V), and TP must shard each one."""
    gemm = rec.linear_at.get(rec.producer.get(_key(x), ""))
    if gemm is None or x.dim() == 0 or len(widths) < 2:
        return
    segment, index = gemm
    info = rec.linears[segment][index]
    if info.split == "column" and x.shape[-1] == info.out_features and sum(widths) == x.shape[-1]:
        rec.linears[segment][index] = replace(info, packed=len(widths), sections=tuple(widths))


def _note_first_input(rec: Recorder, module: str, acts: list[torch.Tensor]) -> None:
    """On a module's first operation, whether it reads a row- or column-parallel GEMM's output."""
    if not module or module in rec.seen_modules:
        return
    rec.seen_modules.add(module)
    for t in acts:
        at = rec.linear_at.get(rec.producer.get(_key(t), ""))
        split = rec.linears[at[0]][at[1]].split if at is not None else ""
        if split in ("row", "column", "replicate"):
            fed = {"row": rec.fed_by_row, "column": rec.fed_by_column, "replicate": rec.fed_by_replicated}[split]
            fed[rec.segment].append(module)
            return


def _note_slice(rec: Recorder, x: torch.Tensor, args: tuple) -> None:
    """A slice of ``x`` along its last dimension (``qkv[..., a:b]``); once the slices of a GEMM's
    output cover it in consecutive parts, the GEMM is packed (:func:`_mark_packed`)."""
    dim, start, end = (list(args[1:4]) + [0, None, None])[:3]
    if x.dim() == 0 or dim % x.dim() != x.dim() - 1 or (len(args) > 4 and args[4] != 1):
        return
    width = int(x.shape[-1])
    start = 0 if start is None else int(start) % width if int(start) < 0 else int(start)
    end = width if end is None or int(end) > width else int(end) % width if int(end) < 0 else int(end)
    parts = rec.slices.setdefault(rec.producer.get(_key(x), ""), set())
    parts.add((start, end))
    ordered = sorted(parts)
    if ordered[0][0] == 0 and ordered[-1][1] == width and all(a[1] == b[0] for a, b in zip(ordered, ordered[1:])):
        _mark_packed(rec, x, [b - a for a, b in ordered])


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    if target is operator.getitem:
        return "getitem"
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


def _module_of(n: fx.Node, prefix: str) -> str:
    stack = n.meta.get("nn_module_stack")
    if stack:
        return list(stack.values())[-1][0]
    if n.op == "call_module":
        return f"{prefix}.{n.target}" if prefix else str(n.target)
    return prefix
