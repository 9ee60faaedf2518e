"""The report's figures with matplotlib (Agg): each function returns a Figure; ``save`` writes it
as PNG and SVG. Colours are the Okabe-Ito palette (distinguishable with colour-blindness)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import matplotlib  # type: ignore[import-not-found, unused-ignore]

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]  # noqa: E402
from matplotlib.patches import Patch  # type: ignore[import-not-found, unused-ignore]  # noqa: E402

from autopar.report.data import ReportData  # noqa: E402
from autopar.report.page import DPI  # noqa: E402

GIB = 2**30
SEGMENT_COLORS = {"forward": "#0072B2", "recompute": "#56B4E9", "backward": "#D55E00",
                  "weight": "#E69F00", "p2p": "#000000", "dp": "#CC79A7", "optimizer": "#009E73"}
SEGMENT_LABELS = {"forward": "forward", "recompute": "recompute", "backward": "backward",
                  "weight": "weight gradient (W)", "p2p": "p2p send", "dp": "gradient reduction (exposed)",
                  "optimizer": "optimizer step"}
IDLE = "#E8E8E8"
MEMORY_PARTS = (("parameters", "#0072B2"), ("gradients", "#E69F00"), ("optimizer states", "#009E73"),
                ("activations", "#D55E00"), ("recompute workspace", "#F0E442"),
                ("communication buffers", "#CC79A7"), ("reserve (CUDA context)", "#999999"))
MAX_LABELS = 300
"""Micro-batch numbers are written on at most this many bars (and only where they fit)."""
OFF_SCALE = 0.2
"""Below this fraction of the device limit, memory figures leave the limit off their scale."""
RASTER_SEGMENTS = 3000
"""Above this many bars the timeline's bars are rasterised inside the SVG (its size stays small)."""


def _time_unit(seconds: float) -> tuple[float, str]:
    return (1e3, "ms") if seconds < 2 else (1.0, "s")


def save(fig: Any, out: Path, stem: str) -> tuple[Path, Path]:
    """Write ``stem``.png (``DPI``) and ``stem``.svg under ``out``; close the figure."""
    png, svg = out / f"{stem}.png", out / f"{stem}.svg"
    fig.savefig(png, dpi=DPI)
    fig.savefig(svg)
    plt.close(fig)
    return png, svg


