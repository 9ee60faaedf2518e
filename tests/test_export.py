"""`autopar export`: every target's file reads back to the plan it was written for (or to the
nearest expressible plan, every difference a priced warning), and each framework's own config
code, where it is installed, accepts the exports and rejects broken ones."""

import copy
import dataclasses
import importlib.util
import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from autopar.cli import app
from autopar.errors import UserError
from autopar.export import Settings, Target, export_plan, read_back
from autopar.export.common import Pricer
from autopar.plan import Mesh, Plan
from autopar.profiles import profile_spec
from autopar.solve import Pins, search
from autopar.spec import parse_model_spec

TINY_HF = ("hf:LlamaConfig:num_hidden_layers=4,hidden_size=256,num_attention_heads=8,num_key_value_heads=2,"
           "intermediate_size=512,vocab_size=1024,max_position_embeddings=512")


def plan(**kw) -> Plan:
    base = dict(model="llama3-8b", cluster="dgx-a100-80g", gpus=8, global_batch=64, seq_len=4096,
                mesh=Mesh(dp=8), micro_batch_size=1, num_microbatches=8, stage_layers=(32,),
                recompute=("none",) * 32)
    base.update(kw)
    return Plan(**base)


PLANS = {
    # pure data parallelism: GPT-2 (tied head, learned positions), DDP
    "dp": plan(model="gpt2", seq_len=1024, micro_batch_size=4, num_microbatches=2, stage_layers=(12,),
               recompute=("none",) * 12),
    # FSDP ZeRO-3 with CPU offload, full recompute
    "fsdp3-offload": plan(gpus=16, mesh=Mesh(dp=16), global_batch=32, num_microbatches=2, zero_stage=3,
                          offload=True, recompute=("full",) * 32),
    # FSDP ZeRO-3 with per-op recompute (torchtitan's SelectiveAC; the others' nearest is a gap)
    "fsdp3-per-op": plan(gpus=8, mesh=Mesh(dp=8), global_batch=16, micro_batch_size=2, num_microbatches=1,
                         zero_stage=3, recompute=("op",) * 32),
    # tensor + sequence parallelism with ZeRO-1, selective recompute, GQA
    "tp-sp": plan(gpus=16, mesh=Mesh(dp=2, tp=8), global_batch=16, micro_batch_size=2, num_microbatches=4,
                  zero_stage=1, sequence_parallel=True, recompute=("selective",) * 32),
    # 1F1B with uneven stages and two fully recomputed blocks per stage, fp16
    "pp-1f1b-uneven": plan(model="gpt:layers=30,hidden=2048,heads=16,vocab=51200,seq=2048", seq_len=2048,
                           gpus=32, mesh=Mesh(dp=4, tp=2, pp=4), global_batch=128, num_microbatches=32,
                           zero_stage=1, dtype="fp16", stage_layers=(8, 7, 7, 8),
                           recompute=(("full",) * 2 + ("none",) * 6 + ("full",) * 2 + ("none",) * 5
                                      + ("full",) * 2 + ("none",) * 5 + ("full",) * 2 + ("none",) * 6)),
    # interleaved 1F1B, three virtual stages per rank
    "pp-interleaved": plan(model="megatron-7.5b", seq_len=2048, gpus=16, mesh=Mesh(dp=2, tp=2, pp=4),
                           global_batch=32, num_microbatches=16, zero_stage=1, schedule="interleaved",
                           virtual_stages=3, sequence_parallel=True, stage_layers=(3,) * 12,
                           recompute=("selective",) * 36),
    # zero-bubble with uneven virtual stages on a small GQA Llama, ZeRO-2
    "pp-zero-bubble": plan(model="llama:layers=10,hidden=1024,heads=16,kv_heads=4,ffn=2816,vocab=32000,seq=2048",
                           seq_len=2048, gpus=8, mesh=Mesh(dp=4, pp=2), global_batch=32, num_microbatches=8,
                           zero_stage=2, schedule="zero-bubble", virtual_stages=2, stage_layers=(3, 3, 2, 2),
                           recompute=("none",) * 10),
    # 3-D: TP x PP x DP with interleaving, mixed recompute
    "3d": plan(model="llama3-70b", seq_len=8192, gpus=256, mesh=Mesh(dp=8, tp=8, pp=4), global_batch=256,
               num_microbatches=32, zero_stage=1, schedule="interleaved", virtual_stages=5,
               sequence_parallel=True, stage_layers=(4,) * 20, recompute=("selective",) * 40 + ("full",) * 40),
    # context parallelism next to TP and ZeRO-3
    "cp": plan(gpus=16, mesh=Mesh(dp=4, tp=2, cp=2), seq_len=16384, global_batch=16, num_microbatches=4,
               zero_stage=3, recompute=("full",) * 32),
    # data parallelism outside the pipeline (Megatron's --use-tp-pp-dp-mapping), ZeRO-0
    "dp-outside-pp": plan(model="gpt2-medium", seq_len=1024, gpus=8, mesh=Mesh(dp=2, tp=2, pp=2),
                          axis_order=("dp", "pp", "tp"), global_batch=16, num_microbatches=8, stage_layers=(12, 12),
                          recompute=("none",) * 24),
    # an HF config class (tiny Llama), TP x PP x DP
    "hf": plan(model=TINY_HF, seq_len=512, gpus=8, mesh=Mesh(dp=2, tp=2, pp=2), global_batch=16,
               micro_batch_size=2, num_microbatches=4, zero_stage=1, sequence_parallel=True, stage_layers=(2, 2),
               recompute=("none",) * 4),
}
TARGETS = [t.value for t in Target]


@pytest.fixture(scope="module")
def pricer():
    return Pricer()


@pytest.fixture(scope="module")
def exports(pricer):
    """Every plan exported to every target (shared: pricing traces each model once)."""
    return {(name, t): export_plan(p, t, pricer=pricer) for name, p in PLANS.items() for t in TARGETS}


CAUSES = {"stage_layers": {"stage_layers", "schedule"}, "recompute": {"recompute", "schedule", "stage_layers"},
          "virtual_stages": {"schedule"}, "schedule": {"schedule"}, "zero": {"zero_stage"},
          "sequence_parallel": {"sequence_parallel"}, "axis_order": {"axis_order"}, "dtype": {"dtype"},
          "offload": {"offload", "zero_stage"}}
"""Which warnings may account for a difference in each field."""


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", list(PLANS))
def test_export_reads_back_to_the_plan_it_expresses(exports, name, target):
    result, original = exports[name, target], PLANS[name]
    read = read_back(target, result.content, result.plan.num_layers)
    assert read.mismatches(Settings.of(result.plan)) == {}
    # degrees are always stated, and always the plan's; so is the global batch, but in Accelerate's
    # file, which has no micro-batch (a warning says so)
    assert (read.gpus, read.dp, read.tp, read.pp) == (original.gpus, original.mesh.dp, original.mesh.tp,
                                                      original.mesh.pp)
    assert read.global_batch == (None if target == "accelerate" else original.global_batch)
    # every difference from the plan is named by a warning
    named = {s for g in result.gaps for s in g.setting.split(",")}
    for field in Settings.of(result.plan).mismatches(Settings.of(original)):
        assert CAUSES[field] & named, (field, named)
    assert (result.plan == original) == (not any(g.setting not in ("micro_batch_size", "micro_batch_size,num_microbatches")
                                                 for g in result.gaps))


# ---- the frameworks' own config code ------------------------------------------------------------------

class _Mpu:
    """The data-parallel size DeepSpeed's config asks a model-parallel unit for."""

    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


@pytest.mark.parametrize("name", list(PLANS))
def test_deepspeed_config_accepts_the_export_and_rejects_broken_batch_arithmetic(exports, name, monkeypatch):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'autopar[test]')")
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)  # no process group: the mpu gives dp
    result = exports[name, "deepspeed"]
    p, cfg = result.plan, json.loads(result.content)
    ds = DeepSpeedConfig(copy.deepcopy(cfg), mpu=_Mpu(p.mesh.dp))
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (
        p.global_batch, p.micro_batch_size, p.num_microbatches)
    assert ds.zero_optimization_stage == p.zero_stage
    assert (ds.zero_config.offload_optimizer is not None) == p.offload
    assert ds.tensor_parallel_config.autotp_size == (p.mesh.tp if p.mesh.tp > 1 else 0)
    assert ds.pipeline["stages"] == (p.mesh.pp if p.mesh.pp > 1 else "auto")
    assert p.mesh.pp == 1 or ds.zero_optimization_stage <= 1  # the pipeline engine asserts ZeRO <= 1
    broken = dict(cfg, train_batch_size=cfg["train_batch_size"] + cfg["train_micro_batch_size_per_gpu"])
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        DeepSpeedConfig(broken, mpu=_Mpu(p.mesh.dp))


