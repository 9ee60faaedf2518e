"""One device, one process: the runtime's measured step time, MFU and peak memory against the
cost model's estimate for the same plan.

    python benchmarks/single_device.py                       # ~1B GPT on the local GPU (bf16)
    python benchmarks/single_device.py --cluster cpu-local --model gpt:layers=2,hidden=128,heads=4,vocab=512,seq=64 \
        --global-batch 8 --dtype fp32                        # the same path on CPU

autopar plans the model for one device of ``--cluster`` (the solver picks micro-batch,
accumulation and recompute), the runtime trains it in this process on synthetic tokens, and
the script prints medians over the steps after the first. MFU counts the plan's model FLOPs
(no recompute) exactly as the estimate does: measured MFU = predicted MFU × predicted step
time ÷ measured step time. Peak memory is ``torch.cuda.max_memory_allocated`` (allocated
tensors, as the estimate counts them; reserved shown beside it); on CPU it is not measured.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from autopar.runtime.context import ParallelContext
from autopar.runtime.train import TrainConfig, build_program, train
from autopar.workflow import make_plan, read_job

GIB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt:layers=16,hidden=2048,heads=16,vocab=50304,seq=2048,tied=1",
                    help="model spec (default: a 0.9B-parameter GPT)")
    ap.add_argument("--cluster", default="dgx-h100", help="hardware profile of the device")
    ap.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step")
    ap.add_argument("--dtype", default=None, help="bf16 (default where the profile has it) or fp32")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    job = read_job(args.model, args.cluster, 1, args.global_batch, dtype=args.dtype)
    plan, sol = make_plan(job)
    est = sol.estimate
    print(f"model {job.spec.name}: {sol.estimate.tokens_per_s:.0f} tokens/s predicted on one {job.hw.name} device")
    print(f"plan: mbs={plan.micro_batch_size} x {plan.num_microbatches} micro-batches, dtype {plan.dtype}, "
          f"recompute {sorted(set(plan.recompute))}, device {device}")
    ctx = ParallelContext(mesh=None, device=device)
    prog = build_program(plan, ctx, TrainConfig())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = train(plan, args.steps, ctx, program=prog)
    measured = statistics.median(result.step_times_s[1:])
    ratio = est.step_time_s / measured
    print(f"losses: {', '.join(f'{x:.4f}' for x in result.losses)}")
    print(f"step time: predicted {est.step_time_s:.4f} s, measured {measured:.4f} s "
          f"(median of steps 1..{args.steps - 1}), measured/predicted {1 / ratio:.2f}")
    print(f"MFU: predicted {est.mfu:.3f}, measured {est.mfu * ratio:.3f} "
          f"({est.tflops_per_gpu * ratio:.3g} model TFLOP/s)")
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
        print(f"peak memory: predicted {est.memory.peak_bytes / GIB:.2f} GiB, measured {peak / GIB:.2f} GiB "
              f"allocated ({reserved / GIB:.2f} GiB reserved), measured/predicted "
              f"{peak / est.memory.peak_bytes:.2f}")
    else:
        print(f"peak memory: predicted {est.memory.peak_bytes / GIB:.2f} GiB (not measured on CPU)")


if __name__ == "__main__":
    main()
