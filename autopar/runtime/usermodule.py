"""A user's own decoder-only LM (``path/to/file.py:factory``, or a module handed to
``autopar.parallelize``) as pipeline stages, with nothing of it written for autopar.

Source. A factory file is called again for every stage, its parameters on meta and its buffers
computed on the CPU (``load_user_model(spec, buffers=True)``: a causal mask is a value, not a
shape). A module object is the one stage of its rank, changed in place; it is traced with all its
tensors swapped for meta copies and restored.

Stage. The anatomy (``trace.anatomy``, read off the trace) names the blocks, the embeddings
before them, the final norm and the head. A stage keeps its blocks (the container keeps the
original keys, so every parameter keeps its single-process name); later stages get zero stand-ins
for the embeddings (an ``nn.Embedding``'s output shape, no parameter), earlier ones lose the final
norm and the head. Parameters are materialised on the device (tied ones stay tied) and drawn from
a generator seeded by their name: matrices N(0, 0.02), the blocks' row-parallel (residual)
projections N(0, 0.02/√(2L)) as GPT-2, nanoGPT and minGPT do, norms by their own
``reset_parameters`` (else weight 1, bias 0), other vectors 0 — any layout holds the
single-process values. A module object with real weights keeps them.

Forward. The stage runs the model's own ``forward`` on the tokens, inputs after the tokens
(targets) given as zeros of their example shapes, and stops where the stage ends by raising
from a forward hook: at the head's output (the logits of every position, before any loss the
model computes; the runtime computes its own, vocab-parallel under TP) or at the last local
block's output. A later stage's first block takes the received hidden states in place of what
the model computed before it (from the stand-ins: zeros). So a stage runs whatever the model does
around its blocks (positions, masks computed from shapes), provided the model calls its blocks in
order and reads nothing but the tokens' shape before the head (not masks in the other inputs).

Tensor parallelism shards the GEMMs the tracer labelled; a hand-written attention that reads
its width off its input (nanoGPT's ``B, T, C = x.size()``) sees the local width: each module
owning a column-parallel GEMM is called on a narrow view of its input (``C/tp`` wide, never
read) and the column GEMMs get the whole input back; its width and head-count attributes are
divided by ``tp_families.localize``. Selective recompute checkpoints the blocks'
``scaled_dot_product_attention`` calls; attention written out op by op has no call to
checkpoint and is refused.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopar.errors import UserError
from autopar.plan import Plan
from autopar.layout import Anatomy
from autopar.trace.anatomy import _is_norm, anatomy
from autopar.runtime.models import _as_linear, _keep_blocks, _seeded_normal_, _set
from autopar.runtime.parallelize import CheckpointedSDPA
from autopar.spec import ModelSpec, parse_model_spec, with_seq
from autopar.trace import ModelGraph, trace_module, traced_spec
from autopar.trace.tracer import _at_seq
from autopar.usermodel import load_user_model

INIT_STD = 0.02
"""Standard deviation of every weight matrix (GPT-2's)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Traced:
    """What the runtime reads off a user module's trace."""

    spec: ModelSpec
    """Its shape (``traced_spec``), at the plan's sequence length."""
    anatomy: Anatomy
    sdpa: bool
    """Its blocks call ``scaled_dot_product_attention`` (what selective recompute checkpoints)."""
    graph: ModelGraph
    """The trace (bf16, one sequence), what the cost model prices."""


class UserModule:
    """Where a user module's stages come from (a factory file; :class:`ObjectModule` a module object)."""

    def __init__(self, spec: ModelSpec) -> None:
        self.name = spec.name
        self._spec = spec

    def base_spec(self) -> ModelSpec:
        return self._spec

    def traced(self, seq: int) -> Traced:
        """Its shape and anatomy at ``seq`` tokens (traced once per process)."""
        return traced_file(self._spec.name, seq)

    @contextlib.contextmanager
    def on_meta(self) -> Iterator[tuple[nn.Module, tuple[torch.Tensor, ...]]]:
        """The whole model and its example inputs, every tensor on meta."""
        yield load_user_model(self._spec)

    def stage_model(self) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        """A fresh model (parameters on meta, buffers computed on the CPU) and its example inputs."""
        return load_user_model(self._spec, buffers=True)


class ObjectModule(UserModule):
    """A module object and its example inputs (``autopar.parallelize``): its one stage is the
    object itself, pruned in place."""

    def __init__(self, model: nn.Module, inputs: tuple[torch.Tensor, ...], name: str) -> None:
        super().__init__(ModelSpec(arch="module", layers=0, hidden=0, heads=0, vocab=0, seq=0, name=name))
        self._model, self._inputs, self._used = model, tuple(t.to("meta") for t in inputs), False
        self._traced: dict[int, Traced] = {}
        params = [p.is_meta for p in model.parameters()]
        if any(params) and not all(params):
            raise UserError(f"{name} has parameters on meta and others not; give all of them real values, or none")
        meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
        if meta_buffers:
            raise UserError(f"{name}'s buffer {meta_buffers[0]} is on meta: autopar cannot compute its value; "
                            "build the model with real tensors, or use --model file.py:factory")

    def traced(self, seq: int) -> Traced:
        if seq not in self._traced:
            self._traced[seq] = trace_user(self, seq)
        return self._traced[seq]

    @contextlib.contextmanager
    def on_meta(self) -> Iterator[tuple[nn.Module, tuple[torch.Tensor, ...]]]:
        if self._used:
            raise RuntimeError("the module object is already a stage")
        saved = [(m, dict(m._parameters), dict(m._buffers)) for m in self._model.modules()]
        metas: dict[int, nn.Parameter] = {}  # tied parameters stay tied
        for module, params, buffers in saved:
            for key, p in params.items():
                if p is not None:
                    module._parameters[key] = metas.setdefault(
                        id(p), nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad))
            for key, b in buffers.items():
                if b is not None:
                    module._buffers[key] = b.to("meta")
        try:
            yield self._model, self._inputs
        finally:
            for module, params, buffers in saved:
                module._parameters.clear()
                module._parameters.update(params)
                module._buffers.clear()
                module._buffers.update(buffers)

    def stage_model(self) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        if self._used:
            raise UserError("a module object given to autopar.parallelize is one stage per rank: "
                            "plan it with virtual_stages=1")
        self._used = True
        return self._model, self._inputs


