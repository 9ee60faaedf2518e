"""DeepSpeed: a ``ds_config.json`` and the ``deepspeed`` launcher line.

Keys are those ``deepspeed.runtime.config.DeepSpeedConfig`` reads (DeepSpeed 0.19):
``train_batch_size`` = ``train_micro_batch_size_per_gpu`` x ``gradient_accumulation_steps`` x
data-parallel size, ``zero_optimization`` (stage, ``offload_optimizer``, ``offload_param``),
``bf16``/``fp16``, ``tensor_parallel.autotp_size`` (AutoTP training), ``pipeline`` (the
engine's section: stages, partitioning, ``activation_checkpoint_interval``),
``activation_checkpointing`` and ``sequence_parallel_size`` (Ulysses) for context parallelism.

What it cannot express: ZeRO-2/3 under a pipeline (the pipeline engine asserts ZeRO <= 1),
schedules other than its 1F1B ``TrainSchedule`` and virtual stages, stage sizes other than
``partition_uniform``'s, Megatron-style sequence parallelism with AutoTP, selective
recompute and per-block recompute mixes, mesh orders other than pipe > data > model.
"""

from __future__ import annotations

import json

from autopar.errors import UserError
from autopar.export.common import (Adapter, Nodes, Option, Settings, contiguous, describe_recompute, per_rank,
                                   dp_overlap, mode_counts, order_gap, replace_plan, uniform_recompute)
from autopar.plan import Plan
from cost_models.axes import Degrees
from cost_models.pipeline import partition_uniform
from cost_models.recipe import ExecutionRecipe

FRAMEWORK = "DeepSpeed 0.19 (deepspeed.runtime.config.DeepSpeedConfig)"
DEFAULT_FILE = "ds_config.json"


def adapt(a: Adapter) -> None:
    plan = a.plan
    pp = plan.mesh.pp
    if pp > 1:
        if plan.zero_stage > 1:
            a.gap("zero_stage", plan.zero_stage, "DeepSpeed's pipeline engine runs ZeRO 0 or 1 only",
                  [Option(nearest="zero_optimization.stage 1", plan=replace_plan(a.plan, zero_stage=1))])
        if a.plan.virtual_stages > 1 or a.plan.schedule != "1f1b":
            merged = per_rank(a.plan)
            a.gap("schedule", f"{a.plan.schedule} (v={a.plan.virtual_stages})" if a.plan.virtual_stages > 1
                  else a.plan.schedule, "DeepSpeed's pipeline engine runs one stage per rank with its 1F1B TrainSchedule",
                  [Option(nearest="1F1B, one stage per rank",
                          plan=contiguous(replace_plan(a.plan, recompute=tuple(m for r in merged for m in r)),
                                          tuple(map(len, merged)), 1, schedule="1f1b"))])
        uniform = partition_uniform(a.plan.num_layers, pp)
        if a.plan.stage_layers != uniform:
            a.gap("stage_layers", a.plan.stage_layers, "PipelineModule partitions its layers uniformly "
                  "(partition_method='uniform')", [Option(nearest=f"pipeline.partition uniform: {uniform}",
                                                          plan=contiguous(a.plan, uniform))])
    if a.plan.sequence_parallel:
        a.gap("sequence_parallel", True, "AutoTP shards no activations along the sequence",
              [Option(nearest="tensor_parallel.autotp_size without sequence parallelism",
                      plan=replace_plan(a.plan, sequence_parallel=False))])
    modes = set(a.plan.recompute)
    if modes & {"selective", "op"} or len(modes) > 1:
        a.gap("recompute", describe_recompute(a.plan), "DeepSpeed checkpoints every block or none "
              "(activation_checkpointing; pipeline.activation_checkpoint_interval)",
              [Option(nearest="activation checkpointing of every block", plan=uniform_recompute(a.plan, "full")),
               Option(nearest="no activation checkpointing", plan=uniform_recompute(a.plan, "none"))])
    a.refit({"full": "activation checkpointing of every block"})
    order_gap(a, "DeepSpeed's topology orders pipe > data > model", "pipe > data > model")


