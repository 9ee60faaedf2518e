"""Megatron-LM: a launch script whose ``pretrain_gpt.py`` arguments are the plan.

Flag names are those of Megatron-LM's ``megatron/training/arguments.py`` (core_v0.19 and
main, where most are generated from ``TransformerConfig``'s fields). What Megatron cannot
express: GPipe and zero-bubble schedules (it runs 1F1B, interleaved with virtual stages),
interleaving with one chunk per rank, recompute mixes other than one mode everywhere or
``--recompute-method block``'s (full on the first k blocks of every chunk), mesh
orders other than tp innermost with pp outside or inside dp, Transformer Engine's
``--tp-comm-overlap`` without sequence parallelism, and mixture-of-experts layers under tensor
parallelism without sequence parallelism (``MoELayer`` refuses to train so).

Expert parallelism: ``--expert-model-parallel-size`` is the plan's ep and
``--expert-tensor-parallel-size`` the recipe's expert TP (tp, or 1 when the experts are not split
over tp). Megatron lays the expert layers out as its own grid, etp x ep x edp x pp over the same
devices (``parallel_state.initialize_model_parallel``); with expert TP 1 and tp > 1 its ep groups
take the tp ranks first, each routing its own sequence shard, where autopar's runtime replicates
the experts' work over tp: the same experts per device, less expert compute than priced.
"""

from __future__ import annotations

import argparse
import shlex

from autopar.errors import UserError
from autopar.export.common import (Adapter, Family, Nodes, Option, Settings, Shape, axis_order, chunks, counts,
                                   derive_batch, describe_recompute, dp_overlap, mode_counts, order_gap, replace_plan, twin_options,
                                   with_chunks)
from autopar.plan import Plan
from cost_models.axes import Axis, Degrees
from cost_models.pipeline import block_method_k
from cost_models.recipe import Attention, ExecutionRecipe

FRAMEWORK = "Megatron-LM core_v0.19 (megatron/training/arguments.py)"
DEFAULT_FILE = "pretrain_autopar.sh"
SCRIPT = "pretrain_gpt.py"
_MESH_ORDERS = ((Axis.PP, Axis.DP, Axis.CP, Axis.TP), (Axis.DP, Axis.PP, Axis.CP, Axis.TP))
"""Megatron's rank orders, outermost first: its default and ``--use-tp-pp-dp-mapping``'s."""


def adapt(a: Adapter, shape: Shape) -> None:
    """Replace what Megatron cannot express by the nearest setting it can."""
    _check_experts(a.plan, shape, a.recipe)
    if shape.family == Family.OTHER:
        a.gap("model", shape.source, "Megatron's GPT builder makes GPT-2-style or Llama-style blocks, not "
              "this architecture", twin_options(a.plan, shape, "a Llama-style model of the same shape ({spec})"))
    if shape.experts and a.plan.mesh.tp > 1 and not a.plan.sequence_parallel:
        a.gap("sequence_parallel", False, "Megatron's MoE layers train under tensor parallelism only with "
              "sequence parallelism", [Option(nearest="--sequence-parallel",
                                              plan=replace_plan(a.plan, sequence_parallel=True))])
    if a.plan.mesh.pp > 1:
        _schedule(a)
    order_gap(a, "Megatron places tp innermost and pp outside or inside dp", "the default order tp-cp-ep-dp-pp",
              _MESH_ORDERS)
    if _recompute_flags(a.plan) is None:
        _recompute(a)
    a.refit({"selective": "--recompute-granularity selective", "full": "--recompute-granularity full "
             "--recompute-method uniform"})
    if a.recipe.tp_comm_overlap and a.plan.mesh.tp > 1 and not a.plan.sequence_parallel:
        recipe = _replace_recipe(a.recipe, tp_comm_overlap=False)
        a.gap("recipe.tp_comm_overlap", True, "--tp-comm-overlap needs --sequence-parallel",
              [Option(nearest="no --tp-comm-overlap", plan=a.plan, recipe=recipe)])


def expert_tp(plan: Plan, recipe: ExecutionRecipe) -> int:
    """``--expert-tensor-parallel-size`` (devices each expert's GEMMs split over): tp when the
    recipe splits the experts like the dense MLP (``expert_tensor_parallel``), else 1."""
    return plan.mesh.tp if recipe.expert_tensor_parallel else 1