def calls_sdpa(graph: ModelGraph) -> bool:
    """Whether the (one kind of) block calls ``scaled_dot_product_attention``."""
    return any("scaled_dot_product_attention" in n.target for b in graph.blocks for n in b.nodes)


def trace_user(source: UserModule, seq: int) -> Traced:
    """Trace the whole model at ``seq`` tokens (on meta): its shape and anatomy."""
    with source.on_meta() as (model, inputs):
        graph = trace_module(model, _at_seq(inputs, seq), source.name, capture="auto")
        base = source.base_spec()
        spec = traced_spec(graph, with_seq(base, seq) if seq else base)  # 0: the factory's own length
        try:
            anat = anatomy(graph, model, spec.vocab)
        except ValueError as exc:
            raise UserError(f"{source.name}: {exc}") from None
    return Traced(spec=spec, anatomy=anat, sdpa=calls_sdpa(graph), graph=graph)


@functools.lru_cache(maxsize=8)
def traced_file(text: str, seq: int) -> Traced:
    """``trace_user`` of a factory file (``path.py:factory``), once per process."""
    return trace_user(UserModule(parse_model_spec(text)), seq)


def unsupported(plan: Plan, traced: Traced) -> str | None:
    """Why the runtime cannot run ``plan`` on this user module, or None."""
    if "selective" in plan.recompute and not traced.sdpa:
        return (f"selective recompute checkpoints a scaled_dot_product_attention call, and "
                f"{traced.spec.name}'s attention is written out op by op; use --recompute none or full")
    if "op" in plan.recompute and not traced.sdpa:
        return (f"per-op recompute keeps a scaled_dot_product_attention call's output, and "
                f"{traced.spec.name}'s attention is written out op by op; use --recompute none or full")
    return None


