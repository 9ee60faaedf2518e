"""Searches along a traced graph's edges (``fx.Node.users``) for the tensor-parallel layout:
whether a GEMM is a low-rank projection that a norm hands to another GEMM (DeepSeek's latent
attention), and which parts of its output the attention core reads before any other GEMM."""

from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils._pytree import tree_flatten

SDPA = {F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default}
RMS_NORM = {F.rms_norm, torch.ops.aten.rms_norm.default}
NORM_OPS = RMS_NORM | {torch.rsqrt, torch.ops.aten.rsqrt.default, F.layer_norm, torch.ops.aten.layer_norm.default,
                        torch.ops.aten.native_layer_norm.default}
"""Ops of a normalisation (an RMS norm written out computes an ``rsqrt``)."""
GEMM_OPS = {F.linear, torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
            torch.matmul, torch.ops.aten.matmul.default, torch.ops.aten.bmm.default, operator.matmul}
SEARCH_LIMIT = 64
"""Nodes a low-rank check visits at most (DeepSeek's norm between its GEMMs is about 10)."""


def holds_weight(node: fx.Node, root: nn.Module) -> bool:
    """Whether a GEMM node multiplies by a parameter (an ``nn.Linear``, a ``get_attr``)."""
    if node.op == "call_module":
        assert isinstance(node.target, str)
        return isinstance(root.get_submodule(node.target), nn.Linear)
    return any(isinstance(a, fx.Node) and a.op == "get_attr" for a in tree_flatten((node.args, node.kwargs))[0])


def is_norm_node(node: fx.Node, root: nn.Module) -> bool:
    if node.op == "call_module":
        assert isinstance(node.target, str)
        return isinstance(root.get_submodule(node.target), (nn.LayerNorm, nn.RMSNorm))
    return node.target in NORM_OPS or (node.op == "call_method" and node.target == "rsqrt")


def readers(node: fx.Node) -> list[fx.Node]:
    """The nodes reading ``node``'s value: its users, and for an op writing into its first
    argument in place (``copy_`` into a slice of a buffer: DeepSeek's query and key states) the
    readers of that argument and of every tensor it is a view of."""
    found = list(node.users)
    op = node.target
    if isinstance(op, torch._ops.OpOverload) and op._schema.arguments and \
            (info := op._schema.arguments[0].alias_info) is not None and info.is_write:
        dst = node.args[0]
        while isinstance(dst, fx.Node):
            found += [u for u in dst.users if u is not node]
            target = dst.target
            dst = dst.args[0] if isinstance(target, torch._ops.OpOverload) and target.is_view and dst.args else None
    return found


def reaches_core(start: list[fx.Node], root: nn.Module, inside: Callable[[fx.Node], bool]) -> bool:
    """Whether a value read by the ``start`` nodes reaches the attention core (SDPA, or a
    product of two activations) before any weight GEMM."""
    stack, seen = list(start), set[fx.Node]()
    while stack and len(seen) < SEARCH_LIMIT:
        node = stack.pop()
        if node in seen or node.op == "output" or not inside(node):
            continue
        seen.add(node)
        if node.target in SDPA:
            return True
        if node.target in GEMM_OPS or node.op == "call_module" and holds_weight(node, root):
            if not holds_weight(node, root):
                return True
            continue
        stack.extend(readers(node))
    return False


def core_parts(n: fx.Node, out_features: int, ndim: int, root: nn.Module,
                inside: Callable[[fx.Node], bool]) -> tuple[tuple[int, int], ...]:
    """(start, end) columns of GEMM node ``n``'s output that reach the attention core before
    any weight GEMM: its parts cut by a split along the last dimension (DeepSeek's
    ``kv_a_proj_with_mqa``: the compressed K,V, normed into ``kv_b_proj``, and the RoPE key
    every head reads), or all of it."""
    for split in n.users:
        if split.target not in (torch.split, torch.ops.aten.split_with_sizes.default, torch.ops.aten.split.Tensor,
                                torch.functional.split) or len(split.args) < 2:
            continue
        sizes, dim = split.args[1], split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if not isinstance(dim, int) or dim % ndim != ndim - 1:
            continue
        widths = list(sizes) if isinstance(sizes, (list, tuple)) else \
            [sizes] * (out_features // sizes) if isinstance(sizes, int) and sizes else []
        if sum(widths) != out_features:
            continue
        starts = [sum(widths[:i]) for i in range(len(widths))]
        parts = []
        for item in split.users:
            if item.target is operator.getitem and isinstance(item.args[1], int) and \
                    reaches_core([item], root, inside):
                i = item.args[1]
                parts.append((starts[i], starts[i] + widths[i]))
        return tuple(sorted(parts))
    return ((0, out_features),) if reaches_core([n], root, inside) else ()


def low_rank(n: fx.Node, root: nn.Module, inside: Callable[[fx.Node], bool]) -> bool:
    """Whether GEMM node ``n``'s output reaches another weight GEMM through a normalisation,
    before any attention core: a low-rank projection (DeepSeek's latent attention:
    ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``), which tensor parallelism keeps whole
    on every rank, as Megatron-Core and torchtitan do, splitting the GEMM after the norm.
    The search stays ``inside`` the block (not through the residual into the next one's norm)."""
    stack = [(u, False) for u in n.users]
    seen: set[tuple[fx.Node, bool]] = set()
    while stack and len(seen) < SEARCH_LIMIT:
        node, normed = stack.pop()
        if (node, normed) in seen or node.op == "output" or node.target in SDPA or not inside(node):
            continue
        seen.add((node, normed))
        if node.target in GEMM_OPS or (node.op == "call_module" and holds_weight(node, root)):
            if normed and holds_weight(node, root):
                return True
            continue  # another weight GEMM before any norm, or the attention core's product
        normed = normed or is_norm_node(node, root)
        stack.extend((u, normed) for u in node.users)
    return False
