"""The kernel rates a GPU profile's constants stand for, measured on the local GPU: GEMMs with
one small dimension (bf16, and fp8 through ``torch._scaled_mm`` with tensor-wise scales, as
torchao's Float8Linear and Transformer Engine's delayed scaling run them), each fused SDPA
backend's causal forward and backward, the kernels an unforced SDPA runs, the dynamic Float8
cast, and the routed experts' grouped GEMMs of the published mixture-of-experts runs against
their price (``GROUPED``).

    python benchmarks/gpu_kernels.py --out gpu_kernels.json     # one GPU, about a minute
    python benchmarks/gpu_kernels.py --pool benchmarks/measured/gpu_kernels_h100_*.json  # the fit

For each dtype it fits the cost model's GEMM shape law (``cost_models.compute.gemm_efficiency``),
e · m/(m+H) · n/(n+H) · k/(k+D) for an (m x k) @ (k x n) product, to the rates of three
families of shapes with one dimension small (few tokens; a tp-split output; a tp-split input);
then checks the bf16 law out of sample on transformer linears' forward and backward (input and weight
gradients at their own shapes).
Rates are FLOP/s over the datasheet peak of ``--profile`` (default dgx-h100), counted as the
cost model counts them (attention: ``attention.causal_fraction`` of 4·b·h·s²·d forward and
``FLASH_BWD_RATIO`` times that backward). Medians of CUDA-event timed repeats after warm-up.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from cost_models.attention import FLASH_BWD_RATIO, causal_fraction
from cost_models.hardware import load_profile

SMALL = (128, 256, 512, 1024, 2048, 4096, 8192)
"""The small dimension of the GEMM families; the other two are ``LARGE``."""
LARGE = 8192
FAMILIES = {"tokens": lambda n: (n, LARGE, LARGE), "out": lambda n: (LARGE, LARGE, n),
            "in": lambda n: (LARGE, n, LARGE)}
"""(m, k, n) of a GEMM (m x k) @ (k x n) with one small dimension: few tokens (a small
micro-batch), a column-parallel output split by tp, a row-parallel input split by tp."""
LINEARS = ((8192, 4096, 6144), (8192, 4096, 28672), (8192, 14336, 4096), (8192, 4096, 768),
           (8192, 512, 4096), (8192, 1792, 4096), (16384, 1536, 4608), (16384, 6144, 1536),
           (2048, 8192, 8192), (4096, 2048, 2048))
"""(tokens, in, out) of the bf16 linears whose forward and backward check the fitted law out
of sample: Llama-3 8B's at tp 1 and 8, a 760M GPT's, few tokens, a 1B GPT's."""
ATTENTION = ((16, 32, 512, 128), (8, 32, 1024, 128), (4, 32, 2048, 128), (2, 32, 4096, 128),
             (1, 32, 8192, 128), (1, 16, 16384, 128), (4, 32, 2048, 64))
"""(batch, heads, sequence, head dim) of the causal SDPA shapes timed."""
BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
GROUPED = {"gpt-oss-120b h100 ep8 mbs1": (16, 1024, 2880, 5760, 2880),
           "gpt-oss-120b b200 ep8 mbs4": (16, 4096, 2880, 5760, 2880),
           "qwen3-30b-a3b ep16 mbs1": (8, 4096, 2048, 1536, 768),
           "deepseek-v3 ep64 mbs1": (4, 8192, 7168, 4096, 2048),
           "mixtral-8x7b ep8 seq4096": (1, 8192, 4096, 28672, 14336)}
"""(local experts, rows per expert, h, gate/up width, expert width) of the routed experts'
grouped GEMMs on one rank of the published mixture-of-experts runs (benchmarks/published/
megatron_bridge_{moe,b200}.json: rows = tokens x topk x ep / experts under even routing) and of
Mixtral; timed as ``torch._grouped_mm`` (what HF's grouped_mm experts and torchtitan run) and
compared with the cost model's ``compute.gemm_s`` of the same ``Gemm``s."""
E4M3_MAX = 448.0
BATCH_S = 5e-3
"""Device seconds of back-to-back calls each timed repeat spans (``timed``)."""


