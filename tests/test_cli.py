"""The command line: design.md's contracts, one-line errors with exit 2, README and CI in step."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopar.cli import app

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_plan_json_has_design_fields(tmp_path):
    out = tmp_path / "p.json"
    res = invoke("plan", "--model", "gpt3-175b", "--cluster", "dgx-a100-80g", "--gpus", "1024",
                 "--global-batch", "1536", "--json", "--out", str(out))
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert set(data) == {"plan", "estimate", "search"}
    for key in ["step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "fits", "memory", "time"]:
        assert key in data["estimate"]
    assert set(data["estimate"]["memory"]) >= {"peak_bytes", "params_bytes", "grads_bytes",
                                               "optimizer_bytes", "activations_bytes", "buffers_bytes"}
    assert set(data["estimate"]["time"]) >= {"compute_s", "tp_comm_s", "dp_comm_s", "pp_comm_s",
                                             "bubble_s", "optimizer_s"}
    assert set(data["search"]) >= {"time_s", "candidates", "optimal", "gap"}
    mesh = data["plan"]["mesh"]
    assert mesh["dp"] * mesh["tp"] * mesh["pp"] == 1024
    assert data["estimate"]["fits"] and sum(data["plan"]["stage_layers"]) == 96
    assert json.loads(out.read_text()) == data["plan"]


def test_estimate_json_matches_the_plan_estimate():
    args = ["--model", "megatron-7.5b", "--cluster", "dgx-a100-80g", "--gpus", "128",
            "--global-batch", "512", "--json"]
    plan = json.loads(invoke("plan", *args).stdout)["plan"]
    res = invoke("estimate", *args, "--tp", str(plan["mesh"]["tp"]), "--pp", str(plan["mesh"]["pp"]),
                 "--zero", str(plan["zero_stage"]), "--mbs", str(plan["micro_batch_size"]),
                 "--schedule", plan["schedule"], "--recompute", plan["recompute"][0],
                 "--sp" if plan["sequence_parallel"] else "--no-sp")
    assert res.exit_code == 0, res.output
    est = json.loads(res.stdout)
    if plan["mesh"]["pp"] == 1:  # estimate places layers evenly; the plan may not when pp > 1
        assert est["step_time_s"] == pytest.approx(plan["estimate"]["step_time_s"], rel=1e-12)


def test_inspect_json():
    res = invoke("inspect", "--model", "llama3-8b", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["params"] == 8030261248 and data["blocks"][0]["repeats"] == 32


@pytest.mark.parametrize("args, fragment", [
    (["plan", "--model", "gpt5", "--cluster", "dgx-a100-80g", "--gpus", "8", "--global-batch", "8"],
     "unknown model"),
    (["plan", "--model", "gpt:layers=2,hidden=oops", "--cluster", "dgx-a100-80g", "--gpus", "8",
      "--global-batch", "8"], "not an integer"),
    (["plan", "--model", "gpt2", "--cluster", "dgx-a100-80g", "--gpus", "12", "--global-batch", "24"],
     "not a multiple of the 8 devices per node"),
    (["plan", "--model", "gpt2", "--cluster", "tpu-pod", "--gpus", "8", "--global-batch", "8"],
     "unknown cluster"),
    (["plan", "--model", "gpt3-175b", "--cluster", "dgx-a100-80g", "--gpus", "8", "--global-batch", "8"],
     "does not fit"),
    (["estimate", "--model", "gpt2", "--cluster", "dgx-a100-80g", "--gpus", "8", "--global-batch", "8",
      "--tp", "3"], "not divisible"),
    (["run", "missing-plan.json"], "does not exist"),
    (["estimate", "--model", "gpt2", "--cluster", "dgx-a100-80g", "--gpus", "8", "--global-batch", "8",
      "--recipe", "megatron-3000"], "unknown recipe"),
    (["estimate", "--model", "gpt2", "--cluster", "dgx-a100-80g", "--gpus", "8", "--global-batch", "8",
      "--fp8"], "no fp8 peak"),
])
def test_bad_input_is_one_line_and_exit_2(args, fragment):
    res = invoke(*args)
    assert res.exit_code == 2, res.output
    assert fragment in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert "Traceback" not in res.output


def test_console_script_exit_code_and_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "autopar.cli", "plan", "--model", "nope", "--cluster",
                           "cpu-local", "--gpus", "4", "--global-batch", "4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("autopar: error: unknown model") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, fragment", [
    (["plan", "--bogus"], "No such option: --bogus"),
    (["plan", "--model", "gpt2"], "Missing option '--cluster'"),
    (["run", "plan.json", "--steps", "0"], "Invalid value for '--steps'"),
])
def test_usage_errors_are_one_line_and_exit_2(args, fragment):
    proc = subprocess.run([sys.executable, "-m", "autopar.cli", *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("autopar: error: ") and fragment in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


TINY = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16,tied=0"


@pytest.mark.slow
def test_plan_then_run_prints_one_loss_per_step(tmp_path, monkeypatch):
    """design.md: `autopar run PLAN --json` prints one global-batch loss and one time per step;
    the run's temporary directory is removed after success."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    plan_file = tmp_path / "plan.json"
    res = invoke("plan", "--model", TINY, "--cluster", "cpu-local", "--gpus", "2", "--global-batch", "4",
                 "--dtype", "fp32", "--tp", "2", "--out", str(plan_file))
    assert res.exit_code == 0, res.output
    res = invoke("run", str(plan_file), "--steps", "2", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert set(data) == {"losses", "step_times_s"}
    assert len(data["losses"]) == len(data["step_times_s"]) == 2
    # Uniform random tokens over 64 ids: the first loss is close to ln 64 = 4.16.
    assert abs(data["losses"][0] - 4.16) < 0.1 and all(t > 0 for t in data["step_times_s"])
    assert not list(tmp_path.glob("autopar-run-*"))


@pytest.mark.slow
def test_demo_plans_runs_and_compares():
    res = invoke("demo", "--steps", "2", "--gpus", "2")
    assert res.exit_code == 0, res.output
    assert "predicted step time" in res.stdout and "measured" in res.stdout
    # Byte-level text: the loss falls from the first step on (uniform tokens would not).
    losses = [float(x) for x in re.findall(r"step \d: loss ([\d.]+)", res.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0] - 0.1, losses


def test_offload_and_axis_order_pins_reach_the_plan():
    res = invoke("plan", "--model", "gpt:layers=4,hidden=128,heads=4,vocab=512,seq=64,tied=0", "--cluster",
                 "dgx-a100-80g", "--gpus", "16", "--global-batch", "64", "--axis-order", "tp,dp,pp", "--offload",
                 "--zero", "1", "--json")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)["plan"]
    assert plan["axis_order"] == ["tp", "dp", "pp"] and plan["offload"] is True and plan["zero_stage"] == 1
    bad = invoke("plan", "--model", "gpt2", "--cluster", "dgx-a100-80g", "--gpus", "16", "--global-batch", "64",
                 "--axis-order", "tp,dp")
    assert bad.exit_code == 2 and "must list pp, dp, tp" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_plan_table_counts_every_recompute_mode():
    """The plan table names each recompute mode its blocks run, per-op included (it once showed
    Llama-3 8B's "none x28" and dropped the other four blocks' "op")."""
    res = invoke("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "8",
                 "--seq-len", "8192")
    assert res.exit_code == 0, res.output
    plan = json.loads(invoke("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8",
                             "--global-batch", "8", "--seq-len", "8192", "--json").stdout)["plan"]
    shown = re.search(r"recompute\s*│\s*([^│]+?)\s*│", res.stdout).group(1)
    counts = {m: plan["recompute"].count(m) for m in set(plan["recompute"])}
    assert sum(counts.values()) == sum(plan["stage_layers"]) and len(counts) > 1, counts
    assert shown == ", ".join(f"{m} x{counts[m]}" for m in ("none", "selective", "full", "op") if m in counts), shown


def test_cli_surface_is_frozen():
    names = sorted(c.name or c.callback.__name__ for c in app.registered_commands)
    assert names == ["calibrate", "demo", "estimate", "explain", "export", "inspect", "launch", "plan", "profile",
                     "report", "run", "tokenize", "verify"]
    import typer
    group = typer.main.get_command(app)

    def options(name: str) -> list[str]:
        return sorted(o for p in group.commands[name].params for o in p.opts if o.startswith("--"))
    assert options("run") == ["--data", "--json", "--max-restarts", "--resume", "--save", "--save-every", "--steps",
                              "--trust-code"]
    assert options("launch") == ["--data", "--gpus-per-node", "--max-restarts", "--nodes", "--out", "--rdzv-endpoint",
                                 "--resume", "--save", "--save-every", "--steps", "--trust-code"]
    strategy = ["--cp", "--dp", "--ep", "--mbs", "--pp", "--recipe", "--recompute", "--schedule", "--sp", "--tp",
                "--vpp", "--zero"]
    job = ["--cluster", "--dtype", "--global-batch", "--gpus", "--json", "--model", "--seq-len"]
    assert options("estimate") == sorted(strategy + job + ["--fp8"])
    assert options("plan") == sorted(strategy + job + ["--axis-order", "--offload", "--out", "--price-per-gpu-hour",
                                                       "--time-limit", "--verify", "--what-if"])
    for name in ("calibrate", "explain", "export", "report"):  # every command that reads a plan file (README: What is code)
        assert "--trust-code" in options(name)


def test_plan_pins_vpp_refuses_cp_and_explain_lists_alternatives(tmp_path):
    model = "gpt:layers=8,hidden=1024,heads=16,vocab=32000,seq=1024"
    out = tmp_path / "plan.json"
    args = ["plan", "--model", model, "--cluster", "dgx-a100-80g", "--gpus", "16",
            "--global-batch", "64", "--json"]
    res = runner.invoke(app, args + ["--vpp", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["plan"]["virtual_stages"] == 2 and data["plan"]["schedule"] == "interleaved"
    assert len(data["plan"]["stage_layers"]) == 2 * data["plan"]["mesh"]["pp"]
    assert data["estimate"]["fits"] and data["search"]["optimal"]
    bad = runner.invoke(app, args + ["--cp", "2", "--recipe", "deepspeed"])  # a program without CP
    assert bad.exit_code == 2 and "no context parallelism" in bad.output and "--recipe autopar" in bad.output
    assert len(bad.output.strip().splitlines()) == 1
    res = runner.invoke(app, ["explain", str(out), "--top-k", "3", "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert len(info["alternatives"]) == 3
    assert info["alternatives"][0]["step_time_s"] <= info["step_time_s"] * (1 + 1e-9)
    dims = {d["name"]: d for d in info["dimensions"]}
    assert dims["virtual_stages"]["chosen"] == "2" and dims["tp"]["neighbours"]


def test_recipe_reaches_the_plan_and_changes_the_price(tmp_path):
    """The Plan records the recipe it was priced under; another recipe prices another program
    (Megatron-LM 2021 keeps the attention scores: more memory, a slower step), and explain
    re-prices the plan under the recipe it is given."""
    args = ["--model", "gpt:layers=8,hidden=1024,heads=16,vocab=32000,seq=2048", "--cluster", "dgx-a100-80g",
            "--gpus", "8", "--global-batch", "32", "--json"]
    fixed = ["--dp", "8", "--mbs", "1"]
    ours = json.loads(runner.invoke(app, ["estimate", *args, *fixed]).output)
    old = json.loads(runner.invoke(app, ["estimate", *args, *fixed, "--recipe", "megatron-2021"]).output)
    assert old["memory"]["activations_bytes"] > 2 * ours["memory"]["activations_bytes"]
    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", *args, "--recipe", "megatron-core", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["recipe"] == "megatron-core"
    bad = recipe_file = tmp_path / "bad.json"
    recipe_file.write_text('{"name": "x", "attention": "sparse"}')
    res = invoke("explain", str(out), "--recipe", str(bad))
    assert res.exit_code == 2 and "malformed" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert "torch==2.13.0" in ci
    assert ci in (ROOT / "README.md").read_text()


def test_run_streams_each_step_as_it_ends(tmp_path):
    """`autopar run` shows steps live (a bar on a terminal, plain lines otherwise): rank 0's
    report of each step reaches the launcher while the job runs, equal to the final result."""
    from autopar.plan import load_plan
    from autopar.runtime import run_plan
    out = tmp_path / "p.json"
    res = invoke("plan", "--model", "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16", "--cluster", "cpu-local",
                 "--gpus", "2", "--global-batch", "4", "--dtype", "fp32", "--out", str(out))
    assert res.exit_code == 0, res.output
    seen: list[tuple[int, float]] = []
    result = run_plan(load_plan(out), 3, on_step=lambda step, loss, s: seen.append((step, loss)))
    assert [s for s, _ in seen] == [0, 1, 2]
    assert all(abs(loss - want) < 1e-6 for (_, loss), want in zip(seen, result.losses))


def test_cp_pin_plans_and_estimates_under_megatron_and_run_refuses_it(tmp_path):
    """``--cp`` pins context parallelism under a recipe that has it: the plan records it (cp in
    the mesh and the axis order), ``estimate --cp`` prices it, and ``autopar run`` refuses cp x
    pp (Megatron composes them, autopar's runtime not yet) in one line naming the export; without
    the pin a short sequence never gets cp > 1."""
    model = "gpt:layers=8,hidden=1024,heads=16,vocab=32000,seq=1024"
    job = ["--model", model, "--cluster", "dgx-a100-80g", "--gpus", "16", "--global-batch", "64",
           "--recipe", "megatron-core"]
    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", *job, "--cp", "2", "--pp", "2", "--json", "--out", str(out)])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)["plan"]
    assert plan["mesh"]["cp"] == 2 and "cp" in plan["axis_order"]
    assert plan["mesh"]["dp"] * plan["mesh"]["tp"] * plan["mesh"]["pp"] * 2 == 16
    free = json.loads(runner.invoke(app, ["plan", *job, "--json"]).output)["plan"]
    assert free["mesh"]["cp"] == 1 and free["axis_order"] == ["pp", "dp", "tp"]
    est = runner.invoke(app, ["estimate", *job, "--tp", "2", "--cp", "2", "--json"])
    assert est.exit_code == 0, est.output
    one = runner.invoke(app, ["estimate", *job, "--tp", "2", "--cp", "1", "--json"])
    assert json.loads(est.output)["memory"]["activations_bytes"] < json.loads(one.output)["memory"]["activations_bytes"]
    bad = runner.invoke(app, ["estimate", *job, "--cp", "3"])
    assert bad.exit_code == 2 and len(bad.output.strip().splitlines()) == 1
    ran = runner.invoke(app, ["run", str(out)])
    assert ran.exit_code == 2 and "with pipelining" in ran.output and "autopar export" in ran.output
    assert len(ran.output.strip().splitlines()) == 1


def test_ep_pin_reaches_the_plan_is_checked_in_one_line_and_the_plan_runs_here(tmp_path):
    """``--ep`` pins expert parallelism on an MoE model (the plan's mesh records it, ep
    regrouping dp: the devices stay dp x tp x pp); a degree that does not divide the experts,
    or any on a dense model, is one line. Under the autopar recipe the plan is one autopar's
    runtime runs (``autopar.layout.expert_parallel_unsupported``: any pipeline schedule, no
    sequence parallelism of MoE layers)."""
    moe = "moe:layers=2,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=512,seq=256,experts=4,topk=2"
    job = ["--model", moe, "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "16"]
    out = tmp_path / "plan.json"
    res = invoke("plan", *job, "--ep", "2", "--json", "--out", str(out))
    assert res.exit_code == 0, res.output
    mesh = json.loads(res.stdout)["plan"]["mesh"]
    assert mesh["ep"] == 2 and mesh["dp"] * mesh["tp"] * mesh["pp"] * mesh["cp"] == 8 and mesh["dp"] % 2 == 0
    from autopar.plan import load_plan
    from autopar.runtime.context import check_plan
    plan = load_plan(out)
    assert not plan.sequence_parallel and plan.refusal() is None
    check_plan(plan)  # the runtime's own check, before any process starts
    for args, fragment in ((["plan", *job, "--ep", "3"], "--ep 3 does not divide the 4 routed experts"),
                           (["estimate", "--model", "gpt2", "--cluster", "dgx-h100", "--gpus", "8",
                             "--global-batch", "16", "--ep", "2"], "has no routed experts")):
        bad = invoke(*args)
        assert bad.exit_code == 2 and fragment in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    est = invoke("estimate", *job, "--ep", "4", "--json")
    assert est.exit_code == 0, est.output


def test_leading_dense_blocks_plan_with_every_block_counted_and_export_to_megatron_only(tmp_path):
    """A DeepSeek-shaped model (2 dense blocks, then MoE blocks): the plan's stage_layers count
    all 4 blocks, the leading ones opening the first stage in one recompute mode; explain
    re-prices the plan exactly; launch writes its scripts (the runtime trains both block
    kinds: test_runtime's DeepSeek-V3 and GLM-4.5 parity); the Megatron export writes both
    kinds (--moe-layer-freq), as does torchtitan's DeepSeek-V3 (tests/test_export.py), and the
    others refuse it in one line."""
    pytest.importorskip("transformers")
    from tests.test_trace_hf import DSV3_TINY
    out = tmp_path / "p.json"
    res = invoke("plan", "--model", DSV3_TINY, "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "64",
                 "--recipe", "megatron-core", "--pp", "2", "--json", "--out", str(out))
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)["plan"]
    assert sum(plan["stage_layers"]) == 4 and plan["stage_layers"][0] >= 3
    assert len(set(plan["recompute"][:2])) == 1
    res = invoke("explain", str(out), "--json", "--top-k", "1")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["step_time_s"] == pytest.approx(json.loads(out.read_text())["estimate"]["step_time_s"],
                                                                   rel=1e-12)
    res = invoke("export", str(out), "--to", "megatron")
    assert res.exit_code == 0 and "--moe-layer-freq '([0]*2+[1]*2)'" in res.stdout, res.output
    res = invoke("export", str(out), "--to", "deepspeed")
    assert res.exit_code == 2 and "leads with 2 dense blocks" in res.stderr and len(res.stderr.splitlines()) == 1
    assert "export it with --to megatron" in res.stderr
    res = invoke("launch", str(out), "--out", str(tmp_path / "launch"))
    assert res.exit_code == 0, res.output