def _transformer_config(text: str, **override):
    """megatron-core's TransformerConfig from an exported script, as Megatron-LM's
    ``core_transformer_config_from_args`` builds it from the same arguments."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from autopar.export import megatron
    _, a = megatron.read_arguments(text)
    pp = a.pipeline_model_parallel_size or 1
    layout = a.pipeline_model_parallel_layout
    vpp = len(layout.split("|")) // pp if layout else a.num_virtual_stages_per_pipeline_rank
    dtype = torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32
    kw = dict(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
              num_query_groups=a.num_query_groups if a.group_query_attention else None,
              ffn_hidden_size=a.ffn_hidden_size, tensor_model_parallel_size=a.tensor_model_parallel_size,
              pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
              pipeline_model_parallel_layout=layout,
              num_layers_in_first_pipeline_stage=a.decoder_first_pipeline_num_layers,
              num_layers_in_last_pipeline_stage=a.decoder_last_pipeline_num_layers,
              sequence_parallel=a.sequence_parallel, context_parallel_size=a.context_parallel_size or 1,
              recompute_granularity=a.recompute_granularity, recompute_method=a.recompute_method,
              recompute_num_layers=a.recompute_num_layers, bf16=a.bf16, fp16=a.fp16, params_dtype=dtype,
              pipeline_dtype=dtype, normalization=a.normalization or "LayerNorm", gated_linear_unit=a.swiglu,
              add_bias_linear=not a.disable_bias_linear, num_moe_experts=a.num_experts, moe_router_topk=a.moe_router_topk or 2,
              expert_model_parallel_size=a.expert_model_parallel_size or 1,
              expert_tensor_parallel_size=a.expert_tensor_parallel_size)
    if a.recompute_modules:
        kw["recompute_modules"] = a.recompute_modules
    return TransformerConfig(**{**kw, **override})


@pytest.mark.parametrize("name", list(PLANS))
def test_megatron_core_accepts_the_export_and_rejects_a_broken_layout(exports, name):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'autopar[test]')")
    result = exports[name, "megatron"]
    p = result.plan
    cfg = _transformer_config(result.content)
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.num_layers) == (
        p.mesh.tp, p.mesh.pp, p.num_layers)
    assert (cfg.virtual_pipeline_model_parallel_size or 1) == p.virtual_stages
    assert cfg.sequence_parallel == p.sequence_parallel
    if cfg.pipeline_model_parallel_layout is not None:  # megatron-core's own view of the stages
        layout = cfg.pipeline_model_parallel_layout.layout
        blocks = [sum(1 for t in layout[r][c] if t.name == "decoder") for c in range(p.virtual_stages)
                  for r in range(p.mesh.pp)]
        assert tuple(blocks) == p.stage_layers
    if cfg.pipeline_model_parallel_layout is not None or cfg.num_layers_in_first_pipeline_stage is not None:
        with pytest.raises((AssertionError, ValueError)):  # one block more than the stages hold
            _transformer_config(result.content, num_layers=p.num_layers + 1)
    else:  # an even split, which Megatron-LM's validate_args requires to be exact
        assert p.num_layers % (p.mesh.pp * p.virtual_stages) == 0
    with pytest.raises(ValueError, match="multiple of tensor_model_parallel_size"):
        _transformer_config(result.content, tensor_model_parallel_size=cfg.num_attention_heads + 1)


def _megatron_lm_parser():
    """Megatron-LM's own ``pretrain_gpt.py`` argument parser (``megatron.training``, in a Megatron-LM
    checkout on the path, not in the megatron-core wheel), or a skip."""
    import typing
    if importlib.util.find_spec("megatron.training") is None:
        pytest.skip("Megatron-LM (megatron.training) is not on the path")
    if not hasattr(typing, "override"):  # Megatron-LM main imports typing.override (Python 3.12)
        pytest.skip("Megatron-LM's main branch needs Python 3.12 (typing.override)")
    import argparse

    from megatron.training.arguments import add_megatron_arguments
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    add_megatron_arguments(parser)
    return parser


def test_megatron_lm_parses_every_exported_argument(exports):
    from autopar.export.megatron import launch_tokens
    parser = _megatron_lm_parser()
    for name in PLANS:
        _, tokens = launch_tokens(exports[name, "megatron"].content)
        args, unknown = parser.parse_known_args(tokens)
        assert unknown == [], name
        assert args.num_layers == exports[name, "megatron"].plan.num_layers
    assert parser.parse_known_args(["--tensor-model-paralel-size", "2"])[1]  # a misspelt flag is caught


@pytest.mark.parametrize("name", list(PLANS))
def test_torchtitan_config_accepts_the_export_and_rejects_a_wrong_world_size(exports, name):
    pytest.importorskip("torchtitan", reason="torchtitan is not installed")
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed.parallel_dims import ParallelDims

    from autopar.export import torchtitan
    result = exports[name, "torchtitan"]
    p, found = result.plan, torchtitan.literals(result.content)
    parallelism = ParallelismConfig(**found["ParallelismConfig"])
    training = TrainingConfig(**found["TrainingConfig"])
    dims = ParallelDims.from_config(parallelism, world_size=p.gpus)
    assert (dims.dp_replicate * dims.dp_shard, dims.tp, dims.pp, dims.cp) == (p.mesh.dp, p.mesh.tp, p.mesh.pp, p.mesh.cp)
    # torchtitan counts tokens: a micro-batch of b sequences is b x seq tokens (positions restart at
    # max_context_length), a step global batch x seq; the trainer derives the accumulation steps
    assert training.max_context_length == p.seq_len
    assert training.num_tokens_per_microbatch_per_dp_rank == p.micro_batch_size * p.seq_len
    assert training.num_tokens_per_train_step == p.global_batch * p.seq_len
    chunks = parallelism.num_pp_microbatches if p.mesh.pp > 1 else 1
    per_iteration = training.num_tokens_per_microbatch_per_dp_rank * chunks * p.mesh.dp
    assert training.num_tokens_per_train_step % per_iteration == 0  # the trainer's check
    assert chunks * training.num_tokens_per_train_step // per_iteration == p.num_microbatches
    with pytest.raises(AssertionError, match="Invalid parallel dims"):
        ParallelDims.from_config(parallelism, world_size=2 * p.gpus)


def test_torchtitan_loads_the_export_module(exports, tmp_path, monkeypatch):
    pytest.importorskip("torchtitan", reason="torchtitan is not installed")
    import importlib.util
    if importlib.util.find_spec("triton") is None:
        pytest.skip("torchtitan's model definitions import triton, which is not installed")
    import torch
    from torchtitan.config import ConfigManager
    result = exports["pp-zero-bubble", "torchtitan"]
    (tmp_path / "tt_zero_bubble.py").write_text(result.content)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = ConfigManager().parse_args(["--module", "tt_zero_bubble", "--config", "autopar_plan"])
    assert config.parallelism.pipeline_parallel_schedule == "InterleavedZeroBubble"
    with torch.device("meta"):
        model = config.model_spec.model.build()
    names = {n for n, _ in model.named_modules()}
    assert {f for part in config.parallelism.module_fqns_per_model_part for f in part} <= names


@pytest.mark.parametrize("name", list(PLANS))
def test_accelerate_launcher_accepts_the_export_and_rejects_broken_ones(exports, name, tmp_path, monkeypatch):
    pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install 'autopar[test]')")
    import types

    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin, MegatronLMPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env
    result = exports[name, "accelerate"]
    p, path = result.plan, tmp_path / "accelerate_config.yaml"
    path.write_text(result.content)
    kind = load_config_from_file(str(path)).distributed_type
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    _validate_launch_command(args)
    env = prepare_deepspeed_cmd_env(args)[1] if kind == DistributedType.DEEPSPEED else prepare_multi_gpu_env(args)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if kind == DistributedType.FSDP:
        fsdp, mesh = FullyShardedDataParallelPlugin(), ParallelismConfig()
        accelerator = types.SimpleNamespace(multi_device=True, num_processes=p.gpus, is_fsdp2=True,
                                            distributed_type=kind, is_main_process=False)
        mesh._validate_accelerator(accelerator)  # what Accelerator() checks: sizes multiply to the world
        assert (fsdp.fsdp_version, fsdp.reshard_after_forward) == (2, p.zero_stage == 3)
        assert (mesh.dp_shard_size, mesh.tp_size, mesh.cp_size) == (p.mesh.dp, p.mesh.tp, p.mesh.cp)
        monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", str(p.mesh.tp + 1))
        with pytest.raises(ValueError, match="total_size"):
            ParallelismConfig()._validate_accelerator(accelerator)
    elif kind == DistributedType.MEGATRON_LM:
        mp = MegatronLMPlugin()
        assert (mp.tp_degree, mp.pp_degree, mp.context_parallel_size, mp.num_micro_batches) == (
            p.mesh.tp, p.mesh.pp, p.mesh.cp, p.num_microbatches)
        assert mp.use_distributed_optimizer == (p.zero_stage == 1)
    elif kind == DistributedType.DEEPSPEED:
        ds = DeepSpeedPlugin()
        assert (ds.zero_stage, ds.gradient_accumulation_steps) == (p.zero_stage, p.num_microbatches)
    else:
        assert kind == DistributedType.MULTI_GPU and int(args.num_processes) == p.gpus
    broken = tmp_path / "broken.yaml"
    broken.write_text(result.content + "tensor_parallel_degree: 2\n")
    with pytest.raises(ValueError, match="unknown keys"):
        load_config_from_file(str(broken))


# ---- gaps, their prices, and the command line -------------------------------------------------------

def test_a_gap_names_the_nearest_setting_and_prices_it(exports):
    result = exports["pp-zero-bubble", "megatron"]
    (gap,) = [g for g in result.gaps if g.setting == "schedule"]
    assert gap.planned == "zero-bubble" and "interleaved" in gap.nearest
    assert result.plan.schedule == "interleaved" and result.plan.virtual_stages == 2
    assert gap.planned_cost.step_time_s and gap.nearest_cost.step_time_s and gap.nearest_cost.fits
    assert gap.nearest_cost.step_time_s != gap.planned_cost.step_time_s  # zero-bubble's bubble is smaller
    assert "--pipeline-model-parallel-layout 'E,t*3|t*3|t*2|t*2,L'" in result.content  # uneven stages kept
    line = gap.line(result.target)
    assert line.startswith("megatron cannot express schedule=zero-bubble") and "predicted step" in line


# llama3-70b as `autopar plan --cluster dgx-h100 --gpus 256 --global-batch 512 --seq-len 8192 --tp 4
# --pp 4 --schedule 1f1b --recompute none` chooses it: ZeRO 2, uneven stages, no recompute, that
# only just fit (78.5 GiB: SP's gathered GEMM inputs kept, as torch's SP keeps them)
SEVENTY = plan(model="llama3-70b", cluster="dgx-h100", gpus=256, global_batch=512, seq_len=8192,
               mesh=Mesh(dp=16, tp=4, pp=4), num_microbatches=32, zero_stage=2, schedule="1f1b",
               sequence_parallel=True, stage_layers=(15, 19, 23, 23), recompute=("none",) * 80)


def test_when_the_nearest_settings_do_not_fit_recompute_is_added_until_they_do(pricer):
    result = export_plan(SEVENTY, "deepspeed", pricer=pricer)
    # DeepSpeed pipelines take ZeRO 0-1 only: the planned ZeRO 2 is the first gap
    assert [g.setting for g in result.gaps][:3] == ["zero_stage", "stage_layers", "sequence_parallel"]
    assert any(g.nearest_cost.fits is False for g in result.gaps)  # the case this test is about
    if any(g.nearest_cost.fits is False for g in result.gaps):
        assert result.gaps[-1].setting == "recompute" and "do not fit" in result.gaps[-1].reason
        assert set(result.plan.recompute) == {"full"}
    assert result.exported.fits and result.planned.fits
    assert json.loads(result.content)["pipeline"]["activation_checkpoint_interval"] == (
        1 if "full" in result.plan.recompute else 0)


def test_targets_refuse_what_has_no_nearest_setting():
    with pytest.raises(UserError, match="ep=2 but gpt2 has no routed experts; re-plan with --ep 1"):
        export_plan(dataclasses.replace(PLANS["dp"], mesh=Mesh(dp=PLANS["dp"].mesh.dp, ep=2)), "megatron")
    with pytest.raises(UserError, match="name the file like a Python module"):
        export_plan(PLANS["dp"], "torchtitan", "my-config.py")
    with pytest.raises(UserError, match="dp_shard or cp above 1"):  # Accelerate's TP runs under FSDP2
        export_plan(plan(mesh=Mesh(tp=8), num_microbatches=64, zero_stage=3), "accelerate")


runner = CliRunner()


def test_cli_export_writes_the_file_and_warns_on_stderr(tmp_path):
    path = tmp_path / "plan.json"
    PLANS["pp-zero-bubble"].save(path)
    out = tmp_path / "ds_config.json"
    res = runner.invoke(app, ["export", str(path), "--to", "deepspeed", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["pipeline"]["stages"] == 2
    assert "launch: deepspeed --num_nodes 1 --num_gpus 8" in res.stdout
    warnings = [line for line in res.stderr.splitlines() if line.startswith("autopar: warning: ")]
    assert warnings and all("deepspeed cannot express" in w for w in warnings[:-1])
    assert any("schedule=zero-bubble (v=2)" in w and "predicted step" in w for w in warnings)
    assert warnings[-1].startswith("autopar: warning: as exported: predicted step")


def test_cli_export_json_lists_the_warnings_and_stdout_carries_the_file(tmp_path):
    path = tmp_path / "plan.json"
    PLANS["tp-sp"].save(path)
    res = runner.invoke(app, ["export", str(path), "--to", "torchtitan", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["target"] == "torchtitan" and data["framework"].startswith("torchtitan main at ")
    assert {w["setting"] for w in data["warnings"]} == {"zero_stage", "recompute"}
    assert all(w["nearest_step_time_s"] and w["nearest_fits"] is not None for w in data["warnings"])
    assert len([line for line in res.stderr.splitlines() if line.startswith("autopar: warning:")]) == 3
    res = runner.invoke(app, ["export", str(path), "--to", "megatron"])
    assert res.exit_code == 0 and res.stdout.startswith("#!/usr/bin/env bash")
    assert "--tensor-model-parallel-size 8" in res.stdout and "autopar: launch:" in res.stderr


@pytest.mark.parametrize("args, fragment", [
    (["export", "missing.json", "--to", "megatron"], "does not exist"),
    (["export", "PLAN", "--to", "torchtitan", "--out", "bad-name.py"], "name the file like a Python module"),
])
def test_cli_export_bad_input_is_one_line_exit_2(tmp_path, args, fragment):
    path = tmp_path / "plan.json"
    PLANS["dp"].save(path)
    res = runner.invoke(app, [str(path) if a == "PLAN" else str(tmp_path / a) if a.endswith(".py") else a for a in args])
    assert res.exit_code == 2 and res.stderr.startswith("autopar: error: ") and fragment in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_cli_export_unknown_target_is_one_line_exit_2(tmp_path):
    res = subprocess.run([sys.executable, "-m", "autopar.cli", "export", "plan.json", "--to", "jax"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 2 and "'jax' is not one of" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_model_family_maps_to_each_builder(pricer):
    gpt2 = plan(model="hf:GPT2Config:n_layer=2,n_embd=64,n_head=4,vocab_size=100,n_positions=64", gpus=2,
                mesh=Mesh(dp=2), global_batch=4, seq_len=64, micro_batch_size=2, num_microbatches=1,
                stage_layers=(2,), recompute=("none",) * 2)
    megatron = export_plan(gpt2, "megatron", pricer=pricer)
    assert not megatron.gaps  # GPT-2's block is Megatron's GPT block: learned positions, LayerNorm, tied head
    assert "--position-embedding-type learned_absolute" in megatron.content
    assert "--untie-embeddings-and-output-weights" not in megatron.content and "--swiglu" not in megatron.content
    titan = export_plan(gpt2, "torchtitan", pricer=pricer)
    (gap,) = titan.gaps
    assert gap.setting == "model" and titan.plan.model.startswith("llama:layers=2,hidden=64,heads=4")
    assert "TIED = 2, 64, 4, 4, 256, 100, True" in titan.content.replace("LAYERS, DIM, HEADS, KV_HEADS, FFN, VOCAB, ", "")
    llama = export_plan(PLANS["tp-sp"], "megatron", pricer=pricer).content
    assert "--group-query-attention \\\n    --num-query-groups 8" in llama and "--swiglu" in llama


# ---- expert parallelism -------------------------------------------------------------------------------

MOE = "moe:layers=4,hidden=256,heads=8,kv_heads=2,ffn=512,vocab=1024,seq=512,experts=8,topk=2"


def moe_plan(**kw) -> Plan:
    """A tiny Mixtral-style plan: 8 devices as dp 4 x tp 2, ep 4 over the dp ranks."""
    base = dict(model=MOE, seq_len=512, mesh=Mesh(dp=4, tp=2, ep=4), global_batch=32, micro_batch_size=2,
                num_microbatches=4, zero_stage=1, sequence_parallel=True, stage_layers=(4,), recompute=("none",) * 4)
    return plan(**{**base, **kw})


@pytest.mark.parametrize("recipe, expert_tp, zero", [("megatron-core", 2, 3), ("autopar", 1, 1)])
def test_megatron_writes_expert_parallelism_and_reads_it_back(pricer, recipe, expert_tp, zero):
    from autopar.export import megatron
    p = moe_plan(recipe=recipe, zero_stage=zero)
    result = export_plan(p, "megatron", pricer=pricer)
    assert not result.gaps and result.plan == p
    _, a = megatron.read_arguments(result.content)
    # ep as planned; expert TP is tp where the recipe splits each expert's GEMMs over tp, else 1
    assert (a.num_experts, a.expert_model_parallel_size, a.expert_tensor_parallel_size) == (8, 4, expert_tp)
    assert "    --expert-model-parallel-size 4 \\\n    --expert-tensor-parallel-size " in result.content
    assert a.sequence_parallel and not a.use_torch_fsdp2  # Megatron-LM refuses torch FSDP2 with EP
    assert a.use_megatron_fsdp == (zero == 3)
    read = read_back("megatron", result.content, p.num_layers)
    assert read.ep == 4 and read.mismatches(Settings.of(p)) == {}
    assert read_back("megatron", result.content.replace("--expert-model-parallel-size 4", "--expert-model-parallel-size 2"),
                     p.num_layers).mismatches(Settings.of(p)) == {"ep": (2, 4)}


def test_megatron_writes_no_expert_parallelism_for_ep_1(pricer):
    from autopar.export import megatron
    p = moe_plan(mesh=Mesh(dp=4, tp=2))
    result = export_plan(p, "megatron", pricer=pricer)
    _, a = megatron.read_arguments(result.content)
    assert a.expert_model_parallel_size is None and a.num_experts == 8
    assert read_back("megatron", result.content, p.num_layers).ep == 1


def test_megatron_moe_under_tp_gets_sequence_parallelism_as_a_priced_gap(pricer):
    p = moe_plan(sequence_parallel=False)
    result = export_plan(p, "megatron", pricer=pricer)
    (gap,) = result.gaps
    assert gap.setting == "sequence_parallel" and gap.nearest == "--sequence-parallel" and gap.nearest_cost.step_time_s
    assert result.plan.sequence_parallel and "    --sequence-parallel \\\n" in result.content
    assert read_back("megatron", result.content, p.num_layers).mismatches(Settings.of(result.plan)) == {}


@pytest.mark.parametrize("changes, fragment", [
    (dict(model=MOE.replace("experts=8", "experts=6"), mesh=Mesh(dp=8, ep=4), micro_batch_size=1,
          sequence_parallel=False),
     "ep=4 but .* has 6 routed experts: Megatron's --expert-model-parallel-size must divide --num-experts; "
     "re-plan with an --ep that divides 6"),
    (dict(recipe="megatron-core", mesh=Mesh(dp=4, tp=2, ep=8)),  # expert TP 2 x ep 8 > 8 devices
     "expert grid needs .* = 2 x 8 x 1 to divide the 8 devices; re-plan with an --ep that divides dp x cp = 4"),
])
def test_megatron_refuses_an_ep_megatron_rejects_in_one_line(changes, fragment):
    with pytest.raises(UserError, match=fragment) as exc:
        export_plan(moe_plan(**changes), "megatron")
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("target", ["deepspeed", "accelerate"])
def test_other_targets_refuse_ep_naming_the_megatron_export(target):
    with pytest.raises(UserError, match=f"ep=4: the {target} export does not write expert parallelism; "
                                        "export it with --to megatron") as exc:
        export_plan(moe_plan(), target)
    assert "\n" not in str(exc.value)


QWEN3_MOE = ("hf:Qwen3MoeConfig:hidden_size=256,num_hidden_layers=4,num_attention_heads=8,num_key_value_heads=2,"
             "head_dim=64,moe_intermediate_size=128,num_experts=8,num_experts_per_tok=2,norm_topk_prob=True,"
             "vocab_size=1024,max_position_embeddings=512")
"""A tiny Qwen3-MoE as torchtitan's Qwen3 MoE decoder builds it (every block sparse, top-k renormalised)."""


