"""The fuzz tier, counted: per parser and loader (``tests/fuzz_cases.py``), the cases run, how
many were accepted, and the findings: non-user exceptions (anything but a one-line
``UserError``/``ProfileError``, a hang past ``--case-timeout`` included) and broken promises of
accepted inputs (a plan that does not round-trip or price, a profile without a finite step).

    python benchmarks/fuzz.py [--cases 10000] [--parsers plan,profile] [--seed 0]

Unlike ``pytest -m fuzz`` it does not stop at the first finding: it counts them all and prints
the distinct ones (first input of each). Only public entry points are called, so pointing
PYTHONPATH at an older autopar measures it the same way. Each parser runs in a process of its
own, its address space capped (``--max-memory-gib``) so that an unbounded allocation is a
MemoryError, not a swapping machine, and so that what one parser's inputs leave behind (a half
import after a MemoryError) cannot count against the next. Exit status 1 when anything was found.
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from fuzz_cases import PARSERS, Finding  # noqa: E402


RESULT = "FUZZ-RESULT "
"""Prefix of the child process's result line."""


class CaseTimeout(BaseException):
    """A case ran past ``--case-timeout`` (a BaseException, so no ``except Exception`` in the
    code under test swallows it)."""


def _alarm(signum, frame):  # noqa: ARG001 - signal handler signature
    signal.setitimer(signal.ITIMER_REAL, 1.0)  # again, should this one land where it is ignored (a gc callback)
    raise CaseTimeout()


def run_parser(name: str, cases: int, seed_value: int, case_timeout: float) -> dict:
    """Run ``cases`` inputs of one parser; its counts and distinct findings."""
    strategy, check = PARSERS[name]
    counts: Counter = Counter()
    found: dict[str, tuple[str, str]] = {}  # message -> (kind, first input)

    @seed(seed_value)
    @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def prop(value) -> None:
        counts["run"] += 1
        signal.setitimer(signal.ITIMER_REAL, case_timeout)
        try:
            counts["accepted"] += bool(check(value))
        except Finding as exc:
            counts[exc.kind] += 1
            found.setdefault(f"{exc.kind}: {exc}", (exc.kind, repr(value)[:300]))
        except CaseTimeout:
            counts["exception"] += 1
            found.setdefault(f"exception: no answer within {case_timeout:g} s", ("exception", repr(value)[:300]))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    start = time.perf_counter()
    prop()
    return {"name": name, "time_s": time.perf_counter() - start, "counts": counts, "found": found}


def _child(args: argparse.Namespace) -> int:
    """Run one parser in this process and print its result as one JSON line."""
    cap = int(args.max_memory_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    signal.signal(signal.SIGALRM, _alarm)
    r = run_parser(args.parsers, args.cases, args.seed, args.case_timeout)
    print(RESULT + json.dumps({"name": r["name"], "time_s": r["time_s"], "counts": dict(r["counts"]),
                               "found": r["found"]}), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=10_000, help="inputs per parser")
    ap.add_argument("--parsers", default=",".join(PARSERS), help=f"comma-separated: {', '.join(PARSERS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--case-timeout", type=float, default=60.0, help="seconds one input may take")
    ap.add_argument("--max-memory-gib", type=float, default=12.0, help="address-space cap of each parser's process")
    ap.add_argument("--show", type=int, default=5, help="distinct findings printed per parser")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args)
    total = 0
    print(f"{'parser':<12} {'cases':>7} {'accepted':>9} {'non-user exceptions':>20} {'broken promises':>16} "
          f"{'distinct':>9} {'time s':>8}", flush=True)
    results = []
    for name in args.parsers.split(","):
        proc = subprocess.run([sys.executable, __file__, "--child", "--parsers", name, "--cases", str(args.cases),
                               "--seed", str(args.seed), "--case-timeout", str(args.case_timeout),
                               "--max-memory-gib", str(args.max_memory_gib)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
        if not lines:  # the process itself died: one finding, the run cut short
            r = {"name": name, "time_s": 0.0, "counts": {"exception": 1},
                 "found": {f"exception: the parser's process died (exit {proc.returncode})": ["exception", ""]}}
        else:
            r = json.loads(lines[-1][len(RESULT):])
        c = Counter(r["counts"])
        results.append(r)
        total += c["exception"] + c["promise"]
        print(f"{name:<12} {c['run']:>7} {c['accepted']:>9} {c['exception']:>20} {c['promise']:>16} "
              f"{len(r['found']):>9} {r['time_s']:>8.1f}", flush=True)
    for r in results:
        for message, (_, value) in list(r["found"].items())[:args.show]:
            print(f"\n[{r['name']}] {message[:300]}\n    first input: {value}")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
