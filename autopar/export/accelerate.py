"""Accelerate: a config YAML for ``accelerate launch --config_file`` (Accelerate 1.15).

Which backend section it writes follows the plan: a pipeline needs the Megatron-LM section
(``megatron_lm_*``: Accelerate's only training pipeline); without one, ZeRO-0 on plain data
parallelism is ``MULTI_GPU`` (DDP), ZeRO-1 on it the DeepSpeed section, and everything else
FSDP2 (``fsdp_version: 2``) with a ``parallelism_config`` (dp_shard, tp, cp).

What it cannot express: the micro-batch size (the training script's DataLoader) and, under
DDP and FSDP2, gradient accumulation (``Accelerator(gradient_accumulation_steps=...)``);
ZeRO-0/1 next to tensor or context parallelism (FSDP2 shards gradients), sequence parallelism
under FSDP2's tensor parallelism (transformers' tp_plan), recompute in the DDP and DeepSpeed
sections, per-block recompute mixes under FSDP2; under the Megatron-LM section, ZeRO-2, virtual
stages and schedules other than 1F1B, stage sizes other than even or a different last stage,
no recompute at all (Accelerate's plugin defaults to full), and mesh orders other than
Megatron's.
"""

from __future__ import annotations

from autopar.errors import UserError
from autopar.export import megatron
from autopar.export.common import (Adapter, Nodes, Option, Settings, chunks, contiguous, counts, describe_recompute, mode_counts,
                                   nodes, per_rank, order_gap, replace_plan, uniform_recompute, with_chunks)
from autopar.plan import Plan
from cost_models.axes import Degrees

FRAMEWORK = "Accelerate 1.15 (accelerate launch --config_file)"
DEFAULT_FILE = "accelerate_config.yaml"
PREFIX = "parallelism_config_"


def backend(plan: Plan) -> str:
    """The ``distributed_type`` the plan is written as."""
    m = plan.mesh
    if m.pp > 1:
        return "MEGATRON_LM"
    if m.tp == 1 and m.cp == 1 and (plan.zero_stage == 0 or m.dp == 1) and not plan.offload:
        return "MULTI_GPU" if plan.gpus > 1 else "NO"
    if m.tp == 1 and m.cp == 1 and plan.zero_stage == 1:
        return "DEEPSPEED"
    return "FSDP"


def adapt(a: Adapter) -> None:
    kind = backend(a.plan)
    if kind == "MEGATRON_LM":
        _megatron(a)
    elif kind == "FSDP":
        if a.plan.mesh.dp == 1 and a.plan.mesh.cp == 1:
            a.gap("mesh", f"dp=1,tp={a.plan.mesh.tp}", "Accelerate runs tensor parallelism under FSDP2, which needs "
                  "dp_shard or cp above 1 to shard over; export to torchtitan or megatron", [])
        _fsdp(a)
    else:
        if set(a.plan.recompute) != {"none"}:
            a.gap("recompute", describe_recompute(a.plan), f"Accelerate's {kind} section has no activation-checkpointing key",
                  [Option(nearest="none in the config; call model.gradient_checkpointing_enable() in the script "
                                  "to recompute every block", plan=uniform_recompute(a.plan, "none"))])
    batch = "" if kind == "MEGATRON_LM" else "" if kind == "DEEPSPEED" else \
        f" and Accelerator(gradient_accumulation_steps={a.plan.num_microbatches})"
    setting = "micro_batch_size" if kind in ("MEGATRON_LM", "DEEPSPEED") else "micro_batch_size,num_microbatches"
    a.gap(setting, f"{a.plan.micro_batch_size},{a.plan.num_microbatches}" if "," in setting else a.plan.micro_batch_size,
          "Accelerate takes the micro-batch from the training script's DataLoader",
          [Option(nearest=f"DataLoader(batch_size={a.plan.micro_batch_size}){batch} in the training script",
                  plan=a.plan)])


