"""``autopar profile``: the collectives are fitted to the cost model's own α-β formulas (so a
profile prices what it measured), and the command writes a profile that --cluster accepts."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from autopar.cli import app
from autopar.profile import BANDWIDTH_FLOOR, LATENCY_FLOOR, failure, fit_collectives
from autopar.profile_bench import SIZES
from cost_models import comm, load_profile

runner = CliRunner()


@pytest.mark.parametrize("alpha,beta,world,rs", [(150e-6, 0.7e9, 4, 1.0), (5e-6, 150e9, 8, 1.0),
                                                  (1e-3, 2e9, 2, 2.0), (700e-6, 1e9, 4, 1.7)])
def test_fit_recovers_alpha_beta_and_reduce_scatter_factor_of_the_cost_models_formulas(alpha, beta, world, rs):
    g = comm.Group(size=world, bw_bytes_s=beta, p2p_bytes_s=beta, latency_s=alpha, inter_node=False, rs_factor=rs)
    rows = [(kind, world, b, f(b, g) * (1 + 0.02 * ((i % 3) - 1)))  # ±2 % noise
            for i, b in enumerate(SIZES)
            for kind, f in (("all_reduce", comm.all_reduce_s), ("reduce_scatter", comm.reduce_scatter_s),
                            ("all_gather", comm.all_gather_s))]
    call, a, b, f = fit_collectives(rows)
    assert call == 0.0  # one group size cannot tell a call's cost from its steps'
    assert math.isclose(a, alpha, rel_tol=0.05) and math.isclose(b, beta, rel_tol=0.05)
    assert math.isclose(f, rs, rel_tol=0.05)


@pytest.mark.parametrize("call", [0.0, 2e-3])
def test_two_group_sizes_tell_a_calls_fixed_cost_from_its_steps(call):
    """CPU ranks on shared cores reach each collective skewed: a fixed cost per call beside α
    per ring step. Collectives over 4 ranks (6 steps of an all-reduce) and over pairs side by
    side (2 steps) separate the two; the fit recovers both and β."""
    alpha, beta = 0.9e-3, 1e9
    rows = []
    for size in (4, 2):
        g = comm.Group(size=size, bw_bytes_s=beta, p2p_bytes_s=beta, latency_s=alpha, inter_node=False,
                       call_s=call, rs_factor=2.0)
        rows += [(kind, size, b, f(b, g) * (1 + 0.02 * ((i % 3) - 1)))
                 for i, b in enumerate(SIZES)
                 for kind, f in (("all_reduce", comm.all_reduce_s), ("reduce_scatter", comm.reduce_scatter_s),
                                 ("all_gather", comm.all_gather_s))]
    c, a, b, f = fit_collectives(rows)
    assert c == pytest.approx(call, abs=0.1e-3) and a == pytest.approx(alpha, rel=0.1)
    assert b == pytest.approx(beta, rel=0.05) and f == pytest.approx(2.0, rel=0.05)


def test_times_that_show_no_bandwidth_give_a_finite_bound_the_profile_accepts():
    """On a loaded machine every collective can take the same time whatever its size: the fit
    then finds no bandwidth term, and β leaves ``BANDWIDTH_FLOOR`` of the largest transfer's
    time to its bytes, not infinity (which no profile accepts)."""
    rows = [(kind, 4, b, 2e-3) for b in SIZES for kind in ("all_reduce", "all_gather", "reduce_scatter")]
    _, a, b, _ = fit_collectives(rows)
    largest = comm.all_reduce_s(SIZES[-1], comm.Group(size=4, bw_bytes_s=1.0, p2p_bytes_s=1.0, latency_s=0.0,
                                                      inter_node=False))
    assert b == pytest.approx(largest / (BANDWIDTH_FLOOR * 2e-3)) and 0 < b / 1e9 < 1e6 and a >= 0


def test_times_that_show_no_latency_give_the_floor_not_zero():
    """Times exactly proportional to the bytes (a loaded machine can time them so) fit no
    latency term: α is then ``LATENCY_FLOOR`` of the smallest transfer's time over its steps
    (the all-gather of the fewest bytes), never 0, and β is the rate the times show."""
    beta = 2e9
    unit = comm.Group(size=4, bw_bytes_s=beta, p2p_bytes_s=beta, latency_s=0.0, inter_node=False)
    steps = comm.Group(size=4, bw_bytes_s=float("inf"), p2p_bytes_s=float("inf"), latency_s=1.0, inter_node=False)
    ops = {"all_reduce": comm.all_reduce_s, "all_gather": comm.all_gather_s}
    _, a, b, _ = fit_collectives([(kind, 4, n, ops[kind](n, unit)) for n in SIZES for kind in ops])
    assert b == pytest.approx(beta, rel=1e-6)
    assert a == pytest.approx(LATENCY_FLOOR * comm.all_gather_s(SIZES[0], unit) / comm.all_gather_s(SIZES[0], steps))


@pytest.mark.slow
def test_profile_writes_a_profile_the_cost_model_uses(tmp_path):
    out = tmp_path / "here.json"
    res = runner.invoke(app, ["profile", "--ranks", "2", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    hw = load_profile(str(out))
    assert hw.name == "here" and hw.devices_per_node == 2 and hw.launcher == "gloo"
    assert hw.peak_tflops["fp32"] > 0 and hw.intra_node.bw_gbps > 0 and hw.intra_node.latency_us > 0
    assert "autopar profile --ranks 2" in data["notes"]["source"]
    # the reference run refitted the efficiencies (autopar.calibrate), and said so
    assert "reference gpt:" in data["notes"]["calibrated"] and 0 < hw.memory_efficiency <= 1
    assert hw.host_overlaps_device is False and hw.kernel_dispatch_us > 0
    assert 0 < hw.attention_efficiency["sdpa"] <= 1  # the autopar recipe's SDPA, measured
    assert hw.ranks_per_core >= 1  # 2 ranks of 1 thread over the machine's cores
    assert hw.fsdp_hook_us > 0  # FSDP2 hooks per group and micro-batch, measured
    assert hw.zb_block_us > 0  # the zero-bubble schedule's split backward per block, measured
    assert set(hw.checkpoint_us) == {"selective", "full", "op"}  # checkpointing's machinery, per mode
    assert hw.checkpoint_us["op"] > hw.checkpoint_us["selective"] > 0  # the per-op policy wraps every operator
    assert 0 < hw.optimizer_memory_efficiency <= 1
    assert 0 <= hw.overlap_penalty <= 1 and "asynchronously" in data["notes"]["overlap_penalty"]
    est = runner.invoke(app, ["estimate", "--model", "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16",
                              "--cluster", str(out), "--gpus", "2", "--global-batch", "4", "--dtype", "fp32",
                              "--tp", "1", "--pp", "1", "--json"])
    assert est.exit_code == 0 and json.loads(est.stdout)["step_time_s"] > 0
    bad = runner.invoke(app, ["profile", "--ranks", "1", "--out", str(tmp_path / "x.json")])
    assert bad.exit_code == 2 and "--links dgx-h100" in bad.output  # one rank times no link
    bad = runner.invoke(app, ["profile", "--ranks", "0", "--out", str(tmp_path / "x.json")])
    assert bad.exit_code == 2 and "--ranks must be at least 1" in bad.output
    bad = runner.invoke(app, ["profile", "--ranks", "2", "--links", "dgx-h100", "--out", str(tmp_path / "x.json")])
    assert bad.exit_code == 2 and "drop --links" in bad.output
    bad = runner.invoke(app, ["profile", "--ranks", "1", "--links", "nowhere", "--out", str(tmp_path / "x.json")])
    assert bad.exit_code == 2 and "unknown cluster 'nowhere'" in bad.output
    bad = runner.invoke(app, ["profile", "--repeats", "0", "--out", str(tmp_path / "x.json")])
    assert bad.exit_code == 2 and "--repeats must be at least 1" in bad.output


def test_repeated_runs_give_each_figure_its_median_and_say_the_ranges():
    from autopar.profile import median_profile
    runs = [{"name": "x", "peak_tflops": {"fp32": v}, "host_overlaps_device": False, "devices_per_node": 4,
             "intra_node": {"bw_gbps": 1.0, "latency_us": lat}, "notes": {"source": "measured"}}
            for v, lat in ((0.05, 900.0), (0.04, 1200.0), (0.06, 1000.0))]
    out = median_profile(runs, "measured figure")
    assert out["peak_tflops"]["fp32"] == 0.05 and out["intra_node"] == {"bw_gbps": 1.0, "latency_us": 1000.0}
    assert out["host_overlaps_device"] is False and out["devices_per_node"] == 4 and out["name"] == "x"
    assert out["notes"]["source"] == ("measured; each measured figure the median of 3 runs "
                                      "(ranges: intra_node.latency_us 900..1200, peak_tflops.fp32 0.04..0.06)")
    assert runs[0]["notes"]["source"] == "measured"  # the runs are left as they were
    assert median_profile(runs[:1], "measured figure") == runs[0]


TORCHRUN_ABORT = """phase p2p
terminate called without an active exception
E1126 21:29:01.184000 26789 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -6) local_rank: 1
Traceback (most recent call last):
  File "torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 26793)  (SIGTERM)
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 26794)  (SIGABRT)
=======================================================
"""


def test_a_failed_profile_names_what_a_rank_said_and_the_root_cause():
    line = failure(TORCHRUN_ABORT.splitlines())
    assert line.startswith("terminate called without an active exception; rank 1 ")
    assert "-6" in line and "SIGABRT" in line and "=" not in line
    assert failure(["[rank0]: Traceback (most recent call last):", '[rank0]:   File "x.py", line 1',
                    "[rank0]: ValueError: no such shape", "===="]) == "[rank0]: ValueError: no such shape"
    assert failure([]) == "no output"


def test_one_rank_profile_takes_its_links_from_the_named_profile():
    """A single GPU (or one CPU rank) has no peer to time collectives with: its profile carries
    the tiers of the profile --links names, and says so; everything else is its own."""
    from autopar.profile import build_profile, links_profile, with_links
    from cost_models.hardware import profile_from_dict
    rank = {"peak": 7e14, "shaped": [5e14, 6e14], "attention": 4e14, "bw": 3e12, "dispatch": 5e-6,
            "optimizer_tensor": 5e-5, "dtensor": 1e-4, "hooks": 2e-4, "tp_linear": 3e-4, "tp_loss": 2e-3,
            "pp_chunk": 4e-4, "zb_block": 7e-4,
            "checkpoint": {"selective": 4e-4, "full": 1e-3, "op": 3e-3}, "collectives": [], "p2p": []}
    alone = build_profile([rank], 1, 16, "cpu", "bf16", "one", "autopar profile --ranks 1 --links dgx-h100")
    assert "intra_node" not in alone and "intra_node" not in alone["notes"]  # nothing measured, nothing said
    shipped = links_profile("dgx-h100")
    hw = profile_from_dict(with_links(alone, shipped, "dgx-h100"))
    assert hw.intra_node == shipped.intra_node and hw.inter_node == shipped.inter_node
    assert hw.overlap_penalty == shipped.overlap_penalty and "not measured" in hw.notes["overlap_penalty"]
    assert hw.peak_tflops["bf16"] == 700.0 and hw.devices_per_node == 1 and hw.hbm_bw_gbps == 3000.0
    assert hw.checkpoint_us == {"selective": 400.0, "full": 1000.0, "op": 3000.0}
    assert hw.optimizer_tensor_us == 50.0 and hw.dtensor_optimizer_us == 100.0
    assert "--links dgx-h100" in hw.notes["intra_node"] and "not measured" in hw.notes["inter_node"]


def test_the_overlap_penalty_is_the_median_share_a_collective_adds_beside_compute():
    """Each rank's median over the all-reduce sizes, then the median over ranks, within [0, 1]:
    a rank whose collective slowed its GEMMs by more than the collective's own time (a CPU rank
    descheduled meanwhile) counts as hiding nothing, not as more."""
    from autopar.profile import _overlap_penalty
    ranks = [{"overlap": [0.9, 1.1, 0.95]}, {"overlap": [0.6, 0.8, 1.4]}, {"overlap": [1.2, 1.5, 1.3]}]
    assert _overlap_penalty(ranks) == 0.95
    assert _overlap_penalty([{"overlap": [1.6, 2.0, 1.2]}]) == 1.0
    assert _overlap_penalty([{"overlap": [0.0, 0.0, 0.1]}]) == 0.0
