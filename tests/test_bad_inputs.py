"""The bad-input catalogue: every subcommand, every way in (model spec, hardware profile, plan
file, recipe, pins and sizes, output paths). Each case exits 2 with exactly one line on stderr,
``autopar: error: ...`` naming the fix, no traceback, and leaves no file behind.

No case starts torchrun or traces a large model: each is refused before that."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopar.cli import app
from autopar.plan import Mesh, Plan
from cost_models.strategy import Estimate

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
TINY = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16,tied=0"
JOB = ["--cluster", "cpu-local", "--gpus", "4", "--global-batch", "8"]
H100 = ["--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "8"]
PROFILE = json.loads((ROOT / "hardware_profiles" / "cpu-local.json").read_text())
BIG = "1" + "0" * 5000
"""A JSON integer over Python's 4,300-digit conversion limit."""
DEEP = "[" * 100_000 + "]" * 100_000
"""JSON nested deeper than the recursion limit."""


def good_plan() -> dict:
    """A valid plan of the gpt-tiny preset (4 blocks, 4 heads) on 4 CPU ranks."""
    plan = Plan(model="gpt-tiny", cluster="cpu-local", gpus=4, global_batch=8, seq_len=32, dtype="fp32",
                mesh=Mesh(dp=2, pp=2), micro_batch_size=2, num_microbatches=2, stage_layers=(2, 2),
                recompute=("none",) * 4)
    return json.loads(plan.to_json())


def plan_with(**change) -> str:
    """The good plan with top-level fields replaced (``mesh__tp=3`` edits a nested one)."""
    data = good_plan()
    for key, value in change.items():
        *outer, last = key.split("__")
        target = data
        for name in outer:
            target = target[name]
        if value is DELETE:
            del target[last]
        else:
            target[last] = value
    return json.dumps(data)


DELETE = object()