def _check_experts(plan: Plan, shape: Shape, recipe: ExecutionRecipe) -> None:
    """Refuse, in one line naming the fix, an ep that Megatron-LM's ``validate_args`` (ep
    divides ``--num-experts``) or its expert grid (etp x ep x pp divides the devices) rejects."""
    ep, m = plan.mesh.ep, plan.mesh
    if ep == 1:
        return
    if not shape.experts:
        raise UserError(f"the plan has ep={ep} but {shape.source} has no routed experts; re-plan with --ep 1")
    if shape.experts % ep:
        raise UserError(f"the plan has ep={ep} but {shape.source} has {shape.experts} routed experts: Megatron's "
                        f"--expert-model-parallel-size must divide --num-experts; re-plan with an --ep that divides "
                        f"{shape.experts}")
    etp = expert_tp(plan, recipe)
    if plan.gpus % (etp * ep * m.pp):
        raise UserError(f"the plan has ep={ep}: Megatron's expert grid needs --expert-tensor-parallel-size x "
                        f"--expert-model-parallel-size x --pipeline-model-parallel-size = {etp} x {ep} x {m.pp} "
                        f"to divide the {plan.gpus} devices; re-plan with an --ep that divides dp x cp = {m.dp * m.cp}")


def _replace_recipe(recipe: ExecutionRecipe, **changes: object) -> ExecutionRecipe:
    import dataclasses
    return dataclasses.replace(recipe, **changes)  # type: ignore[arg-type]


def _schedule(a: Adapter) -> None:
    plan = a.plan
    v = plan.virtual_stages
    looped = "interleaved 1F1B (--num-virtual-stages-per-pipeline-rank)"
    if plan.schedule == "gpipe":
        a.gap("schedule", "gpipe", "Megatron has no GPipe schedule",
              [Option(nearest="1F1B" if v == 1 else looped,
                      plan=replace_plan(plan, schedule="1f1b" if v == 1 else "interleaved"))])
    elif plan.schedule == "zero-bubble":
        a.gap("schedule", "zero-bubble", "Megatron-LM has no zero-bubble pipeline schedule",
              [Option(nearest="1F1B" if v == 1 else looped,
                      plan=replace_plan(plan, schedule="1f1b" if v == 1 else "interleaved"))])
    elif plan.schedule == "interleaved" and v == 1:
        a.gap("schedule", "interleaved", "Megatron interleaves only with 2 or more virtual stages per rank",
              [Option(nearest="1F1B", plan=replace_plan(plan, schedule="1f1b"))])
    elif plan.schedule == "1f1b" and v > 1:
        a.gap("schedule", "1f1b", f"{v} virtual stages per rank run interleaved in Megatron",
              [Option(nearest=looped, plan=replace_plan(plan, schedule="interleaved"))])


def _recompute_flags(plan: Plan) -> list[str] | None:
    """Megatron's recompute flags for the plan's modes, or None if it has none for them."""
    per = [counts(c) for c in chunks(plan)]
    if any(o for _, _, _, o in per):  # per-op recompute: Megatron's granularities are modules
        return None
    if all(s == 0 and f == 0 for _, s, f, _ in per):
        return []
    if all(n == 0 and f == 0 for n, _, f, _ in per):
        return ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"]
    if all(n == 0 and s == 0 for n, s, _, _ in per):
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    # Megatron's block method: full on the first k blocks of every chunk, none on the rest
    k = None if any(s for _, s, _, _ in per) else block_method_k([[sum(c)] for c in per], [f for _, _, f, _ in per])
    if k is not None:
        return ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", str(k)]
    return None


def _recompute(a: Adapter) -> None:
    plan = a.plan
    per = [counts(c) for c in chunks(plan)]
    options = [Option(nearest="--recompute-granularity selective (every block)",
                      plan=replace_plan(plan, recompute=("selective",) * plan.num_layers)),
               Option(nearest="--recompute-granularity full --recompute-method uniform (every block)",
                      plan=replace_plan(plan, recompute=("full",) * plan.num_layers)),
               Option(nearest="no recompute", plan=replace_plan(plan, recompute=("none",) * plan.num_layers))]
    for k in sorted({f for _, _, f, _ in per} | {s + f + o for _, s, f, o in per}):
        if 0 < k < max(map(sum, per)):
            new = [["full"] * min(k, sum(c)) + ["none"] * (sum(c) - min(k, sum(c))) for c in per]
            options.append(Option(nearest=f"--recompute-granularity full --recompute-method block "
                                          f"--recompute-num-layers {k} (the first {k} blocks of every chunk)",
                                  plan=with_chunks(plan, new)))
    a.gap("recompute", describe_recompute(plan), "Megatron recomputes one granularity, in the same number of blocks "
          "of every pipeline chunk, and has no per-op recompute (its selective granularity recomputes "
          "whole modules)" if "op" in plan.recompute else "Megatron recomputes one granularity, in the same "
          "number of blocks of every pipeline chunk", options)


