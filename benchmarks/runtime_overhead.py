"""autopar's generated program against hand-written stock PyTorch at the same configuration.

    python benchmarks/runtime_overhead.py [--steps 12] [--rounds 3]

Three configurations on 4 gloo CPU ranks (one thread each): DDP, FSDP2 ZeRO-3 and a 4-stage
1F1B pipeline, each trained on the same model, batch and synthetic tokens by ``autopar run``'s
runtime and by ``benchmarks/handwritten.py``, each in a torchrun job of its own. Rounds
alternate the two so machine noise hits both; per configuration the table shows the median step time (first 2 steps of each run
dropped as warm-up), the ratio autopar / hand-written of those medians (goal ≤ 1.03) and the spread of the
per-round ratios (each round's autopar median over its hand-written median: lowest, median, highest).
The 4 ranks share the machine's cores: run it on an idle machine (``uptime`` is printed with the table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autopar.plan import Mesh, Plan  # noqa: E402
from autopar.runtime import RunSpec, run_job  # noqa: E402

MODEL = "gpt:layers=8,hidden=256,heads=8,vocab=2048,seq=128,tied=0"
BATCH, WORLD, LAYERS = 16, 4, 8
WARMUP = 2
TIMEOUT_S = 900
"""Longest one torchrun job may take, s."""


def plan_for(kind: str) -> Plan:
    common: dict[str, Any] = dict(model=MODEL, cluster="cpu-local", gpus=WORLD, global_batch=BATCH, seq_len=128,
                                  dtype="fp32", recompute=("none",) * LAYERS)
    if kind == "ddp":
        return Plan(mesh=Mesh(dp=WORLD), zero_stage=0, micro_batch_size=BATCH // WORLD, num_microbatches=1,
                    stage_layers=(LAYERS,), **common)
    if kind == "fsdp":
        return Plan(mesh=Mesh(dp=WORLD), zero_stage=3, micro_batch_size=BATCH // WORLD, num_microbatches=1,
                    stage_layers=(LAYERS,), **common)
    return Plan(mesh=Mesh(pp=WORLD), micro_batch_size=2, num_microbatches=BATCH // 2, schedule="1f1b",
                stage_layers=(LAYERS // WORLD,) * WORLD, **common)


def handwritten(kind: str, steps: int) -> list[float]:
    """The hand-written job's step times. Its rank 0 prints them once every step is done; a rank
    that then aborts in torch 2.13's interpreter teardown (SIGABRT, "terminate called without an
    active exception") fails the job after the measurement, so printed times count whatever the
    exit status. The job writes to a file, not a pipe: a worker torchrun leaves behind would hold
    a pipe open and keep this process waiting after the timeout killed torchrun."""
    with tempfile.TemporaryFile(mode="w+") as out:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc-per-node={WORLD}", str(ROOT / "benchmarks" / "handwritten.py"), kind,
                                 MODEL, str(BATCH), str(steps)], stdout=out, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
        try:
            code = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        out.seek(0)
        text = out.read()
    lines = [line for line in text.splitlines() if line.startswith("[")]
    if not lines:
        raise RuntimeError(f"hand-written {kind} printed no step times (exit {code}): "
                           f"{(text.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    kinds = ["ddp", "fsdp", "pipeline"]
    ours: dict[str, list[list[float]]] = {k: [] for k in kinds}
    theirs: dict[str, list[list[float]]] = {k: [] for k in kinds}
    load_at_start = os.getloadavg()[0]
    for r in range(args.rounds):
        for k in kinds:  # one job each, like the hand-written runs: no state left by another plan
            for autopar_turn in (r % 2 == 0, r % 2 == 1):  # autopar first in even rounds, hand-written in odd
                if autopar_turn:
                    ours[k].append(run_job([RunSpec(plan=plan_for(k), steps=args.steps)], timeout_s=TIMEOUT_S)[0]
                                   .step_times_s[WARMUP:])
                else:
                    theirs[k].append(handwritten(k, args.steps)[WARMUP:])
    print(f"model {MODEL}, global batch {BATCH}, {WORLD} gloo ranks, {args.rounds} rounds x "
          f"{args.steps - WARMUP} timed steps; 1-minute load average {load_at_start:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end")
    print(f"{'configuration':<16}{'autopar s':>12}{'hand-written s':>16}{'ratio':>8}{'per-round ratios':>24}")
    for k in kinds:
        a = statistics.median(t for run in ours[k] for t in run)
        h = statistics.median(t for run in theirs[k] for t in run)
        rounds = sorted(statistics.median(x) / statistics.median(y) for x, y in zip(ours[k], theirs[k]))
        spread = f"{rounds[0]:.3f} {statistics.median(rounds):.3f} {rounds[-1]:.3f}"
        print(f"{k:<16}{a:>12.4f}{h:>16.4f}{a / h:>8.3f}{spread:>24}")


if __name__ == "__main__":
    main()
