"""``autopar calibrate``: the refit recovers known constants from the phases they produce, and
the command runs a plan profiled and writes a profile that prices it as measured."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest
from typer.testing import CliRunner

from autopar.calibrate import Measured, _gemm_tflops, refit
from autopar.cli import app
from autopar.errors import UserError
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
    # as ``autopar profile`` measures it, before its reference run refits the efficiencies; a
    # core per rank (a pipeline on shared cores is fitted to its step: below)
    start = dataclasses.replace(load_profile("cpu-local"), matmul_efficiency=1.0, memory_efficiency=1.0,
                                optimizer_memory_efficiency=1.0, ranks_per_core=1.0)
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
    # bandwidth enough that this tiny model's GEMMs stay compute-bound at 1.5x the peak
    start = dataclasses.replace(load_profile("cpu-local"), matmul_efficiency=1.0, memory_efficiency=1.0,
                                optimizer_memory_efficiency=1.0, hbm_bw_gbps=1e3, ranks_per_core=1.0)
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


@pytest.mark.parametrize("dp,pp", [(2, 2), (4, 1)])
def test_ranks_on_shared_cores_scale_the_peak_to_their_step(dp, pp):
    """Ranks sharing cores (cpu-local: 4 ranks on 2) run their operators faster than the
    profile's every-rank-busy rates while a peer waits (a pipeline stage in the fill, a DDP
    rank ahead of the rest at the all-reduce): the GEMM rate and operator times are not used
    (a GEMM rate 1.5x the profile's moves nothing); the optimizer is fitted as ever, then the
    peak is scaled until the predicted step is the measured one."""
    plan = _plan(dp, pp)
    model = profile_spec(parse_model_spec(MODEL))
    start = load_profile("cpu-local")
    assert start.ranks_per_core > 1
    peak = start.peak_tflops["fp32"]
    truth = dataclasses.replace(start, peak_tflops={"fp32": peak * 0.7}, optimizer_memory_efficiency=0.3)
    est = estimate(model, truth, plan.strategy(), global_batch=plan.global_batch)
    run = Measured(step_s=est.step_time_s, compute_s=0.5 * est.time.compute_s, optimizer_s=est.time.optimizer_s,
                   gemm_tflops=1.5 * _gemm_tflops(model, start, plan), peak_bytes=1.0)
    new, fits = refit(plan, model, start, run)
    assert [f.name for f in fits] == ["optimizer_memory_efficiency", "peak_tflops.fp32"]
    assert new.optimizer_memory_efficiency == pytest.approx(0.3, rel=1e-6)
    assert new.peak_tflops["fp32"] == pytest.approx(peak * 0.7, rel=1e-6) and "sharing cores" in fits[-1].why
    assert (new.matmul_efficiency, new.memory_efficiency) == (start.matmul_efficiency, start.memory_efficiency)
    after = estimate(model, new, plan.strategy(), global_batch=plan.global_batch)
    assert after.step_time_s == pytest.approx(est.step_time_s, rel=1e-6)
    # a step no peak within STEP_SCALES explains keeps the peak and says so
    kept, fits = refit(plan, model, start, dataclasses.replace(run, step_s=est.step_time_s * 1e-3))
    assert kept.peak_tflops["fp32"] == peak and "kept" in fits[-1].why


def test_several_runs_are_fitted_together_in_the_geometric_mean():
    """``refit_runs`` fits one profile to several plans' runs: on shared cores the peak whose
    predicted steps miss the measured ones by opposite factors (one plan ran 10 % slow, the
    other 10 % fast) is the one that made them; a core per rank, the GEMM rate moves by the
    geometric mean of the runs' rate ratios (1.2 and 1/1.2: not at all). One run's luck no
    longer sets the profile alone."""
    from autopar.calibrate import refit_runs

    model = profile_spec(parse_model_spec(MODEL))
    start = load_profile("cpu-local")
    peak = start.peak_tflops["fp32"]
    truth = dataclasses.replace(start, peak_tflops={"fp32": peak * 0.7}, optimizer_memory_efficiency=0.3)
    runs = []
    for plan, luck in ((_plan(2, 1), 1.1), (_plan(2, 2), 1 / 1.1)):
        est = estimate(model, truth, plan.strategy(), global_batch=plan.global_batch)
        runs.append((plan, model, Measured(step_s=est.step_time_s * luck, compute_s=est.time.compute_s,
                                           optimizer_s=est.time.optimizer_s * luck,
                                           gemm_tflops=_gemm_tflops(model, start, plan), peak_bytes=1.0)))
    new, fits = refit_runs(runs, start)
    assert [f.name for f in fits] == ["optimizer_memory_efficiency", "peak_tflops.fp32"] and "(2 runs)" in fits[-1].why
    assert new.optimizer_memory_efficiency == pytest.approx(0.3, rel=1e-3)
    assert new.peak_tflops["fp32"] == pytest.approx(peak * 0.7, rel=1e-3)
    alone, _ = refit(*runs[0][:2], start, runs[0][2])  # the slow run alone prices every plan slow
    assert alone.peak_tflops["fp32"] < 0.95 * new.peak_tflops["fp32"]
    core = dataclasses.replace(start, ranks_per_core=1.0)
    rated = [(plan, model, dataclasses.replace(run, gemm_tflops=_gemm_tflops(model, core, plan) * f))
             for (plan, _, run), f in zip(runs, (1.2, 1 / 1.2))]
    new, fits = refit_runs(rated, core)
    assert fits[0].name == "matmul_efficiency" and fits[0].new == pytest.approx(core.matmul_efficiency, rel=1e-9)


def test_calibrate_runs_every_plan_and_prices_each_under_one_profile():
    """``calibrate_runs`` runs every plan, fits once, and reports each plan's phases before and
    after under the one refitted profile; plans of different clusters are refused in one line."""
    from autopar.calibrate import calibrate_plans, calibrate_runs

    model = profile_spec(parse_model_spec(MODEL))
    hw = load_profile("cpu-local")

    def ranks(gemm: float) -> tuple[dict[str, float], ...]:
        return tuple({"rank": i, "gemm": gemm, "attention": 0.0, "other": 0.01, "optimizer": 0.001,
                      "comm": 0.0, "gemm_flops": 1e9, "peak_bytes": 1e6} for i in range(2))
    calls = []

    def run(step: float):
        def fn():
            calls.append(step)
            return [step] * 10, ranks(0.05)
        return fn
    plans = (_plan(2, 1), _plan(1, 2))
    cals = calibrate_runs([(plans[0], model, run(0.10)), (plans[1], model, run(0.30))], hw, 2, "test")
    assert calls == [0.10, 0.30] and len(cals) == 2 and cals[0].profile is cals[1].profile
    steps = [{p.name: p for p in c.phases}["step"] for c in cals]
    assert [s.measured_s for s in steps] == [0.10, 0.30]
    after = [estimate(model, cals[0].profile, p.strategy(), global_batch=p.global_batch).step_time_s for p in plans]
    assert [s.after_s for s in steps] == pytest.approx(after, rel=1e-12)
    assert "(2 runs)" in cals[0].profile.notes["calibrated"]
    other = dataclasses.replace(plans[1], cluster="dgx-h100")
    with pytest.raises(UserError, match="calibrate plans of one cluster together"):
        calibrate_plans((plans[0], other), 10, 2, "test")
    with pytest.raises(UserError, match="calibrate plans of one dtype together"):  # before running either
        calibrate_plans((plans[0], dataclasses.replace(plans[1], dtype="bf16")), 10, 2, "test")


@pytest.mark.parametrize("gpu", [True, False])
def test_the_element_wise_fit_explains_the_operators_not_the_time_between_them(gpu):
    """The element-wise efficiency is fitted to the measured compute (a GPU's device time, a
    CPU rank's time inside operators): time outside them (a GPU idle around the step's
    synchronisation, a CPU rank waiting for its peers or running Python), which a short
    reference step has proportionally more of, does not move it."""
    plan = Plan(model="gpt:layers=4,hidden=1024,heads=8,vocab=32000,seq=1024,tied=0", cluster="dgx-h100", gpus=1,
                global_batch=8, seq_len=1024, dtype="bf16", mesh=Mesh(dp=1), zero_stage=0, micro_batch_size=8,
                num_microbatches=1, schedule="1f1b", stage_layers=(4,), recompute=("none",) * 4)
    model = profile_spec(parse_model_spec(plan.model))
    start = dataclasses.replace(load_profile("dgx-h100"), host_overlaps_device=gpu)
    truth = dataclasses.replace(start, memory_efficiency=0.3, optimizer_memory_efficiency=0.4)
    est = estimate(model, truth, plan.strategy(), global_batch=plan.global_batch)
    outside = 0.5 * est.step_time_s
    run = Measured(step_s=est.step_time_s + outside, compute_s=est.time.compute_s, optimizer_s=est.time.optimizer_s,
                   gemm_tflops=_gemm_tflops(model, truth, plan), peak_bytes=1.0)
    new, fits = refit(plan, model, start, run)
    assert ("device time" if gpu else "time in operators") in fits[-1].why
    assert new.memory_efficiency == pytest.approx(0.3, rel=0.02)
    after = estimate(model, new, plan.strategy(), global_batch=plan.global_batch)
    assert after.time.compute_s == pytest.approx(est.time.compute_s, rel=1e-6)


def test_measured_compute_is_the_slowest_stage_of_its_ranks_medians():
    """Ranks of one stage run one program: their median, not the rank the machine descheduled
    most; stages differ: the slowest. Ranks follow the plan's axis order (pp outermost by
    default: ranks 0-1 stage 0, 2-3 stage 1 at dp 2 x pp 2)."""
    from autopar.calibrate import measured, stages

    def rank(i: int, compute: float, optimizer: float = 0.01) -> dict[str, float]:
        return {"rank": i, "gemm": compute / 2, "attention": 0.0, "other": compute / 2, "optimizer": optimizer,
                "gemm_flops": 1e9, "peak_bytes": 1.0}
    assert stages(_plan(2, 2)) == (0, 0, 1, 1) and stages(_plan(2, 1)) == (0, 0)
    steps = [1.0] * 10
    ddp = measured(steps, 2, (rank(0, 0.19), rank(1, 0.29), rank(2, 0.23), rank(3, 0.24)), (0, 0, 0, 0))
    assert ddp.compute_s == pytest.approx(0.235)
    pipe = measured(steps, 2, (rank(0, 0.2), rank(1, 0.3), rank(2, 0.5), rank(3, 0.7, optimizer=0.05)),
                    stages(_plan(2, 2)))
    assert pipe.compute_s == pytest.approx(0.6) and pipe.optimizer_s == pytest.approx(0.03)
    # CPU ranks time their optimizer step in the unprofiled steps: that, not the profiled one
    timed = tuple({**rank(i, 0.2, optimizer=0.05), "optimizer_timed": 0.02 + 0.01 * i} for i in range(4))
    assert measured(steps, 2, timed, (0, 0, 0, 0)).optimizer_s == pytest.approx(0.035)


def test_the_profiles_reference_run_is_fitted_to_its_operators_on_shared_cores():
    """``autopar profile``'s data-parallel reference (``anchor``) is where the element-wise rate
    comes from: fitted to its operators even on shared cores, its GEMM rate used."""
    plan = _plan(4, 1)
    model = profile_spec(parse_model_spec(MODEL))
    start = dataclasses.replace(load_profile("cpu-local"), memory_efficiency=1.0)
    truth = dataclasses.replace(start, memory_efficiency=0.3)
    est = estimate(model, truth, plan.strategy(), global_batch=plan.global_batch)
    run = Measured(step_s=est.step_time_s, compute_s=est.time.compute_s, optimizer_s=est.time.optimizer_s,
                   gemm_tflops=_gemm_tflops(model, truth, plan), peak_bytes=1.0)
    new, fits = refit(plan, model, start, run, anchor=True)
    assert [f.name for f in fits] == ["matmul_efficiency", "optimizer_memory_efficiency", "memory_efficiency"]
    assert new.memory_efficiency == pytest.approx(0.3, rel=1e-6)
    # the same run of a user's plan (not the reference) is fitted to its step
    assert refit(plan, model, start, run)[1][-1].name == "peak_tflops.fp32"


def test_a_phase_no_efficiency_can_explain_keeps_the_constant():
    plan = _plan()
    model = profile_spec(parse_model_spec(MODEL))
    hw = load_profile("cpu-local")
    est = estimate(model, hw, plan.strategy(), global_batch=plan.global_batch)
    run = Measured(step_s=est.step_time_s * 1e-6, compute_s=0.0, optimizer_s=est.time.optimizer_s * 1e-6,
                   gemm_tflops=_gemm_tflops(model, hw, plan), peak_bytes=1.0)
    new, fits = refit(plan, model, hw, run, anchor=True)  # faster than any efficiency <= 1 allows
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
    # ranks sharing cores (cpu-local): the peak is scaled to the step (or kept, saying so)
    assert phases["step"]["after_s"] == pytest.approx(phases["step"]["measured_s"], rel=1e-3) or \
        any("kept" in f["why"] for f in info["fits"])
    assert info["gemm_tflops"] > 0 and info["peak_measured_bytes"] > 0
    hw = load_profile(str(out))
    assert "autopar calibrate" in hw.notes["calibrated"]
    again = runner.invoke(app, ["estimate", "--model", MODEL, "--cluster", str(out), "--gpus", "2",
                                "--global-batch", "8", "--dtype", "fp32", "--tp", "1", "--pp", "1", "--mbs", "2",
                                "--zero", "0", "--recompute", "none", "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.output)["step_time_s"] == pytest.approx(phases["step"]["after_s"], rel=1e-9)


def test_a_run_whose_profiled_steps_were_stretched_is_run_again():
    """On CPU ranks the profiled steps' operator times are in those steps' time: where they ran
    well over the unprofiled steps (the machine busy), ``calibrate`` runs the plan again, up to
    ``ATTEMPTS`` runs, and fits the least stretched one; a GPU's device times are kept at once."""
    from autopar.calibrate import ATTEMPTS, DILATION_LIMIT, calibrate, dilation

    plan = _plan()
    model = profile_spec(parse_model_spec(MODEL))
    hw = load_profile("cpu-local")

    def ranks(gemm: float) -> tuple[dict[str, float], ...]:
        return tuple({"rank": i, "gemm": gemm, "attention": 0.0, "other": 0.01, "optimizer": 0.001,
                      "comm": 0.0, "gemm_flops": 1e9, "peak_bytes": 1e6} for i in range(2))
    busy = ([0.1] * 7 + [0.2] * 3, ranks(0.1))  # profiled 2x: GEMMs at 10 GFLOP/s
    calm = ([0.1] * 7 + [0.105] * 3, ranks(0.05))  # 20 GFLOP/s
    assert dilation(busy[0], 2) == pytest.approx(2.0) and dilation(calm[0], 2) < DILATION_LIMIT
    for runs, calls, rate in (([busy, calm], 2, 20.0), ([busy] * 5, ATTEMPTS, 10.0), ([calm, busy], 1, 20.0)):
        left = list(runs)
        cal = calibrate(plan, model, hw, 2, lambda: left.pop(0), "test")
        assert len(runs) - len(left) == calls and cal.gemm_tflops * 1e3 == pytest.approx(rate)
    left = [busy, calm]
    on_gpu = dataclasses.replace(hw, host_overlaps_device=True)
    assert calibrate(plan, model, on_gpu, 2, lambda: left.pop(0), "test").gemm_tflops * 1e3 == pytest.approx(10.0)
    assert len(left) == 1


