"""``autopar profile``: measure this machine as a cluster and write a hardware profile.

The parent starts ``--ranks`` processes under torchrun (gloo on CPU, NCCL on GPU), each with
the threads a rank of a plan gets (cores // ranks on CPU), so every figure is what one rank
sees while the others run. Each rank times (medians of repeats):

- GEMMs: a large square one (the peak), and transformer-shaped ones (b·s tokens through
  h -> 3h, h -> 4h, 4h -> h): their rate over the peak is the matmul efficiency;
- an element-wise add over 32 MiB arrays (memory bandwidth);
- the host time of a tiny built-in block's forward and backward, per kernel the cost model
  counts for it (``kernels_per_block``: the per-kernel dispatch floor; on CPU ranks it adds to
  every pass, ``host_overlaps_device`` false), an AdamW step's host time per parameter tensor
  and what a DTensor parameter adds to it (``optimizer_tensor_us``, ``dtensor_optimizer_us``),
  what FSDP2's hooks add per parameter group and micro-batch (``fsdp_hook_us``), what DTensor
  tensor parallelism adds per split Linear and to the vocab-parallel head and loss
  (``tp_linear_us``, ``tp_loss_us``), and what
  ``torch.distributed.pipelining``'s schedules add per model chunk and, under zero-bubble,
  per block (``pp_chunk_us``, ``zb_block_us``), and what activation checkpointing's machinery
  adds per block in each recompute mode (``checkpoint_us``);
- all-reduce, reduce-scatter and all-gather over the whole group, and over pairs side by side
  (4 or more ranks), at message sizes from 4 B to 16 MiB (on CPU ranks each right after a
  block's worth of GEMMs, as a step meets it), and point-to-point send/recv between pairs;
- all-reduces of 1, 4 and 16 MiB issued asynchronously beside GEMMs that last about twice
  their time: what each adds to the GEMMs over its time alone is the share of an overlapped
  collective compute does not hide (``overlap_penalty``: on CPU ranks about 1, gloo's thread
  taking the cores the compute runs on; 0 would be a collective on engines of its own).

Then a reference transformer (``REFERENCE``: a small GPT, data-parallel over every rank) trains
a few steps under the new profile and ``autopar.calibrate`` refits its efficiencies to it (the
GEMM rate inside a training step, the optimizer's and the element-wise throughput, where the
host time of small operators lands): micro-benchmarks miss what a real step does between its
GEMMs. The user's own plans are out of sample; ``autopar calibrate PLAN`` fits one of them.

The all-reduces and all-gathers are fitted, by non-negative least squares over every size at
once, to the cost model's own formulas (``cost_models.comm``): t = c + a(n, bytes)·α +
b(n, bytes)/β, where a and b are what those formulas give for α = 1 s, β = ∞ and for α = 0,
β = 1 B/s, and c the fixed cost of a call (fitted where two group sizes tell it from the
steps'); the reduce-scatters give the tier's ``reduce_scatter_factor`` over that law. The
point-to-point bandwidth is the slope of send/recv time over bytes. Rank 0 writes the profile
(the shipped format, ``cost_models.hardware``) with each figure's source in its notes.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from autopar.errors import UserError
from autopar.profile_bench import (ADD_ELEMENTS, ATTENTION, BURST_GEMMS, CHECKPOINT_DEPTH, CHECKPOINT_SECONDS,
                                   DISPATCH_BLOCK, DISPATCH_RECIPE, HOOK_GROUPS, HOOK_SECONDS, OPTIMIZER_TENSORS,
                                   OVERLAP_SIZES, PIPE_DEPTH, PIPE_MICROBATCHES, PIPE_SECONDS, SHAPES, TP_DEPTHS,
                                   TP_SECONDS, measure)
from cost_models.recipe import load_recipe

if TYPE_CHECKING:
    from autopar.plan import Plan
    from cost_models import HardwareProfile

PHASES = ("gemm", "memory", "dispatch", "collectives", "p2p", "recompute", "pipeline", "reference")
REFERENCE = {"cpu": ("gpt:layers=4,hidden=256,heads=4,vocab=1024,seq=128,tied=0", 4),
             "cuda": ("gpt:layers=8,hidden=2048,heads=16,vocab=32000,seq=2048,tied=0", 2)}
"""The reference transformer per device type and its micro-batch per rank (one micro-batch)."""
REFERENCE_STEPS = 10
"""Steps of the reference run: 2 warm-up, 5 timed, 3 profiled (``autopar.calibrate``)."""


BANDWIDTH_FLOOR = 0.01
"""Least share of the largest timed collective's time ``fit_collectives`` gives its bandwidth
term: below it the noise of a loaded machine, not the link, sets the fitted β."""
LATENCY_FLOOR = 0.01
"""Least share of the smallest timed collective's time ``fit_collectives`` gives its latency
term (the same reason: a link always has some; a fitted 0 is noise)."""


def fit_collectives(rows: list[tuple[str, int, int, float]]) -> tuple[float, float, float, float]:
    """(call s, α s, β bytes/s, reduce-scatter factor) of ``rows`` (kind, group size, bytes,
    seconds) under the cost model's formulas: the fixed cost per call, α per ring step and β
    fitted on the all-reduces and all-gathers (the call's cost only where two or more group
    sizes tell it from the steps', else 0; β at most the rate that leaves ``BANDWIDTH_FLOOR``
    of the largest one's time to its bytes, α at least ``LATENCY_FLOOR`` of the smallest one's
    time over its steps), the factor the median ratio of each reduce-scatter to its ring
    formula under them (gloo reduces the whole buffer: about 2; NCCL's ring: about 1)."""
    from cost_models import comm
    ops = {"all_reduce": comm.all_reduce_s, "all_gather": comm.all_gather_s}

    def unit(n: int, call: float, alpha: float, beta: float) -> comm.Group:
        return comm.Group(size=n, bw_bytes_s=beta, p2p_bytes_s=beta, latency_s=alpha, inter_node=False, call_s=call)
    ring = [row for row in rows if row[0] in ops]
    sizes = {n for _, n, _, _ in ring}
    design = np.array([[ops[k](b, unit(n, 1.0, 0.0, math.inf)), ops[k](b, unit(n, 0.0, 1.0, math.inf)),
                        ops[k](b, unit(n, 0.0, 0.0, 1.0))] for k, n, b, _ in ring])
    if len(sizes) < 2:  # one group size: a call's cost and its steps' are one term
        design = design[:, 1:]
    times = np.array([t for *_, t in ring])
    # Relative error is what a plan's estimate feels: weight each row by 1/t, t at least a
    # quarter of the rows' median (a collective timed no longer than its burst reads ~0).
    weights = 1.0 / np.maximum(times, max(1e-9, float(np.median(times)) / 4))
    fitted = _nonnegative_lstsq(design * weights[:, None], times * weights)
    call, alpha, inv_beta = fitted if len(fitted) == 3 else (0.0, *fitted)
    # Where latency alone explains the times (a loaded machine's noise swamps the bytes), the
    # bandwidth term is below the noise: it is priced at BANDWIDTH_FLOOR of the largest
    # transfer's time, never as infinite bandwidth (which no profile accepts).
    largest = int(np.argmax(design[:, -1]))
    cap = design[largest, -1] / (BANDWIDTH_FLOOR * max(float(times[largest]), 1e-9))
    beta = min(1.0 / inv_beta, cap) if inv_beta > 0 else cap
    smallest = int(np.argmin(design[:, -1]))
    steps = design[smallest, -2]
    alpha = max(alpha, LATENCY_FLOOR * float(times[smallest]) / max(float(steps), 1e-9))
    ratios = [t / comm.reduce_scatter_s(b, unit(n, call, alpha, beta)) for k, n, b, t in rows
              if k == "reduce_scatter" and comm.reduce_scatter_s(b, unit(n, call, alpha, beta)) > 0]
    factor = min(10.0, max(0.1, statistics.median(ratios))) if ratios else 1.0
    return call, alpha, beta, factor


def _nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> tuple[float, ...]:
    """argmin |a x - y| over x >= 0 for a few unknowns: the best least-squares solution over
    every subset of the columns whose solution is non-negative (the optimum lies on a face)."""
    k = a.shape[1]
    best: tuple[float, tuple[float, ...]] | None = None
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        x = np.linalg.lstsq(a[:, cols], y, rcond=None)[0]
        if (x < 0).any():
            continue
        r = float(np.sum((a[:, cols] @ x - y) ** 2))
        if best is None or r < best[0] - 1e-15 * max(1.0, r):
            full = [0.0] * k
            for j, v in zip(cols, x):
                full[j] = float(v)
            best = (r, tuple(full))
    return best[1] if best is not None else (0.0,) * k


def _fit_p2p(rows: list[tuple[int, float]]) -> float:
    """Point-to-point bytes/s: the slope of time over bytes."""
    if len(rows) < 2:
        return 0.0
    x, y = np.array([b for b, _ in rows], dtype=float), np.array([t for _, t in rows])
    slope = np.polyfit(x, y, 1)[0]
    return 1.0 / slope if slope > 0 else 0.0


def build_profile(results: list[dict], world: int, threads: int, device: str, dtype: str, name: str,
                  command: str) -> dict:
    """The hardware profile of the ranks' ``results`` (medians over ranks)."""
    med = lambda key: statistics.median(r[key] for r in results)  # noqa: E731
    peak = med("peak")
    shaped = statistics.median(statistics.median(r["shaped"]) for r in results)
    tier = _tier(results, world) if world > 1 else None
    where = "GPU" if device == "cuda" else f"CPU rank ({threads} thread{'s' if threads > 1 else ''} of {os.cpu_count()} cores)"
    links_note = {"intra_node": (
        f"all-reduce, reduce-scatter and all-gather over {world} ranks at 4 B..16 MiB"
        + ("" if device == "cuda" else f", each right after {BURST_GEMMS} 256^3 GEMMs on every "
           "rank less their time (as a step meets it: autopar.profile_bench._in_step)")
        + (f", and over pairs of ranks side by side ({world // 2} pairs)" if world > 2 and world % 2 == 0 else "")
        + "; each the median over ranks; the fixed cost per call (call_latency_us, where two group sizes tell it "
        "from the steps'), alpha per "
        "ring step and bus bandwidth fitted to cost_models.comm's ring formulas on the all-reduces "
        "and all-gathers by non-negative least squares on relative error; reduce_scatter_factor: median ratio of "
        "the reduce-scatters to their ring formula; p2p_bw_gbps: slope of send/recv time over bytes. "
        "inter_node: one machine measured, the same tier")} if tier else {}
    return {
        "name": name,
        "device": where,
        "devices_per_node": world,
        "memory_gib": round(_device_memory_gib(device) / (1 if device == "cuda" else world), 2),
        "peak_tflops": {dtype: round(peak / 1e12, 5)},
        "hbm_bw_gbps": round(med("bw") / 1e9, 3),
        **({"intra_node": tier, "inter_node": tier, "overlap_penalty": _overlap_penalty(results)}
           if tier else {}),
        "matmul_efficiency": round(min(1.0, shaped / peak), 3),
        "attention_efficiency": {load_recipe(DISPATCH_RECIPE).attention_kernel: round(min(1.0, med("attention") / peak), 3)},
        "memory_efficiency": 1.0,
        "reserve_gib": 0.0,
        "kernel_dispatch_us": round(med("dispatch") * 1e6, 2),
        "optimizer_tensor_us": round(med("optimizer_tensor") * 1e6, 2),
        "dtensor_optimizer_us": round(med("dtensor") * 1e6, 2),
        "fsdp_hook_us": round(med("hooks") * 1e6, 2),
        "tp_linear_us": round(med("tp_linear") * 1e6, 2),
        "tp_loss_us": round(med("tp_loss") * 1e6, 2),
        "pp_chunk_us": round(med("pp_chunk") * 1e6, 2),
        "zb_block_us": round(med("zb_block") * 1e6, 2),
        "checkpoint_us": {mode: round(statistics.median(r["checkpoint"][mode] for r in results) * 1e6, 2)
                          for mode in results[0]["checkpoint"]},
        "host_overlaps_device": device == "cuda",
        "ranks_per_core": 1.0 if device == "cuda" else round(max(1.0, world * threads / (os.cpu_count() or 1)), 3),
        "launcher": "nccl" if device == "cuda" else "gloo",
        "notes": {
            "source": f"measured by `{command}`: {world} ranks running at once, {threads} thread(s) each",
            "peak_tflops": f"median per-rank {dtype} rate of a square GEMM (1024^3 on CPU, 8192^3 on GPU)",
            "matmul_efficiency": f"median rate of the GEMMs {SHAPES[device]} (tokens, in, out) over the peak",
            "hbm_bw_gbps": (f"median per-rank rate of a {ADD_ELEMENTS[device] * 4 >> 20} MiB element-wise add "
                            "(3 arrays touched)"),
            "attention_efficiency": (f"median per-rank rate of a causal scaled_dot_product_attention forward and "
                                     f"backward (batch, heads, seq, head dim {ATTENTION[device]}), its FLOPs as "
                                     f"cost_models.compute counts the fused kernel's, over the peak; under the "
                                     f"{DISPATCH_RECIPE} recipe's kernel family"),
            **links_note,
            **({"overlap_penalty": (
                f"median over ranks and all-reduces of {', '.join(f'{n >> 20} MiB' for n in OVERLAP_SIZES)} over "
                f"every rank of what one adds to GEMMs it runs beside (issued asynchronously before "
                f"them, waited for after; the GEMMs about twice its time), over its time alone; at most "
                f"1 (autopar.profile_bench._overlap)")} if tier else {}),
            "memory_gib": "device memory (GPU) or host memory divided by the ranks (CPU)",
            "kernel_dispatch_us": (f"median host time of a forward and backward of {DISPATCH_BLOCK!r}'s block "
                                   f"over 3 x the {DISPATCH_RECIPE} recipe's kernels_per_block"),
            "host_overlaps_device": "CUDA kernels run behind the host; CPU operators on the thread dispatching them",
            "fsdp_hook_us": (f"median over ranks of (a forward and backward of {HOOK_GROUPS} {DISPATCH_BLOCK!r} "
                             "blocks, each an FSDP2 fully_shard group over the rank alone, weights kept gathered and "
                             "gradients unsynchronised - the same unwrapped, alternated for "
                             f"{HOOK_SECONDS:g} s on every rank at once) / {HOOK_GROUPS + 1} groups "
                             "(autopar.profile_bench._fsdp_hook_s)"),
            "pp_chunk_us": (f"median over ranks of (ScheduleInterleaved1F1B over two chunks of {PIPE_DEPTH} "
                            f"{DISPATCH_BLOCK!r} blocks, a pipeline over the rank alone, at {PIPE_MICROBATCHES} "
                            "micro-batches - the same passes looped, alternated for "
                            f"{PIPE_SECONDS:g} s on every rank at once) per chunk and micro-batch "
                            "(autopar.profile_bench._pipeline_host_s)"),
            "zb_block_us": ("the same of ScheduleInterleavedZeroBubble over ScheduleInterleaved1F1B, per block and "
                            "micro-batch"),
            "checkpoint_us": (f"per recompute mode, median over ranks of (a forward and backward of "
                              f"{DISPATCH_BLOCK!r} at {CHECKPOINT_DEPTH} blocks wrapped by "
                              "autopar.runtime.parallelize.apply_recompute - the same unwrapped, alternated for "
                              f"{CHECKPOINT_SECONDS:g} s on every rank at once) per block, less a block's forward "
                              "dispatch (kernel_dispatch_us x kernels_per_block) for full and op, whose recomputed "
                              "forward the cost model prices (autopar.profile_bench._checkpoint_host_s)"),
            "ranks_per_core": "ranks x threads each over the machine's cores (os.cpu_count), at least 1; 1 on GPUs",
            "tp_linear_us": (f"median over ranks of what autopar.runtime.parallelize.apply_tensor_parallel adds to "
                             f"a forward and backward of {DISPATCH_BLOCK!r} at {TP_DEPTHS[0]} and {TP_DEPTHS[-1]} "
                             "blocks (split over a mesh of the rank alone, against the same unsplit, alternated for "
                             f"{TP_SECONDS:g} s per depth on every rank at once): "
                             "the slope per block over its split Linears (autopar.profile_bench._tp_host_s)"),
            "tp_loss_us": ("the same at no block less one split module (the embedding): the vocab-parallel head "
                           "and loss_parallel's cross-entropy"),
            "optimizer_tensor_us": (f"median over ranks of an AdamW step of {OPTIMIZER_TENSORS} plain parameter "
                                    f"tensors of 64 elements (host time: their operators move 2 KiB) / "
                                    f"{OPTIMIZER_TENSORS}, every rank at once"),
            "dtensor_optimizer_us": (f"median over ranks of (an AdamW step of {OPTIMIZER_TENSORS} DTensor parameters "
                                     f"sharded over the {world} ranks - the same of plain tensors) / {OPTIMIZER_TENSORS}"),
        },
    }


def _overlap_penalty(results: list[dict]) -> float:
    """The share of a collective's time that compute beside it does not hide: the median over
    ranks of each rank's median over ``OVERLAP_SIZES``, within [0, 1]."""
    share = statistics.median(statistics.median(r["overlap"]) for r in results)
    return round(min(1.0, max(0.0, share)), 3)


def _tier(results: list[dict], world: int) -> dict:
    """The measured tier of the ranks' collectives and point-to-point transfers."""
    timed: dict[tuple, list[float]] = {}
    for r in results:  # a rank that reached a collective last times it short: the median over ranks
        for kind, size, nbytes, t in r["collectives"]:
            timed.setdefault((kind, size, nbytes), []).append(t)
    call, alpha, beta, rs_factor = fit_collectives([(*k, statistics.median(ts)) for k, ts in timed.items()])
    p2p = _fit_p2p([row for r in results for row in r["p2p"]])
    return {"bw_gbps": round(beta / 1e9, 4), "latency_us": round(alpha * 1e6, 2),
            "call_latency_us": round(call * 1e6, 2), "efficiency": 1.0,
            "p2p_bw_gbps": round(p2p / 1e9, 4), "reduce_scatter_factor": round(rs_factor, 3)}


def links_profile(links: str) -> "HardwareProfile":
    """The profile ``--links`` names (shipped name or file)."""
    from cost_models import ProfileError
    from cost_models.hardware import load_profile
    try:
        return load_profile(links)
    except ProfileError as exc:
        raise UserError(f"--links: {exc}") from None


def with_links(profile: dict, source: "HardwareProfile", links: str) -> dict:
    """``profile`` (one rank's: no collective measured) with the interconnect tiers of
    ``source`` (``--links links``), its notes saying so."""
    import dataclasses
    note = (f"not measured (one rank has no peer): {source.name}'s tiers (--links {links}), for plans of more "
            "devices than this one")
    return {**profile, "intra_node": dataclasses.asdict(source.intra_node),
            "inter_node": dataclasses.asdict(source.inter_node), "overlap_penalty": source.overlap_penalty,
            "notes": {**profile["notes"], "intra_node": note, "inter_node": note, "overlap_penalty": note}}


def cuda_devices() -> int:
    """GPUs torch sees here (0 without CUDA)."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _device_memory_gib(device: str) -> float:
    if device == "cuda":
        import torch
        return torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
    return kib / 2 ** 20


def worker(out: Path, name: str, command: str) -> None:
    """One rank under torchrun: measure, gather to rank 0, which fits and writes ``out``."""
    import torch
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    say = (lambda phase: print(f"phase {phase}", flush=True)) if rank == 0 else (lambda phase: None)
    dtype = torch.bfloat16 if cuda else torch.float32
    mine = measure(rank, world, device, dtype, say)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        profile = build_profile(gathered, world, torch.get_num_threads(), device.type,
                                "bf16" if cuda else "fp32", name, command)
        out.write_text(json.dumps(profile, indent=2) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def profile_machine(ranks: int, out: Path, name: str, on_phase: Callable[[str, int], None] = lambda p, r: None,
                    repeats: int = 1, links: str | None = None) -> dict:
    """Run the measurements on ``ranks`` local ranks ``repeats`` times; write and return the
    profile: each figure the median of its runs (``median_profile``), then calibrated on as many
    reference runs, each refitted figure again their median. ``on_phase(phase, run)``: progress.
    One rank times no collective: its tiers are those of the profile ``links`` names."""
    if ranks < 1:
        raise UserError(f"--ranks must be at least 1, got {ranks}")
    if ranks == 1 and links is None:
        raise UserError("--ranks 1 times no collective (one rank has no peer): name the profile whose links plans "
                        "of more devices should use, e.g. --links dgx-h100, or profile 2 or more ranks")
    if ranks > 1 and links is not None:
        raise UserError(f"--links lends another profile's links to --ranks 1; {ranks} ranks measure their own: "
                        "drop --links")
    gpus = cuda_devices()
    if gpus and ranks > gpus:
        raise UserError(f"--ranks {ranks}: this machine has {gpus} GPU{'s' if gpus > 1 else ''}; "
                        f"profile --ranks {gpus} or fewer")
    source = links_profile(links) if links is not None else None
    if repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {repeats}")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: directory {out.parent} does not exist")
    threads = max(1, (os.cpu_count() or 1) // ranks)
    command = (f"autopar profile --ranks {ranks}" + (f" --links {links}" if links is not None else "")
               + (f" --repeats {repeats}" if repeats > 1 else ""))
    with tempfile.TemporaryDirectory(prefix="autopar-profile-") as tmp:
        runs = []
        for run in range(repeats):
            result = Path(tmp) / f"profile-{run}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   "-m", "autopar.profile", str(result), name, command]
            env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
            with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
                log = []
                assert proc.stdout is not None
                for line in proc.stdout:
                    log.append(line)
                    if line.startswith("phase "):
                        on_phase(line.split()[1], run)
            if proc.returncode != 0 or not result.is_file():
                raise UserError(f"profiling failed: {failure(log)}")
            measured = json.loads(result.read_text())
            runs.append(with_links(measured, source, str(links)) if source is not None else measured)
        merged = Path(tmp) / "profile.json"
        merged.write_text(json.dumps(median_profile(runs, "measured figure"), indent=2) + "\n")
        fits = []
        for run in range(repeats):
            on_phase("reference", run)
            fits.append(calibrated(merged, ranks, command))
        profile = median_profile(fits, "calibrated figure")
    if repeats > 1:
        profile["notes"]["calibrated"] = f"the first of {repeats} reference runs: {profile['notes']['calibrated']}"
    out.write_text(json.dumps(profile, indent=2) + "\n")
    return profile


def median_profile(runs: list[dict], what: str) -> dict:
    """One profile of several runs of the same measurement: each number the median of its
    runs, the rest (names, notes, flags) the first run's; with more than one run, the source
    note says so of each ``what`` with the range of every figure that differed."""
    spread: dict[str, tuple[float, float]] = {}

    def merge(values: list, path: str):
        first = values[0]
        if isinstance(first, dict):
            return {key: merge([v[key] for v in values], f"{path}.{key}" if path else key) for key in first}
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            if min(values) != max(values):
                spread[path] = (min(values), max(values))
            return statistics.median(values)
        return first
    out = merge(runs, "")
    if len(runs) > 1:
        ranges = ", ".join(f"{path} {lo:.4g}..{hi:.4g}" for path, (lo, hi) in sorted(spread.items()))
        out["notes"]["source"] += (f"; each {what} the median of {len(runs)} runs"
                                   + (f" (ranges: {ranges})" if ranges else ""))
    return out


def failure(log: list[str]) -> str:
    """One line for a failed torchrun: the last error a rank printed (an exception's last line
    or the C++ runtime's ``terminate called``), with the root cause's exit code and signal from
    torchrun's summary; the last line printed where neither is found."""
    lines = [line.strip() for line in log if line.strip() and not line.lstrip().startswith("File ")]
    errors = [line for line in lines if re.match(r"(\[rank\d+\]:\s*)?([\w.]+(Error|Exception)\b|terminate called)", line)
              and "ChildFailedError" not in line]
    exits = [re.sub(r"\s+", " ", line) for line in lines if line.startswith("exitcode")]
    ranks = [line.split(":", 1)[1].strip() for line in lines if line.startswith("rank ")]
    where = f"rank {ranks[-1]}, {exits[-1]}" if exits and ranks else (exits[-1] if exits else "")
    said = errors[-1] if errors else (lines[-1] if lines and not where else "")
    return "; ".join(part for part in (said, where) if part) or "no output"


def reference_plan(profile_file: Path, ranks: int) -> "Plan":
    """The reference transformer (``REFERENCE``) data-parallel over ``ranks``, priced on the
    profile in ``profile_file``."""
    from autopar.plan import Mesh, Plan
    from autopar.spec import parse_model_spec
    data = json.loads(profile_file.read_text())
    model, mbs = REFERENCE["cpu" if data.get("launcher") == "gloo" else "cuda"]
    spec = parse_model_spec(model)
    return Plan(model=model, cluster=str(profile_file), gpus=ranks, global_batch=mbs * ranks, seq_len=spec.seq,
                dtype=next(iter(data["peak_tflops"])), mesh=Mesh(dp=ranks), zero_stage=0, micro_batch_size=mbs,
                num_microbatches=1, schedule="1f1b", stage_layers=(spec.layers,), recompute=("none",) * spec.layers)


def calibrated(profile_file: Path, ranks: int, command: str) -> dict:
    """The profile in ``profile_file`` refitted to a run of the reference plan (``calibrate``)."""
    import dataclasses
    from autopar.calibrate import calibrate_plans
    plan = reference_plan(profile_file, ranks)
    (cal,) = calibrate_plans((plan,), REFERENCE_STEPS, 2, f"`{command}` (reference {plan.model}, dp {ranks}, "
                                                          f"micro-batch {plan.micro_batch_size})", anchor=True)
    out = dataclasses.asdict(cal.profile)
    out["notes"]["source"] += "; then calibrated on a reference run (notes.calibrated)"
    return out


if __name__ == "__main__":
    worker(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
    sys.stdout.flush()
    # Skip the interpreter's teardown: a gloo group still referenced by torch's device-mesh and
    # FSDP state at exit is destroyed among static objects, and its threads then abort the
    # process ("terminate called without an active exception": 1 run in 5-10 here, after the
    # profile was written and every group destroyed).
    os._exit(0)