def _zero_flags(plan: Plan, shape: Shape, recipe: ExecutionRecipe) -> list[str]:
    """ZeRO stage and offload: the distributed optimizer (ZeRO-1), torch FSDP2 (ZeRO-2/3 where
    Megatron allows it: no pipeline, untied head, no fp16) or Megatron-FSDP otherwise."""
    zero, dp = plan.zero_stage, plan.mesh.dp
    out: list[str] = []
    if zero == 1:
        out.append("--use-distributed-optimizer")
    elif zero in (2, 3):
        if _fsdp2_allowed(plan, shape):
            out += ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]
            if zero == 2:
                out.append("--torch-fsdp2-no-reshard-after-forward")
        else:
            out += ["--use-megatron-fsdp", "--use-distributed-optimizer", "--data-parallel-sharding-strategy",
                    "optim_grads" if zero == 2 else "optim_grads_params", "--ckpt-format", "fsdp_dtensor"]
    if plan.offload:
        out += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0", "--use-precision-aware-optimizer"]
    overlap = dp > 1 and _dp_overlap(plan, recipe) and "--use-torch-fsdp2" not in out
    if overlap:
        out.append("--overlap-grad-reduce")
        if zero >= 1:
            out.append("--overlap-param-gather")
    return out


def _dp_overlap(plan: Plan, recipe: ExecutionRecipe) -> bool:
    return dp_overlap(plan, recipe)


def _fsdp2_allowed(plan: Plan, shape: Shape) -> bool:
    return plan.mesh.pp == 1 and plan.mesh.ep == 1 and not shape.tied and plan.dtype != "fp16"


def _pipeline_flags(plan: Plan) -> list[str]:
    pp, v, layers = plan.mesh.pp, plan.virtual_stages, plan.stage_layers
    if pp == 1:
        return []
    out = ["--pipeline-model-parallel-size", str(pp)]
    if len(set(layers)) == 1:
        return out + (["--num-virtual-stages-per-pipeline-rank", str(v)] if v > 1 else [])
    middle = layers[1:-1]
    if v == 1 and len(set(middle)) <= 1 and (pp == 2 or middle[0] * (pp - 2) + layers[0] + layers[-1] == sum(layers)):
        return out + ["--decoder-first-pipeline-num-layers", str(layers[0]),
                      "--decoder-last-pipeline-num-layers", str(layers[-1])]
    stages = [("E," if i == 0 else "") + (f"t*{n}" if n else "") + (",L" if i == len(layers) - 1 else "")
              for i, n in enumerate(layers)]
    return out + ["--pipeline-model-parallel-layout", "|".join(stages)]


def _attention(recipe: ExecutionRecipe) -> str:
    if recipe.attention == Attention.UNFUSED:
        return "unfused"
    return "fused" if recipe.attention_kernel == "cudnn" else "flash"


def arguments(plan: Plan, shape: Shape, recipe: ExecutionRecipe) -> list[str]:
    """``pretrain_gpt.py``'s arguments for the (adapted) plan."""
    m = plan.mesh
    args = ["--num-layers", str(shape.layers), "--hidden-size", str(shape.hidden),
            "--num-attention-heads", str(shape.heads)]
    if shape.kv_heads != shape.heads and not (shape.block and shape.block.latent):  # MLA has no kv heads
        args += ["--group-query-attention", "--num-query-groups", str(shape.kv_heads)]
    args += ["--ffn-hidden-size", str(shape.ffn), "--seq-length", str(plan.seq_len),
             "--max-position-embeddings", str(shape.max_positions)]
    if shape.family in (Family.LLAMA, Family.MCORE):
        args += ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"]
    else:
        args += ["--position-embedding-type", "learned_absolute"]
    if not shape.tied:
        args.append("--untie-embeddings-and-output-weights")
    if shape.experts:
        args += ["--num-experts", str(shape.experts), "--moe-router-topk", str(shape.topk)]
    if shape.block is not None:
        args += shape.block.args
    args += ["--tensor-model-parallel-size", str(m.tp)]
    if m.tp > 1 and plan.sequence_parallel:
        args.append("--sequence-parallel")
    if m.ep > 1:
        args += ["--expert-model-parallel-size", str(m.ep)]
    if shape.experts:
        args += ["--expert-tensor-parallel-size", str(expert_tp(plan, recipe))]
    if m.ep > 1:  # the all-to-all dispatch autopar prices (Megatron's default gathers every token)
        args += ["--moe-token-dispatcher-type", "alltoall"]
    args += _pipeline_flags(plan)
    if m.cp > 1:
        args += ["--context-parallel-size", str(m.cp)]
    order = axis_order(plan)
    if Axis.DP in order and Axis.PP in order and order.index(Axis.DP) < order.index(Axis.PP):
        args.append("--use-tp-pp-dp-mapping")
    args += ["--micro-batch-size", str(plan.micro_batch_size), "--global-batch-size", str(plan.global_batch)]
    args += _recompute_flags(plan) or []
    args += _zero_flags(plan, shape, recipe)
    if recipe.tp_comm_overlap and m.tp > 1 and plan.sequence_parallel:
        args.append("--tp-comm-overlap")
    if not recipe.grad_accum_fusion and "--no-gradient-accumulation-fusion" not in args:
        args.append("--no-gradient-accumulation-fusion")
    if plan.dtype in ("bf16", "fp16"):
        args.append(f"--{plan.dtype}")
    args += ["--attention-backend", _attention(recipe)]
    return args