def test_calibrate_refuses_bad_input_in_one_line(tmp_path):
    plan_file = tmp_path / "plan.json"
    _plan().save(plan_file)
    res = runner.invoke(app, ["calibrate", str(plan_file), "--steps", "5", "--warmup", "2"])
    assert res.exit_code == 2 and "--steps 6" in res.output
    res = runner.invoke(app, ["calibrate", str(tmp_path / "missing.json")])
    assert res.exit_code == 2
    other = tmp_path / "other.json"
    dataclasses.replace(_plan(), cluster="dgx-h100").save(other)
    res = runner.invoke(app, ["calibrate", str(plan_file), str(other)])
    assert res.exit_code == 2 and "calibrate plans of one cluster together" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_gpu_profile_counts_each_kernel_once_under_its_operator():
    """On CUDA the profiler lists every kernel twice: as an event of its own (device type
    CUDA) and in the device time of the operator that launched it. The phases count it once."""
    from types import SimpleNamespace

    import torch
    from torch.autograd import DeviceType

    from autopar.runtime import phases

    def event(name: str, kind: DeviceType, us: float, total_us: float | None = None, flops: float = 0.0):
        return SimpleNamespace(name=name, device_type=kind, self_device_time_total=us,
                               device_time_total=us if total_us is None else total_us, flops=flops)
    events = [event("aten::mm", DeviceType.CPU, 300.0, flops=6e9),
              event("sm90_xmma_gemm_bf16", DeviceType.CUDA, 300.0),
              event("aten::_scaled_dot_product_flash_attention", DeviceType.CPU, 100.0),
              event("flash_fwd_kernel", DeviceType.CUDA, 100.0),
              event("Optimizer.step#AdamW.step", DeviceType.CPU, 0.0, total_us=50.0),
              event("Optimizer.step#AdamW.step", DeviceType.CUDA, 55.0),
              event("aten::_foreach_add_", DeviceType.CPU, 50.0),
              event("aten::gelu", DeviceType.CPU, 20.0),
              event("vectorized_elementwise_kernel", DeviceType.CUDA, 70.0)]
    prof = SimpleNamespace(events=lambda: events)
    got = phases.summary(prof, 1, torch.device("cuda"))  # type: ignore[arg-type]
    assert got["gemm"] == pytest.approx(300e-6) and got["attention"] == pytest.approx(100e-6)
    assert got["optimizer"] == pytest.approx(50e-6) and got["gemm_flops"] == 6e9
    assert got["other"] == pytest.approx(20e-6)  # the gelu; the foreach add is the optimizer's