def titan_moe(**kw) -> Plan:
    """8 devices as FSDP over dp 8, ep 4 regrouping them (tp 1: torchtitan's ep and autopar's are the same ranks)."""
    return moe_plan(**{**dict(mesh=Mesh(dp=8, ep=4), sequence_parallel=False, micro_batch_size=1, zero_stage=3), **kw})


def test_torchtitan_writes_a_qwen3_moe_and_its_expert_parallelism(pricer):
    from autopar.export import torchtitan
    p = titan_moe(model=QWEN3_MOE)
    result = export_plan(p, "torchtitan", pricer=pricer)
    assert not result.gaps and result.plan == p
    found = torchtitan.literals(result.content)
    assert found["ParallelismConfig"]["expert_parallel_degree"] == 4
    assert {k: found["constants"][k] for k in ("EXPERTS", "TOP_K", "EXPERT_FFN", "HEAD_DIM", "LAYERS")} == {
        "EXPERTS": 8, "TOP_K": 2, "EXPERT_FFN": 128, "HEAD_DIM": 64, "LAYERS": 4}
    read = read_back("torchtitan", result.content, p.num_layers)
    assert read.ep == 4 and read.mismatches(Settings.of(p)) == {}
    assert read_back("torchtitan", result.content.replace("expert_parallel_degree=4", "expert_parallel_degree=2"),
                     p.num_layers).mismatches(Settings.of(p)) == {"ep": (2, 4)}