def config(plan: Plan, recipe: ExecutionRecipe) -> dict:
    """The DeepSpeed config of the (adapted) plan."""
    m = plan.mesh
    cfg: dict = {"train_batch_size": plan.global_batch,
                 "train_micro_batch_size_per_gpu": plan.micro_batch_size,
                 "gradient_accumulation_steps": plan.num_microbatches}
    if plan.dtype in ("bf16", "fp16"):
        cfg[plan.dtype] = {"enabled": True}
    zero: dict = {"stage": plan.zero_stage}
    if plan.zero_stage > 0:
        zero["overlap_comm"] = dp_overlap(plan, recipe)
    if plan.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if plan.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg["zero_optimization"] = zero
    if m.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": m.tp}
    full = "full" in plan.recompute
    if m.pp > 1:
        cfg["pipeline"] = {"stages": m.pp, "partition": "uniform", "activation_checkpoint_interval": 1 if full else 0}
    if full:
        cfg["activation_checkpointing"] = {"partition_activations": m.tp > 1, "contiguous_memory_optimization": False,
                                           "cpu_checkpointing": False}
    if m.cp > 1:
        cfg["sequence_parallel_size"] = m.cp
        cfg["data_parallel_size"] = m.dp
    return cfg


def render(plan: Plan, recipe: ExecutionRecipe, where: Nodes, filename: str) -> tuple[str, str]:
    launch = (f"deepspeed --num_nodes {where.count} --num_gpus {where.per_node} --hostfile hostfile "
              f"train.py --deepspeed --deepspeed_config {filename}")
    notes = []
    if plan.mesh.pp > 1:
        notes.append(f"build the model as a PipelineModule(num_stages={plan.mesh.pp}, partition_method='uniform')"
                     f" over its blocks, topology data={plan.mesh.dp} model={plan.mesh.tp}")
    if "full" in plan.recompute and plan.mesh.pp == 1:
        notes.append("checkpoint every block in the model (deepspeed.checkpointing.checkpoint, or HF's "
                     "model.gradient_checkpointing_enable())")
    if notes:
        launch += "  # " + "; ".join(notes)
    return json.dumps(config(plan, recipe), indent=2) + "\n", launch


def parse(text: str, layers: int) -> Settings:
    """The plan settings a ds_config states, for a model of ``layers`` blocks (placed by
    ``partition_uniform``)."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"DeepSpeed config is not valid JSON: {exc}") from None
    zero = cfg.get("zero_optimization", {})
    tp = cfg.get("tensor_parallel", {}).get("autotp_size", 1) or 1
    pipe = cfg.get("pipeline", {})
    pp = pipe.get("stages", 1) if isinstance(pipe.get("stages", 1), int) else 1
    cp = cfg.get("sequence_parallel_size", 1)
    micro, accum, total = (cfg.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                                "train_batch_size"))
    dp = total // (micro * accum) if total and micro and accum else None
    full = "activation_checkpointing" in cfg or pipe.get("activation_checkpoint_interval", 0) > 0
    stage_layers = partition_uniform(layers, pp)
    return Settings(gpus=dp * tp * pp * cp if dp else None, dp=dp, tp=tp, pp=pp, cp=cp,
                    zero=zero.get("stage", 0) if dp and dp > 1 else 0,
                    offload=zero.get("offload_optimizer", {}).get("device", "none") == "cpu",
                    micro_batch_size=micro, num_microbatches=accum, global_batch=total,
                    schedule="1f1b" if pp > 1 else None, virtual_stages=1, sequence_parallel=False,
                    stage_layers=stage_layers,
                    recompute=tuple(mode_counts(n, "full" if full else "none") for n in stage_layers),
                    dtype="bf16" if cfg.get("bf16", {}).get("enabled") else "fp16" if cfg.get("fp16", {}).get("enabled")
                    else "fp32", axis_order=Degrees(pp=pp, dp=dp or 1, cp=cp, tp=tp).active())