def _fsdp(a: Adapter) -> None:
    p = a.plan
    if p.mesh.dp > 1 and p.zero_stage in (0, 1):
        a.gap("zero_stage", p.zero_stage, "FSDP2 with tensor or context parallelism shards gradients and weights",
              [Option(nearest="fsdp_reshard_after_forward: false (ZeRO-2)", plan=replace_plan(p, zero_stage=2)),
               Option(nearest="fsdp_reshard_after_forward: true (ZeRO-3)", plan=replace_plan(p, zero_stage=3))])
    if a.plan.sequence_parallel:
        a.gap("sequence_parallel", True, "Accelerate's tensor parallelism applies the model's tp_plan, without "
              "sequence parallelism", [Option(nearest="parallelism_config_tp_size without sequence parallelism",
                                              plan=replace_plan(a.plan, sequence_parallel=False))])
    if {"selective", "op"} & set(a.plan.recompute) or len(set(a.plan.recompute)) > 1:
        a.gap("recompute", describe_recompute(a.plan), "fsdp_activation_checkpointing checkpoints every block or none",
              [Option(nearest="fsdp_activation_checkpointing: true", plan=uniform_recompute(a.plan, "full")),
               Option(nearest="fsdp_activation_checkpointing: false", plan=uniform_recompute(a.plan, "none"))])
    a.refit({"full": "fsdp_activation_checkpointing: true"})
    _order(a, "Accelerate's mesh is dp_replicate > dp_shard > cp > tp")


def _order(a: Adapter, reason: str) -> None:
    order_gap(a, reason, "pp > dp > tp")