class ZeroEmbedding(nn.Module):
    """Stands in for an embedding on a stage after the first (its output is replaced by the
    received hidden states): zeros of the embedding's output shape, no parameter."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), device=ids.device).expand(*ids.shape, self.width)


def _materialise(model: nn.Module, device: torch.device) -> None:
    """Meta parameters become uninitialised ones on ``device`` (a tied parameter stays one
    tensor); buffers move there with their values."""
    memo: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None:
                if id(p) not in memo:
                    memo[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                module._parameters[key] = memo[id(p)]
        for key, b in module._buffers.items():
            if b is not None:
                module._buffers[key] = b.to(device)


@torch.no_grad()
def init_user(model: nn.Module, anat: Anatomy, seed: int, aliases: dict[str, str]) -> None:
    """Every parameter from its name (module docstring); ``aliases``: the name a parameter is
    drawn as (a last stage's copy of a tied head: the embedding's)."""
    norm_params: set[int] = set()
    for module in model.modules():
        if not _is_norm(module):
            continue
        norm_params.update(id(p) for p in module.parameters(recurse=False))
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            for key, p in module._parameters.items():
                if p is not None:
                    p.fill_(1.0 if key == "weight" else 0.0)
    residual = {f"{b}.{row}.weight" for b in anat.blocks for row in anat.row}
    scaled = INIT_STD / math.sqrt(2 * len(anat.blocks))
    for name, p in model.named_parameters():
        if id(p) in norm_params:
            continue
        if p.dim() >= 2:
            _seeded_normal_(p, aliases.get(name, name), seed, scaled if name in residual else INIT_STD)
        else:
            p.zero_()


class _Reached(Exception):
    """Raised from the forward hook of the module where a stage ends, carrying its output."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output


@dataclass(frozen=True, kw_only=True, slots=True)
class _StageCall:
    """How one stage calls the model's own forward."""

    forward: Callable[..., Any]
    """The model class's ``forward`` (unbound)."""
    first: bool
    last: bool
    container: str
    head: str
    extras: tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]
    """(shape, dtype, per position) of each example input after the tokens: per-position
    inputs ([batch, seq, ...]) take the micro-batch's batch and sequence."""


def _stage_forward(self: nn.Module, call: _StageCall, x: torch.Tensor) -> torch.Tensor:
    """Tokens [b, s] (first stage) or hidden states [b, s, h] -> hidden states, or logits [b, s, V]."""
    b, s = x.shape[:2]
    tokens = x if call.first else torch.zeros((b, s), dtype=torch.long, device=x.device)
    extras = [torch.zeros((b, s, *shape[2:]) if per_position else shape, dtype=dtype, device=x.device)
              for shape, dtype, per_position in call.extras]
    container = self.get_submodule(call.container)
    entries = [m for m in container._modules.values() if m is not None]
    handles = []
    if not call.first:
        def substitute(module: nn.Module, args: tuple) -> tuple:
            if not args:
                raise ValueError(f"{call.container}'s blocks are called without a positional input; "
                                 "the runtime pipelines blocks called as block(hidden, ...)")
            return (x, *args[1:])
        handles.append(entries[0].register_forward_pre_hook(substitute, prepend=True))

    def stop(module: nn.Module, args: tuple, output: Any) -> None:
        raise _Reached(output)

    end = self.get_submodule(call.head) if call.last else entries[-1]
    handles.append(end.register_forward_hook(stop))
    try:
        call.forward(self, tokens, *extras)
    except _Reached as reached:
        out = reached.output
        return out[0] if isinstance(out, tuple) else out
    finally:
        for handle in handles:
            handle.remove()
    where = f"its head {call.head}" if call.last else f"block {list(container._modules)[-1]}"
    raise ValueError(f"the model's forward returned without calling {where}")


