"""Trace a module on meta into a :class:`ModelGraph`: capture, run each distinct block once,
count. See ``capture`` (how graphs are captured) and ``measure`` (what each node is counted as).
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from autopar.errors import UserError
from autopar.spec import ModelSpec
from autopar.trace.capture import (Capture, _culprit, _first_line, export_capture, find_repeated_blocks,
                                   fx_capture, outer_groups)
from autopar.trace.graph import ActivationBytes, BlockInfo, ModelGraph
from autopar.trace.measure import MeasureRun, Recipe, Recorder, flop_mapping
from autopar.trace.nodynamo import without_dynamo

MEGATRON_GPT_DROPOUT = 0.1
"""Attention and hidden dropout of Megatron-LM's GPT recipe (Shoeybi et al. 2019; Korthikanti et
al. 2022 count its masks), used for the recipe activations of the built-in ``gpt`` models."""


def _fresh(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return torch.empty(t.shape, dtype=t.dtype, device="meta", requires_grad=t.requires_grad)
    return t


def _segment_finder(cap: Capture):
    members = {n: names[0] for names in cap.blocks for n in names}

    def segment_of(node: fx.Node) -> str:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            if path in members:
                return path
        return ""
    return segment_of


def _run(model: nn.Module, cap: Capture, inputs: tuple, recipe: Recipe,
         like: Recorder | None = None) -> Recorder:
    """One measured run of the capture on meta; every block kind runs once (``like``: an
    earlier run's recorder, whose parameter lookup this one shares)."""
    batch = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 1
    rec = Recorder.for_module(model, recipe, like, batch=batch)
    with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t), \
            FlopCounterMode(display=False, custom_mapping=flop_mapping()) as counter:
        if cap.how == "torch.fx":
            outputs: dict[str, Any] = {}

            def leaf(rep: str, name: str):
                def call(*args, **kwargs):
                    if rep not in outputs:
                        run = MeasureRun(cap.block_gms[rep], rec, counter, lambda n: rep, prefix=rep)
                        outputs[rep] = run.run(*args, **kwargs) if not kwargs else run.run(*args, *kwargs.values())
                        return outputs[rep]
                    return tree_map(_fresh, outputs[rep])
                return call
            leaves = {n: leaf(names[0], n) for names in cap.blocks for n in names}
            top = MeasureRun(cap.gm, rec, counter, lambda n: "", leaves=leaves)
        else:
            top = MeasureRun(cap.gm, rec, counter, _segment_finder(cap))
        try:
            top.run(*inputs)
        except UserError:
            raise
        except Exception as exc:  # an op without a meta kernel, a shape the model rejects
            node = rec.node
            raise UserError(f"running {_culprit(exc, model)} on meta failed at node {node!r}: "
                            f"{_first_line(exc)}") from None
    return rec


