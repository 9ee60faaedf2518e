"""torchtitan: a config module for torchtitan's main branch (``COMMIT``).

torchtitan's main branch (no release since 0.2.2 has it) describes a job as a Python function
returning ``Trainer.Config`` (selected with ``--module <module> --config <function>``;
``--section.key`` flags override it). The export is such a module: the model torchtitan builds
for the plan's (``autopar.export.titanmodels``) and ``TrainingConfig``/``ParallelismConfig``/
activation checkpointing written as literal keyword arguments, so that ``parse`` reads them back
with ``ast``.

Mapping: ZeRO 0 is ``data_parallel_replicate_degree`` (FSDP2 over a one-rank shard mesh: DDP),
ZeRO 2/3 ``data_parallel_shard_degree`` with ``fsdp_reshard_after_forward`` never/always;
stages are explicit ``module_fqns_per_model_part``. torchtitan counts tokens, not sequences
(its batch dimension folded into the tokens since pytorch/torchtitan#4121, 2026-08-20): a
micro-batch of b sequences is ``num_tokens_per_microbatch_per_dp_rank`` = b x seq tokens with
``max_context_length`` = seq (positions restart there, and attention with them: the same
b causal sequences), a step ``num_tokens_per_train_step`` = global batch x seq tokens; with a
pipeline the micro-batches are ``num_pp_microbatches``, without it gradient-accumulation
steps, which torchtitan derives from the step's tokens.

Per-op recompute (``op``) is torchtitan's ``SelectiveAC`` (every second matmul's output and
the attention's kept). What it cannot express, each a priced gap: ZeRO-1 (FSDP2 always shards
gradients), fp16, autopar's selective recompute (the attention core only; torchtitan's selective
AC is per-op), per-block recompute mixes, mesh orders other than pp > dp > cp > tp; models it has
no definition of become its Llama 3 decoder at the same shape, a Mixtral-style or otherwise
routed Qwen3-MoE its Qwen3 MoE decoder at the same shape (an ``hf:Qwen3MoeConfig`` twin, so the
cost model prices the model torchtitan builds), and an HF Llama's sliding windows the same model
without them (torchtitan's Llama 3 attends causally over the whole sequence).

Expert parallelism is ``expert_parallel_degree``: torchtitan takes the ep ranks from
dp_shard x cp x tp, autopar's ep regroups dp x cp, the same ranks when tp = 1 and the dp ranks
shard (ZeRO 2/3; ZeRO 0 is a gap to them). Under tp > 1 torchtitan folds its experts over the tp
ranks (since pytorch/torchtitan#3167 deprecated expert tensor parallelism, 2026-04-30), which
autopar does not price: the export refuses. Mixtures torchtitan has no definition of
(DeepSeek-V2, GLM, Qwen2-MoE) are refused, naming the Megatron export.
"""

from __future__ import annotations

import ast

from autopar.errors import UserError
from autopar.export.common import (Adapter, Family, Nodes, Option, Settings, Shape, derive_batch, describe_recompute,
                                   mode_counts, model_spec, order_gap, replace_plan, twin_options, uniform_recompute)
from autopar.export.titanmodels import (DEEPSEEK_V3, GPT_OSS, QWEN3, QWEN3_MOE, deepseek_v3, gpt_oss, llama_rope,
                                        model_source, qwen3)
from autopar.plan import Plan
from cost_models.axes import Degrees

COMMIT = "b5bcd76c6"
"""The torchtitan commit the config module is written for (main, 2026-08-21)."""
FRAMEWORK = f"torchtitan main at {COMMIT} (torchtitan.config.ConfigManager, Trainer.Config)"
DEFAULT_FILE = "autopar_torchtitan.py"
FUNCTION = "autopar_plan"
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B",
             "zero-bubble": "InterleavedZeroBubble"}
"""autopar's schedules and the torch.distributed.pipelining schedules torchtitan names (all
place stages looped: rank r runs stages r, r + pp, ...)."""
_MULTI = {"Interleaved1F1B", "InterleavedZeroBubble"}
AC = {"none": "None", "full": "FullAC.Config()", "op": "SelectiveAC.Config()"}
"""How the config module writes each recompute mode torchtitan has (``activation_checkpoint``:
``torchtitan/distributed/activation_checkpoint.py``; SelectiveAC keeps every second matmul's
output and the attention's, as autopar's ``op``)."""


