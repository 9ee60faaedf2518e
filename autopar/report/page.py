"""The report as one self-contained HTML page: CSS inline, figures embedded as base64 PNG, no
script and nothing fetched at view time."""

from __future__ import annotations

import base64
from html import escape
from pathlib import Path
from typing import Collection

from cost_models.strategy import RECOMPUTE
from autopar.report.data import ReportData
from autopar.report.timeline import __doc__ as TIMELINE_DOC

GIB = 2**30
DPI = 150
"""Pixels per inch of the figures' PNGs (``figures.save``)."""
CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:2rem auto;max-width:1200px;
color:#1d1d1d;padding:0 1rem;line-height:1.45}
h1{font-size:1.5rem;margin-bottom:.2rem}h2{font-size:1.15rem;margin-top:2.2rem;border-bottom:1px solid #ddd}
.sub{color:#555;margin-top:0}
.cards{display:flex;flex-wrap:wrap;gap:.8rem;margin:1.2rem 0}
.card{border:1px solid #ddd;border-radius:8px;padding:.6rem 1rem;min-width:9rem}
.card b{display:block;font-size:1.3rem}.card span{color:#666;font-size:.85rem}
.bad b{color:#B00000}
figure{margin:1rem 0}figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{color:#555;font-size:.9rem}
table{border-collapse:collapse;font-size:.88rem;margin:.6rem 0}
th,td{border-bottom:1px solid #e4e4e4;padding:.25rem .7rem;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums}
tr.plan{background:#FFF1E0;font-weight:600}
pre{white-space:pre-wrap;font-size:.8rem;color:#444;background:#fafafa;padding:.8rem;border:1px solid #eee}
"""


def _img(png: Path, alt: str) -> str:
    """The PNG inline, at the size its figure was drawn (``DPI`` pixels per inch shown
    as 96 CSS pixels), so every figure's text reads at the same size."""
    raw = png.read_bytes()
    width = int.from_bytes(raw[16:20], "big") * 96 // DPI  # IHDR width
    data = base64.b64encode(raw).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{escape(alt)}" style="width:{width}px">'


def _figure(png: Path, alt: str, caption: str) -> str:
    return f"<figure>{_img(png, alt)}<figcaption>{caption}</figcaption></figure>"


def _t(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms" if seconds < 2 else f"{seconds:.4g} s"


def _card(value: str, label: str, bad: bool = False) -> str:
    return f'<div class="card{" bad" if bad else ""}"><b>{escape(value)}</b><span>{escape(label)}</span></div>'


def _table(head: list[str], rows: list[list[str]], numeric: Collection[int], marked: Collection[int] = ()) -> str:
    out = ["<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>"]
    for i, row in enumerate(rows):
        cells = "".join(f'<td class="n">{escape(c)}</td>' if j in numeric else f"<td>{escape(c)}</td>"
                        for j, c in enumerate(row))
        out.append(f'<tr{" class=plan" if i in marked else ""}>{cells}</tr>')
    return "".join(out) + "</table>"


def render(data: ReportData, figures: dict[str, Path]) -> str:
    """The page; ``figures`` maps timeline, memory, step, alternatives (and measured) to PNGs."""
    p, e, hw = data.plan, data.estimate, data.hw
    m = p.mesh
    title = f"{p.model} on {p.gpus:,} x {p.cluster}"
    cards = [_card(_t(e.step_time_s), "predicted step time"), _card(f"{e.tokens_per_s:,.0f}", "tokens/s"),
             _card(f"{e.mfu:.1%}", "MFU"), _card(f"{e.tflops_per_gpu:.3g}", "TFLOP/s per device"),
             _card(f"{e.memory.peak_bytes / GIB:.2f} GiB", f"peak of {hw.memory_bytes / GIB:.1f} GiB"
                   + ("" if e.fits else " - DOES NOT FIT"), bad=not e.fits)]
    if data.measured is not None:
        cards.append(_card(_t(data.measured.typical_s), f"measured ({data.measured.typical_s / e.step_time_s:.2f}x)"))
    sched = p.schedule + (f" (v={p.virtual_stages})" if p.virtual_stages > 1 else "")
    rc = ", ".join(f"{mode} x{p.recompute.count(mode)}" for mode in RECOMPUTE if mode in p.recompute)
    facts = [["mesh", f"dp={m.dp} tp={m.tp} pp={m.pp}{f' cp={m.cp}' if m.cp > 1 else ''} (axis order {' > '.join(p.axis_order)}, outermost first)"],
             ["ZeRO stage", str(p.zero_stage)], ["micro-batch x micro-batches", f"{p.micro_batch_size} x {p.num_microbatches}"],
             ["schedule", sched], ["sequence parallel", str(p.sequence_parallel)], ["recompute", rc],
             ["CPU offload", str(p.offload)], ["dtype / recipe", f"{p.dtype} / {p.recipe}"],
             ["global batch x sequence", f"{p.global_batch:,} x {p.seq_len:,}"],
             ["device", f"{hw.device}, {hw.devices_per_node} per node"]]
    tl = data.timeline
    parts = [f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>autopar: {escape(title)}</title>",
             f"<style>{CSS}</style></head><body>",
             f"<h1>{escape(title)}</h1><p class=sub>autopar plan report: what the cost model predicts for this plan, "
             "and why the search chose it.</p>", '<div class="cards">', *cards, "</div>",
             _table(["", ""], facts, set()),
             "<h2>Pipeline schedule</h2>",
             _figure(figures["timeline"], "pipeline timeline",
                     f"Each row is a pipeline rank; bars are the passes of each micro-batch (numbered where they fit), "
                     f"grey is idle time (the bubble: {_t(e.time.bubble_s)} in the cost model), after the dotted line "
                     f"the once-per-step tail. Simulated from the cost model's per-stage times: "
                     f"{_t(tl.step_s)} against its {_t(e.step_time_s)} "
                     f"({tl.step_s / e.step_time_s - 1:+.2%}); how, at the bottom of the page."),
             "<h2>Memory per device</h2>",
             _figure(figures["memory"], "memory per pipeline rank",
                     f"Peak bytes on one device of each pipeline rank, by kind; the solid line is the plan limit "
                     f"(device memory less the allocator headroom of {hw.allocator_headroom:.1%})."
                     + (f" Offloaded state in host memory: {e.memory.host_bytes / GIB:.2f} GiB per device."
                        if p.offload else "")),
             "<h2>Where the step time goes</h2>",
             _figure(figures["step"], "step time breakdown",
                     "Top: the critical path of one step (the slowest stage's micro-batches by kind, the "
                     "bubble, the longest tail). Bottom: each kind of communication, the part on the critical "
                     "path and the part hidden behind compute (the same collectives priced with nothing "
                     f"overlapped, less the exposed part; overlapped collectives still cost "
                     f"{hw.overlap_penalty:.0%} of their time, counted as exposed).")]
    per_stage = [[str(s), str(sum(p.stage_layers[s::p.mesh.pp])),
                  f"{(d.forward_s + d.recompute_s + d.backward_s + d.p2p_s) * 1e3:.4g}",
                  f"{d.forward_s * 1e3:.4g}", f"{d.recompute_s * 1e3:.4g}", f"{d.backward_s * 1e3:.4g}",
                  f"{(d.dp_tail_s + d.optimizer_s) * 1e3:.4g}", f"{d.memory.peak_bytes / GIB:.2f}"]
                 for s, d in enumerate(data.details)]
    parts += ["<h3>Per pipeline rank</h3>",
              _table(["rank", "blocks", "T per micro-batch ms", "forward ms", "recompute ms", "backward ms",
                      "tail ms", "peak GiB"], per_stage, {1, 2, 3, 4, 5, 6, 7})]
    parts.append("<h2>Alternatives</h2>")
    if data.alternatives:
        parts.append(_figure(figures["alternatives"], "step time vs peak memory",
                             f"{escape(data.search_note)}; the star is this plan."))
        rows = [[str(a.rank or "-"), a.summary, _t(a.step_time_s),
                 f"{a.step_time_s / e.step_time_s - 1:+.1%}", f"{a.peak_bytes / GIB:.2f}",
                 f"{a.tokens_per_s:,.0f}", f"{a.mfu:.1%}", "yes" if a.fits else "NO"] for a in data.alternatives]
        parts.append(_table(["#", "strategy", "step", "vs plan", "peak GiB", "tokens/s", "MFU", "fits"], rows,
                            {0, 2, 3, 4, 5, 6}, {i for i, a in enumerate(data.alternatives) if a.is_plan}))
    else:
        parts.append(f"<p>{escape(data.search_note)}</p>")
    if data.measured is not None and "measured" in figures:
        meas = data.measured
        parts += ["<h2>Predicted vs measured</h2>",
                  _figure(figures["measured"], "measured step times",
                          f"{len(meas.step_times_s)} steps of <code>autopar run --json</code>; median "
                          f"{_t(meas.typical_s)} against {_t(e.step_time_s)} predicted."),
                  _table(["step", "measured", "vs predicted", "loss"],
                         [[str(i), _t(t), f"{t / e.step_time_s:.2f}x",
                           f"{meas.losses[i]:.5g}" if i < len(meas.losses) else ""]
                          for i, t in enumerate(meas.step_times_s)], {0, 1, 2, 3})]
    parts += ["<h2>How the schedule is drawn</h2>", f"<pre>{escape(TIMELINE_DOC or '')}</pre>",
              "</body></html>\n"]
    return "".join(parts)