def render(plan: Plan, shape: Shape, recipe: ExecutionRecipe, where: Nodes, header: list[str]) -> tuple[str, str]:
    """(the launch script, the command that runs it)."""
    args = arguments(plan, shape, recipe)
    if shape.block is not None:
        header = [*header, *(f"NOTE: {n}" for n in shape.block.notes)]
    env = ["export CUDA_DEVICE_MAX_CONNECTIONS=1"] if (plan.mesh.tp > 1 or plan.mesh.cp > 1) and not any(
        f in args for f in ("--use-torch-fsdp2", "--use-megatron-fsdp")) else []
    lines = ["#!/usr/bin/env bash", *(f"# {h}" for h in header),
             f"# The plan was priced with a vocabulary of {shape.vocab}: add the tokenizer that has it, the data",
             "# (--data-path or --mock-data) and the schedule (--train-iters, --lr ...) after the script name,",
             "# or pass them to this script. Run it on every node with NODE_RANK and MASTER_ADDR set.",
             "set -euo pipefail", *env,
             f"torchrun --nnodes {where.count} --nproc-per-node {where.per_node} --node-rank \"${{NODE_RANK:-0}}\" "
             "--master-addr \"${MASTER_ADDR:-localhost}\" --master-port \"${MASTER_PORT:-6000}\" \\",
             f"    {SCRIPT} \\"]
    pairs = _group(args)
    lines += [f"    {' '.join(shlex.quote(t) for t in p)} \\" for p in pairs]
    lines.append('    "$@"')
    return "\n".join(lines) + "\n", "NODE_RANK=<this node> MASTER_ADDR=<node 0> bash <script>"


def _group(args: list[str]) -> list[list[str]]:
    """Flags with their values, one per line."""
    out: list[list[str]] = []
    for t in args:
        if t.startswith("--") or not out:
            out.append([t])
        else:
            out[-1].append(t)
    return out


# ---- reading a script back ---------------------------------------------------------------------------

_INT_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads", "--num-query-groups", "--ffn-hidden-size",
              "--seq-length", "--max-position-embeddings", "--num-experts", "--moe-router-topk",
              "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
              "--expert-model-parallel-size", "--expert-tensor-parallel-size",
              "--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage",
              "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--micro-batch-size",
              "--global-batch-size", "--recompute-num-layers")
_STR_FLAGS = ("--pipeline-model-parallel-layout", "--recompute-granularity", "--recompute-method",
              "--data-parallel-sharding-strategy", "--position-embedding-type", "--normalization",
              "--attention-backend", "--ckpt-format")
_BOOL_FLAGS = ("--sequence-parallel", "--use-distributed-optimizer", "--use-torch-fsdp2", "--use-megatron-fsdp",
               "--torch-fsdp2-no-reshard-after-forward", "--optimizer-cpu-offload", "--bf16", "--fp16",
               "--use-tp-pp-dp-mapping", "--group-query-attention", "--swiglu", "--disable-bias-linear",
               "--untie-embeddings-and-output-weights", "--overlap-grad-reduce", "--overlap-param-gather",
               "--tp-comm-overlap", "--no-gradient-accumulation-fusion", "--use-precision-aware-optimizer")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in _INT_FLAGS:
        p.add_argument(flag, type=int)
    for flag in _STR_FLAGS:
        p.add_argument(flag)
    p.add_argument("--recompute-modules", nargs="*")
    for flag in _BOOL_FLAGS:
        p.add_argument(flag, action="store_true")
    return p