def _adapt_experts(a: Adapter, shape: Shape) -> None:
    if shape.family != Family.LLAMA and shape.source not in (QWEN3_MOE, DEEPSEEK_V3, GPT_OSS):
        raise UserError(f"{shape.source} has {shape.experts} routed experts: the torchtitan export writes "
                        "torchtitan's Qwen3 MoE decoder, which builds Qwen3-MoE's and Llama-style (Mixtral's) "
                        "experts, or its DeepSeek-V3 or GPT-OSS; export it with --to megatron")
    m = a.plan.mesh
    if m.tp > 1:
        raise UserError(f"the plan runs {shape.experts} routed experts under tp={m.tp}: torchtitan's expert layers "
                        "take their ranks from dp x cp x tp (the experts folded over the tp ranks), a layout autopar "
                        "does not price; re-plan with --tp 1 or export it with --to megatron")
    if shape.source in (DEEPSEEK_V3, GPT_OSS):
        (deepseek_v3 if shape.source == DEEPSEEK_V3 else gpt_oss)(a.plan)  # refuses what torchtitan does not build
        found = None
    else:
        found = qwen3(a.plan, shape)
    if found is not None and not found.as_built:
        twin = found.twin(shape)
        a.gap("model", shape.source, "torchtitan trains its own model definitions; its mixture of experts is the "
              "Qwen3 MoE decoder (per-head q/k RMSNorm, the top-k scores renormalised, every block sparse)",
              [Option(nearest=f"torchtitan's Qwen3 MoE decoder at the same shape ({twin})",
                      plan=replace_plan(a.plan, model=twin))])
    if m.ep > 1 and a.plan.zero_stage == 0:
        a.gap("zero_stage", 0, "torchtitan's experts take their ep ranks from the FSDP shard group, which ZeRO 0 "
              "(data_parallel_replicate_degree) leaves at one rank",
              [Option(nearest="data_parallel_shard_degree with fsdp_reshard_after_forward='never' (ZeRO-2)",
                      plan=replace_plan(a.plan, zero_stage=2)),
               Option(nearest="data_parallel_shard_degree with fsdp_reshard_after_forward='always' (ZeRO-3)",
                      plan=replace_plan(a.plan, zero_stage=3))])


def _adapt_rope(a: Adapter, shape: Shape) -> None:
    """What torchtitan's Llama 3 decoder does not build of a Llama-style HF model's attention:
    gaps that keep the plan (the cost model prices causal attention under torchtitan's recipe)."""
    rope = llama_rope(a.plan, shape)
    if rope.windows:  # priced as the same HF model without its windows
        spec = model_spec(a.plan)
        twin = f"hf:{spec.source}:" + ",".join([*(f"{k}={v}" for k, v in spec.options if k != "sliding_window"),
                                                "sliding_window=None"])
        a.gap("attention", f"sliding windows of {', '.join(map(str, rope.windows))} tokens",
              "torchtitan's Llama 3 decoder has no sliding windows",
              [Option(nearest=f"causal attention over all {a.plan.seq_len} tokens ({twin})",
                      plan=replace_plan(a.plan, model=twin))])
    if rope.other:
        a.gap("rope", rope.other, "torchtitan's RoPE scales frequencies as Llama 3 or YaRN only",
              [Option(nearest=f"plain RoPE of base {rope.theta:g}", plan=a.plan)])