def timeline(data: ReportData) -> Any:
    """Pipeline ranks by time: every pass of every micro-batch, sends, idle time (the bubble), and
    the once-per-step tail."""
    tl = data.timeline
    scale, unit = _time_unit(tl.step_s)
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.42 * max(tl.pp, 2)), layout="constrained")
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for g in tl.segments:
        bars.setdefault((g.rank, g.kind), []).append((g.start_s * scale, (g.end_s - g.start_s) * scale))
    raster = len(tl.segments) > RASTER_SEGMENTS
    for r in range(tl.pp):
        ax.broken_barh([(0, tl.flush_s * scale)], (r - 0.4, 0.8), facecolors=IDLE, zorder=1)
    for (r, kind), xs in bars.items():
        h = 0.3 if kind == "p2p" else 0.8
        ax.broken_barh(xs, (r - h / 2, h), facecolors=SEGMENT_COLORS[kind], edgecolor="white",
                       linewidth=0.3 if len(tl.segments) < 2000 else 0, zorder=2, rasterized=raster)
    width_px = 12 * DPI * 0.85
    labels = [g for g in tl.segments if g.kind in ("forward", "backward") and g.micro >= 0
              and (g.end_s - g.start_s) / tl.step_s * width_px > 14]
    if len(labels) <= MAX_LABELS:
        for g in labels:
            ax.text((g.start_s + g.end_s) / 2 * scale, g.rank, str(g.micro), ha="center", va="center",
                    fontsize=7, color="white", zorder=3)
    ax.axvline(tl.flush_s * scale, color="#444444", linestyle=":", linewidth=1, zorder=4)
    ax.set_yticks(range(tl.pp), [f"stage {r}" for r in range(tl.pp)] if tl.pp <= 32 else
                  [str(r) if r % max(1, tl.pp // 16) == 0 else "" for r in range(tl.pp)])
    ax.set_ylim(tl.pp - 0.5, -0.5)
    ax.set_xlim(0, tl.step_s * scale * 1.01)
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel("pipeline rank")
    sched = tl.schedule + (f", v={tl.chunks} chunks per rank" if tl.chunks > 1 else "")
    est = data.estimate.step_time_s
    mbs = f"{tl.num_microbatches} micro-batch{'es' if tl.num_microbatches > 1 else ''}"
    ax.set_title(f"Pipeline schedule: {sched}, pp={tl.pp}, {mbs} - "
                 f"simulated step {tl.step_s * scale:.4g} {unit} (cost model {est * scale:.4g} {unit})",
                 fontsize=10, loc="left")
    present = {kind for _, kind in bars}
    handles = [Patch(facecolor=SEGMENT_COLORS[k], label=SEGMENT_LABELS[k]) for k in SEGMENT_COLORS if k in present]
    handles.append(Patch(facecolor=IDLE, label="idle (bubble)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    ax.annotate("flush", (tl.flush_s * scale, -0.5), xytext=(2, 2), textcoords="offset points",
                fontsize=7, color="#444444", va="bottom", annotation_clip=False)
    return fig


def memory_parts(data: ReportData) -> list[tuple[str, list[float]]]:
    """Bytes per pipeline rank of each ``MEMORY_PARTS`` entry; they add up to each rank's peak."""
    reserve = data.hw.reserve_gib * GIB
    rows: dict[str, list[float]] = {name: [] for name, _ in MEMORY_PARTS}
    for d in data.details:
        mem = d.memory
        rows["parameters"].append(mem.params_bytes)
        rows["gradients"].append(mem.grads_bytes)
        rows["optimizer states"].append(mem.optimizer_bytes)
        rows["activations"].append(mem.activations_bytes)
        rows["recompute workspace"].append(d.workspace_bytes)
        rows["communication buffers"].append(mem.buffers_bytes - d.workspace_bytes - reserve)
        rows["reserve (CUDA context)"].append(reserve)
    return [(name, rows[name]) for name, _ in MEMORY_PARTS]


def memory(data: ReportData) -> Any:
    """Peak bytes per device of each pipeline rank, by kind, against the device's limit."""
    pp = len(data.details)
    fig, ax = plt.subplots(figsize=(max(6.5, min(14, 3 + 0.45 * pp)), 4.6), layout="constrained")
    bottom = [0.0] * pp
    colors = dict(MEMORY_PARTS)
    for name, values in memory_parts(data):
        if not any(v > 0 for v in values):
            continue
        gib = [v / GIB for v in values]
        ax.bar(range(pp), gib, bottom=bottom, color=colors[name], label=name, width=0.7,
               edgecolor="white", linewidth=0.4)
        bottom = [b + g for b, g in zip(bottom, gib)]
    limit = data.hw.memory_bytes / GIB
    peak = max(d.memory.peak_bytes for d in data.details) / GIB
    if peak >= OFF_SCALE * limit:
        ax.axhline(limit, color="#B00000", linewidth=1.2, label=f"plan limit {limit:.1f} GiB")
        if data.hw.allocator_headroom > 0:
            ax.axhline(data.hw.memory_gib, color="#B00000", linewidth=0.8, linestyle="--",
                       label=f"device {data.hw.memory_gib:.1f} GiB")
        ax.set_ylim(0, max(peak, data.hw.memory_gib) * 1.12)
    else:  # the limit would flatten the bars: leave it off the scale and say so
        ax.set_ylim(0, peak * 1.25)
    ax.set_xticks(range(pp), [str(s) if pp <= 24 or s % max(1, pp // 16) == 0 else "" for s in range(pp)])
    ax.set_xlim(-0.5 - max(0, 3 - pp) / 2, pp - 0.5 + max(0, 3 - pp) / 2)
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel("GiB per device")
    ax.set_title(f"Memory per device ({data.hw.device})\npeak {peak:.3g} GiB of {limit:.3g} GiB"
                 + ("" if peak >= OFF_SCALE * limit else " (the limit is off the scale)"), fontsize=10, loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


def step_breakdown(data: ReportData) -> Any:
    """The step on its critical path by kind, and each kind of communication exposed vs
    overlapped."""
    t = data.estimate.time
    scale, unit = _time_unit(data.estimate.step_time_s)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.0), layout="constrained",
                                      gridspec_kw={"height_ratios": [1, 2.2]})
    parts = [("compute", t.compute_s, "#0072B2"), ("tensor parallel", t.tp_comm_s, "#E69F00"),
             ("data parallel / ZeRO", t.dp_comm_s, "#CC79A7"), ("pipeline p2p", t.pp_comm_s, "#000000"),
             ("bubble", t.bubble_s, "#BBBBBB"), ("optimizer step", t.optimizer_s, "#009E73")]
    left = 0.0
    total = data.estimate.step_time_s * scale
    for name, sec, color in parts:
        if sec <= 0:
            continue
        w = sec * scale
        top.barh(0, w, left=left, color=color, edgecolor="white", label=f"{name} {w:.3g} {unit}")
        if w / total > 0.07:
            top.text(left + w / 2, 0, f"{w / total:.0%}", ha="center", va="center", fontsize=8,
                     color="white" if color not in ("#BBBBBB", "#E69F00") else "black")
        left += w
    top.set_xlim(0, total * 1.005)
    top.set_yticks([])
    top.set_title(f"Step time {total:.4g} {unit} on the critical path", fontsize=10, loc="left")
    top.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize=8, frameon=False)
    names = [c.name for c in data.comm]
    exposed = [c.exposed_s * scale for c in data.comm]
    hidden = [c.overlapped_s * scale for c in data.comm]
    ys = range(len(names))
    bottom.barh(ys, exposed, color="#D55E00", label="exposed (on the critical path)")
    bottom.barh(ys, hidden, left=exposed, color="#56B4E9", hatch="//", edgecolor="white",
                label="overlapped (hidden behind compute)")
    for y, e, h in zip(ys, exposed, hidden):
        text = f"  {e:.3g} exposed + {h:.3g} overlapped {unit}" if e + h > 0 else "  none"
        bottom.text(e + h, y, text, va="center", fontsize=8)
    bottom.set_yticks(list(ys), names)
    bottom.invert_yaxis()
    bottom.set_xlabel(f"{unit} per step")
    bottom.set_xlim(0, max([e + h for e, h in zip(exposed, hidden)] + [1e-12]) * 1.35)
    bottom.set_title("Communication: exposed vs overlapped", fontsize=10, loc="left")
    bottom.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, fontsize=8, frameon=False)
    return fig


def alternatives(data: ReportData) -> Any:
    """Predicted step time vs peak memory of the search's best strategies, the plan marked."""
    fig, ax = plt.subplots(figsize=(8, 4.8), layout="constrained")
    alts = data.alternatives
    others = [a for a in alts if not a.is_plan]
    for fits, color, label in ((True, "#0072B2", "alternative (fits)"), (False, "#999999", "alternative (does not fit)")):
        pts = [a for a in others if a.fits == fits]
        if pts:
            ax.scatter([a.peak_bytes / GIB for a in pts], [a.step_time_s for a in pts], s=36, color=color,
                       label=label, zorder=3)
    limit = data.hw.memory_bytes / GIB
    xs = [a.peak_bytes / GIB for a in alts]
    ys = [a.step_time_s for a in alts]
    show_limit = max(xs) >= OFF_SCALE * limit
    lo, hi = min(xs + [limit] * show_limit), max(xs + [limit] * show_limit)
    pad = max((hi - lo) * 0.08, hi * 0.01)
    ax.set_xlim(max(0.0, lo - pad), hi + pad)
    ypad = max((max(ys) - min(ys)) * 0.12, max(ys) * 0.005)
    ax.set_ylim(min(ys) - ypad, max(ys) + ypad)
    for (x, y), ranks in _near(others, (ax.get_xlim(), ax.get_ylim())):
        ax.annotate(",".join(map(str, ranks)), (x, y), xytext=(5, 3), textcoords="offset points",
                    fontsize=7, color="#333333")
    mine = [a for a in alts if a.is_plan]
    if mine:
        a = mine[0]
        ax.scatter([a.peak_bytes / GIB], [a.step_time_s], marker="*", s=260, color="#D55E00",
                   edgecolor="black", linewidth=0.6, label=f"this plan (#{a.rank})" if a.rank else "this plan",
                   zorder=4)
    if show_limit:
        ax.axvline(limit, color="#B00000", linewidth=1, label=f"plan limit {limit:.1f} GiB")
    ax.set_xlabel("predicted peak memory per device (GiB)"
                  + ("" if show_limit else f"; the limit, {limit:.3g} GiB, off the scale"))
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(f"Top {len(alts)} strategies: step time vs peak memory", fontsize=10, loc="left")
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def _near(points: Sequence[Any], lims: tuple[tuple[float, float], tuple[float, float]],
          tol: float = 0.025) -> list[tuple[tuple[float, float], list[int]]]:
    """Alternatives grouped where their markers would overlap (within ``tol`` of the axes),
    so that one label names them all: ((x, y) of the first, ranks)."""
    (x0, x1), (y0, y1) = lims
    groups: list[tuple[tuple[float, float], list[int]]] = []
    for a in points:
        x, y = a.peak_bytes / GIB, a.step_time_s
        for i, ((gx, gy), ranks) in enumerate(groups):
            if abs(x - gx) <= tol * (x1 - x0) and abs(y - gy) <= tol * (y1 - y0):
                ranks.append(a.rank)
                groups[i] = ((max(x, gx), gy), ranks)  # the label goes right of the group
                break
        else:
            groups.append(((x, y), [a.rank]))
    return groups


def measured(data: ReportData) -> Any:
    """Measured step times beside the predicted one."""
    meas = data.measured
    assert meas is not None
    pred = data.estimate.step_time_s
    scale, unit = _time_unit(max(max(meas.step_times_s), pred))
    fig, ax = plt.subplots(figsize=(8, 3.8), layout="constrained")
    xs = range(len(meas.step_times_s))
    colors = ["#BBBBBB" if i == 0 and len(meas.step_times_s) > 1 else "#0072B2" for i in xs]
    ax.bar(xs, [t * scale for t in meas.step_times_s], color=colors, width=0.7)
    ax.axhline(pred * scale, color="#D55E00", linewidth=1.6, label=f"predicted {pred * scale:.4g} {unit}")
    ax.axhline(meas.typical_s * scale, color="#0072B2", linewidth=1, linestyle="--",
               label=f"measured median {meas.typical_s * scale:.4g} {unit} "
                     f"({meas.typical_s / pred:.2f}x predicted)")
    ax.set_xticks(list(xs), [str(i) for i in xs] if len(meas.step_times_s) <= 40 else
                  [str(i) if i % 10 == 0 else "" for i in xs])
    ax.set_xlabel("step (grey: warm-up, left out of the median)")
    ax.set_ylabel(f"step time ({unit})")
    ax.set_title("Predicted vs measured step time", fontsize=10, loc="left")
    ax.legend(loc="upper right", fontsize=8)
    return fig


def _si(x: float, _pos: object = None) -> str:
    """1.2M, 350k: tick labels for throughputs."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def what_if(key: str, values: Sequence[int], rows: Sequence[Any], price: float | None) -> Any:
    """Throughput, MFU and (with a price) cost per million tokens against the swept value;
    ``rows`` are ``whatif.WhatIfRow``. A gpus sweep also draws linear scaling from its first
    point."""
    from matplotlib.ticker import FuncFormatter, NullFormatter  # type: ignore[import-not-found, unused-ignore]

    ok = [(v, r) for v, r in zip(values, rows) if r.estimate is not None]
    panels = [("tokens/s", lambda r: r.estimate.tokens_per_s), ("MFU (%)", lambda r: 100 * r.estimate.mfu)]
    if price is not None:
        panels.append((f"USD per million tokens at ${price:g}/GPU-hour", lambda r: r.cost_per_mtok(price)))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), layout="constrained",
                             squeeze=False)
    spread = len(set(values)) > 1 and max(values) / min(values) >= 4
    for ax, (name, get) in zip(axes[0], panels):
        xs = [v for v, _ in ok]
        ys = [get(r) for _, r in ok]
        ax.plot(xs, ys, marker="o", color="#0072B2", zorder=3)
        if name == "tokens/s" and key == "gpus" and len(ok) > 1:
            ax.plot(xs, [ys[0] * x / xs[0] for x in xs], linestyle="--", color="#999999", linewidth=1,
                    label="linear scaling", zorder=2)
            ax.legend(loc="upper left", fontsize=8)
        for x, y, (_, r) in zip(xs, ys, ok):
            ax.annotate(r.mesh, (x, y), xytext=(0, 7), textcoords="offset points", fontsize=7,
                        ha="center", color="#333333")
        for v, r in zip(values, rows):
            if r.estimate is None:
                ax.axvline(v, color="#B00000", linestyle=":", linewidth=1)
        if spread:
            ax.set_xscale("log", base=2)
        ax.margins(x=0.08)
        ax.set_xticks(list(values), [f"{v:,}" for v in values], rotation=30 if len(values) > 6 else 0)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(key)
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        if not ys:
            continue
        lo, hi = min(ys), max(ys)
        if name == "tokens/s" and lo > 0 and hi / lo >= 4:
            ax.set_yscale("log")
            ax.set_ylim(lo / 1.5, hi * 1.6)
        elif name.startswith("MFU"):
            ax.set_ylim(0, max(hi * 1.2, hi + 5))
        else:
            pad = (hi - lo) * 0.2 or abs(hi) * 0.1 or 1.0
            ax.set_ylim(lo - pad, hi + 1.5 * pad)
        if name == "tokens/s":
            ax.yaxis.set_major_formatter(FuncFormatter(_si))
            ax.yaxis.set_minor_formatter(NullFormatter())
    fig.suptitle(f"What if {key} = {', '.join(f'{v:,}' for v in values)}  (labels: dp x tp x pp"
                 + ("; dotted: no plan fits" if len(ok) < len(rows) else "") + ")", fontsize=10)
    return fig