def timed(fn: Callable[[], object], repeats: int = 20) -> float:
    """Median seconds of one call of ``fn`` on the current stream, after 3 warm-ups: each
    repeat times (CUDA events) enough back-to-back calls to fill ``BATCH_S``, so the host
    queues them ahead of the device and no launch latency is counted (one call of a small
    GEMM is a few tens of microseconds, the order of a launch)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    calls = max(1, min(200, int(BATCH_S / max(a.elapsed_time(b) * 1e-3, 1e-6))))
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3 / calls)
    return statistics.median(times)


def gemm_rate(m: int, k: int, n: int, dtype: str) -> float:
    """FLOP/s of an (m x k) @ (k x n) product; fp8: e4m3 operands, tensor-wise fp32 scales,
    bf16 output (the weight operand column-major, as ``_scaled_mm`` requires)."""
    dev = "cuda"
    if dtype == "bf16":
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        fn: Callable[[], object] = lambda: a @ b
    else:
        a = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=dev)
        fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return 2.0 * m * k * n / timed(fn)


def grouped_times(local: int, rows: int, h: int, up: int, f: int, device: str = "cuda",
                  time: Callable[[Callable[[], object]], float] | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of one expert MLP's two grouped GEMMs, bf16 with autograd:
    [local x rows, h] @ [local, h, up] then [local x rows, f] @ [local, f, h], each expert's rows
    contiguous (``offs``), as an expert-parallel rank runs them after its dispatch."""
    time = time or timed
    offs = torch.arange(1, local + 1, device=device, dtype=torch.int32) * rows
    x = torch.randn(local * rows, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    a = torch.randn(local * rows, f, device=device, dtype=torch.bfloat16, requires_grad=True)
    w1 = torch.randn(local, h, up, device=device, dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(local, f, h, device=device, dtype=torch.bfloat16, requires_grad=True)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        return torch._grouped_mm(x, w1, offs=offs), torch._grouped_mm(a, w2, offs=offs)

    def both() -> None:
        y1, y2 = forward()
        torch.autograd.backward([y1, y2], [torch.ones_like(y1), torch.ones_like(y2)])

    fwd = time(lambda: forward())
    return fwd, time(both) - fwd


def grouped_predicted(local: int, rows: int, h: int, up: int, f: int, hw) -> tuple[float, float]:
    """The cost model's (forward, backward) seconds of ``grouped_times``' GEMMs."""
    from cost_models.compute import Gemm, gemm_s, grad_gemms
    gemms = [Gemm(batch=local, m=rows, n=up, k=h), Gemm(batch=local, m=rows, n=h, k=f)]
    return (sum(gemm_s(g, hw, "bf16", 2) for g in gemms),
            sum(gemm_s(x, hw, "bf16", 2) for g in gemms for x in grad_gemms(g)))


def attention_rate(shape: tuple[int, int, int, int], backend: str) -> float | None:
    """FLOP/s of a causal SDPA forward and backward on one backend, None where it cannot run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, h, s, d = shape
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    flops = (1 + FLASH_BWD_RATIO) * 4.0 * b * h * s * s * d * causal_fraction(s)
    try:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return flops / timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(), 10)
    except RuntimeError:
        return None


def default_kernels(shape: tuple[int, int, int, int]) -> list[str]:
    """The CUDA kernels a causal SDPA forward and backward runs with no backend forced (what
    autopar's runtime calls): which backend torch picks on this device."""
    b, h, s, d = shape
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    return sorted(n[:120] for n in names if any(w in n.lower() for w in ("attn", "fmha", "flash", "cudnn", "sdpa")))


def cast_rate(elements: int) -> dict:
    """Bytes/s of a dynamic tensor-wise Float8 cast of a bf16 tensor, eager (amax, scale,
    clamp, cast): counted as the cost model counts it, 2 bytes read for the amax plus 2 read
    and 1 written for the cast, and the kernels' own traffic beside it for comparison."""
    x = torch.randn(elements, device="cuda", dtype=torch.bfloat16)

    def cast() -> torch.Tensor:
        scale = E4M3_MAX / x.abs().max().float().clamp(min=1e-12)
        return (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)

    t = timed(cast)
    compiled = torch.compile(cast)
    tc = timed(compiled)
    return {"elements": elements, "seconds": t, "model_bytes_per_s": 5.0 * elements / t,
            "compiled_seconds": tc, "compiled_model_bytes_per_s": 5.0 * elements / tc}


def linear_times(t: int, i: int, o: int) -> tuple[float, float]:
    """(forward, backward) seconds of a bf16 ``F.linear`` of t tokens, i -> o features: the
    forward's (t x i) @ (i x o) and the backward's input and weight gradients."""
    x = torch.randn(t, i, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(o, i, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(t, o, device="cuda", dtype=torch.bfloat16)
    def step() -> None:
        x.grad = w.grad = None  # fresh gradients: no accumulation kernels
        F.linear(x, w).backward(g)

    fwd = timed(lambda: F.linear(x, w))
    return fwd, timed(step) - fwd


def gemm_time(m: float, k: float, n: float, law: dict, hw) -> float:
    """The cost model's bf16 time of an (m x k) @ (k x n) GEMM (``compute.gemm_s``) with
    ``law``'s constants in ``hw``."""
    import dataclasses
    from cost_models.compute import Gemm, gemm_s
    fitted = dataclasses.replace(hw, matmul_efficiency=law["efficiency"], matmul_half_dim=law["half_dim"],
                                 matmul_half_depth=law["half_depth"])
    return gemm_s(Gemm(batch=1, m=m, n=n, k=k), fitted, "bf16", 2)


def fit_product_law(gemms: list[dict], dtype: str, hw, half_dim: float | None = None) -> dict:
    """e, H, D minimising the squared log error of the cost model's GEMM time over ``gemms``
    of ``dtype`` on ``hw``: the roofline ``compute.gemm_s``, the larger of the FLOPs at
    e · m/(m+H) · n/(n+H) · k/(k+D) of the peak and the operands' bytes at ``hw``'s
    element-wise rate (H on a grid of 0-1024 by 8 unless ``half_dim`` fixes it, D 0-2048 by
    16, e 0.40-1.00 by 0.005), over the compute-bound shapes (``compute_bound``)."""
    peak, elem = hw.peak_flops(dtype), 1 if dtype == "fp8" else 2
    memory_bytes_s = hw.hbm_bw_gbps * 1e9 * hw.memory_efficiency
    gemms = compute_bound(gemms, peak, elem, hw.hbm_bw_gbps * 1e9)
    m, k, n = (np.array([g[x] for g in gemms], float)[:, None] for x in "mkn")
    flops = 2 * m * k * n
    measured = np.log(flops / (np.array([g["efficiency"] for g in gemms])[:, None] * peak))
    mem_s = elem * (m * k + k * n + m * n) / memory_bytes_s
    effs = np.arange(0.40, 1.0001, 0.005)[None, :]
    best = (math.inf, 0.0, 0.0, 0.0)
    for h in np.arange(0.0, 1025.0, 8.0) if half_dim is None else [half_dim]:
        out = m / (m + h) * n / (n + h)
        for d in np.arange(0.0, 2049.0, 16.0):
            t = np.maximum(flops / (peak * effs * out * k / (k + d)), mem_s)
            err = ((np.log(t) - measured) ** 2).sum(axis=0)
            i = int(err.argmin())
            if err[i] < best[0]:
                best = (float(err[i]), float(effs[0, i]), float(h), float(d))
    err, e, h, d = best
    return {"efficiency": e, "half_dim": h, "half_depth": d, "rms_log_error": math.sqrt(err / len(gemms)),
            "shapes": len(gemms)}


def compute_bound(gemms: list[dict], peak: float, elem: float, hbm_bytes_s: float) -> list[dict]:
    """The GEMMs of ``gemms`` whose operands (``elem`` bytes each) at the full HBM bandwidth
    (``hbm_bytes_s``, the profile's datasheet figure) take less than half their measured time: the shape law is fitted on these alone. Thinner
    ones stream their operands at 0.8 of the datasheet bandwidth, a bound that is not the
    law's (the cost model's roofline prices GEMM bytes at ``memory_efficiency``, the
    element-wise kernels' fraction, so it over-prices them; no training GEMM of the rows we
    hold is that thin)."""
    out = []
    for g in gemms:
        m, k, n = g["m"], g["k"], g["n"]
        measured_s = 2.0 * m * k * n / (g["efficiency"] * peak)
        if elem * (m * k + k * n + m * n) / hbm_bytes_s < 0.5 * measured_s:
            out.append(g)
    return out


def fit_laws(runs: list[dict], hw) -> dict[str, dict]:
    """Per dtype, the shape law (``fit_product_law``) fitted to the median efficiency of each
    GEMM shape over ``runs`` (a single GPU's rates move by 5-10 % between runs): bf16's
    asymptote and both half-dims; Float8's asymptote and reduction half-dim, its output
    half-dim the bf16 one (``compute.gemm_efficiency``)."""
    shapes = [(g["dtype"], g["m"], g["k"], g["n"]) for g in runs[0]["gemms"]]
    rates = {s: [g["efficiency"] for r in runs for g in r["gemms"] if (g["dtype"], g["m"], g["k"], g["n"]) == s]
             for s in shapes}
    laws: dict[str, dict] = {}
    for dtype in ("bf16", "fp8"):
        med = [{"m": m, "k": k, "n": n, "efficiency": statistics.median(rates[(d, m, k, n)])}
               for d, m, k, n in shapes if d == dtype]
        laws[dtype] = law = fit_product_law(med, dtype, hw, laws["bf16"]["half_dim"] if laws else None)
        print(f"{dtype}: {law['efficiency']:.3f} * m/(m+{law['half_dim']:.0f}) * n/(n+{law['half_dim']:.0f}) * "
              f"k/(k+{law['half_depth']:.0f}), rms log error {law['rms_log_error']:.3f} over the "
              f"{law['shapes']} of {len(med)} shapes that are compute-bound", flush=True)
    return laws


def pool(paths: list[str], hw) -> None:
    """Print the shape laws (``fit_laws``) and each SDPA backend's sequence law
    (``fit_seq_law``) of the runs in ``paths``."""
    runs = [json.loads(open(p).read()) for p in paths]
    print(f"{len(runs)} runs on {', '.join(sorted({r['device'] for r in runs}))}")
    fit_laws(runs, hw)
    for backend, (e, half, rms, seqs) in seq_laws(runs).items():
        print(f"sdpa {backend}: {e:.3f} * s / (s + {half:.0f}) over seq {seqs[0]}-{seqs[-1]}, head dim 128, "
              f"rms log error {rms:.3f}")
    for backend, (ratio, half) in head_laws(runs).items():
        print(f"sdpa {backend}: head dim 64 runs at {ratio:.3f} of 128's efficiency: d / (d + {half:.1f})")
    grouped: dict[str, list[tuple[float, float]]] = {}
    for r in runs:
        for gr in r.get("grouped", []):
            grouped.setdefault(gr["name"], []).append((gr["forward_predicted_s"] / gr["forward_s"],
                                                       gr["backward_predicted_s"] / gr["backward_s"]))
    for name, ratios in grouped.items():
        print(f"grouped {name}: priced / measured forward {statistics.median(r[0] for r in ratios):.3f}, "
              f"backward {statistics.median(r[1] for r in ratios):.3f} over {len(ratios)} runs")


def head_laws(runs: list[dict]) -> dict[str, tuple[float, float]]:
    """Per SDPA backend, (r, D): r the median over ``runs`` of its efficiency at head dim 64
    over that at 128 on the same (batch, heads, sequence), and D of the law d / (d + D) that
    ratio gives (``HardwareProfile.attention_half_head_dim``): r = 64 (128 + D) / (128 (64 + D))."""
    out = {}
    for backend in BACKENDS:
        ratios = []
        for r in runs:
            eff = {tuple(a["shape"]): a["efficiency"] for a in r["attention"] if a["backend"] == backend}
            ratios += [e / eff[(*shape[:3], 128)] for shape, e in eff.items()
                       if shape[3] == 64 and e and eff.get((*shape[:3], 128))]
        if ratios:
            ratio = statistics.median(ratios)
            out[backend] = (ratio, 8192 * (1 - ratio) / (128 * ratio - 64))
    return out


def seq_laws(runs: list[dict]) -> dict[str, tuple[float, float, float, list[int]]]:
    """Per SDPA backend, (e, S, rms log error, the sequence lengths) of its sequence law
    (``fit_seq_law``) fitted to the median efficiency at each length over ``runs``, head dim
    128."""
    out = {}
    for backend in BACKENDS:
        points: dict[int, list[float]] = {}
        for r in runs:
            for a in r["attention"]:
                if a["backend"] == backend and a["efficiency"] and a["shape"][3] == 128:
                    points.setdefault(a["shape"][2], []).append(a["efficiency"])
        if points:
            seqs = sorted(points)
            out[backend] = (*fit_seq_law(seqs, [statistics.median(points[q]) for q in seqs]), seqs)
    return out


def fit_seq_law(seqs: list[int], effs: list[float]) -> tuple[float, float, float]:
    """(e, S, rms log error) of e · s / (s + S) fitted to attention efficiencies over sequence
    lengths (``HardwareProfile.attention_half_seq``; S on a grid of 0-8192 by 16, e its
    closed-form optimum)."""
    s, eff = np.array(seqs, float), np.log(np.array(effs))
    best = (math.inf, 0.0, 0.0)
    for half in np.arange(0.0, 8193.0, 16.0):
        r = eff - np.log(s / (s + half))
        err = float(((r - r.mean()) ** 2).sum())
        if err < best[0]:
            best = (err, float(np.exp(r.mean())), float(half))
    return best[1], best[2], math.sqrt(best[0] / len(seqs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="dgx-h100", help="profile whose datasheet peaks the rates are over")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--pool", nargs="+", metavar="RUN.json", default=None,
                    help="measure nothing: fit the laws to the per-shape medians of these runs' GEMMs")
    args = ap.parse_args()
    hw = load_profile(args.profile)
    if args.pool:
        pool(args.pool, hw)
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    out: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "profile": hw.name, "peak_tflops": {"bf16": hw.peak_flops("bf16") / 1e12,
                                                     "fp8": hw.peak_flops("fp8") / 1e12},
                 "gemms": [], "attention": [], "casts": []}
    for dtype in ("bf16", "fp8"):
        peak = hw.peak_flops(dtype)
        for family, dims in FAMILIES.items():
            for small in SMALL:
                m, k, n = dims(small)
                rate = gemm_rate(m, k, n, dtype)
                out["gemms"].append({"dtype": dtype, "family": family, "m": m, "k": k, "n": n,
                                     "tflops": rate / 1e12, "efficiency": rate / peak})
                print(f"{dtype} {family:6s} m {m:5d} k {k:5d} n {n:5d}: {rate / 1e12:7.1f} TFLOP/s "
                      f"({rate / peak:.3f} of peak)", flush=True)
    out["laws"] = fit_laws([out], hw)
    law = out["laws"]["bf16"]
    out["linears"] = []
    for t, i, o in LINEARS:
        fwd, bwd = linear_times(t, i, o)
        pred_f = gemm_time(t, i, o, law, hw)
        pred_b = gemm_time(t, o, i, law, hw) + gemm_time(i, t, o, law, hw)
        out["linears"].append({"tokens": t, "in": i, "out": o, "forward_s": fwd, "backward_s": bwd,
                               "forward_predicted_s": pred_f, "backward_predicted_s": pred_b})
        print(f"linear {t:5d} x {i:5d} -> {o:5d}: forward {fwd * 1e3:6.3f} ms (law {pred_f / fwd:.3f}x), "
              f"backward {bwd * 1e3:6.3f} ms (law {pred_b / bwd:.3f}x; twice the forward "
              f"{2 * fwd / bwd:.3f}x)", flush=True)
    for shape in ATTENTION:
        for backend in BACKENDS:
            arate = attention_rate(shape, backend)
            eff = None if arate is None else arate / hw.peak_flops("bf16")
            out["attention"].append({"shape": list(shape), "backend": backend,
                                     "tflops": None if arate is None else arate / 1e12, "efficiency": eff})
            print(f"sdpa {backend:20s} {shape}: " + ("unavailable" if arate is None else
                  f"{arate / 1e12:6.1f} TFLOP/s ({eff:.3f} of peak)"), flush=True)
    out["grouped"] = []
    for name, (local, rows, h, up, f) in GROUPED.items():
        fwd, bwd = grouped_times(local, rows, h, up, f)
        pf, pb = grouped_predicted(local, rows, h, up, f, hw)
        flops = 2.0 * local * rows * (h * up + f * h)
        out["grouped"].append({"name": name, "local": local, "rows": rows, "h": h, "up": up, "f": f,
                               "forward_s": fwd, "backward_s": bwd,
                               "forward_predicted_s": pf, "backward_predicted_s": pb})
        print(f"grouped {name}: forward {flops / fwd / 1e12:6.1f} TFLOP/s (priced {pf / fwd:.3f}x), "
              f"backward {2 * flops / bwd / 1e12:6.1f} TFLOP/s (priced {pb / bwd:.3f}x)", flush=True)
    out["default_attention_kernels"] = default_kernels(ATTENTION[3])
    print(f"sdpa with no backend forced runs: {out['default_attention_kernels']}", flush=True)
    for elements in (2 ** 24, 2 ** 27):
        c = cast_rate(elements)
        c["memory_efficiency"] = c["model_bytes_per_s"] / (hw.hbm_bw_gbps * 1e9)
        c["compiled_memory_efficiency"] = c["compiled_model_bytes_per_s"] / (hw.hbm_bw_gbps * 1e9)
        out["casts"].append(c)
        print(f"fp8 cast of {elements} elements: eager {c['seconds'] * 1e3:.3f} ms, torch.compile "
              f"{c['compiled_seconds'] * 1e3:.3f} ms: {c['memory_efficiency']:.3f} and "
              f"{c['compiled_memory_efficiency']:.3f} of {args.profile}'s HBM at the model's 5 "
              "bytes/element", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