def test_torchtitan_writes_another_moe_as_its_qwen3_moe_decoder_priced(pricer):
    # Mixtral-style experts (no q/k norm) become torchtitan's Qwen3 MoE decoder at the same shape, priced as an
    # hf:Qwen3MoeConfig; ZeRO 0 (DDP) cannot lend torchtitan's experts their ep ranks: FSDP's shard group can
    result = export_plan(titan_moe(zero_stage=0), "torchtitan", pricer=pricer)
    assert [g.setting for g in result.gaps] == ["model", "zero_stage"]
    twin = parse_model_spec(result.plan.model)
    assert twin.source == "Qwen3MoeConfig" and (twin.experts, twin.topk, twin.layers, twin.hidden) == (8, 2, 4, 256)
    assert "moe_intermediate_size=512" in result.plan.model and result.plan.zero_stage in (2, 3)
    assert result.exported.step_time_s >= result.planned.step_time_s > 0  # q/k norms cost a little
    assert "EXPERTS, TOP_K, EXPERT_FFN = 8, 2, 512" in result.content


def test_torchtitan_refuses_experts_under_tp_in_one_line():
    with pytest.raises(UserError, match="8 routed experts under tp=2: torchtitan's expert layers take their ranks "
                                        "from dp x cp x tp") as exc:
        export_plan(moe_plan(), "torchtitan")
    assert "\n" not in str(exc.value) and "--to megatron" in str(exc.value)


def _titan_dsv3() -> Plan:
    return _dsv3_plan(mesh=Mesh(dp=8, ep=4), sequence_parallel=False, recipe="torchtitan", zero_stage=3,
                      micro_batch_size=1)