def trace_module(model: nn.Module, example: torch.Tensor | tuple[torch.Tensor, ...], name: str = "",
                 *, recipe_dropout: float = 0.0, dtype: torch.dtype | None = torch.bfloat16,
                 capture: str = "auto") -> ModelGraph:
    """Trace ``model`` (on meta) called on ``example`` (meta tensors).

    ``dtype``: floating parameters and inputs are cast to it (16-bit activations, as trained);
    None keeps them. ``recipe_dropout``: dropout of the Megatron-recipe activations.
    ``capture``: ``fx``, ``export`` or ``auto`` (fx, then export if fx fails).
    """
    inputs = example if isinstance(example, tuple) else (example,)
    if dtype is not None:
        model = model.to(dtype)
        inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    groups = outer_groups(find_repeated_blocks(model))
    if capture == "export":
        cap = export_capture(model, inputs, groups)
    else:
        try:
            cap = fx_capture(model, groups)
        except UserError as fx_error:
            if capture == "fx":
                raise
            try:
                cap = export_capture(model, inputs, groups)
            except UserError as exc:
                raise UserError(f"{exc} (and {fx_error})") from None
    # fx runs need no dynamo (torch.export has imported it already): skip its import.
    with without_dynamo() if cap.how == "torch.fx" else nullcontext():
        measured = _run(model, cap, inputs, Recipe(attention="fused"))
        recipe = _run(model, cap, inputs, Recipe(attention="unfused", dropout=recipe_dropout),
                      measured)
    blocks = []
    for names in cap.blocks:
        rep = names[0]
        if rep not in measured.nodes:
            continue
        block = model.get_submodule(rep)
        heads, kv_seen, head_dim, before = measured.attention.get(rep, (0, 0, 0, 0))
        linears = tuple(measured.linears[rep])
        # KV heads as projected (HF repeats them before SDPA): the narrowest projection before it.
        widths = [lin.out_features for lin in linears[:before] if head_dim and lin.out_features % head_dim == 0]
        kv_heads = min([kv_seen] + [w // head_dim for w in widths])
        nested = [len(g) for g in find_repeated_blocks(block)]
        squares = frozenset(n.name for n in measured.nodes[rep] if n.target == "aten.pow.Tensor_Scalar"
                            and n.shape and n.out_bytes == 4 * math.prod(n.shape))
        blocks.append(BlockInfo(
            kind=type(block).__name__, names=names,
            params=sum(p.numel() for p in block.parameters()),
            param_tensors=len(list(block.parameters())),
            param_bytes=sum(p.numel() * p.element_size() for p in block.parameters()),
            nodes=tuple(measured.nodes[rep]), activations=measured.activations(rep),
            recipe_activations=recipe.activations(rep), linears=linears,
            heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            experts=max([lin.experts for lin in linears] + nested + [0]),
            fed_by_row=tuple(measured.fed_by_row[rep]), fed_by_column=tuple(measured.fed_by_column[rep]),
            fed_by_replicated=tuple(measured.fed_by_replicated[rep]),
            written_norms=measured.activations(rep, squares),
            sdpa_extras=_sdpa_extras(measured, rep, kv_seen - kv_heads, head_dim, math.prod(inputs[0].shape[:2]))))
    top = tuple(measured.nodes[""])
    vocab = max([m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)] + [0])
    vocab_mods = {n.module for n in top if n.split == "vocab"
                  and getattr(model.get_submodule(n.module), "num_embeddings", 0) == vocab}
    vocab_mods |= {n.module for n in top if n.split == "column" and n.shape and n.shape[-1] == vocab}
    return ModelGraph(
        name=name or type(model).__name__, capture=cap.how, input_shape=tuple(inputs[0].shape),
        nodes=top, pre_nodes=measured.pre_nodes, blocks=tuple(blocks),
        params=sum(p.numel() for p in model.parameters()),
        param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        param_tensors=len(list(model.parameters())),
        top_activations=measured.activations(""),
        vocab_parallel=tuple(sorted(vocab_mods)), linears=tuple(measured.linears[""]),
        embeddings=tuple(measured.embeddings))


def _sdpa_extras(rec: Recorder, rep: str, repeated: int, head_dim: int, tokens: int) -> ActivationBytes | None:
    """What block ``rep``'s SDPA call keeps for an explicit mask (``BlockInfo.sdpa_extras``):
    the mask's bytes where the block saved it first, and ``repeated`` more K and V heads than
    projected; None where its SDPA call gets no mask."""
    key, elem = rec.sdpa.get(rep, (0, 0))
    if not key:
        return None
    saved = rec.saved.get(key)
    mask = saved.nbytes if saved is not None and saved.segment == rep else 0
    kv = 2 * repeated * head_dim * elem * tokens if repeated > 0 else 0
    return ActivationBytes(replicated=mask, sharded=kv, attn=0)


def build_spec_model(spec: ModelSpec, micro_batch: int = 1) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model of ``spec`` on meta and its example inputs (tokens [micro_batch, seq])."""
    tokens = torch.zeros(micro_batch, spec.seq, dtype=torch.long, device="meta")
    if spec.builtin:
        from autopar.model import build_model
        with without_dynamo():  # building on meta compiles nothing: skip dynamo's import
            return build_model(spec, device="meta"), (tokens,)
    if spec.arch == "module":
        from autopar.usermodel import load_user_model
        return load_user_model(spec)
    from autopar.hf import build_hf
    return build_hf(spec, torch.bfloat16), (tokens,)


def _at_seq(inputs: tuple[torch.Tensor, ...], seq: int) -> tuple[torch.Tensor, ...]:
    """A user factory's inputs at ``seq`` tokens (0: as given): every input as long as the
    tokens (targets, masks) along dimension 1 resized with them (meta, so nothing is copied)."""
    tokens = inputs[0]
    if not seq or tokens.dim() < 2 or tokens.shape[1] == seq:
        return inputs
    old = tokens.shape[1]
    return tuple(torch.zeros(t.shape[0], seq, *t.shape[2:], dtype=t.dtype, device=t.device)
                 if t.dim() >= 2 and t.shape[1] == old else t for t in inputs)


def trace_spec(spec: ModelSpec, micro_batch: int = 1) -> ModelGraph:
    """Trace the model of ``spec`` at its sequence length, on meta."""
    return trace_spec_model(spec, micro_batch)[0]


def trace_spec_model(spec: ModelSpec, micro_batch: int = 1) -> tuple[ModelGraph, nn.Module]:
    """``trace_spec``'s graph and the meta model it traced."""
    model, inputs = build_spec_model(spec, micro_batch)
    if spec.arch == "module":
        inputs = _at_seq(inputs, spec.seq)
        inputs = inputs if micro_batch == 1 else tuple(t.expand(micro_batch * t.shape[0], *t.shape[1:])
                                                       for t in inputs)
    graph = trace_module(model, inputs, spec.name,
                         recipe_dropout=MEGATRON_GPT_DROPOUT if spec.arch == "gpt" else 0.0,
                         capture="auto" if spec.arch == "module" else ("fx" if spec.builtin else "export"))
    if not spec.builtin and spec.arch != "module":  # built by transformers (hf: and MoE presets)
        from autopar.hf import attention_windows, masked_attention_layers
        graph = dataclasses.replace(graph, runtime_masked_layers=masked_attention_layers(model.config, spec.seq),
                                    attention_windows=tuple(attention_windows(model.config)))
    return graph, model
