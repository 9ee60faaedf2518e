"""Peak memory against the published runs that report it, and their out-of-memory runs.

    python benchmarks/validate_rows.py --memory

Each row of ``benchmarks/published/*.json`` with a reported peak (``memory_gib``) or that ran
out of memory (metric ``out_of_memory``) is priced as ``validate_rows`` prices its value (its
framework's recipe, its layout, the shipped profiles): the highest pipeline stage's peak, and
whether the plan would be predicted to fit.
"""

from __future__ import annotations

import dataclasses
import statistics

from published_rows import Row as DataRow, Source
from validate_rows import Models, recipe_of, row_strategy, unpriceable

from cost_models import estimate, load_profile


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MemoryResult:
    """A row whose source reports its peak memory or that it ran out of memory, and the
    shipped model's peak for it (the highest pipeline stage's)."""

    source: str
    row: DataRow
    peak_gib: float
    cap_gib: float
    """What a plan may fill on the row's device (``HardwareProfile.memory_bytes``)."""
    fits: bool

    @property
    def error(self) -> float:
        """Predicted peak over the reported one, in % (a reported peak only)."""
        if self.row.memory_gib is None:
            raise ValueError(f"{self.source} {self.row.id} reports no peak memory")
        return 100.0 * (self.peak_gib / self.row.memory_gib - 1.0)


def memory_results(sources: list[Source], models: Models) -> list[MemoryResult]:
    """Every priceable row that reports its peak memory or ran out of memory, under the
    shipped profiles."""
    out = []
    for src in sources:
        for row in src.rows:
            if (row.memory_gib is None and row.metric != "out_of_memory") or unpriceable(src, row):
                continue
            hw, recipe = load_profile(row.cluster), recipe_of(src.source, row)
            assert recipe is not None  # unpriceable said so
            model = models.get(row.model, row.seq_len)
            est = estimate(model, hw, row_strategy(row, model.layers, recipe), global_batch=row.global_batch)
            out.append(MemoryResult(source=src.source, row=row, peak_gib=max(est.stage_peak_bytes) / 2**30,
                                    cap_gib=hw.memory_bytes / 2**30, fits=est.fits))
    return out


def print_memory(results: list[MemoryResult]) -> None:
    print("== peak memory: predicted (allocated) against reported, GiB")
    for m in results:
        if m.row.memory_gib is None:
            verdict = "predicted not to fit" if not m.fits else "PREDICTED TO FIT"
            print(f"  {m.source:<20} {m.row.id:<38} ran out of memory; {m.peak_gib:6.1f} of {m.cap_gib:.1f}: {verdict}")
        else:
            print(f"  {m.source:<20} {m.row.id:<38} {m.row.memory_gib:6.1f} {m.peak_gib:6.1f} {m.error:+7.1f} %")
    errors = [abs(m.error) for m in results if m.row.memory_gib is not None]
    if errors:
        print(f"  reported peaks {len(errors)}: median |error| {statistics.median(errors):.1f} %, max {max(errors):.1f} %")
