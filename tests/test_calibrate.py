"""``autopar calibrate``: the refit recovers known constants from the phases they produce, and
the command runs a plan profiled and writes a profile that prices it as measured."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from autopar.calibrate import Measured, _gemm_tflops, refit
from autopar.cli import app
from autopar.plan import Mesh, Plan
from autopar.profiles import profile_spec
from autopar.spec import parse_model_spec
from cost_models import estimate, load_profile

MODEL = "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=32,tied=0"
runner = CliRunner()


def _plan(dp: int = 2, pp: int = 1) -> Plan:
    return Plan(model=MODEL, cluster="cpu-local", gpus=dp * pp, global_batch=8, seq_len=32, dtype="fp32",
                mesh=Mesh(dp=dp, pp=pp), zero_stage=0, micro_batch_size=2, num_microbatches=8 // (2 * dp),
                schedule="1f1b", stage_layers=(2 // pp,) * pp, recompute=("none",) * 2)


@pytest.mark.parametrize("dp,pp", [(2, 1), (1, 2)])
def test_refit_recovers_the_constants_that_made_the_phases(dp, pp):
    """Phases priced with known efficiencies, fed back as a measurement, give those
    efficiencies back (GEMM exactly, the others to the bisection's precision)."""
    plan = _plan(dp, pp)
    model = profile_spec(parse_model_spec(MODEL))
    # as ``autopar profile`` measures it, before its reference run refits the efficiencies
    start = dataclasses.replace(load_profile("cpu-local"), matmul_efficiency=1.0, memory_efficiency=1.0,
                                optimizer_memory_efficiency=1.0)
    truth = dataclasses.replace(start, matmul_efficiency=0.4, optimizer_memory_efficiency=0.2,
                                memory_efficiency=0.3)
    est = estimate(model, truth, plan.strategy(), global_batch=plan.global_batch)
    run = Measured(step_s=est.step_time_s, compute_s=est.time.compute_s, optimizer_s=est.time.optimizer_s,
                   gemm_tflops=_gemm_tflops(model, truth, plan), peak_bytes=1.0)
    new, fits = refit(plan, model, start, run)
    assert new.matmul_efficiency == pytest.approx(0.4, rel=1e-9)
    assert new.optimizer_memory_efficiency == pytest.approx(0.2, rel=1e-6)
    assert new.memory_efficiency == pytest.approx(0.3, rel=1e-6)
    assert [f.name for f in fits] == ["matmul_efficiency", "optimizer_memory_efficiency", "memory_efficiency"]
    after = estimate(model, new, plan.strategy(), global_batch=plan.global_batch)
    assert after.step_time_s == pytest.approx(est.step_time_s, rel=1e-6)


def test_gemms_faster_than_the_peak_raise_the_peak():
    """A run whose GEMMs beat the profile's peak (CPU ranks measured all busy at once, a step
    leaving some waiting) raises the peak, the efficiency staying 1, and the element-wise fit
    then explains the rest of the step as it was made."""
    plan = _plan(2, 2)
    model = profile_spec(parse_model_spec(MODEL))
    start = dataclasses.replace(load_profile("cpu-local"), matmul_efficiency=1.0, memory_efficiency=1.0,
                                optimizer_memory_efficiency=1.0)
    peak = start.peak_tflops["fp32"]
    truth = dataclasses.replace(start, peak_tflops={"fp32": peak * 1.5}, optimizer_memory_efficiency=0.2,
                                memory_efficiency=0.3)
    est = estimate(model, truth, plan.strategy(), global_batch=plan.global_batch)
    run = Measured(step_s=est.step_time_s, compute_s=est.time.compute_s, optimizer_s=est.time.optimizer_s,
                   gemm_tflops=_gemm_tflops(model, truth, plan), peak_bytes=1.0)
    new, fits = refit(plan, model, start, run)
    assert new.peak_tflops["fp32"] == pytest.approx(peak * 1.5, rel=1e-9) and new.matmul_efficiency == 1.0
    assert new.memory_efficiency == pytest.approx(0.3, rel=1e-6)
    assert [f.name for f in fits][:2] == ["peak_tflops.fp32", "matmul_efficiency"] and "above the peak" in fits[0].why


def test_a_phase_no_efficiency_can_explain_keeps_the_constant():
    plan = _plan()
    model = profile_spec(parse_model_spec(MODEL))
    hw = load_profile("cpu-local")
    est = estimate(model, hw, plan.strategy(), global_batch=plan.global_batch)
    run = Measured(step_s=est.step_time_s * 1e-6, compute_s=0.0, optimizer_s=est.time.optimizer_s * 1e-6,
                   gemm_tflops=_gemm_tflops(model, hw, plan), peak_bytes=1.0)
    new, fits = refit(plan, model, hw, run)  # faster than any efficiency <= 1 allows
    assert new.memory_efficiency == 1.0 and "set to 1" in fits[-1].why


def test_calibrate_command_profiles_the_run_and_writes_a_profile_that_prices_it(tmp_path):
    plan_file, out = tmp_path / "plan.json", tmp_path / "cal.json"
    _plan().save(plan_file)
    res = runner.invoke(app, ["calibrate", str(plan_file), "--steps", "7", "--warmup", "2", "--out", str(out),
                              "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    phases = {p["name"]: p for p in info["phases"]}
    assert phases["step"]["measured_s"] > 0 and phases["compute"]["measured_s"] > 0
    assert phases["step"]["after_s"] == pytest.approx(phases["step"]["measured_s"], rel=1e-3) or \
        any("set to 1" in f["why"] for f in info["fits"])
    assert info["gemm_tflops"] > 0 and info["peak_measured_bytes"] > 0
    hw = load_profile(str(out))
    assert "autopar calibrate" in hw.notes["calibrated"]
    again = runner.invoke(app, ["estimate", "--model", MODEL, "--cluster", str(out), "--gpus", "2",
                                "--global-batch", "8", "--dtype", "fp32", "--tp", "1", "--pp", "1", "--mbs", "2",
                                "--zero", "0", "--recompute", "none", "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.output)["step_time_s"] == pytest.approx(phases["step"]["after_s"], rel=1e-9)


def test_calibrate_refuses_bad_input_in_one_line(tmp_path):
    plan_file = tmp_path / "plan.json"
    _plan().save(plan_file)
    res = runner.invoke(app, ["calibrate", str(plan_file), "--steps", "5", "--warmup", "2"])
    assert res.exit_code == 2 and "--steps 6" in res.output
    res = runner.invoke(app, ["calibrate", str(tmp_path / "missing.json")])
    assert res.exit_code == 2
