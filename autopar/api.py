"""The Python API: ``autopar.parallelize`` turns a model into this rank's share of a plan.

    par = autopar.parallelize(model, (tokens,), cluster="cpu-local", global_batch=8)
    loss = par.step(tokens, targets)        # one optimizer step on the global batch

Run under torchrun (one process per device of the plan; a single process needs none). The
model is the built-in ``autopar.model.Transformer``, an HF transformers causal LM, or your own
decoder-only LM module (nanoGPT's ``GPT``: ``example_inputs`` are then what a training step
passes it, ``(tokens, targets)``), on ``meta`` (weights initialised by autopar, the same on
every layout) or with real weights (copied into the shards; every rank builds the same model).
Your own module becomes this rank's pipeline stage in place (``runtime.usermodule``: one stage
per rank, so no interleaved schedule). Without a ``plan`` it is planned here for the job's world
size: traced, priced and solved as ``autopar plan`` does; the plan is on ``par.plan``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from autopar.errors import UserError
from autopar.model import Transformer
from autopar.plan import Plan
from autopar.runtime.context import build_context, init_distributed
from autopar.runtime.models import runtime_state_dict
from autopar.runtime.train import Program, TrainConfig, build_program, step_on_batch
from autopar.runtime.usermodule import ObjectModule
from autopar.solve import Pins
from autopar.spec import ModelSpec
from autopar.trace import profile_from_graph
from autopar.workflow import make_plan, read_job, verdicts


@dataclass(kw_only=True, slots=True, eq=False)
class Parallelized:
    """This rank's program for ``plan``: its stage modules, optimizers and schedule."""

    plan: Plan
    program: Program

    @property
    def modules(self) -> list[nn.Module]:
        """The local (sharded, wrapped) pipeline stages."""
        return self.program.modules

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on the global batch ([global_batch, seq_len] on every rank);
        returns the global-batch mean next-token loss."""
        return step_on_batch(self.program, tokens, targets)


def _spec_text(spec: ModelSpec, seq: int) -> str:
    fields = f"layers={spec.layers},hidden={spec.hidden},heads={spec.heads},vocab={spec.vocab},seq={seq}"
    if spec.arch == "llama":
        return f"llama:{fields},kv_heads={spec.num_kv_heads},ffn={spec.ffn_hidden}"
    return f"gpt:{fields},ffn={spec.ffn_hidden},tied={int(spec.tied)}"


_HF_SKIP = {"use_cache", "dtype", "torch_dtype", "transformers_version", "model_type", "architectures"}


def _rebuildable(model: nn.Module) -> bool:
    """autopar's own Transformer or an HF model: a ``--model`` spec rebuilds it."""
    return isinstance(model, Transformer) or hasattr(getattr(model, "config", None), "to_diff_dict")


def model_spec_text(model: nn.Module, seq: int) -> str:
    """The ``--model`` spec that rebuilds ``model``'s architecture (for the plan file)."""
    if isinstance(model, Transformer):
        return _spec_text(model.spec, seq)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_diff_dict"):
        raise UserError(f"no --model spec rebuilds a {type(model).__name__}: it is not autopar.model.Transformer "
                        "or an HF transformers model; give autopar.parallelize the module itself")
    values = {k: v for k, v in config.to_diff_dict().items()
              if k not in _HF_SKIP and isinstance(v, (bool, int, float, str)) and "," not in str(v)}
    return f"hf:{type(config).__name__}:" + ",".join(f"{k}={v}" for k, v in sorted(values.items())) + f",seq={seq}"


def _load_weights(prog: Program, model: nn.Module) -> None:
    """Copy a real model's weights into this rank's shards (a full state dict per stage)."""
    full = runtime_state_dict(model, prog.anatomy)
    for module in prog.modules:
        mine = get_model_state_dict(module).keys()
        missing = [k for k in mine if k not in full]
        if missing:
            raise UserError(f"the model lacks weights the plan's stages hold: {missing[:3]}")
        set_model_state_dict(module, {k: full[k] for k in mine},
                             options=StateDictOptions(full_state_dict=True))


def _verdicts_once(spec: ModelSpec) -> tuple[tuple[str, str], ...]:
    """The twin's verdicts (``workflow.verdicts``), computed by rank 0 of the job and sent to
    the others: one verification, not one per rank."""
    if not dist.is_initialized():
        return verdicts(spec)
    box = [verdicts(spec) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


def parallelize(model: nn.Module, example_inputs: tuple[torch.Tensor, ...], *, cluster: str,
                global_batch: int, plan: Plan | None = None, dtype: str | None = None,
                lr: float = TrainConfig().lr, time_limit_s: float = 60.0) -> Parallelized:
    """Plan (unless ``plan`` is given) and build this rank's program for ``model``.

    ``example_inputs`` is one micro-batch of tokens ``(tokens,)``, [b, seq] int64 (for your own
    module, what its training step passes, e.g. ``(tokens, targets)``, tokens first): its
    sequence length is the training length. ``cluster`` is a hardware profile name or path; the
    number of devices is the job's world size.
    """
    device = init_distributed() if "WORLD_SIZE" in os.environ else torch.device("cpu")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not example_inputs or not all(isinstance(t, torch.Tensor) for t in example_inputs):
        raise UserError("example_inputs must be a tuple of tensors, the tokens first")
    seq = int(example_inputs[0].shape[-1])
    if plan is not None and plan.gpus != world:
        raise UserError(f"the plan is for {plan.gpus} devices but the job has {world}; "
                        f"start it with torchrun --nproc-per-node {plan.gpus}")
    if _rebuildable(model):
        if len(example_inputs) != 1:
            raise UserError(f"example_inputs of a {type(model).__name__} are (tokens,), "
                            f"got {len(example_inputs)} tensors")
        if plan is None:
            job = read_job(model_spec_text(model, seq), cluster, world, global_batch, seq_len=seq, dtype=dtype)
            plan, _ = make_plan(job, time_limit_s=time_limit_s, verified=_verdicts_once(job.spec))
        prog = build_program(plan, build_context(plan, device), TrainConfig(lr=lr))
        if not any(p.is_meta for p in model.parameters()):
            _load_weights(prog, model)
        return Parallelized(plan=plan, program=prog)
    cls = type(model)
    source = ObjectModule(model, tuple(example_inputs), f"{cls.__module__}.{cls.__qualname__}")
    if plan is None:
        traced = source.traced(seq)
        job = read_job(traced.spec, cluster, world, global_batch, seq_len=seq, dtype=dtype)
        refused = () if traced.sdpa else ("selective", "op")  # no SDPA call to checkpoint or keep
        plan, _ = make_plan(job, Pins(virtual_stages=1, refused=refused), time_limit_s=time_limit_s,
                            profile=profile_from_graph(traced.graph, traced.spec), verify=False)
    elif plan.virtual_stages > 1:
        raise UserError(f"{source.name} becomes one pipeline stage per rank; give a plan with virtual_stages=1")
    ctx = build_context(plan, device, source.traced(plan.seq_len))
    prog = build_program(plan, ctx, TrainConfig(lr=lr), source=source)
    return Parallelized(plan=plan, program=prog)
