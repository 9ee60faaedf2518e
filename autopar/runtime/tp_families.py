"""What HF families need under tensor and sequence parallelism beyond torch's styles
(``runtime.parallelize`` applies the styles and calls these): module attributes that count
heads or hold a projection's width divided by tp, a model-built per-head bias cut to the
rank's heads, per-head and replicated weights shown to the forward as local tensors whose
gradients are partial sums over the tp ranks, sequence shards gathered where a sub-layer is
called, and a mixture of experts on the rank's own tokens. Nothing here is proved: ``autopar
verify`` runs each family's twin against one process."""

from __future__ import annotations

import copy
import inspect
from typing import Callable, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autopar.layout import Anatomy


_HEAD_BIASES = ("alibi", "position_bias")
"""Keyword arguments of an attention that carry a bias built by the model for every head, heads
leading ([batch x heads, 1, s] for Bloom's ``alibi``, [heads, 1, s] for MPT's ``position_bias``)."""


def local_alibi(block: nn.Module, anat: Anatomy, heads: int, tp: int, rank: int) -> None:
    """Cut the ALiBi bias that a block's attention takes by keyword (``_HEAD_BIASES``: the
    model builds it for every head) to this rank's heads, the slice its column-parallel QKV
    computes."""
    k = heads // tp

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        cut = {}
        for key in _HEAD_BIASES:
            bias = kwargs.get(key)
            if isinstance(bias, torch.Tensor) and bias.dim() and not bias.shape[0] % heads:
                per_head = bias.view(-1, heads, *bias.shape[1:])[:, rank * k:(rank + 1) * k]
                cut[key] = per_head.reshape(-1, *bias.shape[1:])
        return (args, {**kwargs, **cut}) if cut else None

    for owner in {name.rpartition(".")[0] for name in anat.column}:
        module = block.get_submodule(owner)
        if set(_HEAD_BIASES) & set(inspect.signature(type(module).forward).parameters):
            module.register_forward_pre_hook(hook, with_kwargs=True)


def show_local(module: nn.Module, names: list[str], view: Callable[[DTensor], torch.Tensor]) -> None:
    """Hooks showing ``module``'s forward ``view`` of each of its DTensor parameters ``names`` in
    the parameter's place (an attribute read, never registered), the parameter back after, also
    when the forward raises: activation checkpointing stops a recomputation early by raising
    inside it, which would otherwise leave the view in the parameter's place for the next
    forward and the optimizer (found under pipelining with full recompute). The parameter is
    read at each forward, not here: FSDP2 replaces it with its own after this."""
    def show(mod: nn.Module, args: tuple) -> None:
        for n in names:
            whole = mod._parameters[n]
            mod.__dict__[f"_autopar_whole_{n}"] = whole
            mod._parameters[n] = cast(nn.Parameter, view(cast(DTensor, whole)))

    def restore(mod: nn.Module, args: tuple, out: object) -> None:
        for n in names:
            if f"_autopar_whole_{n}" in mod.__dict__:
                mod._parameters[n] = mod.__dict__.pop(f"_autopar_whole_{n}")
    module.register_forward_pre_hook(show)
    module.register_forward_hook(restore, always_call=True)


def replicate_over(module: nn.Module, names: list[str], mesh: DeviceMesh) -> None:
    """``module``'s parameters ``names`` as DTensors replicated over ``mesh`` (its tp axis)."""
    for n in names:
        module.register_parameter(n, nn.Parameter(DTensor.from_local(
            getattr(module, n).data, mesh, (Replicate(),), run_check=False)))


def experts_on_own_tokens(block: nn.Module, anat: Anatomy, mesh: DeviceMesh) -> None:
    """Under sequence parallelism a mixture of experts (its router, experts and any other
    plain weight of the layer: Qwen2-MoE's shared-expert gate) runs on the rank's own tokens,
    replicated over tp: each weight is a DTensor replicated over tp, shown to the forward as
    its local tensor whose gradient is a partial sum over the ranks' tokens (completed as SP's
    norms' are). A shared expert split by TP keeps its styles."""
    layer = anat.experts[0].rpartition(".")[0]
    root = block.get_submodule(layer) if layer else block
    for module in root.modules():
        names = [n for n, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        if names:
            replicate_over(module, names, mesh)
            show_local(module, names, lambda w: w.to_local(grad_placements=(Partial(),)))


def local_head_params(block: nn.Module, anat: Anatomy, heads: int, mesh: DeviceMesh) -> None:
    """A parameter with one value per query head held by the attention itself (GPT-OSS's
    ``sinks``): kept whole, replicated over tp (a checkpoint holds all of it), and shown to the
    forward as this rank's heads' slice; its gradient is a partial sum over the tp ranks (each
    fills its own heads), which the data-parallel wrapper or ``train._reduce_partial_grads``
    completes, as for sequence parallelism's norms."""
    k, rank = heads // mesh.size(), mesh.get_local_rank()
    for owner in {name.rpartition(".")[0] for name in anat.column}:
        module = block.get_submodule(owner)
        names = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 1 and p.numel() == heads]
        if names:
            replicate_over(module, names, mesh)
            show_local(module, names, lambda w: w.to_local(grad_placements=(Partial(),))[rank * k:(rank + 1) * k])