def _megatron(a: Adapter) -> None:
    if a.plan.zero_stage == 2 and a.plan.mesh.dp > 1:
        a.gap("zero_stage", 2, "Accelerate's Megatron-LM section has the distributed optimizer (ZeRO-1) and "
              "Megatron-FSDP (ZeRO-3) only",
              [Option(nearest="megatron_lm_use_distributed_optimizer: true (ZeRO-1)", plan=replace_plan(a.plan, zero_stage=1)),
               Option(nearest="megatron_lm_use_custom_fsdp: true (ZeRO-3)", plan=replace_plan(a.plan, zero_stage=3))])
    if a.plan.virtual_stages > 1 or a.plan.schedule != "1f1b":
        merged = per_rank(a.plan)
        a.gap("schedule", f"{a.plan.schedule} (v={a.plan.virtual_stages})" if a.plan.virtual_stages > 1
              else a.plan.schedule, "Accelerate's Megatron-LM section has no "
              "virtual pipeline stages; Megatron runs 1F1B", [Option(
                  nearest="1F1B, one stage per rank",
                  plan=contiguous(replace_plan(a.plan, recompute=tuple(m for r in merged for m in r)),
                                  tuple(map(len, merged)), 1, schedule="1f1b"))])
    if _stage_keys(a.plan) is None:
        layers, pp = a.plan.num_layers, a.plan.mesh.pp
        options = []
        for q in sorted({layers // pp, -(-layers // pp)}):
            last = layers - q * (pp - 1)
            if last >= 1:
                sizes = (q,) * (pp - 1) + (last,)
                options.append(Option(nearest=f"stages {sizes}" + ("" if last == q else
                                                                    f" (megatron_lm_decoder_last_pipeline_num_layers: {last})"),
                                      plan=contiguous(a.plan, sizes)))
        a.gap("stage_layers", a.plan.stage_layers, "Accelerate's Megatron-LM section splits evenly or sets the "
              "last stage apart", options)
    if megatron._recompute_flags(a.plan) in (None, []):
        flags = megatron._recompute_flags(a.plan)
        reason = ("Accelerate's Megatron-LM plugin recomputes by default (full, uniform) and has no key to turn it off"
                  if flags == [] else "Megatron recomputes one granularity, in the same number of blocks of every stage")
        per = [counts(c) for c in chunks(a.plan)]
        options = [Option(nearest="megatron_lm_recompute_granularity: selective", plan=uniform_recompute(a.plan, "selective")),
                   Option(nearest="megatron_lm_recompute_granularity: full (uniform)", plan=uniform_recompute(a.plan, "full"))]
        for k in sorted({f for _, _, f, _ in per if f} | {s + f + o for _, s, f, o in per if s + f + o}):
            if k < max(map(sum, per)):
                new = [["full"] * min(k, sum(c)) + ["none"] * (sum(c) - min(k, sum(c))) for c in per]
                options.append(Option(nearest=f"megatron_lm_recompute_granularity: full, method block, {k} layers",
                                      plan=with_chunks(a.plan, new)))
        a.gap("recompute", describe_recompute(a.plan), reason, options)
    a.refit({"selective": "megatron_lm_recompute_granularity: selective",
             "full": "megatron_lm_recompute_granularity: full (uniform)"})
    _order(a, "Accelerate's Megatron-LM section uses Megatron's default rank order")


def _stage_keys(plan: Plan) -> dict | None:
    layers = plan.stage_layers
    if len(set(layers)) == 1:
        return {}
    if len(set(layers[:-1])) == 1:
        return {"megatron_lm_decoder_last_pipeline_num_layers": layers[-1]}
    return None


def sections(plan: Plan) -> dict:
    """The config of the (adapted) plan, as nested dicts of scalars."""
    kind = backend(plan)
    where = nodes(plan)
    cfg: dict = {"compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": kind,
                 "downcast_bf16": "no", "machine_rank": 0, "main_training_function": "main",
                 "mixed_precision": "no" if plan.dtype == "fp32" else plan.dtype,
                 "num_machines": where.count, "num_processes": plan.gpus, "rdzv_backend": "static",
                 "same_network": True, "use_cpu": False}
    m = plan.mesh
    if kind == "FSDP":
        cfg["fsdp_config"] = {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_reshard_after_forward": plan.zero_stage == 3 or m.dp == 1,
                              "fsdp_offload_params": plan.offload,
                              "fsdp_activation_checkpointing": "full" in plan.recompute,
                              "fsdp_cpu_ram_efficient_loading": True, "fsdp_state_dict_type": "SHARDED_STATE_DICT"}
        cfg["parallelism_config"] = {PREFIX + "dp_replicate_size": 1, PREFIX + "dp_shard_size": m.dp,
                                     PREFIX + "tp_size": m.tp, PREFIX + "cp_size": m.cp}
    elif kind == "DEEPSPEED":
        ds = {"zero_stage": plan.zero_stage, "gradient_accumulation_steps": plan.num_microbatches,
              "offload_optimizer_device": "cpu" if plan.offload else "none", "offload_param_device": "none",
              "zero3_init_flag": False}
        cfg["deepspeed_config"] = ds
    elif kind == "MEGATRON_LM":
        mg: dict[str, object] = {"megatron_lm_tp_degree": m.tp, "megatron_lm_pp_degree": m.pp,
              "megatron_lm_context_parallel_size": m.cp,
              "megatron_lm_num_micro_batches": plan.num_microbatches,
              "megatron_lm_sequence_parallelism": plan.sequence_parallel and m.tp > 1,
              "megatron_lm_use_distributed_optimizer": plan.zero_stage == 1,
              "megatron_lm_use_custom_fsdp": plan.zero_stage == 3,
              "megatron_lm_optimizer_cpu_offload": plan.offload,
              "megatron_lm_use_precision_aware_optimizer": plan.offload,
              "megatron_lm_gradient_clipping": 1.0}
        mg.update(_stage_keys(plan) or {})
        flags = megatron._recompute_flags(plan) or []
        keys = dict(zip(flags[::2], flags[1::2]))
        mg["megatron_lm_recompute_granularity"] = keys.get("--recompute-granularity", "full")
        if mg["megatron_lm_recompute_granularity"] == "full":
            mg["megatron_lm_recompute_method"] = keys["--recompute-method"]
            mg["megatron_lm_recompute_num_layers"] = int(keys["--recompute-num-layers"])
        cfg["megatron_lm_config"] = mg
    return cfg


def _yaml(cfg: dict, indent: str = "") -> list[str]:
    out = []
    for key, value in cfg.items():
        if isinstance(value, dict):
            out.append(f"{indent}{key}:")
            out += _yaml(value, indent + "  ")
        elif isinstance(value, bool):
            out.append(f"{indent}{key}: {'true' if value else 'false'}")
        elif isinstance(value, str) and value in ("no", "none", "yes", "true", "false"):
            out.append(f"{indent}{key}: '{value}'")
        else:
            out.append(f"{indent}{key}: {value}")
    return out


def render(plan: Plan, where: Nodes, header: list[str], filename: str) -> tuple[str, str]:
    env = (f"ACCELERATE_GRADIENT_ACCUMULATION_STEPS={plan.num_microbatches} "
           if backend(plan) in ("MULTI_GPU", "FSDP", "NO") else "")
    nodes_flags = " --machine_rank <this node> --main_process_ip <node 0>" if where.count > 1 else ""
    launch = f"{env}accelerate launch --config_file {filename}{nodes_flags} train.py"
    text = "\n".join([*(f"# {h}" for h in header), *_yaml(sections(plan))]) + "\n"
    return text, launch


# ---- reading a config back ------------------------------------------------------------------------

def read_yaml(text: str) -> dict:
    """The nested mapping of scalars ``render`` writes (a YAML subset: ``key: value`` lines
    indented two spaces per level, ``#`` comments)."""
    root: dict = {}
    stack: list[tuple[int, dict]] = [(-1, root)]
    for raw in text.splitlines():
        line = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        key, sep, value = line.strip().partition(":")
        if not sep:
            raise UserError(f"Accelerate config line {raw!r} is not `key: value`")
        while stack[-1][0] >= depth:
            stack.pop()
        if value.strip() == "":
            child: dict = {}
            stack[-1][1][key] = child
            stack.append((depth, child))
        else:
            stack[-1][1][key] = _scalar(value.strip())
    return root


def _scalar(text: str) -> object:
    if text in ("true", "false"):
        return text == "true"
    if text[:1] in "'\"" and text[-1:] == text[:1]:
        return text[1:-1]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse(text: str, layers: int) -> Settings:
    """The plan settings a config states, for a model of ``layers`` blocks."""
    cfg = read_yaml(text)
    kind, gpus = cfg.get("distributed_type"), cfg.get("num_processes")
    dtype = {"no": "fp32"}.get(cfg.get("mixed_precision", "no"), cfg.get("mixed_precision"))
    if kind == "FSDP":
        f, p = cfg["fsdp_config"], cfg.get("parallelism_config", {})
        dp = p.get(PREFIX + "dp_shard_size", 1) * p.get(PREFIX + "dp_replicate_size", 1)
        tp, cp = p.get(PREFIX + "tp_size", 1), p.get(PREFIX + "cp_size", 1)
        full = f.get("fsdp_activation_checkpointing", False)
        return Settings(gpus=gpus, dtype=dtype, dp=dp, tp=tp, pp=1, cp=cp, zero=(3 if f.get("fsdp_reshard_after_forward") else 2)
                        if dp > 1 else 0, offload=f.get("fsdp_offload_params", False), schedule=None, virtual_stages=1,
                        sequence_parallel=False, stage_layers=(layers,), recompute=(mode_counts(layers, "full" if full else "none"),),
                        axis_order=Degrees(dp=dp, cp=cp, tp=tp).active())
    if kind in ("MULTI_GPU", "NO"):
        return Settings(gpus=gpus, dtype=dtype, dp=gpus, tp=1, pp=1, cp=1, zero=0, offload=False, schedule=None, virtual_stages=1,
                        sequence_parallel=False, stage_layers=(layers,), recompute=(mode_counts(layers),),
                        axis_order=Degrees(dp=gpus or 1).active())
    if kind == "DEEPSPEED":
        d = cfg["deepspeed_config"]
        return Settings(gpus=gpus, dtype=dtype, dp=gpus, tp=1, pp=1, cp=1, zero=d.get("zero_stage"),
                        offload=d.get("offload_optimizer_device", "none") == "cpu",
                        num_microbatches=d.get("gradient_accumulation_steps"), schedule=None, virtual_stages=1,
                        sequence_parallel=False, stage_layers=(layers,), recompute=(mode_counts(layers),),
                        axis_order=Degrees(dp=gpus or 1).active())
    if kind == "MEGATRON_LM":
        g = cfg["megatron_lm_config"]
        tp, pp, cp = g["megatron_lm_tp_degree"], g["megatron_lm_pp_degree"], g.get("megatron_lm_context_parallel_size", 2)
        dp = gpus // (tp * pp * cp)
        last = g.get("megatron_lm_decoder_last_pipeline_num_layers")
        stage_layers = ((((layers - last) // (pp - 1),) * (pp - 1) + (last,)) if last is not None
                        else (layers // pp,) * pp)
        granularity = g.get("megatron_lm_recompute_granularity", "full")
        method, k = g.get("megatron_lm_recompute_method", "uniform"), g.get("megatron_lm_recompute_num_layers", 1)

        def rec(n: int) -> tuple[int, ...]:
            if granularity == "selective":
                return mode_counts(n, "selective")
            return mode_counts(n, "full", n if method == "uniform" else min(k, n))
        zero = 1 if g.get("megatron_lm_use_distributed_optimizer") else 3 if g.get("megatron_lm_use_custom_fsdp") else 0
        return Settings(gpus=gpus, dtype=dtype, dp=dp, tp=tp, pp=pp, cp=cp, zero=zero if dp > 1 else 0,
                        offload=g.get("megatron_lm_optimizer_cpu_offload", False),
                        num_microbatches=g.get("megatron_lm_num_micro_batches"), schedule="1f1b", virtual_stages=1,
                        sequence_parallel=g.get("megatron_lm_sequence_parallelism", False) and tp > 1,
                        stage_layers=stage_layers, recompute=tuple(rec(n) for n in stage_layers),
                        axis_order=Degrees(pp=pp, dp=dp, cp=cp, tp=tp).active())
    raise UserError(f"Accelerate config has distributed_type {kind!r}, not one autopar writes")
