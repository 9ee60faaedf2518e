"""Elastic restarts lose no training: a rank SIGKILLed mid-run (``runtime.faults``, a test
hook honoured on torchrun's first attempt only), torchrun ``--max-restarts 1`` restarts the
workers, and each resumes from the latest complete checkpoint of its ``--save`` store, drawing
the same batches by step. The losses of every step then equal an uninterrupted run's of the
same plan in the same job, bit for bit: the restart reloads weights and AdamW state exactly
(DCP), and the same plan sums the same numbers in the same order (tolerance 0).

4 gloo ranks (dp2 x tp2), a 2-block GPT, 8 steps saved every 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopar import checkpoint_dir as cd
from autopar.plan import Mesh, Plan
from autopar.runtime import RunSpec, run_job
from autopar.runtime.faults import Fault

GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,tied=0"
STEPS = 8
PLAN = Plan(model=GPT, cluster="cpu-local", gpus=4, global_batch=8, seq_len=8, dtype="fp32", mesh=Mesh(dp=2, tp=2),
            micro_batch_size=2, num_microbatches=2, stage_layers=(2,), recompute=("none",) * 2)


def _first_step(workdir: Path, attempt: int) -> int:
    """The first step rank 0 trained in ``attempt`` (its stdout: ``step N: loss ...``)."""
    [log] = workdir.glob(f"logs/*/attempt_{attempt}/0/stdout.log")
    return int(next(line for line in log.read_text().splitlines() if line.startswith("step ")).split()[1][:-1])


@pytest.mark.slow
@pytest.mark.parametrize("fault, where", [(Fault.STEP, "1:5"), (Fault.SAVE, "0:6")],
                         ids=["rank 1 killed before step 5", "rank 0 killed while saving step 6"])
def test_a_killed_rank_resumes_and_loses_nothing(tmp_path, monkeypatch, fault, where):
    """Killed before step 5 the run resumes from step 4; killed while step 6's checkpoint was
    being written (its shards on disk, no manifest) the previous checkpoint, step 4, is still
    the latest and the run resumes from it. Either way every step's loss is the
    uninterrupted run's, and the store ends with the last two checkpoints."""
    monkeypatch.setenv(fault.value, where)
    store = tmp_path / "ck"
    hit, clean = run_job([RunSpec(plan=PLAN, steps=STEPS, save=store, save_every=2),
                          RunSpec(plan=PLAN, steps=STEPS)], workdir=tmp_path / "job", max_restarts=1,
                         timeout_s=300)
    assert not list((tmp_path / "job").glob("logs/*/attempt_2")), "more than one restart"
    assert _first_step(tmp_path / "job", 1) == 4, "the restart did not resume from step 4's checkpoint"
    assert hit.start_step == 0 and len(hit.losses) == STEPS and len(hit.step_times_s) == STEPS
    assert hit.losses == clean.losses  # bit for bit
    assert sorted(p.name for p in store.iterdir()) == ["latest", "step-00000006", "step-00000008"]
    final = cd.verify(store / "step-00000008")
    assert final.run.losses == tuple(clean.losses) and final.step == STEPS and final.samples == STEPS * 8