def adapt(a: Adapter, shape: Shape) -> None:
    if shape.experts:
        _adapt_experts(a, shape)
    elif shape.source == QWEN3 and qwen3(a.plan, shape).as_built:
        pass  # torchtitan's Qwen3 decoder as it is
    elif shape.family != Family.LLAMA:
        a.gap("model", shape.source, "torchtitan trains its own model definitions; the nearest is its "
              "Llama 3 decoder", twin_options(a.plan, shape, "torchtitan's Llama 3 decoder at the same shape ({spec})"))
    else:
        _adapt_rope(a, shape)
    if a.plan.zero_stage == 1:
        a.gap("zero_stage", 1, "FSDP2 shards gradients whenever it shards optimizer states",
              [Option(nearest="data_parallel_shard_degree with fsdp_reshard_after_forward='never' (ZeRO-2)",
                      plan=replace_plan(a.plan, zero_stage=2)),
               Option(nearest="data_parallel_shard_degree with fsdp_reshard_after_forward='always' (ZeRO-3)",
                      plan=replace_plan(a.plan, zero_stage=3))])
    if a.plan.offload and a.plan.zero_stage == 0:
        a.gap("offload", True, "enable_cpu_offload offloads FSDP shards", [
            Option(nearest="no CPU offload", plan=replace_plan(a.plan, offload=False))])
    if a.plan.dtype == "fp16":
        a.gap("dtype", "fp16", "torchtitan trains in bfloat16 or float32",
              [Option(nearest="mixed_precision_param='bfloat16'", plan=replace_plan(a.plan, dtype="bf16"))])
    if a.plan.mesh.pp > 1 and a.plan.virtual_stages > 1 and SCHEDULES[a.plan.schedule] not in _MULTI:
        a.gap("schedule", a.plan.schedule, f"{a.plan.virtual_stages} stages per rank need a looped schedule",
              [Option(nearest="Interleaved1F1B", plan=replace_plan(a.plan, schedule="interleaved"))])
    modes = set(a.plan.recompute)
    if "selective" in modes or len(modes) > 1:
        a.gap("recompute", describe_recompute(a.plan),
              "torchtitan applies one activation-checkpointing policy to every block, and its selective "
              "policy is op-level (saves matmul and attention outputs), not autopar's attention-core recompute",
              [Option(nearest=f"activation_checkpoint={AC[m]}", plan=uniform_recompute(a.plan, m))
               for m in ("op", "full", "none")])
    a.refit({m: f"activation_checkpoint={AC[m]}" for m in ("op", "full")})
    order_gap(a, "torchtitan's mesh is pp > dp_replicate > dp_shard > cp > tp", "pp > dp > tp")


def _fqns(plan: Plan) -> list[list[str]]:
    out, at = [], 0
    last = len(plan.stage_layers) - 1
    for i, n in enumerate(plan.stage_layers):
        names = [f"layers.{j}" for j in range(at, at + n)]
        at += n
        out.append((["tok_embeddings"] if i == 0 else []) + names + (["norm", "lm_head"] if i == last else []))
    return out


def settings_kwargs(plan: Plan) -> tuple[dict, dict]:
    """(TrainingConfig, ParallelismConfig) keyword arguments of the (adapted) plan."""
    m = plan.mesh
    pipelined = m.pp > 1
    training = {"num_tokens_per_microbatch_per_dp_rank": plan.micro_batch_size * plan.seq_len,
                "num_tokens_per_train_step": plan.global_batch * plan.seq_len,
                "max_context_length": plan.seq_len,
                "dtype": "float32", "mixed_precision_param": "float32" if plan.dtype == "fp32" else "bfloat16",
                "enable_cpu_offload": plan.offload}
    if pipelined or m.ep > 1:  # torchtitan's CUDA graphs refuse pipelines and the all-to-all dispatcher's host sync
        training["disable_cuda_graphs"] = True
    sharded = plan.zero_stage > 0
    parallelism: dict = {"data_parallel_replicate_degree": 1 if sharded else m.dp,
                         "data_parallel_shard_degree": m.dp if sharded else 1,
                         "fsdp_reshard_after_forward": "always" if plan.zero_stage == 3 else "never",
                         "tensor_parallel_degree": m.tp,
                         "enable_sequence_parallel": plan.sequence_parallel and m.tp > 1,
                         "pipeline_parallel_degree": m.pp,
                         "context_parallel_degree": m.cp}
    if m.ep > 1:
        parallelism["expert_parallel_degree"] = m.ep
    if pipelined:
        parallelism.update(pipeline_parallel_schedule=SCHEDULES[plan.schedule],
                           num_pp_microbatches=plan.num_microbatches,
                           module_fqns_per_model_part=_fqns(plan))
    return training, parallelism


def _kwargs(d: dict, indent: str) -> str:
    return ",\n".join(f"{indent}{k}={v!r}" for k, v in d.items())


def render(plan: Plan, shape: Shape, where: Nodes, header: list[str], module: str) -> tuple[str, str]:
    training, parallelism = settings_kwargs(plan)
    ac = AC[plan.recompute[0]]  # one mode on every block (``adapt``)
    launch = (f"PYTHONPATH=<directory of {module}.py> torchrun --nnodes {where.count} --nproc-per-node "
              f"{where.per_node} -m torchtitan.train --module {module} --config {FUNCTION}")
    doc = "\n".join(header + ["", "Launch on every node:", f"    {launch}",
                              "Set hf_assets_path (tokenizer) and the dataloader to your data; any field can "
                              "be overridden with --section.key."])
    model, flavor = model_source(plan, shape)
    text = f'''"""{doc}
"""

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
{model}


def {FUNCTION}() -> Trainer.Config:
    config = base_recipe()  # optimizer, data loader, checkpointing: torchtitan's recipe for its {flavor}
    spec = model_registry("{flavor}")
    spec.model = _model()
    spec.flavor = "autopar"
    config.model_spec = spec
    config.loss = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=VOCAB))
    config.training = TrainingConfig(
{_kwargs(training, "        ")})
    config.parallelism = ParallelismConfig(
{_kwargs(parallelism, "        ")})
    config.activation_checkpoint = {ac}
    return config
'''
    return text, launch