def test_deepseek_v3_exports_to_torchtitan_as_itself(pricer):
    """torchtitan's DeepSeek-V3 (multi-latent attention, a shared expert, the sigmoid group-limited router,
    leading dense blocks) at the HF config's every width: no gap."""
    pytest.importorskip("transformers")
    from autopar.export import torchtitan
    p = _titan_dsv3()
    result = export_plan(p, "torchtitan", pricer=pricer)
    assert not result.gaps and result.plan == p
    for text in ("n_dense_layers=2", "q_lora_rank=32", "kv_lora_rank=16", "qk_rope_head_dim=8", "dense_hidden_dim=96",
                 "moe_hidden_dim=32", "num_experts=8", "num_shared_experts=1", "router_top_k=2",
                 "router_score_func='sigmoid'", "router_num_expert_groups=2", "router_num_limited_groups=1",
                 "router_route_scale=2.5", "router_route_norm=True", "ComplexRoPE.Config(dim=8, "):
        assert text in result.content, text
    assert torchtitan.literals(result.content)["ParallelismConfig"]["expert_parallel_degree"] == 4
    assert read_back("torchtitan", result.content, p.num_layers).mismatches(Settings.of(p)) == {}
    biased = dataclasses.replace(p, model=p.model.replace("vocab_size=128", "vocab_size=128,attention_bias=True"))
    with pytest.raises(UserError, match="the torchtitan export writes DeepSeek-V3 with plain RoPE or YaRN without a "
                                        "cos/sin factor, no attention biases"):
        export_plan(biased, "torchtitan")
    yarn = dataclasses.replace(p, model=p.model.replace("vocab_size=128", f"vocab_size=128,{YARN}"))
    assert "scaling='yarn', rope_factor=4.0" in export_plan(yarn, "torchtitan", pricer=pricer).content
    with pytest.raises(UserError, match="YaRN without a cos/sin factor"):  # HF scales cos/sin without mscale
        export_plan(dataclasses.replace(yarn, model=yarn.model.replace("'mscale':1.0,", "")), "torchtitan")


YARN = ("rope_parameters={'rope_type':'yarn','rope_theta':10000.0,'factor':4.0,'original_max_position_embeddings':8,"
        "'beta_fast':32.0,'beta_slow':1.0,'mscale':1.0,'mscale_all_dim':1.0}")
"""DeepSeek-V3's YaRN (its factor 40 and 4K original context, scaled down to the tiny model's 32 tokens)."""


LLAMA3_ROPE = ("rope_parameters={'rope_type':'llama3','rope_theta':500000.0,'factor':8.0,'low_freq_factor':1.0,"
               "'high_freq_factor':4.0,'original_max_position_embeddings':64}")


@pytest.mark.parametrize("which", ["deepseek-v3-yarn", "llama-3-scaling", "gpt-oss-yarn"])
def test_torchtitan_builds_the_hf_models_rotary_frequencies(pricer, tmp_path, monkeypatch, which):
    pytest.importorskip("torchtitan", reason="torchtitan is not installed")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("torchtitan's model definitions import triton, which is not installed")
    import torch
    from torchtitan.config import ConfigManager

    from autopar.hf import make_config, transformers_module
    from autopar.spec import hf_option_values
    if which == "deepseek-v3-yarn":
        p = _titan_dsv3()
        p = dataclasses.replace(p, model=p.model.replace("vocab_size=128", f"vocab_size=128,{YARN}"))
    else:
        p = _titan_dense(f"{TINY_HF},{LLAMA3_ROPE}") if which == "llama-3-scaling" else titan_moe(model=GPT_OSS)
    result = export_plan(p, "torchtitan", pricer=pricer)
    assert not result.gaps
    module = f"tt_{which.replace('-', '_')}"  # a module name per case: imports are cached
    (tmp_path / f"{module}.py").write_text(result.content)
    monkeypatch.syspath_prepend(str(tmp_path))
    titan = ConfigManager().parse_args(["--module", module, "--config", "autopar_plan"]).model_spec.model.build()
    spec = parse_model_spec(p.model)
    hf = transformers_module().AutoModelForCausalLM.from_config(make_config(spec.source, hf_option_values(spec.options)))
    attention, rotary = titan.layers["0"].attention, hf.model.rotary_emb
    cache = attention.rope.cache[1]  # position 1: e^(i f) per frequency, or cos then sin (each halves repeated)
    half = cache.numel() // 4
    angles = torch.angle(cache) if cache.is_complex() else torch.atan2(cache[2 * half:3 * half], cache[:half])
    torch.testing.assert_close(angles, rotary.inv_freq)  # HF's rotary frequencies
    # HF scales cos and sin (both q and k) by YaRN's attention factor where torchtitan folds its square into the
    # softmax scale; DeepSeek's mscale_all_dim goes into both models' softmax scales
    scale = hf.model.layers[0].self_attn.scaling * rotary.attention_scaling ** 2
    if which == "llama-3-scaling":  # no YaRN factor: torchtitan's attention keeps its default 1 / sqrt(head width)
        assert rotary.attention_scaling == 1.0 and not hasattr(attention, "softmax_scale")
    else:
        assert attention.softmax_scale == pytest.approx(scale, rel=1e-12)


QWEN3 = ("hf:Qwen3Config:hidden_size=256,num_hidden_layers=4,num_attention_heads=8,num_key_value_heads=2,"
         "head_dim=64,intermediate_size=512,vocab_size=1024,max_position_embeddings=512")
MISTRAL = ("hf:MistralConfig:hidden_size=256,num_hidden_layers=4,num_attention_heads=8,num_key_value_heads=2,"
           "intermediate_size=512,vocab_size=1024,max_position_embeddings=512,sliding_window=128")


GPT_OSS = ("hf:GptOssConfig:hidden_size=256,num_hidden_layers=4,num_local_experts=8,num_experts_per_tok=2,"
           "intermediate_size=128,vocab_size=1024,seq=512")
"""A tiny GPT-OSS with the attention torchtitan's GPT-OSS fixes (64 heads of 64, 8 kv heads, 128-token windows)."""


def test_gpt_oss_exports_to_torchtitan_as_itself(pricer):
    p = titan_moe(model=GPT_OSS)
    result = export_plan(p, "torchtitan", pricer=pricer)
    assert not result.gaps and "_build_gptoss_layers(" in result.content
    for text in ("hidden_dim=128", "num_experts=8", "top_k=2", "scaling='yarn', rope_factor=32.0", "truncate=False",
                 "original_seq_len=4096", "theta=150000.0"):
        assert text in result.content, text
    assert read_back("torchtitan", result.content, p.num_layers).mismatches(Settings.of(p)) == {}
    with pytest.raises(UserError, match="GptOssConfig with num_attention_heads=32: torchtitan's GPT-OSS builds"):
        export_plan(titan_moe(model=GPT_OSS.replace("seq=512", "num_attention_heads=32,seq=512")), "torchtitan")


def _titan_dense(model: str) -> Plan:
    return plan(model=model, seq_len=512, global_batch=16, num_microbatches=2, zero_stage=3, stage_layers=(4,),
                recompute=("none",) * 4)


def test_torchtitan_writes_qwen3_and_llama_as_their_hf_configs_state(pricer):
    # Qwen3 is torchtitan's own Qwen3 decoder (q/k norms, a head width of its own): no twin
    q3 = export_plan(_titan_dense(QWEN3), "torchtitan", pricer=pricer)
    assert not q3.gaps and "_build_qwen3_layers(" in q3.content
    assert "HEAD_DIM, VOCAB, TIED = 4, 256, 8, 2, 64, 1024, False" in q3.content and "\nFFN = 512\n" in q3.content
    # an HF Llama keeps its RoPE (transformers' default: base 10000, no Llama 3 scaling) ...
    llama = export_plan(PLANS["hf"], "torchtitan", pricer=pricer).content
    rope = llama[llama.index("rope=ComplexRoPE.Config("):].split(")")[0]
    assert "theta=10000.0" in rope and "scaling" not in rope
    # ... autopar's own Llama presets are written with Llama 3.1's
    assert "theta=500000.0, scaling='llama', scaling_factor=8.0" in export_plan(PLANS["fsdp3-offload"], "torchtitan",
                                                                             pricer=pricer).content
    # Mistral's windows: torchtitan's Llama 3 attends causally over the sequence, priced as the windowless model
    mistral = export_plan(_titan_dense(MISTRAL), "torchtitan", pricer=pricer)
    assert [g.setting for g in mistral.gaps] == ["attention"] and mistral.plan.model.endswith(",sliding_window=None")
    assert mistral.exported.step_time_s != mistral.planned.step_time_s  # no mask, a causal kernel


