"""The per-rank entry point torchrun starts: ``python -m autopar.runtime.worker PLAN... --out F``.

Runs each plan in turn in one process group (plans of one job share the world size, so tests
pay the start-up once), writes ``{"runs": [{"losses", "step_times_s"}, ...]}`` from rank 0,
and optionally each rank's final parameters. Every rank reports its own exception, on one line
to stderr and in full to ``rank<R>.err`` beside the output, so a failure on one rank is not
seen only as the others hanging.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.plan import load_plan
from autopar.runtime.context import build_context, init_distributed
from autopar.runtime.state import full_state
from autopar.runtime.train import TrainConfig, build_program, train


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="autopar.runtime.worker")
    ap.add_argument("plans", nargs="+", type=Path)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dump-params", action="store_true",
                    help="write each plan's final parameters (full tensors) to <out>.params<i>.pt")
    ap.add_argument("--lr", type=float, default=TrainConfig().lr)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    try:
        device = init_distributed(args.timeout_s)
        cfg = TrainConfig(lr=args.lr)
        runs = []
        for i, path in enumerate(args.plans):
            plan = load_plan(path)
            ctx = build_context(plan, device)
            prog = build_program(plan, ctx, cfg)
            result = train(plan, args.steps, ctx, cfg, program=prog)
            runs.append({"losses": result.losses, "step_times_s": result.step_times_s})
            if args.dump_params:
                state = full_state(prog)
                if state is not None:
                    torch.save(state, args.out.with_name(f"{args.out.name}.params{i}.rank{rank}.pt"))
        if rank == 0:
            args.out.write_text(json.dumps({"runs": runs}))
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except Exception as exc:  # report this rank's failure, then let torchrun stop the others
        args.out.with_name(f"rank{rank}.err").write_text(traceback.format_exc())
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"autopar: rank {rank}: {type(exc).__name__}: {first}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