def test_fsdp_collective_scopes_are_communication_not_operators():
    """FSDP2 wraps its all-gathers and reduce-scatters in ``record_function`` scopes whose self
    time, on CPU ranks, is the synchronous collective's wait: communication, not element-wise
    work (two thirds of a ZeRO-3 step's "other operators" on 4 CPU ranks were these scopes).
    Its copy-out scope is host work around operators: it stays."""
    from types import SimpleNamespace

    import torch
    from torch.autograd import DeviceType

    from autopar.runtime import phases

    def event(name: str, us: float):
        return SimpleNamespace(name=name, device_type=DeviceType.CPU, self_device_time_total=us,
                               device_time_total=us, flops=0.0)
    events = [event("FSDP::all_gather (layers.0)", 500.0), event("FSDP::all_gather", 50.0),
              event("FSDP::post_backward_reduce (layers.0)", 300.0), event("FSDP::post_backward_rs_wait (x)", 20.0),
              event("FSDP::all_gather_copy_out", 10.0), event("FSDP::pre_forward", 5.0), event("aten::gelu", 40.0)]
    got = phases.summary(SimpleNamespace(events=lambda: events), 1, torch.device("cuda"))  # type: ignore[arg-type]
    assert got["comm"] == pytest.approx(870e-6) and got["other"] == pytest.approx(55e-6)


