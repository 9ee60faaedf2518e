"""Measure again the peak memory of the plans in ``tests/data/memory_measured_cpu.json``.

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/memory_measured.py [--steps 6]

The file holds every plan ``benchmarks/plan_quality.py`` ranked for its three GPTs (written
first from ``plan_quality.py --save``). The runtime changes what it keeps alive more often than
the plans change, so this trains the same plans again on 4 gloo CPU ranks (one job) and
rewrites each row's per-rank peak, as ``autopar.runtime.phases`` measures it; the plans stay.
``tests/test_memory_measured.py`` prices them against the cost model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autopar.calibrate import PROFILED  # noqa: E402
from autopar.plan import plan_from_dict  # noqa: E402
from autopar.runtime import RunSpec, run_job  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "memory_measured_cpu.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=str(DATA), help="where to write (default: the data file itself)")
    args = parser.parse_args()
    data = json.loads(DATA.read_text())
    plans = [plan_from_dict(r["plan"]) for r in data["rows"]]
    start = time.perf_counter()
    runs = run_job([RunSpec(plan=p, steps=args.steps, phases=PROFILED) for p in plans], timeout_s=7200)
    for row, run in zip(data["rows"], runs):
        row["peak_bytes"] = [int(x["peak_bytes"]) for x in run.phases]
    import torch
    data["torch"] = torch.__version__
    data["command"] = f"OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/memory_measured.py --steps {args.steps}"
    rows = data.pop("rows")
    head = json.dumps({**data, "rows": []}, separators=(",", ":"))[:-3]
    body = ",\n".join(json.dumps(r, separators=(",", ":")) for r in rows)
    Path(args.out).write_text(f"{head}[\n{body}]}}\n")
    print(f"{len(runs)} plans measured again in {time.perf_counter() - start:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
