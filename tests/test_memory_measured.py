"""Peak memory predicted against measured on the local CPU cluster (issue 14: within 10 %).

``data/memory_measured_cpu.json`` holds the peak of every rank of the 75 plans
``benchmarks/plan_quality.py`` ranks for its three GPTs (4 gloo ranks; measured again by
``benchmarks/memory_measured.py`` when the runtime changes, the command is in the file), measured
by ``autopar.runtime.phases``; each is priced again here under the shipped
``cpu-local`` profile and the cost model as it is now. The peak compared is the largest over
ranks (plan_quality's), predicted as the largest stage's.

torch's zero-bubble schedule (``pipeline.pending``, ``memory.zero_bubble_held_bytes``) and
FSDP2 with one micro-batch (``memory.grads_absent``, the retained all-gather output in
``memory.base_buffer_bytes``) are priced from censuses of the live tensors at the ranks' peaks.
The measurement itself is checked in-process (``runtime.phases``: frees on other threads,
frees of blocks older than the profile, tensors Python holds) and live on 2 ranks.
"""

from __future__ import annotations

import gc
import json
import threading
from pathlib import Path

import pytest
import torch

from autopar.plan import Mesh, Plan, plan_from_dict
from autopar.profiles import profile_spec
from autopar.runtime import RunSpec, phases, run_job
from autopar.runtime.parallelize import uses_ddp
from autopar.spec import parse_model_spec
from cost_models import estimate, load_profile

DATA = json.loads((Path(__file__).parent / "data" / "memory_measured_cpu.json").read_text())
HW = load_profile("cpu-local")
MIB = 2**20


def _name(row: dict) -> str:
    p = row["plan"]
    m = p["mesh"]
    return (f"{row['model']} dp{m['dp']} tp{m['tp']} pp{m['pp']} z{p['zero_stage']} mbs{p['micro_batch_size']} "
            f"m{p['num_microbatches']} {p['schedule']} v{p['virtual_stages']} sp{int(p['sequence_parallel'])} "
            f"rc{p['recompute'][0][0]}")


def _predicted(plan: Plan) -> float:
    prof = profile_spec(parse_model_spec(plan.model))
    return max(estimate(prof, HW, plan.strategy(), global_batch=plan.global_batch).stage_peak_bytes)


def _zero_bubble(plan: Plan) -> bool:
    return plan.schedule == "zero-bubble" and plan.mesh.pp > 1


def _one_microbatch_fsdp(plan: Plan) -> bool:
    m = plan.mesh
    return m.pp == 1 and plan.num_microbatches == 1 and m.dp * m.cp > 1 and not uses_ddp(plan)


ROWS = [(plan_from_dict(r["plan"]), r) for r in DATA["rows"]]
PRICED = ROWS


def _error(plan: Plan, row: dict) -> float:
    return _predicted(plan) / max(row["peak_bytes"]) - 1


def test_the_data_covers_the_grid():
    """All 75 plans, with every family the grid has: DDP, FSDP ZeRO 1-3, tp, pipelines."""
    assert len(ROWS) == 75 and {r["model"] for _, r in ROWS} == {"deep-narrow", "wide", "long-seq"}
    kinds = {(p.zero_stage, p.mesh.tp > 1, p.mesh.pp > 1, p.schedule) for p, _ in ROWS}
    assert {(0, False, False, "1f1b"), (3, False, False, "1f1b"), (1, True, False, "1f1b"),
            (0, False, True, "interleaved"), (2, False, True, "zero-bubble"), (0, False, True, "gpipe")} <= kinds
    assert sum(_zero_bubble(p) for p, _ in ROWS) == 41 and sum(_one_microbatch_fsdp(p) for p, _ in ROWS) == 14


@pytest.mark.parametrize("plan,row", PRICED, ids=[_name(r) for _, r in PRICED])
def test_peak_within_10_percent_of_measured(plan, row):
    err = _error(plan, row)
    assert abs(err) <= 0.10, f"predicted {_predicted(plan) / MIB:.1f} MiB, measured {max(row['peak_bytes']) / MIB:.1f}"


LATER = json.loads((Path(__file__).parent / "data" / "memory_measured_cpu_2.json").read_text())
LATER_ROWS = [(plan_from_dict(r["plan"]), r) for r in LATER["rows"]]


@pytest.mark.parametrize("plan,row", LATER_ROWS, ids=[_name(r) for _, r in LATER_ROWS])
def test_peak_of_the_later_grid_within_10_percent_of_measured(plan, row):
    """The second grid (the ranking under shared cores: ZeRO 1-3 with 1F1B and GPipe under a
    pipeline, which the first grid barely has). ZeRO-3 x pp 2 on the wide model was predicted
    45-58 % high while the gathered weights were counted twice (``states.holds_unsharded``);
    GPipe on it 10-14 % high while every stage was priced with all its micro-batches and all
    its gradients live at once (``memory.forward_first``), long-seq's 4-stage GPipe 10 % low
    without the logits torch's pipelining keeps on the last stage (``memory.stage_output_bytes``)."""
    test_peak_within_10_percent_of_measured(plan, row)


