"""The runtime's features composed, on each HF family's twin: 4 gloo ranks against one process,
where ``autopar verify`` (and ``hf_families.py``) proves each feature alone on 2.

    python benchmarks/hf_compositions.py [family ...] [--json]

Two compositions (``COMPOSITIONS``), each trained for ``verify.STEPS`` SGD steps on the twin's
global batch beside one process and compared as ``verify`` compares (losses within
``verify.LOSS_TOL``, every updated weight within ``verify.GRAD_REL_TOL`` of its step):

- ``tp+sp+pp``: tensor parallelism 2 with sequence parallelism inside each of 2 pipeline stages
  (1F1B, 4 micro-batches), the first stage's blocks recomputed selectively, the last's in full;
- ``fsdp+tp+sp``: FSDP2 (ZeRO-3) over 2 data-parallel ranks around tensor parallelism 2 with
  sequence parallelism, per-op recompute.

A composition is run only with the features the family's twin proved alone (a refused feature
is the planner's to leave out); families whose twin has fewer than 2 blocks skip the pipeline.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_families import FAMILIES  # noqa: E402

COMPOSITIONS = {"tp+sp+pp": ("tp", "sp", "pp", "selective"), "fsdp+tp+sp": ("dp", "tp", "sp", "op")}
"""Composition -> the ``verify`` checks it composes."""


def composed_plan(twin: str, name: str):
    """The 4-rank plan of composition ``name`` on ``twin``."""
    from autopar.plan import Mesh, Plan
    from autopar.verify import TWIN_BATCH, twin_shape
    layers, seq = twin_shape(twin)
    kw: dict = dict(model=twin, cluster="cpu-local", gpus=4, global_batch=TWIN_BATCH, seq_len=seq, dtype="fp32",
                    sequence_parallel=True)
    if name == "tp+sp+pp":
        first = layers - layers // 2
        return Plan(mesh=Mesh(tp=2, pp=2), micro_batch_size=1, num_microbatches=4,
                    stage_layers=(first, layers // 2),
                    recompute=("selective",) * first + ("full",) * (layers // 2), **kw)
    return Plan(mesh=Mesh(dp=2, tp=2), zero_stage=3, micro_batch_size=1, num_microbatches=2,
                stage_layers=(layers,), recompute=("op",) * layers, **kw)


def family_row(family: str) -> dict:
    """Each composition's verdict on ``family``'s twin: "ok", why it differs or crashed, or why it
    was not run."""
    import torch

    from autopar.errors import UserError
    from autopar.runtime import RunSpec, run_job
    from autopar.verify import STEPS, _compare, _config, _crash, _reference, twin_shape, verify
    start = time.perf_counter()
    proved = verify(FAMILIES[family])
    twin = proved.twin
    ok = {v.check.value for v in proved.verdicts if v.ok}
    layers, _ = twin_shape(twin)
    todo, out = [], {}
    for name, needs in COMPOSITIONS.items():
        missing = [c for c in needs if c not in ok]
        if missing:
            out[name] = f"not run: the twin refuses {', '.join(missing)} alone"
        elif "pp" in needs and layers < 2:
            out[name] = "not run: one block"
        else:
            todo.append(name)
    if todo:
        ref = _reference(twin)
        for name in todo:
            with tempfile.TemporaryDirectory(prefix="autopar-compose-") as tmp:
                wd = Path(tmp)
                try:
                    (result,) = run_job([RunSpec(plan=composed_plan(twin, name), steps=STEPS, dump=True)],
                                        workdir=wd, cfg=_config(), timeout_s=600)
                except UserError as exc:
                    out[name] = f"crashed: {_crash(str(exc))}"
                    continue
                state: dict = {}
                for f in sorted(wd.glob("run0.final.rank*.pt")):
                    state.update(torch.load(f))
                out[name] = _compare(result.losses, state, ref) or "ok"
    return {"family": family, "seconds": round(time.perf_counter() - start, 1), "compositions": out}


def main(argv: list[str]) -> None:
    from autopar.errors import UserError
    as_json = "--json" in argv
    names = [a for a in argv if not a.startswith("--")] or list(FAMILIES)
    rows: list[dict] = []
    for family in names:
        try:
            row = family_row(family)
        except UserError as exc:
            rows.append({"family": family, "error": str(exc)})
            print(f"{family:16s} error: {exc}", flush=True)
            continue
        rows.append(row)
        if not as_json:
            print(f"{family:16s} {row['seconds']:6.1f} s  " + "  ".join(
                f"{k}: {v[:150]}" for k, v in row["compositions"].items()), flush=True)
    runs = [v for r in rows if isinstance(r.get("compositions"), dict)
            for v in r["compositions"].values() if not v.startswith("not run")]
    print(f"compositions run: {len(runs)}, ok: {sum(v == 'ok' for v in runs)}", flush=True)
    if as_json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