def read_arguments(text: str) -> tuple[int, argparse.Namespace]:
    """(devices, the ``pretrain_gpt.py`` arguments autopar writes) of a launch script; other
    arguments are ignored."""
    gpus, tokens = launch_tokens(text)
    args, _ = _parser().parse_known_args(tokens)
    return gpus, args


def launch_tokens(text: str) -> tuple[int, list[str]]:
    """(devices, the arguments after the script name) of an exported launch script."""
    joined = text.replace("\\\n", " ")
    for line in joined.splitlines():
        if line.lstrip().startswith("torchrun ") and SCRIPT in line:
            tokens = shlex.split(line)
            at = tokens.index(SCRIPT)
            head = tokens[:at]
            devices = int(head[head.index("--nnodes") + 1]) * int(head[head.index("--nproc-per-node") + 1])
            return devices, [t for t in tokens[at + 1:] if t != "$@"]
    raise UserError(f"no `torchrun ... {SCRIPT}` line in the Megatron script")


def parse(text: str) -> Settings:
    """The plan settings a launch script states."""
    gpus, a = read_arguments(text)
    tp, pp, cp = a.tensor_model_parallel_size or 1, a.pipeline_model_parallel_size or 1, a.context_parallel_size or 1
    dp = gpus // (tp * pp * cp)
    layers = a.num_layers
    if a.pipeline_model_parallel_layout:
        stages = a.pipeline_model_parallel_layout.split("|")
        stage_layers = tuple(_layout_blocks(s) for s in stages)
        v = len(stages) // pp
    elif a.decoder_first_pipeline_num_layers is not None:
        first, last, v = a.decoder_first_pipeline_num_layers, a.decoder_last_pipeline_num_layers, 1
        middle = (layers - first - last) // (pp - 2) if pp > 2 else 0
        stage_layers = (first, *([middle] * (pp - 2)), last)
    else:
        v = a.num_virtual_stages_per_pipeline_rank or 1
        stage_layers = (layers // (pp * v),) * (pp * v)
    zero = 0
    if a.use_distributed_optimizer:
        zero = 1
    if a.use_torch_fsdp2:
        zero = 2 if a.torch_fsdp2_no_reshard_after_forward else 3
    if a.use_megatron_fsdp:
        zero = {"optim": 1, "optim_grads": 2, "optim_grads_params": 3}[a.data_parallel_sharding_strategy]
    return Settings(gpus=gpus, dp=dp, tp=tp, pp=pp, cp=cp, ep=a.expert_model_parallel_size or 1,
                    zero=zero if dp > 1 else 0, offload=a.optimizer_cpu_offload, micro_batch_size=a.micro_batch_size,
                    num_microbatches=derive_batch(dp, a.micro_batch_size, a.global_batch_size),
                    global_batch=a.global_batch_size,
                    schedule=None if pp == 1 else ("interleaved" if v > 1 else "1f1b"), virtual_stages=v,
                    sequence_parallel=a.sequence_parallel and tp > 1, stage_layers=stage_layers,
                    recompute=tuple(_recompute_read(a, n) for n in stage_layers),
                    dtype="bf16" if a.bf16 else "fp16" if a.fp16 else "fp32",
                    axis_order=_order_read(a.use_tp_pp_dp_mapping, dp, tp, pp, cp))


def _layout_blocks(stage: str) -> int:
    n = 0
    for part in stage.split(","):
        part = part.strip()
        if part.startswith("t"):
            n += int(part[2:]) if part.startswith("t*") else part.count("t")
    return n


def _recompute_read(a: argparse.Namespace, n: int) -> tuple[int, ...]:
    if a.recompute_granularity == "selective":
        return mode_counts(n, "selective")
    if a.recompute_granularity == "full":
        return mode_counts(n, "full", n if a.recompute_method == "uniform" else min(a.recompute_num_layers, n))
    return mode_counts(n)


def _order_read(tp_pp_dp: bool, dp: int, tp: int, pp: int, cp: int = 1) -> tuple[Axis, ...]:
    return Degrees(dp=dp, cp=cp, tp=tp, pp=pp).active(_MESH_ORDERS[1] if tp_pp_dp else _MESH_ORDERS[0])