def test_tensor_parallel_waits_are_communication_not_operators():
    """DTensor's all-reduces are functional collectives: the rank waits for them in
    ``_c10d_functional::wait_tensor`` (on CPU ranks most of a tp step). Communication, not the
    element-wise work ``calibrate`` fits the memory rate to; DTensor's own dispatch stays."""
    from types import SimpleNamespace

    import torch
    from torch.autograd import DeviceType

    from autopar.runtime import phases

    def event(name: str, us: float):
        return SimpleNamespace(name=name, device_type=DeviceType.CPU, self_device_time_total=us,
                               device_time_total=us, flops=0.0)
    events = [event("_c10d_functional::wait_tensor", 700.0), event("_c10d_functional::all_reduce", 5.0),
              event("c10d::allreduce_", 25.0), event("PythonSubclass", 60.0), event("Redistribute", 10.0),
              event("aten::gelu", 40.0)]
    got = phases.summary(SimpleNamespace(events=lambda: events), 1, torch.device("cuda"))  # type: ignore[arg-type]
    assert got["comm"] == pytest.approx(730e-6) and got["other"] == pytest.approx(110e-6)


def test_a_dtensor_gemm_counts_its_flops_once():
    """Under tensor parallelism DTensor's ``aten::mm`` dispatches ``aten::mm`` on the local
    shard; the profiler gives both the shard's FLOPs. The rate is the GEMMs' own: once."""
    from types import SimpleNamespace

    import torch
    from torch.autograd import DeviceType

    from autopar.runtime import phases

    def event(name: str, us: float, flops: float = 0.0, children=()):
        return SimpleNamespace(name=name, device_type=DeviceType.CPU, self_device_time_total=us,
                               device_time_total=us + sum(c.device_time_total for c in children), flops=flops,
                               cpu_children=list(children))
    inner = event("aten::mm", 300.0, flops=6e9)
    python = event("PythonSubclass", 40.0, children=[inner])
    outer = event("aten::mm", 10.0, flops=6e9, children=[python])
    plain = event("aten::addmm", 200.0, flops=4e9)
    prof = SimpleNamespace(events=lambda: [outer, python, inner, plain])
    got = phases.summary(prof, 1, torch.device("cuda"))  # type: ignore[arg-type]
    assert got["gemm_flops"] == 10e9 and got["gemm"] == pytest.approx(510e-6)


