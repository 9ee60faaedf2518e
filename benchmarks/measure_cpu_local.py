"""Measure this machine as a cluster of CPU ranks over gloo and write the ``cpu-local`` profile.

    python benchmarks/measure_cpu_local.py [--ranks 4] [--out hardware_profiles/cpu-local.json]

Every figure is measured with ``--ranks`` processes running at once, each with the thread
count the runtime gives a rank (cores // ranks, at least 1), because that is what one rank gets
when the plan runs: per-rank fp32 GEMM FLOP/s (peak: a large square GEMM; matmul efficiency:
the rank's rate on transformer-sized GEMMs relative to it), element-wise bandwidth, and gloo
all-reduce latency and bus bandwidth, and the host time of one eager op (the dispatch floor of
a small model's passes). Medians of repeated timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _gemm_flops(n: int, k: int, m: int, repeats: int) -> float:
    a, b = torch.randn(n, k), torch.randn(k, m)
    return 2.0 * n * k * m / _median_time(lambda: torch.mm(a, b), repeats)


def _worker(rank: int, world: int, port: int, threads: int, queue) -> None:
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dist.barrier()
    peak = _gemm_flops(1024, 1024, 1024, 10)
    dist.barrier()
    # A transformer-sized GEMM: 8 sequences of 64 tokens through a 128 -> 512 MLP projection.
    small = _gemm_flops(512, 128, 512, 50)
    dist.barrier()
    x, y = torch.randn(2**23), torch.randn(2**23)  # 32 MiB each
    bw = 3 * x.numel() * 4 / _median_time(lambda: torch.add(x, y, out=x), 10)
    dist.barrier()
    # Host dispatch of one eager op that autograd records (what a small model's step is made of).
    leaf = torch.zeros(64, requires_grad=True)
    dispatch = _median_time(lambda: [leaf * 2.0 for _ in range(200)], 20) / 200
    dist.barrier()
    tiny = torch.zeros(1)
    alpha = _median_time(lambda: dist.all_reduce(tiny), 50)
    big = torch.zeros(2**22)  # 16 MiB
    t_big = _median_time(lambda: dist.all_reduce(big), 5)
    bus_bw = 2 * (world - 1) / world * big.numel() * 4 / max(t_big - alpha, 1e-9)
    queue.put((rank, peak, small, bw, alpha, bus_bw, dispatch))
    dist.destroy_process_group()


def measure(ranks: int) -> dict:
    """Run the measurements on ``ranks`` concurrent processes; medians over ranks."""
    threads = max(1, (os.cpu_count() or 1) // ranks)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29600 + os.getpid() % 1000
    procs = [ctx.Process(target=_worker, args=(r, ranks, port, threads, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    rows = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    med = [statistics.median(col) for col in list(zip(*rows))[1:]]
    peak, small, bw, alpha, bus_bw, dispatch = med
    cmd = f"python benchmarks/measure_cpu_local.py --ranks {ranks}"
    tier = {"bw_gbps": round(bus_bw / 1e9, 3), "latency_us": round(alpha * 1e6, 1), "efficiency": 1.0}
    return {
        "name": "cpu-local",
        "device": f"CPU rank ({threads} thread{'s' if threads > 1 else ''} of {os.cpu_count()} cores)",
        "devices_per_node": ranks,
        "memory_gib": round(_host_memory_gib() / ranks, 2),
        "peak_tflops": {"fp32": round(peak / 1e12, 5)},
        "hbm_bw_gbps": round(bw / 1e9, 3),
        "intra_node": tier,
        "inter_node": tier,
        "matmul_efficiency": round(min(1.0, small / peak), 3),
        "memory_efficiency": 1.0,
        "reserve_gib": 0.0,
        "kernel_dispatch_us": round(dispatch * 1e6, 2),
        "launcher": "gloo",
        "notes": {
            "source": f"measured by `{cmd}` with {ranks} ranks running at once, {threads} thread(s) each",
            "peak_tflops": "median per-rank fp32 rate of a 1024^3 GEMM",
            "matmul_efficiency": "per-rank rate of a 512x128x512 GEMM divided by the peak",
            "hbm_bw_gbps": "median per-rank rate of a 32 MiB element-wise add (3 arrays touched)",
            "intra_node": "gloo all-reduce: latency of 4 bytes, bus bandwidth of 16 MiB",
            "memory_gib": "host memory divided by the ranks",
            "kernel_dispatch_us": "median host time of one eager op autograd records (x * 2 on 64 floats)",
        },
    }


def _host_memory_gib() -> float:
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
    return kib / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent
                        / "hardware_profiles" / "cpu-local.json")
    args = parser.parse_args()
    profile = measure(args.ranks)
    args.out.write_text(json.dumps(profile, indent=2) + "\n")
    print(json.dumps(profile, indent=2))


if __name__ == "__main__":
    main()