def build_user_stage(source: UserModule, anat: Anatomy, plan: Plan, stage: int, blocks: range,
                     device: torch.device, seed: int, tied: bool) -> nn.Module:
    """Stage ``stage`` (blocks ``blocks``) of a user module, on ``device`` (module docstring)."""
    first, last = stage == 0, plan.mesh.pp == 1 or stage == len(plan.stage_layers) - 1
    model, example = source.stage_model()
    _keep_blocks(model, anat, blocks)
    if not first:
        for name in (anat.embed, *anat.first_extra):
            emb = model.get_submodule(name)
            if not isinstance(emb, nn.Embedding):
                raise ValueError(f"pipelining needs the modules before the blocks to be embeddings; {name} is a "
                                 f"{type(emb).__name__}; use pp=1 for this model")
            _set(model, name, ZeroEmbedding(emb.embedding_dim))
    if not last:
        for name in (anat.final_norm, anat.head):
            if name:
                _set(model, name, None)
    if any(p.is_meta for p in model.parameters()):
        _materialise(model, device)
        init_user(model, anat, seed, {f"{anat.head}.weight": f"{anat.embed}.weight"} if tied else {})
    else:
        model.to(device)
    _as_linear(model, anat)
    tokens = example[0]
    call = _StageCall(forward=type(model).forward, first=first, last=last, container=anat.container, head=anat.head,
                      extras=tuple((tuple(t.shape), t.dtype, t.dim() >= 2 and t.shape[:2] == tokens.shape[:2])
                                   for t in example[1:]))
    model.forward = functools.partial(_stage_forward, model, call)  # type: ignore[method-assign]
    return model


def localize_inputs(model: nn.Module, anat: Anatomy, tp: int) -> None:
    """Each module owning a column-parallel GEMM (not a block itself) is called on a ``1/tp``
    wide view of its input, which its column GEMMs swap back for the whole input: the sizes it
    reads off its input are this rank's (module docstring)."""
    owners: dict[str, list[str]] = {}
    for name in anat.column:
        owner, _, _ = name.rpartition(".")
        if owner:
            owners.setdefault(owner, []).append(name)
    here = {n for n, _ in model.named_modules()}
    for block_name in anat.blocks:
        if block_name not in here:
            continue
        block = model.get_submodule(block_name)
        for owner, gemms in owners.items():
            _narrow(block.get_submodule(owner), [block.get_submodule(g) for g in gemms], tp)


def _narrow(owner: nn.Module, gemms: list[nn.Module], tp: int) -> None:
    held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (narrow view, whole input) while owner runs

    def enter(module: nn.Module, args: tuple) -> tuple | None:
        if not args or not isinstance(args[0], torch.Tensor) or args[0].shape[-1] % tp:
            return None
        whole = args[0]
        view = whole.narrow(-1, 0, whole.shape[-1] // tp)
        held.append((view, whole))
        return (view, *args[1:])

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        if held:
            held.pop()

    def swap(module: nn.Module, args: tuple) -> tuple | None:
        if held and args and args[0] is held[-1][0]:
            return (held[-1][1], *args[1:])
        return None

    owner.register_forward_pre_hook(enter)
    owner.register_forward_hook(leave, always_call=True)
    for gemm in gemms:
        gemm.register_forward_pre_hook(swap, prepend=True)


def recompute_attention_calls(model: nn.Module, recompute: tuple[str, ...], anat: Anatomy) -> None:
    """Selective recompute for the blocks whose mode is ``selective``: their SDPA calls are
    checkpointed (the block's forward runs under :class:`CheckpointedSDPA`)."""
    container = model.get_submodule(anat.container)
    for index, name in enumerate(anat.blocks):
        key = name.rpartition(".")[2]
        block = container._modules.get(key)
        if block is None or recompute[index] != "selective":
            continue
        inner = block.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            with CheckpointedSDPA():
                return _inner(*args, **kwargs)
        block.forward = forward  # type: ignore[method-assign]