@pytest.mark.parametrize("which", ["llama", "qwen3", "qwen3-moe", "deepseek-v3", "gpt-oss"])
def test_torchtitan_builds_the_exported_model_with_the_hf_models_parameters(pricer, tmp_path, monkeypatch, which):
    pytest.importorskip("torchtitan", reason="torchtitan is not installed")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("torchtitan's model definitions import triton, which is not installed")
    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims

    from autopar.hf import make_config, transformers_module
    from autopar.spec import hf_option_values
    p = {"llama": lambda: _titan_dense(TINY_HF), "qwen3": lambda: _titan_dense(QWEN3),
         "qwen3-moe": lambda: titan_moe(model=QWEN3_MOE), "deepseek-v3": _titan_dsv3,
         "gpt-oss": lambda: titan_moe(model=GPT_OSS)}[which]()
    module = f"tt_{which.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(export_plan(p, "torchtitan", pricer=pricer).content)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = ConfigManager().parse_args(["--module", module, "--config", "autopar_plan"])
    dims = ParallelDims.from_config(config.parallelism, world_size=p.gpus)
    assert (dims.dp_shard, dims.ep) == (8, p.mesh.ep)
    spec = parse_model_spec(p.model)
    with torch.device("meta"):
        model = config.model_spec.model.build()
        config_hf = make_config(spec.source, hf_option_values(spec.options))
        hf = transformers_module().AutoModelForCausalLM.from_config(config_hf)
    # the model torchtitan builds holds the HF model's every parameter, experts stacked [experts, ...]
    assert sum(t.numel() for t in model.parameters()) == sum(t.numel() for t in hf.parameters())
    if spec.experts:
        experts = {n: t.shape for n, t in model.named_parameters() if "routed_experts" in n and ".3." in n}
        assert experts and all(shape[0] == spec.experts for shape in experts.values())
        with pytest.raises(ValueError, match="expert_parallel_degree .3. must divide"):
            config.parallelism.expert_parallel_degree = 3
            ParallelDims.from_config(config.parallelism, world_size=p.gpus)


def test_megatron_core_accepts_the_expert_parallel_export(pricer):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'autopar[test]')")
    result = export_plan(moe_plan(recipe="megatron-core"), "megatron", pricer=pricer)
    cfg = _transformer_config(result.content)
    assert (cfg.num_moe_experts, cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size) == (8, 4, 2)
    with pytest.raises(ValueError, match="num_moe_experts must be non None"):  # megatron-core reads the ep
        _transformer_config(result.content, num_moe_experts=None)


def test_the_twin_of_a_mixture_of_experts_keeps_its_experts():
    from autopar.export.common import Family, Shape, llama_twin
    from autopar.spec import parse_model_spec
    shape = Shape(family=Family.OTHER, layers=4, hidden=256, heads=8, kv_heads=2, ffn=512, vocab=1024, seq=512,
                  max_positions=512, tied=False, experts=8, topk=2)
    spec = parse_model_spec(llama_twin(shape))
    assert (spec.experts, spec.topk) == (8, 2)
    assert parse_model_spec(llama_twin(dataclasses.replace(shape, experts=0, topk=0))).experts == 0


def test_an_hf_mixtral_exports_to_megatron_as_itself(pricer):
    pytest.importorskip("transformers")
    mixtral = ("hf:MixtralConfig:num_hidden_layers=2,hidden_size=128,num_attention_heads=4,num_key_value_heads=2,"
               "intermediate_size=256,vocab_size=512,max_position_embeddings=256,num_local_experts=4,"
               "num_experts_per_tok=2")
    p = moe_plan(model=mixtral, seq_len=256, mesh=Mesh(dp=8, ep=4), micro_batch_size=1, sequence_parallel=False,
                 stage_layers=(2,), recompute=("none",) * 2)
    result = export_plan(p, "megatron", pricer=pricer)
    assert not result.gaps  # Mixtral's block is Megatron's Llama-style block with routed experts
    assert "--num-experts 4" in result.content and "--swiglu" in result.content
    assert "--expert-model-parallel-size 4" in result.content


FRAMEWORK_RECIPES = [("torchtitan", "torchtitan"), ("torchtitan-asynctp", "torchtitan"),
                     ("megatron-core", "megatron"), ("megatron-core-te", "megatron"), ("megatron-2021", "megatron"),
                     ("deepspeed", "deepspeed")]
PLANNED_JOBS = [("llama3-8b", 8, 16, 8192), ("llama3-70b", 64, 512, 8192), ("llama3-70b", 256, 1024, 4096),
                ("llama:layers=6,hidden=512,heads=8,kv_heads=2,ffn=1536,vocab=4096,seq=2048", 16, 64, 2048)]


@pytest.mark.parametrize("recipe,target", FRAMEWORK_RECIPES)
def test_a_plan_under_a_frameworks_recipe_exports_to_it_without_a_layout_gap(pricer, recipe, target):
    """Under a framework's recipe the planner searches only what that framework's program runs
    (``ExecutionRecipe.schedules``, ``zero_stages``, ``sequence_parallel``, ``recompute_modes``
    with ``uniform_recompute``, ``uniform_stages``, ``axis_orders``), so the plan exports to it
    as planned: no setting replaced by a nearest one, whatever the job."""
    from autopar.workflow import make_plan, read_job

    gaps = []
    for model, gpus, batch, seq in PLANNED_JOBS:
        job = read_job(model, "dgx-h100", gpus, batch, seq, "bf16", recipe)
        planned, _ = make_plan(job, verify=False)
        out = export_plan(planned, target, pricer=pricer)
        gaps += [f"{model} on {gpus}: {g.setting}={g.planned}" for g in out.gaps if g.setting != "model"]
    assert gaps == []


def test_under_deepspeed_the_blocks_are_placed_as_its_pipeline_engine_places_them(pricer):
    """DeepSpeed's PipelineModule splits the blocks evenly (``partition_method="uniform"``, what
    the export writes): under its recipe the search places them so, where the free optimum
    (Turing-530B on 2,240 A100: pp 28, 2 to 5 blocks a stage) would not, and the plan exports
    with no gap at a step no faster than the free one's."""
    from autopar.workflow import make_plan, read_job
    from cost_models.pipeline import partition_uniform

    job = read_job("megatron-529.6b", "dgx-a100-80g", 2240, 1920, None, "bf16", "deepspeed")
    planned, sol = make_plan(job, verify=False)
    free = search(profile_spec(job.spec), job.hw, 2240, 1920, "bf16",
                  Pins(recipe=dataclasses.replace(job.recipe, uniform_stages=False)))
    assert planned.mesh.pp > 1 and planned.stage_layers == partition_uniform(planned.num_layers, planned.mesh.pp)
    assert len(set(free.strategy.stage_layers)) > 1  # the constraint binds
    assert sol.estimate.step_time_s >= free.estimate.step_time_s * (1 - 1e-9)
    assert export_plan(planned, "deepspeed", pricer=pricer).gaps == ()


def test_under_megatron_core_a_tight_job_recomputes_the_first_blocks_of_every_chunk(pricer):
    """Megatron-Core's ``--recompute-method block`` (full on the first k blocks of every model
    chunk, none on the rest: ``ExecutionRecipe.recompute_block``) is searched on the even split:
    Llama-3 70B at seq 8192 on 16 H100 must recompute, and under megatron-core-te the plan so
    mixed is faster than any with one mode on every block; the plan recomputes the first k
    blocks of every chunk, and the export says so with no gap, reads back to the plan, and
    Megatron-Core's ``TransformerConfig`` accepts its flags."""
    import re

    from autopar.export.common import chunks
    from autopar.workflow import make_plan, read_job
    from cost_models.pipeline import partition_uniform

    job = read_job("llama3-70b", "dgx-h100", 16, 32, 8192, "bf16", "megatron-core-te")
    planned, sol = make_plan(job, verify=False)
    one_mode = search(profile_spec(job.spec), job.hw, 16, 32, "bf16",
                      Pins(recipe=dataclasses.replace(job.recipe, recompute_block=False)))
    assert sol.estimate.step_time_s < one_mode.estimate.step_time_s * 0.99  # the method pays here
    assert set(planned.recompute) == {"none", "full"}
    pp = planned.mesh.pp
    ranks = [[c for i, c in enumerate(chunks(planned)) if i % pp == r] for r in range(pp)]
    assert tuple(sum(map(len, cs)) for cs in ranks) == partition_uniform(planned.num_layers, pp)
    out = export_plan(planned, "megatron", pricer=pricer)
    assert [g.setting for g in out.gaps if g.setting != "model"] == []
    found = re.search(r"--recompute-method block \\\s+--recompute-num-layers (\d+)", out.content)
    assert found, out.content
    k = int(found.group(1))
    assert 0 < k < max(map(len, chunks(planned)))
    for c in chunks(planned):  # the plan lays its blocks out as Megatron recomputes them
        assert c == ("full",) * min(k, len(c)) + ("none",) * (len(c) - min(k, len(c)))
    assert out.plan == planned
    assert read_back("megatron", out.content, planned.num_layers).mismatches(Settings.of(planned)) == {}
    if importlib.util.find_spec("megatron") is not None:
        cfg = _transformer_config(out.content)
        assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "block", k)