def own_output(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """A row GEMM's output as a tensor of its own: TP hands back ``to_local()``'s view, which
    autograd forbids modifying in place, and models do (Falcon: ``mlp_output += attn``)."""
    return output.clone()


def sum_partial_outputs(block: nn.Module, anat: Anatomy, mesh: DeviceMesh) -> None:
    """A low-rank GEMM kept whole (``Anatomy.replicated``) whose output columns every query
    head reads (``Anatomy.partial_outputs``: DeepSeek's RoPE key): each rank's heads give a
    partial sum of those columns' gradient, so the backward sums them over the tp ranks (an
    all-reduce; the forward is unchanged), and the weight's gradient is whole on every rank."""
    parts: dict[str, list[tuple[int, int]]] = {}
    for name, part in anat.partial_outputs:
        parts.setdefault(name, []).append(part)

    def summed(y: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(y, mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))

    for name, ranges in parts.items():
        def hook(module: nn.Module, args: tuple, y: torch.Tensor, _ranges=tuple(ranges)) -> torch.Tensor:
            pieces, at = [], 0
            for start, end in _ranges:
                pieces += [y[..., at:start], summed(y[..., start:end])]
                at = end
            return torch.cat([*pieces, y[..., at:]], dim=-1)
        block.get_submodule(name).register_forward_hook(hook)


def scatter_sequence(mesh) -> Callable:
    """A forward pre-hook cutting a block's first input (replicated [b, s, h]) into this rank's
    sequence shard (the backward all-gathers); HF blocks take more positional inputs, which
    ``PrepareModuleInput`` would need counted."""
    def hook(module: nn.Module, args: tuple) -> tuple:
        x = DTensor.from_local(args[0], mesh, (Replicate(),), run_check=False)
        return (x.redistribute(mesh, (Shard(1),)).to_local(), *args[1:])
    return hook


def gather_sequence(mesh, local: bool = False) -> Callable:
    """A forward pre-hook gathering a sub-layer's input from this rank's sequence shard into a
    replicated DTensor (the backward reduce-scatters once for all the column GEMMs reading
    it): its first positional argument, else the first tensor passed by keyword (HF
    attentions take ``hidden_states=``). ``local``: as the whole plain tensor, for a sub-layer
    whose low-rank GEMMs, kept whole, read it (each GEMM after them completes its own input
    gradient, so the gathered input's gradient is whole on every rank and the backward keeps
    the rank's shard of it). ``autopar verify`` proves the guess per model."""
    def gather(x: torch.Tensor) -> torch.Tensor:
        whole = DTensor.from_local(x, mesh, (Shard(-2),), run_check=False).redistribute(mesh, (Replicate(),))
        return whole.to_local() if local else whole

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args and isinstance(args[0], torch.Tensor):
            return (gather(args[0]), *args[1:]), kwargs
        key = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        return args, {**kwargs, key: gather(kwargs[key])}
    return hook


def gather_output(mesh) -> Callable:
    """A forward hook gathering a block's output from this rank's sequence shard (dim 1) into
    the whole plain tensor: the output itself, or the first element of the tuple an HF block
    returns (Falcon's, with its attention weights); the backward keeps the rank's shard of the
    gradient, which every rank holds whole."""
    def gather(x: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(x, mesh, (Shard(1),), run_check=False).redistribute(mesh, (Replicate(),)).to_local()

    def hook(module: nn.Module, args: tuple, out: object) -> object:
        if isinstance(out, tuple):
            return (gather(out[0]), *out[1:])
        assert isinstance(out, torch.Tensor)
        return gather(out)
    return hook


def is_count(name: str) -> bool:
    """An attribute naming a number of heads (``num_heads``, ``n_head``, ``num_key_value_heads``),
    not a size, a scale or a ratio of them."""
    low = name.lower()
    return "head" in low and not any(w in low for w in ("dim", "size", "scal", "group", "ratio"))


def localize(owner: nn.Module, widths: set[int], heads: set[int], tp: int, single_kv: bool = False) -> None:
    """Divide by ``tp`` each plain int attribute of ``owner`` that a per-rank forward reshapes
    with: head counts (named as such, equal to the model's heads or kv heads) and widths equal
    to a column GEMM's output or one of its packed chunks (OPT's ``embed_dim``, GPT-2's
    ``split_size``); the same for head counts in an HF ``config`` the module reads (Phi-3).
    Nothing here is proved: ``autopar verify`` runs the result against one process."""
    for name, value in list(vars(owner).items()):
        if not isinstance(value, int) or isinstance(value, bool) or value % tp:
            continue
        if (is_count(name) and value in heads) or (value in widths and "head" not in name.lower()):
            setattr(owner, name, value // tp)
        elif single_kv and "group" in name.lower() and value == max(heads):
            setattr(owner, name, value // tp)  # query heads per K,V head (all of them, one K,V head)
    config = getattr(owner, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        local = copy.copy(config)  # this module's view only
        for name, value in config.to_dict().items():
            if isinstance(value, int) and not isinstance(value, bool) and is_count(name) and value in heads \
                    and not value % tp:
                setattr(local, name, value // tp)
        owner.config = local


def localize_block(block: nn.Module, anat: Anatomy, tp: int, heads: set[int],
                   single_kv: dict[str, int] | None = None) -> None:
    """Make every module owning a column-parallel GEMM compute with this rank's heads and widths
    (``single_kv``: multi-query GEMMs, ``single_kv_gemms``, whose K and V widths stay whole)."""
    packed = dict(anat.packed)
    single_kv = single_kv or {}
    owners: dict[str, set[int]] = {}
    for name in anat.column:
        gemm = block.get_submodule(name)
        widths = owners.setdefault(name.rpartition(".")[0], set())
        if name in single_kv:
            widths.update({single_kv[name]} - {0})  # Q's width only
            continue
        widths.update({cast(int, gemm.out_features), *packed.get(name, ())})  # nn.Linear: apply_tensor_parallel checks
    for owner, widths in owners.items():
        localize(block.get_submodule(owner), widths, heads, tp, bool(single_kv))


def single_kv_gemms(block: nn.Module, anat: Anatomy, heads: int) -> dict[str, int]:
    """Under multi-query attention (one K,V head, which tp does not split), the attention's
    column GEMMs that make K or V: name -> the width of their output kept whole on every rank
    (0: all of it, a K or V projection of its own; w > 0: a GEMM packing Q with K and V, of
    whose output the first w columns are Q, split by heads, the rest K and V)."""
    packed = dict(anat.packed)
    attention = anat.column[0].rpartition(".")[0]
    mine = [n for n in anat.column if n.rpartition(".")[0] == attention]
    outs = {n: cast(int, block.get_submodule(n).out_features) for n in mine}
    q = max(outs.values())
    found: dict[str, int] = {}
    for n, w in outs.items():
        width = cast(int, block.get_submodule(n).in_features)
        if w * heads == q and len(mine) > 1:
            found[n] = 0  # one head's width: K or V (RoPE's halves of it may look packed)
        elif len(packed.get(n, ())) > 1:
            found[n] = packed[n][0]  # Q packed with K and V (GPT-BigCode's c_attn)
        elif width % heads == 0 and w == width + 2 * (width // heads):
            found[n] = width  # Q's heads and one K, V head, cut by a view (Falcon-7B's query_key_value)
    return found


def replicate_single_kv(block: nn.Module, gemms: dict[str, int], mesh: DeviceMesh) -> None:
    """Multi-query attention under TP: each GEMM of ``single_kv_gemms`` kept whole and
    replicated over tp, computed on the whole input by every rank (the input, a replicated
    DTensor, read as its local tensor), its weights' and input's gradients partial sums over
    the ranks (each rank's query heads read K and V); a GEMM packing Q with K, V hands on this
    rank's heads of Q and all of K, V."""
    tp, rank = mesh.size(), mesh.get_local_rank()
    for name, q in gemms.items():
        gemm = block.get_submodule(name)
        names = [n for n, _ in gemm.named_parameters(recurse=False)]
        replicate_over(gemm, names, mesh)
        show_local(gemm, names, lambda w: w.to_local(grad_placements=(Partial(),)))

        def local_input(mod: nn.Module, args: tuple) -> tuple:
            x = args[0]
            return (x.to_local(grad_placements=(Partial(),)) if isinstance(x, DTensor) else x, *args[1:])
        gemm.register_forward_pre_hook(local_input)
        if q:
            def own_heads(mod: nn.Module, args: tuple, y: torch.Tensor, _q: int = q) -> torch.Tensor:
                k = _q // tp
                return torch.cat([y[..., rank * k:(rank + 1) * k], y[..., _q:]], dim=-1)
            gemm.register_forward_hook(own_heads)