def test_the_later_grid_has_zero_3_under_a_pipeline():
    assert len(LATER_ROWS) == 75 and sum(p.zero_stage == 3 and p.mesh.pp > 1 for p, _ in LATER_ROWS) >= 4


# --- the measurement (runtime.phases) ---------------------------------------------------------

def _steps(opt: torch.optim.Optimizer, work) -> None:
    """Two optimizer steps, each ``zero_grad``, ``work(step)``, ``step`` (what ``summary`` reads
    the second step's start off)."""
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        work(step)
        opt.step()


def _peak_delta(work, opt: torch.optim.Optimizer) -> float:
    with phases.recording(torch.device("cpu")) as prof:
        _steps(opt, work)
    return phases.summary(prof, 2, torch.device("cpu"))["peak_delta_bytes"]


def test_cpu_peak_sees_frees_on_another_thread():
    """A block whose last reference a worker thread drops (gloo's Work objects do it to FSDP's
    collective buffers) is freed there: the profiler alone never sees it go."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1)
    held: list[torch.Tensor] = []

    def work(step: int) -> None:
        for _ in range(3):
            held.append(torch.ones(2**21))  # 8 MiB
            t = threading.Thread(target=held.clear)  # the last reference goes on another thread
            t.start()
            t.join()

    delta = _peak_delta(work, opt)
    assert 8 * MIB <= delta < 9 * MIB  # one block at a time (the profiler's own sum: 24 MiB)


def test_cpu_peak_does_not_count_blocks_older_than_the_profile_twice():
    """The last step's gradients are freed by the first ``zero_grad`` under the profiler, which
    never saw them allocated: from the second step on, their replacements are counted once."""
    p = torch.nn.Parameter(torch.zeros(3 * 2**22))  # 48 MiB (larger than any block a test left)
    opt = torch.optim.SGD([p], lr=0.0)
    p.grad = torch.ones_like(p)  # a step before the profile

    def work(step: int) -> None:
        p.grad = torch.ones_like(p)

    assert _peak_delta(work, opt) < MIB  # (the profiler's own sum: 48 MiB)


def test_live_bytes_counts_every_tensor_python_holds_once():
    """Weights, gradients and optimizer state, plus other live CPU tensors (pipelining's receive
    buffers), each storage once however many views and DTensor wrappers share it."""
    model = torch.nn.Linear(512, 512)  # 1 MiB + 2 KiB
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gc.collect()
    before = phases.live_bytes([model], [opt])
    buffers = [torch.empty(2**18) for _ in range(3)]  # 3 MiB held elsewhere
    views = [b[:10] for b in buffers]
    assert phases.live_bytes([model], [opt]) - before == 3 * MIB
    del buffers, views


def test_live_two_rank_fsdp_peak_matches_the_model():
    """ZeRO-3 on 2 gloo ranks, 2 micro-batches: measured as ``autopar calibrate`` does and
    priced within 10 % (17.4 MiB; the profiler's own accounting read 45.6-49.7 MiB)."""
    model = "gpt:layers=4,hidden=128,heads=4,vocab=256,seq=64,tied=0"
    plan = Plan(model=model, cluster="cpu-local", gpus=2, global_batch=16, seq_len=64, dtype="fp32",
                mesh=Mesh(dp=2), zero_stage=3, micro_batch_size=4, num_microbatches=2, schedule="1f1b",
                stage_layers=(4,), recompute=("none",) * 4)
    (result,) = run_job([RunSpec(plan=plan, steps=4, phases=2)], timeout_s=300)
    measured = max(r["peak_bytes"] for r in result.phases)
    assert len(result.phases) == 2
    assert all(0 < r["optimizer_timed"] < min(result.step_times_s) for r in result.phases)  # CPU: timed unprofiled
    assert abs(_predicted(plan) / measured - 1) <= 0.10, f"measured {measured / MIB:.1f} MiB"


def test_the_loss_peak_is_what_the_recipe_prices():
    """The fp32 cross-entropy of the runtime (and torchtitan's eager loss) peaks at 4 + 8 bytes
    per logit, under ``loss_parallel`` (tp > 1: vocab-sharded logits) at 4 + 12: measured on
    this CPU rank's allocator (``benchmarks/loss_memory.py``) against the autopar recipe."""
    import sys
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from cost_models.recipe import load_recipe
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import loss_memory
    rec = load_recipe("autopar")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain = loss_memory.loss_bytes_per_logit(mesh, 512, 2048, parallel=False)
        sharded = loss_memory.loss_bytes_per_logit(mesh, 512, 2048, parallel=True)
    finally:
        dist.destroy_process_group()
    assert plain == pytest.approx(rec.logits_bytes + rec.loss_backward_bytes, rel=0.01)
    assert sharded == pytest.approx(rec.logits_bytes + rec.loss_parallel_backward_bytes, rel=0.01)
