"""Build one pipeline stage of a model, materialised and initialised, for the built-in models and
HF transformers causal LMs, from the model's anatomy (``trace.anatomy``); a user's own module
is built by ``runtime.usermodule`` on the same helpers.

Both are built on ``meta``, cut to the stage's blocks (the block container keeps the original
keys, so every parameter keeps its single-process name), moved to the device with
``to_empty`` and initialised per parameter from a generator seeded by the parameter's name:
any layout holds exactly the single-process values.

HF models run through their own base-model forward: the first stage embeds ``input_ids``,
later stages pass hidden states as ``inputs_embeds`` (learned positions are added once, on the
first stage), and only the last stage applies the final norm and the head. HF models get HF's
``_init_weights`` for everything that is not random (buffers, norms), and autopar's draws for
the matrices (normal(0, ``initializer_range``) seeded by name; HF's draws depend on the order
of the whole model). HF's GPT-2 ``Conv1D`` is stored as ``nn.Linear`` and packed GEMMs per
head (``PackedLinear``), the form tensor parallelism shards.
"""

from __future__ import annotations

import math
import types
import zlib
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.hf import build_hf
from autopar.model import build_model
from autopar.plan import Plan
from autopar.layout import Anatomy
from autopar.spec import ModelSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def stage_blocks(plan: Plan, stage: int) -> range:
    """Global block indices of ``stage`` (all blocks without pipelining)."""
    if plan.mesh.pp == 1:
        return range(plan.num_layers)
    start = sum(plan.stage_layers[:stage])
    return range(start, start + plan.stage_layers[stage])


def _keep_blocks(model: nn.Module, anat: Anatomy, blocks: range) -> None:
    keep = {anat.blocks[i].rpartition(".")[2] for i in blocks}
    container = model.get_submodule(anat.container)
    container._modules = OrderedDict((k, m) for k, m in container._modules.items() if k in keep)


def _set(model: nn.Module, name: str, value: nn.Module | None) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, value)


class _NoPositions(nn.Module):
    """Stands in for learned positions after the first stage (they were added there), however
    the model calls them (GPT-2: ``wpe(position_ids)``; OPT: ``embed_positions(mask, past,
    position_ids=...)``)."""

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        first = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        return torch.zeros((), device=first.device)


def _seeded_normal_(p: torch.Tensor, name: str, seed: int, std: float) -> None:
    gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    p.normal_(0.0, std, generator=gen)


@torch.no_grad()
def _init_hf(model: PreTrainedModel, seed: int, std: float, aliases: dict[str, str]) -> None:
    """HF's own ``_init_weights`` first, on a forked RNG seeded per module by its name: it
    computes what ``to_empty`` left uninitialised besides parameters (RoPE frequencies, Gemma's
    embedding scale), the norms' values (1, or Gemma's 0 for its 1 + w) and draws the rest. Then every matrix is redrawn from a generator seeded
    by its name and biases are zeroed, so values do not depend on the layout."""
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        for name, module in model.named_modules():
            # what it draws (GPT-OSS's attention sinks) seeded by the module's name, as the
            # matrices are: the same values whichever stage or layout holds the module
            torch.manual_seed(seed * 1_000_003 + zlib.crc32(f"hf-init:{name}".encode()))
            model._init_weights(module)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            _seeded_normal_(p, aliases.get(name, name), seed, std)
        elif name.endswith("bias"):
            p.zero_()


def _groups(sections: tuple[int, ...]) -> int:
    """Row groups of a packed GEMM's stored layout: the gcd of its projections' widths."""
    return math.gcd(*sections)