# ---- reading a config module back ---------------------------------------------------------------

def _calls(tree: ast.AST) -> dict[str, dict]:
    """Literal keyword arguments of the ``TrainingConfig(...)`` and ``ParallelismConfig(...)``
    calls, and the module's ``NAME = value`` constants."""
    out: dict[str, dict] = {"constants": {}}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "TrainingConfig", "ParallelismConfig"):
            out[node.func.id] = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple):
            for name, value in zip(node.targets[0].elts, node.value.elts):
                if isinstance(name, ast.Name):
                    out["constants"][name.id] = ast.literal_eval(value)
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute)
                and node.targets[0].attr == "activation_checkpoint"):
            out["ac"] = {"mode": next((m for m, text in AC.items() if text.split(".")[0] in ast.unparse(node.value)),
                                      "none")}
    return out


def literals(text: str) -> dict[str, dict]:
    """The keyword arguments of the module's ``TrainingConfig(...)`` and ``ParallelismConfig(...)``
    (keys ``TrainingConfig``, ``ParallelismConfig``), its constants and whether it sets full AC."""
    try:
        found = _calls(ast.parse(text))
    except (SyntaxError, ValueError) as exc:
        raise UserError(f"torchtitan config is not a module of literal settings: {exc}") from None
    if "TrainingConfig" not in found or "ParallelismConfig" not in found:
        raise UserError("torchtitan config has no TrainingConfig(...) or ParallelismConfig(...) call")
    return found


def parse(text: str) -> Settings:
    found = literals(text)
    t, p = found["TrainingConfig"], found["ParallelismConfig"]
    layers = found["constants"].get("LAYERS")
    rep, shard = p.get("data_parallel_replicate_degree", 1), p.get("data_parallel_shard_degree", -1)
    tp, pp, cp = p.get("tensor_parallel_degree", 1), p.get("pipeline_parallel_degree", 1), p.get("context_parallel_degree", 1)
    dp = rep * shard
    seq = t.get("max_context_length", 2048)
    micro = t.get("num_tokens_per_microbatch_per_dp_rank", 16384) // seq
    chunks = p.get("num_pp_microbatches", 1) if pp > 1 else 1  # a dp rank's micro-batches per accumulation step
    step = t.get("num_tokens_per_train_step", -1)
    global_batch = step // seq if step > 0 else micro * chunks * dp
    n = chunks * (derive_batch(dp, micro * chunks, global_batch) or 0)
    if pp > 1:
        parts = p.get("module_fqns_per_model_part")
        stage_layers = tuple(sum(1 for f in part if f.startswith("layers.")) for part in parts) if parts else None
        v = len(parts) // pp if parts else None
        schedule = {v: k for k, v in SCHEDULES.items()}.get(p.get("pipeline_parallel_schedule", "1F1B"))
    else:
        stage_layers, v, schedule = ((layers,) if layers else None), 1, None
    reshard = p.get("fsdp_reshard_after_forward", "default")
    zero = 0 if shard == 1 else 3 if reshard == "always" or (reshard == "default" and pp == 1) else 2
    ac = found.get("ac", {}).get("mode", "none")
    return Settings(gpus=dp * tp * pp * cp, dp=dp, tp=tp, pp=pp, cp=cp, ep=p.get("expert_parallel_degree", 1),
                    zero=zero,
                    offload=t.get("enable_cpu_offload", False), micro_batch_size=micro, num_microbatches=n or None,
                    global_batch=global_batch, schedule=schedule, virtual_stages=v,
                    sequence_parallel=p.get("enable_sequence_parallel", True) and tp > 1, stage_layers=stage_layers,
                    recompute=tuple(mode_counts(k, ac) for k in stage_layers) if stage_layers else None,
                    dtype="fp32" if t.get("mixed_precision_param") == "float32" else "bf16",
                    axis_order=Degrees(pp=pp, dp=dp, cp=cp, tp=tp).active())