def test_pins_a_frameworks_program_cannot_run_are_refused_in_one_line():
    """A pinned setting the recipe's program does not have is refused before the search, in
    one line naming what it has."""
    job = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "16"]
    for recipe, pin, fragment in (("megatron-core", ["--schedule", "gpipe"], "runs 1f1b or interleaved"),
                                  ("torchtitan", ["--recompute", "selective"], "recomputes none or full or op"),
                                  ("torchtitan", ["--zero", "1"], "runs ZeRO 0, 2, 3"),
                                  ("deepspeed", ["--tp", "2", "--sp"], "no sequence parallelism"),
                                  ("megatron-core", ["--axis-order", "tp,dp,pp"], "lays its mesh out as")):
        res = CliRunner().invoke(app, [*job, "--recipe", recipe, *pin])
        assert res.exit_code == 2 and fragment in res.output, (recipe, pin, res.output)
        assert len(res.output.strip().splitlines()) == 1


# ---- DeepSeek: multi-latent attention, shared experts, leading dense blocks ---------------------------

def _mla_config(text: str, **override):
    """megatron-core's MLATransformerConfig from an exported DeepSeek script: the arguments
    ``core_transformer_config_from_args`` passes for multi-latent attention and its MoE."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from autopar.export import megatron
    _, a = megatron.read_arguments(text)
    tokens = megatron.launch_tokens(text)[1]

    def value(flag: str):
        return tokens[tokens.index(flag) + 1] if flag in tokens else None

    pattern = value("--moe-layer-freq")
    kw = dict(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
              ffn_hidden_size=a.ffn_hidden_size, normalization=a.normalization, gated_linear_unit=a.swiglu,
              add_bias_linear=not a.disable_bias_linear, tensor_model_parallel_size=a.tensor_model_parallel_size,
              sequence_parallel=a.sequence_parallel, bf16=a.bf16, multi_latent_attention="--multi-latent-attention" in tokens,
              qk_layernorm="--qk-layernorm" in tokens,
              q_lora_rank=int(value("--q-lora-rank")) if value("--q-lora-rank") else None,
              kv_lora_rank=int(value("--kv-lora-rank")), qk_head_dim=int(value("--qk-head-dim")),
              qk_pos_emb_head_dim=int(value("--qk-pos-emb-head-dim")), v_head_dim=int(value("--v-head-dim")),
              rope_type=value("--rope-type"), rotary_base=float(value("--rotary-base")),
              layernorm_epsilon=float(value("--norm-epsilon")), num_moe_experts=a.num_experts,
              moe_router_topk=a.moe_router_topk,
              moe_layer_freq=eval(pattern, {"__builtins__": {}}) if pattern else 1,  # Megatron-LM evaluates it so
              moe_ffn_hidden_size=int(value("--moe-ffn-hidden-size")),
              moe_shared_expert_intermediate_size=int(value("--moe-shared-expert-intermediate-size") or 0) or None,
              moe_router_score_function=value("--moe-router-score-function"),
              moe_router_enable_expert_bias="--moe-router-enable-expert-bias" in tokens,
              moe_router_pre_softmax="--moe-router-pre-softmax" in tokens,
              moe_router_num_groups=int(value("--moe-router-num-groups")) if value("--moe-router-num-groups") else None,
              moe_router_group_topk=int(value("--moe-router-group-topk")) if value("--moe-router-group-topk") else None,
              moe_router_topk_scaling_factor=float(value("--moe-router-topk-scaling-factor") or 1.0),
              moe_router_dtype=value("--moe-router-dtype"),
              moe_token_dispatcher_type=value("--moe-token-dispatcher-type") or "allgather",
              expert_model_parallel_size=a.expert_model_parallel_size or 1,
              expert_tensor_parallel_size=a.expert_tensor_parallel_size)
    return MLATransformerConfig(**{**kw, **override})


def _dsv3_plan(**kw) -> Plan:
    from tests.test_trace_hf import DSV3_TINY
    base = dict(model=DSV3_TINY, cluster="dgx-h100", seq_len=32, gpus=8, mesh=Mesh(dp=4, tp=2, ep=4),
                global_batch=32, micro_batch_size=2, num_microbatches=4, zero_stage=1, sequence_parallel=True,
                stage_layers=(4,), recompute=("none",) * 4, recipe="megatron-core")
    return plan(**{**base, **kw})


def test_deepseek_v3_exports_to_megatron_as_itself(pricer):
    """DeepSeek-V3's block is Megatron-Core's multi-latent attention with its sigmoid,
    group-limited, bias-balanced router and a shared expert, after its leading dense blocks
    (``--moe-layer-freq``): no model gap, and megatron-core builds the config it states."""
    pytest.importorskip("transformers")
    p = _dsv3_plan()
    result = export_plan(p, "megatron", pricer=pricer)
    assert not result.gaps and result.plan == p
    text = result.content
    for flags in ("--multi-latent-attention", "--qk-layernorm", "--q-lora-rank 32", "--kv-lora-rank 16",
                  "--qk-head-dim 16", "--qk-pos-emb-head-dim 8", "--v-head-dim 16", "--rope-type rope",
                  "--moe-layer-freq '([0]*2+[1]*2)'", "--ffn-hidden-size 96", "--moe-ffn-hidden-size 32",
                  "--moe-shared-expert-intermediate-size 32", "--moe-router-score-function sigmoid",
                  "--moe-router-enable-expert-bias", "--moe-router-num-groups 2", "--moe-router-group-topk 1",
                  "--moe-router-topk-scaling-factor 2.5", "--num-experts 8", "--moe-router-topk 2",
                  "--expert-model-parallel-size 4", "--moe-token-dispatcher-type alltoall"):
        assert f"    {flags} \\\n" in text, flags
    assert "--group-query-attention" not in text  # multi-latent attention has no kv heads to group
    assert "# NOTE: DeepSeek-V3's multi-token prediction" in text
    assert read_back("megatron", text, p.num_layers).mismatches(Settings.of(p)) == {}
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'autopar[test]')")
    cfg = _mla_config(text)
    assert cfg.moe_layer_freq == [0, 0, 1, 1] and cfg.q_lora_rank == 32 and cfg.moe_router_enable_expert_bias
    with pytest.raises(ValueError, match="Expert bias for aux-loss-free routing only supports '?sigmoid"):
        _mla_config(text, moe_router_score_function="softmax", moe_router_pre_softmax=False)


V2_LITE = ("hf:DeepseekV2Config:num_hidden_layers=27,first_k_dense_replace=1,hidden_size=2048,num_attention_heads=16,"
           "num_key_value_heads=16,intermediate_size=10944,moe_intermediate_size=1408,n_routed_experts=64,"
           "n_shared_experts=2,num_experts_per_tok=6,q_lora_rank=None,kv_lora_rank=512,qk_nope_head_dim=128,"
           "qk_rope_head_dim=64,v_head_dim=128,vocab_size=102400,max_position_embeddings=4096,"
           "rope_parameters={'rope_type':'yarn','rope_theta':10000.0,'factor':40.0,'mscale':0.707,"
           "'mscale_all_dim':0.707,'original_max_position_embeddings':4096,'beta_fast':32,'beta_slow':1}")
"""DeepSeek-V2-Lite's published config (deepseek-ai/DeepSeek-V2-Lite config.json)."""