def _unpack(y: torch.Tensor, sections: tuple[int, ...]) -> torch.Tensor:
    """[..., group, per-group rows of each projection] -> [..., whole projections]: a stored
    (grouped) output back to the model's order, for whichever groups ``y`` holds."""
    g = _groups(sections)
    parts = y.unflatten(-1, (-1, sum(sections) // g)).split([s // g for s in sections], dim=-1)
    return torch.cat([p.flatten(-2) for p in parts], dim=-1)


def _group_rows(t: torch.Tensor, sections: tuple[int, ...]) -> torch.Tensor:
    """[out, ...] in the model's order -> grouped: group ``j`` holds rows
    ``[j·s/G, (j+1)·s/G)`` of each projection of width s (G = ``_groups``)."""
    g = _groups(sections)
    parts = [p.unflatten(0, (g, -1)) for p in t.split(list(sections), dim=0)]
    return torch.cat(parts, dim=1).flatten(0, 1)


class PackedLinear(nn.Linear):
    """A GEMM computing several projections at once (GPT-2's fused Q/K/V; Phi-3's Q/K/V of
    unequal widths under GQA), its weight rows stored in G groups (G = gcd of the widths), each
    group holding the same fraction of every projection — equal widths: row ``o·chunks + c`` is
    feature ``o`` of chunk ``c`` — so that any contiguous shard of groups (``ColwiseParallel``'s)
    holds the same heads of every projection. ``forward`` returns the projections one after
    another, as the model cuts them: [q | k | v] of this rank's heads. The stored layout does not
    depend on the TP degree, so checkpoints reshard across plans."""

    def __init__(self, in_features: int, out_features: int, sections: tuple[int, ...], bias: bool = True,
                 device: torch.device | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device)
        self.sections = sections

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if isinstance(y, DTensor):  # sharded over tp: reorder this rank's shard (TP then takes it local)
            local = y.to_local()
            tp = y.shape[-1] // local.shape[-1]
            return DTensor.from_local(_unpack(local, tuple(s // tp for s in self.sections)), y.device_mesh,
                                      y.placements, run_check=False, shape=y.shape, stride=y.stride())
        return _unpack(y, self.sections)


def _conv1d() -> tuple[type[nn.Module], ...]:
    """HF's ``Conv1D`` class, when transformers is installed."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return ()
    return (Conv1D,)


def _to_pack(model: nn.Module, anat: Anatomy) -> list[tuple[str, nn.Module, tuple[int, ...]]]:
    """(name, module, projection widths) of each module the runtime stores in another layout:
    HF's ``Conv1D`` (GPT-2: ``x @ W + b``, W [in, out]) and any packed ``nn.Linear``."""
    conv1d = _conv1d()
    found: list[tuple[str, nn.Module, tuple[int, ...]]] = []
    for name, mod in model.named_modules():
        block = next((b for b in anat.blocks if name.startswith(b + ".")), None)
        sections = dict(anat.kind(block).packed).get(name.removeprefix(f"{block}."), ()) if block else ()
        if isinstance(mod, conv1d) or (len(sections) > 1 and type(mod) is nn.Linear):
            found.append((name, mod, sections))
    return found


def _runtime_layout(mod: nn.Module, sections: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [out, in], bias) of ``mod`` as an ``nn.Linear`` stores them, rows grouped when it
    packs projections of ``sections`` widths (:class:`PackedLinear`)."""
    weight = mod.weight.T if isinstance(mod, _conv1d()) else mod.weight
    bias = mod.bias
    assert isinstance(weight, torch.Tensor) and (bias is None or isinstance(bias, torch.Tensor))
    if len(sections) < 2:
        return weight, bias
    return _group_rows(weight, sections), None if bias is None else _group_rows(bias, sections)


@torch.no_grad()
def _as_linear(model: nn.Module, anat: Anatomy) -> None:
    """Every module of ``_to_pack`` becomes an ``nn.Linear`` (the form TP's styles shard), or a
    :class:`PackedLinear` when packed, holding the same function."""
    for name, mod, sections in _to_pack(model, anat):
        weight, bias = _runtime_layout(mod, sections)
        out_f, in_f = weight.shape
        kw: dict[str, Any] = dict(bias=bias is not None, device=weight.device)
        new = PackedLinear(in_f, out_f, sections, **kw) if len(sections) > 1 else nn.Linear(in_f, out_f, **kw)
        new.weight.copy_(weight)
        if bias is not None:
            new.bias.copy_(bias)
        _set(model, name, new)


@torch.no_grad()
def runtime_state_dict(model: nn.Module, anat: Anatomy) -> dict[str, torch.Tensor]:
    """``model``'s state dict in the runtime's layout (what its stages load), same names."""
    state = model.state_dict()
    for name, mod, sections in _to_pack(model, anat):
        weight, bias = _runtime_layout(mod, sections)
        state[f"{name}.weight"] = weight.contiguous()
        if bias is not None:
            state[f"{name}.bias"] = bias.contiguous()
    return state


def _hf_forward(self: PreTrainedModel, x: torch.Tensor) -> torch.Tensor:
    """tokens or hidden states [b, s(, h)] -> hidden states or logits, for one stage."""
    # the base model: under its prefix, else ``model`` (Llama 4's text model names its prefix
    # ``language_model`` and keeps its decoder as ``model``)
    base = getattr(self, self.base_model_prefix, None) or getattr(self, "model")
    kw = {"input_ids": x} if not torch.is_floating_point(x) else {"inputs_embeds": x}
    hidden = base(**kw, use_cache=False).last_hidden_state
    head = self.get_output_embeddings()
    return head(hidden) if head is not None else hidden


def build_stage(spec: ModelSpec, anat: Anatomy, plan: Plan, stage: int, device: torch.device,
                seed: int) -> nn.Module:
    """Stage ``stage`` of the plan (the whole model without pipelining), initialised on ``device``."""
    first, last = stage == 0, plan.mesh.pp == 1 or stage == len(plan.stage_layers) - 1
    if spec.builtin:
        model = build_model(spec, device="meta", seed=seed)
        _keep_blocks(model, anat, stage_blocks(plan, stage))
        if not first:
            model.embed = None
        if not last:
            model.norm = model.output = None
        model.to_empty(device=device)
        model.tie_weights()
        model.reset_parameters(seed)
        return model
    if spec.arch != "hf" and not spec.experts:  # ``moe:`` specs are HF Mixtral models (``autopar.hf``)
        raise ValueError(f"build_stage builds the built-in gpt/llama models and HF causal LMs, not {spec.arch!r} "
                         "models (user modules: runtime.usermodule.build_user_stage)")
    model = build_hf(spec, torch.float32)
    if spec.tied and plan.mesh.pp > 1 and not first:
        # The last stage's head is its own copy of the embedding: untie before removing it.
        head = model.get_output_embeddings()
        head.weight = nn.Parameter(torch.empty_like(head.weight))
    _keep_blocks(model, anat, stage_blocks(plan, stage))
    if not first:
        _set(model, anat.embed, None)
        for name in anat.first_extra:  # applied on the first stage: learned positions add 0, the rest pass
            kind = type(model.get_submodule(name))
            _set(model, name, _NoPositions() if issubclass(kind, nn.Embedding) else nn.Identity())
    if not last:
        _set(model, anat.final_norm, nn.Identity())
        _set(model, anat.head, None)
    model.to_empty(device=device)
    if spec.tied and first and last:
        model.tie_weights()
    aliases = {f"{anat.head}.weight": f"{anat.embed}.weight"} if spec.tied else {}
    _init_hf(model, seed, float(getattr(model.config, "initializer_range", 0.02)), aliases)
    _as_linear(model, anat)
    model.forward = types.MethodType(_hf_forward, model)
    return model