def estimate_with(**change) -> dict:
    """An estimate of all zeros (its fields from the dataclasses) with ``change``."""
    def zeros(cls) -> dict:
        hints = typing.get_type_hints(cls)
        return {f.name: zeros(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else
                False if hints[f.name] is bool else 0.0
                for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
    return {**zeros(Estimate), **change}


def profile_with(**change) -> str:
    data = dict(PROFILE)
    for key, value in change.items():
        *outer, last = key.split("__")
        target = data
        for name in outer:
            target[name] = dict(target[name])
            target = target[name]
        if value is DELETE:
            del target[last]
        else:
            target[last] = value
    return json.dumps(data)


CASES: list = []


def case(name: str, *args: str, files: dict[str, str | bytes] | None = None, fragment: str = "") -> None:
    """One bad input: ``args`` of the command line, ``{tmp}`` standing for the test's folder,
    ``files`` written there first; ``fragment``: a part of the one line."""
    CASES.append(pytest.param(list(args), files or {}, fragment, id=name))


# -- plan: model specs ------------------------------------------------------------------------
OUT = ["--out", "{tmp}/out/plan.json"]
case("plan-unknown-model", "plan", "--model", "gpt5", *JOB, fragment="unknown model")
case("plan-empty-model", "plan", "--model", "", *JOB, fragment="unknown model")
case("plan-spec-not-int", "plan", "--model", "gpt:layers=2,hidden=oops", *JOB, fragment="not an integer")
case("plan-spec-layers-1e8", "plan", "--model", "gpt:layers=100000000,hidden=64,heads=4,vocab=64,seq=8", *JOB,
     fragment="limit of 1,024")
case("plan-spec-ffn-negative", "plan", "--model", "llama:layers=2,hidden=64,heads=4,vocab=64,seq=8,ffn=-5", *JOB,
     fragment="model ffn")
case("plan-spec-kv-heads-negative", "plan", "--model", "llama:layers=2,hidden=64,heads=4,kv_heads=-2,vocab=64,seq=8",
     *JOB, fragment="kv_heads")
case("plan-spec-topk-negative", "plan", "--model", "moe:layers=2,hidden=64,heads=4,vocab=64,seq=8,experts=2,topk=-1",
     *JOB, fragment="topk")
case("plan-spec-duplicate-key", "plan", "--model", "gpt:layers=2,layers=3,hidden=64,heads=4,vocab=64,seq=8", *JOB,
     fragment="twice")
case("plan-spec-tied-5", "plan", "--model", "gpt:layers=2,hidden=64,heads=4,vocab=64,seq=8,tied=5", *JOB,
     fragment="0 or 1")
case("plan-spec-huge-int", "plan", "--model", f"gpt:layers={BIG},hidden=64,heads=4,vocab=64,seq=8", *JOB,
     fragment="not an integer")
case("plan-spec-zero-heads", "plan", "--model", "gpt:layers=2,hidden=64,heads=0,vocab=64,seq=8", *JOB,
     fragment="heads must be positive")
case("plan-spec-unknown-key", "plan", "--model", "gpt:layers=2,width=3", *JOB, fragment="malformed")
case("plan-spec-unknown-arch", "plan", "--model", "bert:layers=2", *JOB, fragment="unknown model architecture")
case("plan-spec-newline", "plan", "--model", "gpt5\nsecond line", *JOB, fragment="unknown model")
case("plan-missing-module-file", "plan", "--model", "{tmp}/nope.py:make", *JOB, fragment="does not exist")
case("plan-module-bad-factory", "plan", "--model", "tests/fixtures/nanogpt/make.py:not-a-name", *JOB,
     fragment="not a function name")
case("plan-hf-not-int", "plan", "--model", "hf:LlamaConfig:num_hidden_layers=abc", *JOB,
     fragment="num_hidden_layers")
case("plan-hf-layers-1e8", "plan", "--model", "hf:LlamaConfig:num_hidden_layers=100000000", *JOB,
     fragment="limit of 1,024")
case("plan-hf-no-class", "plan", "--model", "hf:", *JOB, fragment="names no config class")
case("plan-hf-unknown-class", "plan", "--model", "hf:NoSuchConfig", *JOB, fragment="not a transformers config")
case("plan-hf-seq-beyond-learned-positions", "plan", "--model", "hf:GPT2Config:seq=4096", *JOB,
     fragment="learns 1024 positions")
case("plan-hf-deep-literal", "plan", "--model", "hf:LlamaConfig:rms_norm_eps=" + "-" * 100_000 + "1", *JOB,
     fragment="rms_norm_eps")
# -- plan: sizes and pins ----------------------------------------------------------------------
case("plan-tp-0", "plan", "--model", TINY, *JOB, "--tp", "0", *OUT, fragment="--tp must be positive")
case("plan-pp-0", "plan", "--model", TINY, *JOB, "--pp", "0", *OUT, fragment="--pp must be positive")
case("plan-mbs-0", "plan", "--model", TINY, *JOB, "--mbs", "0", *OUT, fragment="--mbs must be positive")
case("plan-dp-0", "plan", "--model", TINY, *JOB, "--dp", "0", *OUT, fragment="--dp must be positive")
case("plan-tp-negative", "plan", "--model", TINY, *JOB, "--tp", "-2", fragment="--tp must be positive")
case("plan-tp-huge", "plan", "--model", TINY, *JOB, "--tp", str(10**30), fragment="--tp")
case("plan-gpus-0", "plan", "--model", TINY, "--cluster", "cpu-local", "--gpus", "0", "--global-batch", "8",
     fragment="--gpus must be positive")
case("plan-gpus-negative", "plan", "--model", TINY, "--cluster", "cpu-local", "--gpus", "-8", "--global-batch", "8",
     fragment="--gpus must be positive")
case("plan-gpus-1e12", "plan", "--model", TINY, "--cluster", "dgx-h100", "--gpus", str(10**12), "--global-batch",
     "8", *OUT, fragment="limit of 1,048,576")
case("plan-gpus-not-whole-nodes", "plan", "--model", TINY, "--cluster", "dgx-h100", "--gpus", "12",
     "--global-batch", "24", fragment="not a multiple of the 8 devices per node")
case("plan-batch-0", "plan", "--model", TINY, "--cluster", "cpu-local", "--gpus", "4", "--global-batch", "0",
     fragment="--global-batch must be positive")
case("plan-batch-1e12", "plan", "--model", TINY, "--cluster", "cpu-local", "--gpus", "4", "--global-batch",
     str(10**12), fragment="--global-batch")
case("plan-seq-0", "plan", "--model", TINY, *JOB, "--seq-len", "0", fragment="--seq-len must be positive")
case("plan-seq-negative", "plan", "--model", TINY, *JOB, "--seq-len", "-16", fragment="--seq-len must be positive")
case("plan-seq-1e9", "plan", "--model", TINY, *JOB, "--seq-len", str(10**9), fragment="--seq-len")
case("plan-dtype-fp64", "plan", "--model", TINY, *JOB, "--dtype", "fp64", fragment="--dtype fp64")
case("plan-cp-2", "plan", "--model", TINY, *JOB, "--cp", "2", "--recipe", "deepspeed", fragment="no context parallelism")
case("plan-axis-order", "plan", "--model", TINY, *JOB, "--axis-order", "tp,dp", fragment="must list pp, dp, tp")
case("plan-time-limit-0", "plan", "--model", TINY, *JOB, "--time-limit", "0", fragment="--time-limit")
case("plan-time-limit-nan", "plan", "--model", TINY, *JOB, "--time-limit", "nan", fragment="--time-limit")
case("plan-time-limit-inf", "plan", "--model", TINY, *JOB, "--time-limit", "inf", fragment="--time-limit")
case("plan-recompute-unknown", "plan", "--model", TINY, *JOB, "--recompute", "sometimes", fragment="--recompute")
case("plan-schedule-unknown", "plan", "--model", TINY, *JOB, "--schedule", "pipedream", fragment="--schedule")
case("plan-zero-7", "plan", "--model", TINY, *JOB, "--zero", "7", fragment="--zero")
case("plan-vpp-0", "plan", "--model", TINY, *JOB, "--vpp", "0", fragment="--vpp")
case("plan-gpus-not-int", "plan", "--model", TINY, "--cluster", "cpu-local", "--gpus", "four", "--global-batch", "8",
     fragment="--gpus")
case("plan-unknown-option", "plan", "--bogus", fragment="No such option")
case("plan-missing-cluster", "plan", "--model", TINY, fragment="Missing option '--cluster'")
case("plan-recipe-unknown", "plan", "--model", TINY, *JOB, "--recipe", "megatron-3000", fragment="unknown recipe")
case("plan-recipe-not-utf8", "plan", "--model", TINY, *JOB, "--recipe", "{tmp}/r.json", files={"r.json": b"\xff\xfe"},
     fragment="not valid JSON")
case("plan-recipe-wrong-kind", "plan", "--model", TINY, *JOB, "--recipe", "{tmp}/r.json",
     files={"r.json": json.dumps({**json.loads((ROOT / "cost_models/recipes/autopar.json").read_text()),
                                  "tp_overlap": "yes"})}, fragment="tp_overlap must be true or false")
case("plan-recipe-base-unknown", "plan", "--model", TINY, *JOB, "--recipe", "{tmp}/r.json",
     files={"r.json": json.dumps({"base": "megatron-3000", "tp_overlap": True})}, fragment="unknown recipe")
case("plan-recipe-base-cycle", "plan", "--model", TINY, *JOB, "--recipe", "{tmp}/r.json",
     files={"r.json": json.dumps({"base": "r.json"})}, fragment="base chain")
case("plan-recipe-base-not-a-name", "plan", "--model", TINY, *JOB, "--recipe", "{tmp}/r.json",
     files={"r.json": json.dumps({"base": 3})}, fragment="base must be a recipe name or path")
case("plan-recipe-base-wrong-kind", "plan", "--model", TINY, *JOB, "--recipe", "{tmp}/r.json",
     files={"r.json": json.dumps({"base": "torchtitan", "kernels_per_block": -1})}, fragment="kernels_per_block")
case("plan-recipe-block-without-uniform", "plan", "--model", TINY, *JOB, "--recipe", "{tmp}/r.json",
     files={"r.json": json.dumps({"base": "megatron-core", "uniform_recompute": False})},
     fragment="recompute_block needs uniform_recompute")
# -- plan: output paths, checked before the search ----------------------------------------------
case("plan-out-missing-dir", "plan", "--model", TINY, *JOB, "--out", "{tmp}/no/such/dir/plan.json",
     fragment="does not exist; create it first")
case("plan-out-is-dir", "plan", "--model", TINY, *JOB, "--out", "{tmp}", fragment="is a directory")
case("plan-out-parent-is-file", "plan", "--model", TINY, *JOB, "--out", "{tmp}/f.txt/plan.json", files={"f.txt": "x"},
     fragment="is not a directory")
case("plan-out-unwritable", "plan", "--model", TINY, *JOB, "--out", "/proc/autopar-plan.json", fragment="cannot write")
# -- plan: hardware profiles -------------------------------------------------------------------
PROFILES = {
    "unknown-name": (None, "unknown cluster"),
    "list": ("[]", "is a JSON object"),
    "null": ("null", "is a JSON object"),
    "number": ("42", "is a JSON object"),
    "empty-file": ("", "not valid JSON"),
    "not-utf8": (b"{\"name\": \"\xff\"}", "not UTF-8"),
    "huge-int": (profile_with(memory_gib=0).replace('"memory_gib": 0', f'"memory_gib": {BIG}'), "4,300 digits"),
    "deep": (DEEP, "too deeply"),
    "nan": (profile_with(hbm_bw_gbps=float("nan")), "hbm_bw_gbps must be a number"),
    "infinite": (profile_with(memory_gib=float("inf")), "memory_gib must be a number"),
    "zero-bw": (profile_with(intra_node__bw_gbps=0), "intra_node.bw_gbps"),
    "negative-bw": (profile_with(inter_node__bw_gbps=-5.0), "inter_node.bw_gbps"),
    "string-number": (profile_with(memory_gib="80"), "memory_gib must be a number"),
    "bool-devices": (profile_with(devices_per_node=True), "devices_per_node"),
    "zero-devices": (profile_with(devices_per_node=0), "devices_per_node"),
    "no-peaks": (profile_with(peak_tflops={}), "peak_tflops"),
    "peak-string": (profile_with(peak_tflops={"fp32": "fast"}), "peak_tflops.fp32"),
    "tflops-in-flops": (profile_with(peak_tflops={"fp32": 4.3e10}), "peak_tflops.fp32"),
    "efficiency-2": (profile_with(matmul_efficiency=2.0), "matmul_efficiency"),
    "tier-not-object": (profile_with(intra_node="nvlink"), "intra_node must be a JSON object"),
    "tier-missing-bw": (profile_with(intra_node__bw_gbps=DELETE), "intra_node.bw_gbps"),
    "missing-memory": (profile_with(memory_gib=DELETE), "lacks memory_gib"),
    "unknown-key": (profile_with(turbo=True), "unknown keys"),
    "launcher": (profile_with(launcher="mpi"), "launcher"),
    "reserve-above-memory": (profile_with(reserve_gib=100.0), "reserve_gib must be below memory_gib"),
    "directory": ("DIR", "unknown cluster"),
}
for _name, (_text, _fragment) in PROFILES.items():
    if _text is None:
        case(f"profile-{_name}", "plan", "--model", TINY, "--cluster", "tpu-pod", "--gpus", "4", "--global-batch", "8",
             fragment=_fragment)
    elif _text == "DIR":
        case(f"profile-{_name}", "estimate", "--model", TINY, "--cluster", "{tmp}/d.json", "--gpus", "4",
             "--global-batch", "8", files={"d.json/x": "{}"}, fragment=_fragment)
    else:
        case(f"profile-{_name}", "plan", "--model", TINY, "--cluster", "{tmp}/p.json", "--gpus", "4",
             "--global-batch", "8", *OUT, files={"p.json": _text}, fragment=_fragment)
# -- estimate ------------------------------------------------------------------------------------
case("estimate-tp-0", "estimate", "--model", TINY, *JOB, "--tp", "0", fragment="--tp must be positive")
case("estimate-op-moe", "estimate", "--model", "moe:layers=2,hidden=64,heads=4,vocab=64,seq=8,experts=2,topk=1",
     *JOB, "--recompute", "op", fragment="priced for dense transformer blocks only")
case("estimate-op-cp", "estimate", "--model", "llama:layers=2,hidden=64,heads=4,vocab=64,seq=32", *JOB,
     "--cp", "2", "--recompute", "op", fragment="does not run with context parallelism")
case("plan-op-moe", "plan", "--model", "moe:layers=2,hidden=64,heads=4,vocab=64,seq=8,experts=2,topk=1",
     *JOB, "--recompute", "op", fragment="priced for dense transformer blocks only")
case("estimate-pp-0", "estimate", "--model", TINY, *JOB, "--pp", "0", fragment="--pp must be positive")
case("estimate-mbs-0", "estimate", "--model", TINY, *JOB, "--mbs", "0", fragment="--mbs must be positive")
case("estimate-dp-0", "estimate", "--model", TINY, *JOB, "--dp", "0", fragment="--dp must be positive")
case("estimate-vpp-0", "estimate", "--model", TINY, *JOB, "--vpp", "0", fragment="--vpp must be positive")
case("estimate-tp-3", "estimate", "--model", TINY, *JOB, "--tp", "3", fragment="not divisible")
case("estimate-tp-heads", "estimate", "--model", TINY, *JOB, "--tp", "4", fragment="does not divide the model's 2 heads")
case("estimate-dp-mismatch", "estimate", "--model", TINY, *JOB, "--dp", "3", fragment="dp x tp x pp")
case("estimate-pp-beyond-layers", "estimate", "--model", TINY, *JOB, "--pp", "4", fragment="exceeds the model's 2 layers")
case("estimate-batch-indivisible", "estimate", "--model", TINY, "--cluster", "cpu-local", "--gpus", "4",
     "--global-batch", "6", fragment="not divisible by dp x mbs")
case("estimate-vpp-without-interleaved", "estimate", "--model", TINY, *JOB, "--pp", "2", "--vpp", "2",
     fragment="--schedule interleaved")
case("estimate-fp8-a100", "estimate", "--model", TINY, "--cluster", "dgx-a100-80g", "--gpus", "8", "--global-batch",
     "8", "--fp8", fragment="no fp8 peak")
case("estimate-gpus-1e12", "estimate", "--model", TINY, "--cluster", "dgx-h100", "--gpus", str(10**12),
     "--global-batch", "8", fragment="--gpus")
case("estimate-zero-4", "estimate", "--model", TINY, *JOB, "--zero", "4", fragment="--zero")
case("estimate-recompute-unknown", "estimate", "--model", TINY, *JOB, "--recompute", "half", fragment="--recompute")
case("estimate-seq-0", "estimate", "--model", TINY, *JOB, "--seq-len", "0", fragment="--seq-len must be positive")
case("estimate-offload-pp", "estimate", "--model", TINY, *H100, "--offload", fragment="No such option")
# -- explain: plan files -------------------------------------------------------------------------
PLANS = {
    "missing": (None, "does not exist"),
    "directory": ("DIR", "is not a file"),
    "empty": ("", "not valid JSON"),
    "not-utf8": (b"\x80\x81{}", "not UTF-8"),
    "null": ("null", "a plan is a JSON object"),
    "list": ("[]", "a plan is a JSON object"),
    "number": ("42", "a plan is a JSON object"),
    "string": ('"plan"', "a plan is a JSON object"),
    "deep": (DEEP, "too deeply"),
    "huge-int": (plan_with(gpus=0).replace('"gpus": 0', f'"gpus": {BIG}'), "4,300 digits"),
    "version-2": (plan_with(version=2), "plan version 2"),
    "unknown-field": (plan_with(turbo=True), "unknown fields"),
    "missing-field": (plan_with(mesh=DELETE), "lacks the fields mesh"),
    "unknown-schedule": (plan_with(schedule="pipedream"), "plan schedule 'pipedream'"),
    "zero-7": (plan_with(zero_stage=7), "zero_stage must be 0, 1, 2 or 3"),
    "zero-string": (plan_with(zero_stage="3"), "zero_stage must be an integer"),
    "dtype-fp64": (plan_with(dtype="fp64"), "plan dtype"),
    "recompute-unknown": (plan_with(recompute=["none", "half", "none", "none"]), "recompute modes 'half'"),
    "recompute-not-list": (plan_with(recompute="none"), "must be a JSON array"),
    "axis-order": (plan_with(axis_order=["pp", "pp", "tp"]), "axis_order"),
    "gpus-bool": (plan_with(gpus=True), "gpus must be an integer"),
    "gpus-float": (plan_with(gpus=4.0), "gpus must be an integer"),
    "gpus-1e12": (plan_with(gpus=10**12), "limit"),
    "batch-negative": (plan_with(global_batch=-8), "global_batch must be positive"),
    "seq-0": (plan_with(seq_len=0), "seq_len must be positive"),
    "mesh-not-object": (plan_with(mesh=[2, 1, 2]), "plan mesh must be a JSON object"),
    "mesh-cp-2": (plan_with(mesh__cp=2, mesh__dp=1, global_batch=4, recipe="deepspeed"), "no context parallelism"),
    "mesh-ep-2": (plan_with(mesh__ep=2), "mesh.ep=2 must divide"),
    "mesh-tp-0": (plan_with(mesh__tp=0), "mesh.tp must be positive"),
    "mesh-gpus-mismatch": (plan_with(mesh__dp=4), "devices but gpus"),
    "stage-layers-sum": (plan_with(stage_layers=[3, 3], recompute=["none"] * 6), "place 6 blocks but 'gpt-tiny' has 4"),
    "stage-layers-zero": (plan_with(stage_layers=[0, 4]), "stage_layers entry must be positive"),
    "stage-layers-count": (plan_with(stage_layers=[4], recompute=["none"] * 4), "stage_layers entries"),
    "tp-not-dividing-heads": (plan_with(gpus=6, mesh__dp=1, mesh__tp=3, global_batch=4, micro_batch_size=2),
                              "does not divide the 4 heads"),
    "offload-zero-0": (plan_with(offload=True), "needs zero_stage >= 1"),
    "sp-tp-1": (plan_with(sequence_parallel=True), "needs mesh.tp > 1"),
    "sp-string": (plan_with(sequence_parallel="yes"), "sequence_parallel must be true or false"),
    "verified-unknown": (plan_with(verified=[["turbo", ""]]), "plan verified"),
    "verified-not-pairs": (plan_with(verified=["tp"]), "verified entry must be a JSON array"),
    "estimate-nan": (plan_with(estimate=estimate_with(step_time_s=float("nan"))),
                     "plan estimate.step_time_s must be a finite number"),
    "unknown-model": (plan_with(model="gpt5"), "unknown model"),
    "empty-model": (plan_with(model=""), "plan model must be a non-empty"),
    "hf-learned-positions": (plan_with(model="hf:GPT2Config:n_layer=4,n_head=4,n_embd=64,n_positions=16,seq=16",
                                       seq_len=32), "seq_len 32 exceeds the 16 positions"),
    "unknown-cluster": (plan_with(cluster="tpu-pod"), "unknown cluster"),
    "unknown-recipe": (plan_with(recipe="megatron-3000"), "unknown recipe"),
}
for _name, (_text, _fragment) in PLANS.items():
    path = "{tmp}/nope.json" if _text is None else "{tmp}/plan.json"
    files = {"plan.json/x": "{}"} if _text == "DIR" else {} if _text is None else {"plan.json": _text}
    case(f"explain-{_name}", "explain", path, files=files, fragment=_fragment)
case("explain-time-limit-0", "explain", "{tmp}/plan.json", "--time-limit", "0", files={"plan.json": json.dumps(good_plan())},
     fragment="--time-limit")
case("explain-bad-recipe", "explain", "{tmp}/plan.json", "--recipe", "{tmp}/r.json",
     files={"plan.json": json.dumps(good_plan()), "r.json": '{"name": "x", "attention": "sparse"}'}, fragment="malformed")
case("explain-top-k-0", "explain", "{tmp}/plan.json", "--top-k", "0", files={"plan.json": json.dumps(good_plan())},
     fragment="--top-k")
# -- run: refused before torchrun starts -------------------------------------------------------------
GOOD = {"plan.json": json.dumps(good_plan())}
case("run-missing-plan", "run", "{tmp}/nope.json", fragment="does not exist")
case("run-plan-list", "run", "{tmp}/plan.json", files={"plan.json": "[]"}, fragment="a plan is a JSON object")
case("run-plan-zero-7", "run", "{tmp}/plan.json", files={"plan.json": plan_with(zero_stage=7)}, fragment="zero_stage")
case("run-plan-not-utf8", "run", "{tmp}/plan.json", files={"plan.json": b"\xc3\x28"}, fragment="not UTF-8")
case("run-save-onto-file", "run", "{tmp}/plan.json", "--save", "{tmp}/ckpt", files={**GOOD, "ckpt": "x"},
     fragment="is an existing file")
case("run-save-missing-dir", "run", "{tmp}/plan.json", "--save", "{tmp}/no/such/ckpt", files=GOOD,
     fragment="does not exist; create it first")
case("run-save-into-other-files", "run", "{tmp}/plan.json", "--save", "{tmp}/stuff", files={**GOOD, "stuff/a.txt": "a"},
     fragment="not a checkpoint")
case("run-save-unwritable", "run", "{tmp}/plan.json", "--save", "/proc/autopar-ckpt", files=GOOD, fragment="cannot write")
case("run-resume-not-checkpoint", "run", "{tmp}/plan.json", "--resume", "{tmp}", files=GOOD, fragment="not a checkpoint")
case("run-steps-0", "run", "{tmp}/plan.json", "--steps", "0", files=GOOD, fragment="--steps")
case("run-plan-cp-pp", "run", "{tmp}/plan.json", files={"plan.json": plan_with(mesh__cp=2, mesh__dp=1, global_batch=4)},
     fragment="context parallelism (cp=2) with pipelining")
# -- run: checkpoints and code (README: What is code) ------------------------------------------------
BAD_SUM = json.dumps({"format": "autopar-checkpoint/1", "step": 2, "samples": 16, "model": "gpt-tiny",
                      "files": {".metadata": "0" * 64}})
case("run-resume-changed-byte", "run", "{tmp}/plan.json", "--resume", "{tmp}/ck",
     files={**GOOD, "ck/latest": "step-00000002\n", "ck/step-00000002/manifest.json": BAD_SUM,
            "ck/step-00000002/.metadata": "x"}, fragment=".metadata does not match its sha256")
case("run-resume-no-manifest", "run", "{tmp}/plan.json", "--resume", "{tmp}/raw", files={**GOOD, "raw/.metadata": "x"},
     fragment="pass --trust-code")
case("run-resume-no-complete", "run", "{tmp}/plan.json", "--resume", "{tmp}/ck",
     files={**GOOD, "ck/latest": "step-00000004\n"}, fragment="holds no complete checkpoint")
case("run-save-every-without-save", "run", "{tmp}/plan.json", "--save-every", "2", files=GOOD, fragment="add --save DIR")
case("run-save-every-negative", "run", "{tmp}/plan.json", "--save", "{tmp}/ck", "--save-every", "-1", files=GOOD,
     fragment="--save-every must be at least 0")
case("run-max-restarts-negative", "run", "{tmp}/plan.json", "--max-restarts", "-1", files=GOOD,
     fragment="--max-restarts must be at least 0")
CODE_PLAN = {"plan.json": plan_with(model="tests/fixtures/nanogpt/make.py:make")}
case("run-plan-names-code", "run", "{tmp}/plan.json", files=CODE_PLAN, fragment="pass --trust-code")
case("explain-plan-names-code", "explain", "{tmp}/plan.json", files=CODE_PLAN, fragment="pass --trust-code")
case("run-too-many-ranks", "run", "{tmp}/plan.json",
     files={"plan.json": plan_with(cluster="dgx-h100", gpus=128, mesh__dp=64, global_batch=256)},
     fragment="at most 64")
case("run-refused-feature", "run", "{tmp}/plan.json",
     files={"plan.json": plan_with(verified=[["pp", "rank 0: RuntimeError: boom"]])}, fragment="failed the pp check")
# -- inspect ----------------------------------------------------------------------------------------
case("inspect-seq-0", "inspect", "--model", TINY, "--seq-len", "0", fragment="--seq-len must be positive")
case("inspect-seq-negative", "inspect", "--model", TINY, "--seq-len", "-3", fragment="--seq-len must be positive")
case("inspect-seq-huge", "inspect", "--model", TINY, "--seq-len", str(10**30), fragment="--seq-len")
case("inspect-unknown-model", "inspect", "--model", "gpt5", fragment="unknown model")
case("inspect-hf-not-int", "inspect", "--model", "hf:LlamaConfig:num_hidden_layers=abc", fragment="num_hidden_layers")
case("inspect-hf-learned-positions", "inspect", "--model", "hf:GPT2Config:n_layer=2", "--seq-len", "2048",
     fragment="learns 1024 positions")
case("inspect-moe-topk", "inspect", "--model", "moe:layers=2,hidden=64,heads=4,vocab=64,seq=8,experts=2,topk=3",
     fragment="experts >= topk")
# -- demo -------------------------------------------------------------------------------------------
case("demo-gpus-0", "demo", "--gpus", "0", fragment="--gpus must be positive")
case("demo-gpus-negative", "demo", "--gpus", "-4", fragment="--gpus must be positive")
case("demo-gpus-1000", "demo", "--gpus", "1000", fragment="limit of 64")
case("demo-steps-1", "demo", "--steps", "1", fragment="--steps")
# -- verify -----------------------------------------------------------------------------------------
case("verify-unknown-model", "verify", "--model", "gpt5", fragment="unknown model")
case("verify-bad-spec", "verify", "--model", "gpt:layers=0,hidden=64,heads=4,vocab=64,seq=8",
     fragment="layers must be positive")
case("verify-missing-module", "verify", "--model", "{tmp}/nope.py:make", fragment="does not exist")
case("verify-moe", "verify", "--model", "moe:layers=2,hidden=64,heads=4,vocab=64,seq=8,experts=2,topk=1",
     fragment="checks HF, built-in and user models")
case("verify-encoder-decoder", "verify", "--model", "hf:T5Config:seq=16", fragment="encoder-decoder")
case("verify-hf-huge", "verify", "--model", "hf:LlamaConfig:hidden_size=10000000000", fragment="limit")
case("verify-missing-model", "verify", fragment="Missing option '--model'")


def _snapshot(root: Path) -> set[Path]:
    """The files under ``root`` but the cache's (it keeps what was valid, an HF spec's shape
    read before the bad part of the command was, whatever the command's fate)."""
    return {p for p in root.rglob("*") if (root / "cache") not in (p, *p.parents)}


@pytest.mark.parametrize("args, files, fragment", CASES)
def test_bad_input_is_one_line_exit_2_and_no_file(args, files, fragment, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path / "cache"))
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    (tmp_path / "out").mkdir()
    before = _snapshot(tmp_path)
    res = runner.invoke(app, [a.replace("{tmp}", str(tmp_path)) for a in args])
    lines = res.stderr.splitlines()
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert len(lines) == 1 and lines[0].startswith("autopar: error: "), res.stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert _snapshot(tmp_path) == before, "a file was left behind"


def test_the_catalogue_covers_every_subcommand():
    commands = {p.values[0][0] for p in CASES}
    assert commands == {"plan", "estimate", "explain", "inspect", "run", "demo", "verify"}
    assert len(CASES) >= 80


def test_search_refuses_a_space_it_cannot_enumerate_within_the_time_limit(monkeypatch):
    """The time limit (at least ``ENUMERATION_S``) bounds the enumeration too: here 1,260
    outer candidates and no time to list them."""
    import importlib

    from autopar.errors import UserError
    from autopar.spec import parse_model_spec
    from autopar.trace import profile_spec
    from cost_models import load_profile
    search_module = importlib.import_module("autopar.solve.search")  # the package exports search()
    monkeypatch.setattr(search_module, "ENUMERATION_S", 0.0)
    prof = profile_spec(parse_model_spec(TINY))
    with pytest.raises(UserError, match="more than can be enumerated in --time-limit"):
        search_module.search(prof, load_profile("dgx-h100"), 1024, 2**20, "bf16", time_limit_s=1e-9)