def test_deepseek_v2_lite_writes_what_megatrons_own_script_does():
    """Megatron-LM's DeepSeek-V2-Lite script (examples/post_training/modelopt/conf/deepseek-ai/
    DeepSeek-V2-Lite.sh) sets these model flags; the export of the same HF config writes each."""
    pytest.importorskip("transformers")
    from autopar.export.hfblocks import read
    from autopar.spec import parse_model_spec
    def spec(extra: str = ""):
        return parse_model_spec(V2_LITE + extra)
    assert dict(spec().options)["rope_parameters"].startswith("{'rope_type':'yarn',")  # a dict in the spec
    block = read(spec(), dense_layers=1, seq=4096)
    args = " ".join(block.args)
    for flags in ("--multi-latent-attention", "--kv-lora-rank 512", "--v-head-dim 128", "--qk-head-dim 128",
                  "--qk-layernorm", "--qk-pos-emb-head-dim 64", "--moe-layer-freq ([0]*1+[1]*26)",
                  "--moe-ffn-hidden-size 1408", "--moe-router-pre-softmax", "--moe-shared-expert-intermediate-size 2816",
                  "--rotary-base 10000", "--rotary-scaling-factor 40", "--mscale 0.707", "--mscale-all-dim 0.707",
                  "--rope-type yarn", "--norm-epsilon 1e-06"):
        assert flags in args, flags
    assert "--q-lora-rank" not in args and "--moe-router-num-groups" not in args and block.latent
    assert block.notes == ()
    grouped = read(spec(",topk_method=group_limited_greedy,n_group=8,topk_group=3"), 1, 4096)
    assert "--moe-router-num-groups 8 --moe-router-group-topk 3" in " ".join(grouped.args)
    (note,) = grouped.notes
    assert "best score" in note and "top 2" in note


def test_leading_blocks_other_than_deepseeks_megatron_export_are_refused_in_one_line():
    from autopar.spec import parse_model_spec
    from autopar.workflow import export_lead_refusal
    pytest.importorskip("transformers")
    from tests.test_trace_hf import DSV3_TINY
    spec = parse_model_spec(DSV3_TINY)
    assert export_lead_refusal(spec, "megatron") is None
    assert export_lead_refusal(spec, "torchtitan") is None  # torchtitan's DeepSeek-V3 has them
    why = export_lead_refusal(spec, "deepspeed")
    assert "leads with 2 dense blocks" in why and "export it with --to megatron" in why


HF_BLOCKS = {
    "llama": "hf:LlamaConfig:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
             "intermediate_size=96,vocab_size=128,max_position_embeddings=64,attention_bias=True",
    "mixtral": "hf:MixtralConfig:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
               "intermediate_size=32,num_local_experts=8,num_experts_per_tok=2,vocab_size=128,max_position_embeddings=64",
    "qwen2": "hf:Qwen2Config:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
             "intermediate_size=96,vocab_size=128,max_position_embeddings=64,tie_word_embeddings=True",
    "qwen3": "hf:Qwen3Config:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,head_dim=32,"
             "intermediate_size=96,vocab_size=128,max_position_embeddings=64",
    "qwen2-moe": "hf:Qwen2MoeConfig:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
                 "intermediate_size=96,moe_intermediate_size=32,shared_expert_intermediate_size=48,num_experts=8,"
                 "num_experts_per_tok=2,vocab_size=128,max_position_embeddings=64",
    "qwen3-moe": "hf:Qwen3MoeConfig:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
                 "head_dim=32,intermediate_size=96,moe_intermediate_size=32,num_experts=8,num_experts_per_tok=2,"
                 "norm_topk_prob=True,vocab_size=128,max_position_embeddings=64",
    "glm4-moe": "hf:Glm4MoeConfig:num_hidden_layers=3,first_k_dense_replace=1,hidden_size=64,num_attention_heads=4,"
                "num_key_value_heads=2,head_dim=32,intermediate_size=96,moe_intermediate_size=32,n_routed_experts=8,"
                "n_shared_experts=1,num_experts_per_tok=2,routed_scaling_factor=2.5,attention_bias=True,"
                "vocab_size=128,max_position_embeddings=64",
}
"""Small configs of the HF classes ``autopar.export.hfblocks`` writes as Megatron flags."""


def test_megatron_core_builds_each_hf_block_with_the_hf_models_parameters(pricer, tmp_path):
    """Each HF family's export, built by megatron-core (its local layer specs, on meta), has
    exactly the HF model's parameters but what its notes state: every width, bias, norm, shared
    expert, gate and leading dense block the flags state is the HF model's."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'autopar[test]')")
    transformers = pytest.importorskip("transformers")
    import torch

    from autopar.hf import make_config
    from autopar.spec import hf_option_values, parse_model_spec
    scripts, expected = [], {}
    for name, model in HF_BLOCKS.items():
        spec = parse_model_spec(model)
        layers = spec.layers
        p = plan(model=model, cluster="dgx-h100", seq_len=64, gpus=2, mesh=Mesh(dp=2), global_batch=4,
                 micro_batch_size=2, num_microbatches=1, stage_layers=(layers,), recompute=("none",) * layers)
        result = export_plan(p, "megatron", pricer=pricer)
        assert not result.gaps, (name, [g.line(Target.MEGATRON) for g in result.gaps])
        (tmp_path / f"{name}.sh").write_text(result.content)
        scripts.append(str(tmp_path / f"{name}.sh"))
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(make_config(spec.source, hf_option_values(spec.options)))
        # the one difference a note states: Llama's attention_bias biases o_proj, Megatron's q, k and v only
        o_bias = sum(t.numel() for n, t in hf.named_parameters() if n.endswith("o_proj.bias"))
        assert bool(o_bias) == ("biases o_proj too" in result.content), name
        expected[name] = sum(t.numel() for t in hf.parameters()) - o_bias
    out = subprocess.run([sys.executable, "tests/megatron_params.py", str(tmp_path / "store"), *scripts],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert dict(zip(HF_BLOCKS, map(int, out.stdout.split()))) == expected


def test_an_hf_llama_31_writes_its_rope_base_and_scaling():
    """Llama 3.1's RoPE (base 500,000, the 'llama3' scaling of factor 8) is Megatron's
    --use-rope-scaling, whose other three constants are fixed at Llama 3.1's; a config that
    changes one is a note."""
    pytest.importorskip("transformers")
    from autopar.export.hfblocks import read
    from autopar.spec import parse_model_spec
    base = parse_model_spec(HF_BLOCKS["llama"].replace(",attention_bias=True", ""))

    def block(**rope):
        params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, **rope}
        return read(parse_model_spec(f"{base.name},rope_parameters={params!r}"), 0, 64)
    llama31 = block()
    assert "--rotary-base 500000 --use-rope-scaling --rope-scaling-factor 8" in " ".join(llama31.args)
    assert llama31.notes == () and "--kv-channels" not in llama31.args
    (note,) = block(high_freq_factor=2.0).notes
    assert "high_freq_factor" in note


def test_an_hf_sliding_window_is_written_as_megatrons_window_on_the_same_layers():
    """HF lets a query see the keys less than ``sliding_window`` behind it on the layers
    ``layer_types`` names (Qwen2: from ``max_window_layers`` on); the export writes Transformer
    Engine's left size (one less) and the SWA/full pattern, which megatron-core reads back onto
    the same layers (``is_layer_window_attention``). A window as long as the sequence is none."""
    pytest.importorskip("transformers")
    from autopar.export.hfblocks import read
    from autopar.hf import attention_windows, make_config
    from autopar.spec import hf_option_values, parse_model_spec
    spec = parse_model_spec(HF_BLOCKS["qwen2"].replace("num_hidden_layers=2", "num_hidden_layers=4")
                            + ",use_sliding_window=True,sliding_window=16,max_window_layers=1")
    config = make_config(spec.source, hf_option_values(spec.options))
    assert attention_windows(config) == [0, 16, 16, 16]
    block = read(spec, 0, 64)
    at = block.args.index("--window-size")
    assert block.args[at:at + 4] == ("--window-size", "(15,0)", "--window-attn-skip-freq", "[0,1,1,1]")
    assert not block.notes
    assert "--window-size" not in read(spec, 0, 16).args  # every window covers the sequence
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'autopar[test]')")
    from megatron.core.transformer.utils import is_layer_window_attention
    assert [is_layer_window_attention((15, 0), [0, 1, 1, 1], n) for n in range(1, 5)] == [False, True, True, True]