def test_a_step_slowed_by_the_machine_moves_no_phase():
    """Each profiled step's end is marked (``phases.step_ended``) and every phase is the
    median over the steps: one step with a burst of extra operators (the machine's slow
    moment, seen on the 1128d grid) leaves the phases of the other two."""
    import torch

    from autopar.runtime import phases

    a, b = torch.randn(128, 128), torch.randn(128, 128)
    with phases.recording(torch.device("cpu")) as prof:
        for step in range(3):
            for _ in range(4):
                torch.mm(a, b)
            torch.add(a, b)
            for _ in range(300 if step == 1 else 0):
                torch.add(a, b)
            phases.step_ended()
    got = phases.summary(prof, 3, torch.device("cpu"))
    assert got["gemm_flops"] == pytest.approx(4 * 2 * 128 ** 3) and got["gemm"] > 0
    unmarked = phases.summary(prof, 1, torch.device("cpu"))  # marks that do not match the steps: the sum
    assert unmarked["gemm_flops"] == pytest.approx(3 * 4 * 2 * 128 ** 3)
    assert unmarked["other"] > 10 * got["other"]  # 303 adds against the median step's one (a preempted add: 46x)
    assert got["events"] >= 5 and unmarked["events"] == 3 * got["events"] + 300  # operators, not allocations


