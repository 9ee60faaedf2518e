"""Every published measured run (benchmarks/published/*.json) through the CLI's own path, and
the fit of the profiles' efficiency constants, in-sample and leave-one-source-out.

    python benchmarks/validate_rows.py [--fit] [--loso] [--source NAME ...]

Each row is priced exactly as ``autopar estimate`` prices it: its model spec traced on meta,
its cluster profile, its layout as a fixed strategy, under the execution recipe of the
framework that ran it (``SOURCE_RECIPE``). The prediction is converted to the row's metric
(tokens/s per GPU, step time, TFLOP/s per GPU in the source's FLOP convention). Rows that need
a feature autopar cannot express yet (``Row.needs`` minus ``SUPPORTED``) or a cluster with no
profile are listed as skipped, never silently dropped.

``fit`` chooses, per device family (``FAMILIES``: one chip, one set of fractions of its peak),
the constants in ``FIT_KEYS`` (fused-attention efficiency per kernel, the overlap penalty, and
where no Megatron rows pin them the GEMM and element-wise efficiencies) by
coordinate descent on a grid, minimising the mean over sources of
each source's mean |log(predicted / published)| (every source weighs the same, however many
rows it has). ``loso`` refits without each source in turn and predicts that source with
constants it never saw; a family left with no other source keeps the shipped constants of
the profile, which is said in the output (that error is then not out-of-sample).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from published_rows import (CHECK_ONLY, FEATURE_RECIPE, FEATURES, MEMORY_APPROXIMATED, SOURCE_RECIPE,  # noqa: E402
                            SUPPORTED, Row as DataRow, Source, contradicted, load_sources)

from autopar.errors import UserError  # noqa: E402
from autopar.spec import parse_model_spec, with_seq  # noqa: E402
from cost_models import Degrees, HardwareProfile, ModelProfile, Strategy, estimate, load_profile  # noqa: E402
from cost_models.estimate import model_flops_per_step  # noqa: E402
from cost_models.hardware import ProfileError  # noqa: E402
from cost_models.recipe import load_recipe  # noqa: E402
from cost_models.strategy import RECOMPUTE  # noqa: E402

FAMILIES = {"A100": ("dgx-a100-80g", "dgx-a100-40g", "jean-zay-a100-80g"), "H100": ("dgx-h100",),
            "GT": ("grand-teton-h100-96g",), "B200": ("dgx-b200",)}
"""Profiles sharing one chip: the fitted fractions of peak are common to them. Grand Teton's
500 W H100 is a family of its own: the H100 die, whose fractions its profile carries over
from dgx-h100, under a power cap that lowers the clock its tensor cores sustain
(``sustained_clock``, fitted on its rows). B200 carries dgx-h100's fractions too, with a
``sustained_clock`` of its own fitted on its one row that is not check-only (Llama-3 8B)."""
DONORS = {"GT": "H100", "B200": "H100"}
"""Held out, a family no other source prices takes the fitted fractions of this family (the
same die, or the die whose fractions it carries over), not those of the first family priced
(``loso``)."""
GRID = {
    "matmul_efficiency": [x / 100 for x in range(56, 87, 2)],
    "memory_efficiency": [x / 100 for x in range(30, 81, 3)],
    "attention_efficiency:flash2": [x / 100 for x in range(12, 61, 2)],
    "attention_efficiency:triton": [x / 100 for x in range(12, 61, 2)],
    "attention_efficiency:cudnn": [x / 100 for x in range(20, 81, 2)],
    "fp8_matmul_efficiency": [x / 100 for x in range(30, 81, 2)],
    "overlap_penalty": [x / 100 for x in range(0, 101, 5)],
    "sustained_clock": [x / 100 for x in range(60, 101, 2)],
}
"""The constants ``fit`` may choose and their grids."""
FIT_KEYS = {
    "A100": ("attention_efficiency:flash2", "attention_efficiency:triton", "overlap_penalty"),
    "H100": ("matmul_efficiency", "attention_efficiency:triton", "overlap_penalty"),
    "GT": ("sustained_clock",),
    "B200": ("sustained_clock",),
}
"""What is fitted per family. A100's GEMM and element-wise efficiencies stay as the Megatron
fit of Narayanan Table 1 and Korthikanti Tables 4-5 (``validate_published.py --fit``): refit
over every source they would move to 0.74 / 0.58 and Korthikanti's worst row to 4.8 %, its
1F1B and interleaved rows pulling opposite ways (a pipeline-model residual, not a GEMM one).
H100 has no Megatron rows: its constants come from the rows that ran on it, except what was
measured on one H100 (dgx-h100's notes): the element-wise efficiency (``autopar calibrate``),
the GEMM shape law (``matmul_half_dim``, ``matmul_half_depth``), the cuDNN and FlashAttention-2
kernels' efficiencies and sequence laws, and the Float8 GEMMs' ratio to the 16-bit ones
(``TIED``; all ``gpu_kernels.py``). A constant no training row exercises (``_exercised``:
16-bit GEMMs in a fold of FP8 rows only) keeps its shipped value, so that fold is not
out-of-sample for it. On A100 the one-dimension shape law and ``kernel_dispatch_us`` were
tried (0-800, 0-40 us) and fitted to 0; no A100 has measured the two-dimension one."""
TIED = {"H100": {"fp8_matmul_efficiency": ("matmul_efficiency", 0.936)}}
"""Constants that follow a fitted one by a measured ratio, per family: on one H100 deep
Float8 GEMMs run at 0.660 of the fp8 peak where bf16 ones run at 0.705 of theirs (``python
benchmarks/gpu_kernels.py --pool benchmarks/measured/gpu_kernels_h100_*.json``), so the fit
moves the two together (rounded to the grid's 0.01)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Result:
    """One published row and its prediction (``predicted`` None: skipped, ``why``)."""

    source: str
    row: DataRow
    predicted: float | None
    fits: bool = True
    why: str = ""

    @property
    def ratio(self) -> float:
        """Predicted over published (a priced row only)."""
        if self.predicted is None:
            raise ValueError(f"{self.source} {self.row.id} was not priced: {self.why}")
        return self.predicted / self.row.value

    @property
    def log_error(self) -> float:
        return math.log(self.ratio)

    @property
    def error(self) -> float:
        """Relative error in %."""
        return 100.0 * (self.ratio - 1.0)


def recipe_of(source: str, row: DataRow | None = None) -> str | None:
    """The recipe of a source (or of one of its tables, ``source|table``), for ``row`` where
    given: the source's framework with the row's program features (``FEATURE_RECIPE``); None
    where no recipe has them."""
    base = SOURCE_RECIPE.get(source.split("|")[0])
    features = frozenset(row.needs) & FEATURES if row is not None else frozenset()
    if base is None or not features:
        return base
    return FEATURE_RECIPE.get(base, {}).get(features)


def skip_reason(src: Source, row: DataRow) -> str:
    """Why ``row``'s value is not priced ('' where it is)."""
    if row.metric == "out_of_memory":
        return "ran out of memory: no value to price (--memory checks it is predicted not to fit)"
    return unpriceable(src, row)


def unpriceable(src: Source, row: DataRow) -> str:
    """Why autopar cannot price ``row``'s configuration at all ('' where it can)."""
    missing = sorted(set(row.needs) - SUPPORTED)
    if missing:
        return "needs " + ", ".join(missing)
    if recipe_of(src.source, row) is None:
        features = sorted(set(row.needs) & FEATURES)
        return f"no recipe for source {src.source}" + (f" with {', '.join(features)}" if features else "")
    try:
        load_profile(row.cluster)
    except ProfileError:
        return f"no profile {row.cluster}"
    return ""


def row_strategy(row: DataRow, layers: int, recipe: str) -> Strategy:
    """The row's layout as the fixed strategy ``autopar estimate`` would build."""
    mode = "op" if "per_op_sac" in row.needs else row.recompute  # the sources call it selective
    strat = Strategy(mesh=Degrees(dp=row.dp, cp=row.cp, tp=row.tp, pp=row.pp, ep=row.ep), zero=row.zero,
                     micro_batch=row.micro_batch,
                     num_microbatches=row.global_batch // (row.dp * row.micro_batch),
                     sequence_parallel=row.sequence_parallel, recompute=mode,
                     dtype=row.dtype, fp8=row.fp8, recipe=load_recipe(recipe),
                     schedule="interleaved" if row.vpp > 1 else "1f1b", virtual_stages=row.vpp)
    if row.recompute_layers is None:
        return strat
    # ``recompute_layers`` blocks recomputed (spread over the stages), the rest none.
    base = [layers // row.pp + (1 if s < layers % row.pp else 0) for s in range(row.pp)]
    k, counts = row.recompute_layers, []
    for s, n in enumerate(base):
        r = min(n, k // row.pp + (1 if s < k % row.pp else 0))
        c = [0] * len(RECOMPUTE)
        c[0], c[RECOMPUTE.index(mode)] = n - r, r
        counts.append(tuple(c))
    return dataclasses.replace(strat, recompute="none", stage_layers=tuple(base),
                               stage_recompute=tuple(counts))


def _hardware_flops(model: ModelProfile, strat: Strategy, global_batch: int) -> float:
    """Model FLOPs plus what recompute repeats: the blocks' forward (full), the attention
    core's (selective) or every second weight GEMM's (op), per step."""
    counts = dict(zip(RECOMPUTE, (sum(c[i] for c in strat.stage_recompute) for i in range(len(RECOMPUTE))))) \
        if strat.stage_recompute else {m: model.layers if strat.recompute == m else 0 for m in RECOMPUTE}
    per_block = model.block_matmul_flops_per_token + model.block_attn_flops_per_token
    extra = (counts["full"] * per_block + counts["selective"] * model.block_attn_flops_per_token
             + counts["op"] * model.op_recompute_flops_per_token)
    return model_flops_per_step(model, global_batch) + extra * model.seq * global_batch


def predict(row: DataRow, model: ModelProfile, hw: HardwareProfile, recipe: str) -> tuple[float, bool]:
    """(prediction in the row's metric, predicted to fit)."""
    strat = row_strategy(row, model.layers, recipe)
    est = estimate(model, hw, strat, global_batch=row.global_batch)
    if row.metric == "step_time_s":
        value = est.step_time_s
    elif row.metric == "tokens_per_s_per_gpu":
        value = est.tokens_per_s / row.gpus
    elif row.metric == "tflops_per_gpu":
        flops = (_hardware_flops(model, strat, row.global_batch) if row.flops_convention == "hardware"
                 else model_flops_per_step(model, row.global_batch))
        value = flops / (est.step_time_s * row.gpus) / 1e12
    else:
        value = est.mfu
    return value, est.fits


class Models:
    """Traced model profiles by (spec, seq) and predictions by (row, recipe, profile), each made
    once per process: a fit's trials and the leave-one-source-out folds, which all start from
    the shipped constants, price the same row under the same profile many times."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, int], ModelProfile] = {}
        self._predicted: dict[tuple[DataRow, str, str], tuple[float, bool]] = {}

    def get(self, spec: str, seq: int) -> ModelProfile:
        key = (spec, seq)
        if key not in self._cache:
            from autopar.trace import profile_spec
            self._cache[key] = profile_spec(with_seq(parse_model_spec(spec), seq))
        return self._cache[key]

    def predict(self, row: DataRow, hw: HardwareProfile, recipe: str, hw_key: str) -> tuple[float, bool]:
        """``predict`` of ``row`` (a pure function of the row, the profile's every field and
        the recipe), remembered; ``hw_key``: ``repr(hw)``, which names every field."""
        key = (row, recipe, hw_key)
        if key not in self._predicted:
            self._predicted[key] = predict(row, self.get(row.model, row.seq_len), hw, recipe)
        return self._predicted[key]


def evaluate(sources: list[Source], hws: dict[str, HardwareProfile], models: Models) -> list[Result]:
    """Every row of ``sources`` under the profiles ``hws`` (by name; others loaded)."""
    out = []
    hw_keys: dict[str, str] = {}  # repr of each profile, once per call (9 kB: 40 us)
    for src in sources:
        for row in src.rows:
            why = skip_reason(src, row)
            if why:
                out.append(Result(source=src.source, row=row, predicted=None, why=why))
                continue
            hw = hws.get(row.cluster) or load_profile(row.cluster)
            recipe = recipe_of(src.source, row)
            assert recipe is not None  # skip_reason said so
            try:
                if row.cluster not in hw_keys:
                    hw_keys[row.cluster] = repr(hw)
                value, fits = models.predict(row, hw, recipe, hw_keys[row.cluster])
            except (UserError, ValueError) as exc:
                out.append(Result(source=src.source, row=row, predicted=None, why=f"error: {exc}"))
                continue
            out.append(Result(source=src.source, row=row, predicted=value, fits=fits))
    return out


def priced(results: list[Result]) -> list[Result]:
    return [r for r in results if r.predicted is not None]


def objective(results: list[Result]) -> float:
    """Mean over sources of each source's mean |log error|."""
    by: dict[str, list[float]] = {}
    for r in priced(results):
        by.setdefault(r.source, []).append(abs(r.log_error))
    return statistics.fmean(statistics.fmean(v) for v in by.values()) if by else 0.0


def with_constants(hw: HardwareProfile, values: dict[str, float]) -> HardwareProfile:
    """``hw`` with ``values`` (``attention_efficiency:<kernel>`` keys set one kernel)."""
    attn = dict(hw.attention_efficiency)
    out = hw
    for key, value in values.items():
        if key.startswith("attention_efficiency:"):
            attn[key.split(":", 1)[1]] = value
        else:
            out = dataclasses.replace(out, **{key: value})  # type: ignore[arg-type]
    return dataclasses.replace(out, attention_efficiency=attn)


def constants(hw: HardwareProfile) -> dict[str, float]:
    """The values of ``GRID``'s keys in ``hw``."""
    out = {key: (hw.attention_eff(key.split(":", 1)[1]) if key.startswith("attention_efficiency:")
                 else getattr(hw, key)) for key in GRID}
    out["fp8_matmul_efficiency"] = hw.fp8_matmul_efficiency or hw.matmul_efficiency
    return out


def _kernels(sources: list[Source]) -> set[str]:
    """Fused attention kernels the rows of ``sources`` run (by their recipes)."""
    recipes = [load_recipe(r) for r in {recipe_of(s.source, row) for s in sources for row in s.rows} if r]
    return {r.attention_kernel for r in recipes if r.attention.value == "fused"}


def _exercised(key: str, sources: list[Source], kernels: set[str]) -> bool:
    """Whether some row of ``sources`` runs what constant ``key`` prices: its attention kernel
    (``kernels``), Float8 GEMMs (``fp8_matmul_efficiency``), 16-bit ones (``matmul_efficiency``).
    A constant no row exercises keeps its shipped value instead of drifting on what barely
    touches it (the 16-bit head of an FP8 run)."""
    if key.startswith("attention_efficiency:"):
        return key.split(":", 1)[1] in kernels
    if key in ("matmul_efficiency", "fp8_matmul_efficiency"):
        return any(r.fp8 == (key == "fp8_matmul_efficiency") for s in sources for r in s.rows)
    return True


def tied(values: dict[str, float], family: str) -> dict[str, float]:
    """``values`` with the constants ``TIED`` sets in ``family`` recomputed from theirs."""
    return {**values, **{key: round(ratio * values[src], 2) for key, (src, ratio) in TIED.get(family, {}).items()}}


def fit(sources: list[Source], models: Models, sweeps: int = 2) -> dict[str, HardwareProfile]:
    """Per family, the grid values of ``GRID`` minimising ``objective`` on ``sources`` by
    coordinate descent from the shipped constants (``sweeps`` passes over the parameters).
    A family none of ``sources`` prices keeps its shipped constants."""
    hws = {name: load_profile(name) for names in FAMILIES.values() for name in names}
    for family, names in FAMILIES.items():
        mine = [s for s in sources if any(r.cluster in names for r in s.rows)]
        rows = [dataclasses.replace(s, rows=tuple(r for r in s.rows if r.cluster in names
                                                  and not CHECK_ONLY & set(r.needs)))
                for s in mine]
        if not any(priced(evaluate(rows, hws, models))):
            continue
        current = constants(hws[names[0]])
        used = _kernels([s for s in rows if s.rows])
        keys = [k for k in FIT_KEYS[family] if _exercised(k, [s for s in rows if s.rows], used)]
        for _ in range(sweeps):
            for key in keys:
                best: tuple[float, float] | None = None
                for value in [current[key]] + GRID[key]:
                    trial = tied({**current, key: value}, family)
                    trial_hws = {**hws, **{n: with_constants(hws[n], trial) for n in names}}
                    score = objective(evaluate(rows, trial_hws, models))
                    if best is None or score < best[0] - 1e-12:
                        best = (score, value)
                assert best is not None
                current = tied({**current, key: best[1]}, family)
        hws.update({n: with_constants(hws[n], current) for n in names})
    return hws


def summary(results: list[Result]) -> dict[str, tuple[int, float, float]]:
    """Per source and overall: (rows priced, median |error| %, max |error| %)."""
    out = {}
    groups: dict[str, list[Result]] = {}
    for r in priced(results):
        groups.setdefault(r.source, []).append(r)
    groups["all"] = priced(results)
    for name, rs in groups.items():
        errs = [abs(r.error) for r in rs]
        out[name] = (len(rs), statistics.median(errs), max(errs)) if errs else (0, 0.0, 0.0)
    return out


DOCUMENTED = {"dgx-h100": ("flash2", "cudnn"), "grand-teton-h100-96g": ("flash2", "cudnn"),
              "dgx-a100-80g": ("cudnn",), "dgx-a100-40g": ("cudnn",), "jean-zay-a100-80g": ("cudnn",)}
"""Kernels whose ``attention_efficiency`` a profile takes from documentation or a measurement,
not from a fit (its notes say which): usable as out-of-sample priors."""


KERNEL_PRIORS = {"triton": ("flash2", 1.83)}
"""Documented speed of a kernel relative to another, as (reference kernel, slowdown): MPT /
llm-foundry's Triton FlashAttention (FlashAttention-1's algorithm written in Triton) is
"around 1.3-1.5x" slower than FlashAttention-2 in the forward pass and "around 2x" in the
backward (Dao 2023, arXiv:2307.08691, section 4.1, A100); with the backward's 2.5x the
forward's FLOPs, (1.4 + 2.5 x 2) / 3.5 = 1.83x over both. A prior for a held-out source whose
kernel no other source runs, never fitted."""


def loso(sources: list[Source], models: Models, only: frozenset[str] | None = None) -> list[Result]:
    """Each source predicted with constants fitted on the others. A kernel's efficiency that
    only the held-out source pins is replaced by what the others give the same chip: another
    fitted kernel's value, else a documented one (``DOCUMENTED``); a family the others do not
    price at all takes the fitted fractions of the first family they do (``FAMILIES`` order),
    so no held-out row is priced with a constant it determined. A kernel with a documented speed
    relative to a known one (``KERNEL_PRIORS``) takes that instead of the generic prior. ``only``:
    hold out these sources alone (all by default)."""
    out = []
    for held in sources:
        if only is not None and held.source not in only:
            continue
        rest = [s for s in sources if s.source != held.source]
        hws = fit(rest, models)
        donor = None
        for family, names in FAMILIES.items():
            train = [dataclasses.replace(s, rows=tuple(r for r in s.rows if r.cluster in names))
                     for s in rest]
            fitted = _kernels([s for s in train if s.rows])
            if any(s.rows for s in train):
                donor = donor or hws[names[0]]
            elif donor is not None:
                giver = hws[FAMILIES[DONORS[family]][0]] if family in DONORS else donor
                moved = {k: v for k, v in constants(giver).items()
                         if not k.startswith("attention_efficiency:")}
                for name in names:
                    hws[name] = with_constants(hws[name], moved)
            for name in names:
                hw = hws[name]
                known = [k for k in fitted] + list(DOCUMENTED.get(name, ()))
                prior = hw.attention_eff(known[0]) if known else hw.matmul_efficiency

                def unknown(kernel: str) -> float:
                    ref, slowdown = KERNEL_PRIORS.get(kernel, ("", 1.0))
                    return hw.attention_eff(ref) / slowdown if ref in known else prior
                attn = {k: (v if k in known else unknown(k)) for k, v in hw.attention_efficiency.items()}
                hws[name] = dataclasses.replace(hw, attention_efficiency=attn)
        out += evaluate([held], hws, models)
    return out


def by_table(sources: list[Source]) -> list[Source]:
    """Sources split into their published tables (llm-foundry's README has five, measured
    on different clusters) or documents (``[document ...]`` at the start of a row's
    ``assumed``: torchtitan's three benchmark files, Megatron-Bridge's two releases), named
    ``source|table``; a source without tables stays whole."""
    out = []
    for src in sources:
        tables: dict[str, list[DataRow]] = {}
        for row in src.rows:
            text = row.assumed
            title = text.split("'")[1] if text.startswith("[table '") else \
                text[1:].split()[0] if text.startswith("[") else ""
            tables.setdefault(title, []).append(row)
        for title, rows in tables.items():
            name = f"{src.source}|{title}" if title and len(tables) > 1 else src.source
            out.append(dataclasses.replace(src, source=name, rows=tuple(rows)))
    return out


def _print(results: list[Result], title: str, rows: bool, against: dict[tuple[str, str], str]) -> None:
    """The results (``rows``: each row), per source and overall; ``against``: the rows their own
    source contradicts (``published_rows.contradicted``), marked and summarised apart."""
    print(f"== {title}")
    if rows:
        for r in results:
            if r.predicted is None:
                print(f"  {r.source:<20} {r.row.id:<38} skipped: {r.why}")
            else:
                flag = "" if r.fits else "  PREDICTED NOT TO FIT"
                why = against.get((r.source, r.row.id))
                print(f"  {r.source:<20} {r.row.id:<38} {r.row.value:>10.4g} {r.predicted:>10.4g} "
                      f"{r.error:+7.1f} %{flag}" + (f"  (contradicted: {why})" if why else ""))
    for name, (n, med, mx) in summary(results).items():
        print(f"  {name:<20} rows {n:>4}  median |error| {med:5.1f} %  max {mx:6.1f} %")
    kept = [r for r in results if (r.source, r.row.id) not in against]
    n, med, mx = summary(kept)["all"]
    print(f"  {'all but contradicted':<20} rows {n:>4}  median |error| {med:5.1f} %  max {mx:6.1f} %  "
          f"({len(results) - len(kept)} rows their own source contradicts, marked in --rows)")
    nofit = [r for r in priced(results) if not r.fits and not MEMORY_APPROXIMATED & set(r.row.needs)]
    print(f"  predicted not to fit although they ran: {len(nofit)}")
    approx = [r for r in priced(results) if not r.fits and MEMORY_APPROXIMATED & set(r.row.needs)]
    if approx:
        print(f"  not to fit as priced, a configuration keeping more than the run (MEMORY_APPROXIMATED): "
              f"{', '.join(f'{r.source} {r.row.id}' for r in approx)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="refit the constants on all sources")
    parser.add_argument("--loso", action="store_true", help="leave-one-source-out errors")
    parser.add_argument("--by-table", action="store_true",
                        help="with --loso: leave out one published table at a time")
    parser.add_argument("--rows", action="store_true", help="print every row")
    parser.add_argument("--memory", action="store_true",
                        help="peak memory against the sources that report it, and their out-of-memory runs")
    args = parser.parse_args()
    sources, models = load_sources(), Models()
    if args.memory:
        from published_memory import memory_results, print_memory
        print_memory(memory_results(sources, models))
        return
    hws = fit(sources, models) if args.fit else {}
    if args.fit:
        for family, names in FAMILIES.items():
            print(f"{family}: " + ", ".join(f"{k}={v:g}" for k, v in constants(hws[names[0]]).items()))
    against = {(src.source, rid): why for src in sources for rid, why in contradicted(src).items()}
    _print(evaluate(sources, hws, models), "in-sample (shipped constants)" if not args.fit
           else "in-sample (refitted)", args.rows, against)
    if args.loso:
        held = [s for s in sources if any(not skip_reason(s, r) for r in s.rows)]
        if args.by_table:
            held = by_table(held)
        results = [dataclasses.replace(r, source=r.source.split("|")[0]) for r in loso(held, models)]
        _print(results, "leave-one-table-out" if args.by_table else "leave-one-source-out", args.rows, against)


if __name__ == "__main__":
    main()