def test_plan_quality_reports_how_well_its_rounds_agree():
    """The benchmark's noise ceiling: rounds that rank the plans alike agree at Spearman 1
    (an error-free model could reach 1), rounds that rank them in reverse at -1 (ceiling 0),
    and one round says nothing."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import plan_quality

    pad = [0.0] * plan_quality.WARMUP  # warm-up steps, dropped
    tail = [0.0] * plan_quality.PROFILED

    def run(*rounds: float) -> tuple:
        return (0.0, 0.0, None, [pad + [t] + tail for t in rounds])

    alike = [run(1.0, 1.1), run(2.0, 2.2), run(3.0, 3.3)]
    r, spread, ceiling = plan_quality.repeatability(alike)
    assert (r, ceiling) == (pytest.approx(1.0), pytest.approx(1.0)) and spread == pytest.approx(0.1 / 1.05)
    r, _, ceiling = plan_quality.repeatability([run(1.0, 3.0), run(2.0, 2.0), run(3.0, 1.0)])
    assert r == pytest.approx(-1.0) and ceiling == 0.0
    assert plan_quality.repeatability([run(1.0), run(2.0), run(3.0)]) is None


def test_plan_quality_head_to_head_measures_each_role_once_on_fresh_rounds(monkeypatch, capsys):
    """The head-to-head re-measures the pick, the grid's fastest, plain DDP and plain FSDP,
    each distinct plan once (a plan in several roles is named by all of them), and reads
    every time from its fresh rounds, never from the grid that chose the fastest."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import plan_quality

    model = "gpt:layers=2,hidden=64,heads=2,vocab=128,seq=16,tied=0"
    ddp, fsdp = (plan_quality.baseline(model, 8, 2, 16, 2, z, "cpu-local") for z in (0, 3))
    pad, tail = [0.0] * plan_quality.WARMUP, [0.0] * plan_quality.PROFILED
    # In the grid plain DDP read fastest (0.9 s): the grid's fastest and plain DDP are one plan.
    grid = [(0.9, 0.0, None, []), (2.0, 0.0, None, [])]
    case = ("toy", None, None, [ddp, fsdp], grid, plan_quality.key(fsdp), plan_quality.key(ddp),
            plan_quality.key(fsdp))
    measured = []

    def fresh(plans, steps, rounds):
        measured.append([plan_quality.key(p) for p in plans])
        times = {plan_quality.key(ddp): [1.2, 1.0, 1.1], plan_quality.key(fsdp): [1.5, 1.4, 1.6]}
        return [(statistics.median(times[plan_quality.key(p)]), 0.0, None,
                 [pad + [t] + tail for t in times[plan_quality.key(p)]]) for p in plans]

    monkeypatch.setattr(plan_quality, "measure", fresh)
    out = plan_quality.head_to_head(case, fsdp, steps=6, rounds=3)
    assert measured == [[plan_quality.key(fsdp), plan_quality.key(ddp)]]  # the pick first, each plan once
    assert out["roles"] == [["pick", "plain FSDP"], ["grid's fastest", "plain DDP"]]
    printed = capsys.readouterr().out
    assert "pick = plain FSDP" in printed and "1.364 x" in printed  # 1.5 / 1.1, the fresh medians
    assert "paired 1.400 (1.250-1.455)" in printed  # 1.5 / 1.2, 1.4 / 1.0 and 1.6 / 1.1, round by round
    assert "grid's fastest = plain DDP" in printed and "fastest in 3 of 3" in printed
