"""What each rank of ``autopar profile`` times (``autopar.profile`` starts the ranks, fits and
writes the profile): GEMMs, fused attention, an element-wise add, the host time per kernel, a
DTensor optimizer step, FSDP2's hooks, tensor parallelism's DTensor modules, collectives (over
every rank, and over pairs side by side) and point-to-point transfers. Seconds, bytes and
FLOP/s; medians of repeats."""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable

from cost_models.recipe import load_recipe

DISPATCH_BLOCK = "llama:layers=1,hidden=8,heads=2,kv_heads=2,ffn=16,vocab=8,seq=4"
"""The block whose forward and backward time the host: a pass of the cost model's
``kernels_per_block`` kernels (``DISPATCH_RECIPE``'s count, backward twice the forward's)."""
DISPATCH_RECIPE = "autopar"
SIZES = tuple(4 ** k for k in range(1, 13))
"""Collective message sizes, bytes: 4 B to 16 MiB."""
OPTIMIZER_TENSORS = 48
"""Parameter tensors of the optimizer steps timed for ``dtensor_optimizer_us``."""
BURST_GEMMS = 16
"""256^3 GEMMs each CPU rank runs before a timed collective (``_in_step``): about 10 ms with 4
ranks on 2 cores, the order of one block's pass of the small models CPU ranks train."""
ATTENTION = {"cpu": (4, 4, 512, 32), "cuda": (2, 16, 4096, 128)}
"""(batch, heads, sequence, head dim) of the causal SDPA whose forward and backward give the
fused attention kernel's efficiency (``_attention_rate``)."""
TP_DEPTHS = (2, 6)
"""Blocks of the two tiny models whose split and unsplit passes time ``tp_linear_us``."""
TP_REPEATS = 40
"""Alternated split / unsplit passes timed per depth for ``tp_linear_us``."""
HOOK_GROUPS = 8
"""Blocks, each an FSDP2 group, of the model whose passes time ``fsdp_hook_us``."""
HOOK_REPEATS = 200
"""Alternated wrapped / plain passes timed for ``fsdp_hook_us``."""
SHAPES = {"cpu": ((512, 128, 384), (512, 128, 512), (512, 512, 128), (2048, 512, 2048), (2048, 2048, 512)),
          "cuda": ((8192, 2048, 6144), (8192, 2048, 8192), (8192, 8192, 2048), (8192, 4096, 16384),
                   (8192, 16384, 4096))}
"""(tokens, in, out) of the transformer-shaped GEMMs per device type (b·s through h -> 3h,
h -> 4h, 4h -> h)."""
ADD_ELEMENTS = {"cpu": 2 ** 23, "cuda": 2 ** 27}
"""fp32 elements of each array of the timed element-wise add: 32 MiB on CPU, 512 MiB on GPU
(ten times an H100's 50 MB L2)."""


def _median_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _attention_rate(device, dtype, sync: Callable[[], None]) -> float:
    """FLOP/s of a causal ``scaled_dot_product_attention`` forward and backward (the kernel
    torch dispatches: CPU flash on CPU ranks, FlashAttention-2 or cuDNN on CUDA), counted as
    the cost model counts them (``cost_models.compute``): the forward's 4 b h s² d FLOPs times
    ``causal_fraction(s)``, and the backward ``FLASH_BWD_RATIO`` times that."""
    import torch
    import torch.nn.functional as F
    from cost_models.compute import FLASH_BWD_RATIO, causal_fraction
    b, h, s, d = ATTENTION[device.type]
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    flops = (1 + FLASH_BWD_RATIO) * 4.0 * b * h * s * s * d * causal_fraction(s)
    return flops / _median_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(),
                                10, sync)


def _block_host_s(device, sync: Callable[[], None]) -> float:
    """Forward and backward of one tiny built-in Llama block (``DISPATCH_BLOCK``): host time
    only, its kernels move a few hundred bytes; s."""
    import torch
    from autopar.model import Block
    from autopar.spec import parse_model_spec
    block = Block(parse_model_spec(DISPATCH_BLOCK)).to(device)
    x = torch.randn(1, 4, 8, device=device, requires_grad=True)
    return _median_time(lambda: block(x).sum().backward(), 50, sync)


def _dtensor_step_s(device, world: int, sync: Callable[[], None]) -> float:
    """What a DTensor parameter adds to an AdamW step over a plain tensor, s per parameter
    tensor: ``OPTIMIZER_TENSORS`` small tensors (the step's host time dominates), sharded over
    every rank, against the same as plain tensors. Collective: every rank calls it."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh(device.type, (world,))

    def step_s(sharded: bool) -> float:
        params = []
        for _ in range(OPTIMIZER_TENSORS):
            t = torch.zeros(64 * world, device=device)
            p = torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)]) if sharded else t[:64].clone())
            p.grad = torch.ones_like(p)
            params.append(p)
        opt = torch.optim.AdamW(params, lr=1e-3)
        return _median_time(opt.step, 10, sync)

    return max(0.0, step_s(True) - step_s(False)) / OPTIMIZER_TENSORS


def _fsdp_hook_s(device, world: int, sync: Callable[[], None]) -> float:
    """Host time of FSDP2's hooks per parameter group and micro-batch (forward and backward), s:
    ``HOOK_GROUPS`` tiny blocks each wrapped by ``fully_shard``, weights kept gathered and
    gradients unsynchronised (a pipeline's or an accumulation's inner micro-batch: no
    collective runs), against the same blocks unwrapped, over one more group (the root). Each
    rank shards over a group of its own, so the figure is the hooks' and not the peers'.
    Collective: every rank calls it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    groups = [dist.new_group([r]) for r in range(world)]
    mesh = DeviceMesh.from_group(groups[dist.get_rank()], device.type)
    x = torch.randn(2, 8, device=device)

    def blocks() -> torch.nn.Sequential:
        return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
                                     for _ in range(HOOK_GROUPS))).to(device)

    plain, wrapped = blocks(), blocks()
    for block in wrapped:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    root = fully_shard(wrapped, mesh=mesh, reshard_after_forward=False)
    root.set_requires_gradient_sync(False)
    root.set_reshard_after_backward(False)

    def once(m: torch.nn.Module) -> float:
        t = time.perf_counter()
        m(x).sum().backward()
        sync()
        return time.perf_counter() - t

    once(plain), once(wrapped)
    # alternated, so both see the same contention from the peers on shared cores
    extra = [once(wrapped) - once(plain) for _ in range(HOOK_REPEATS)]
    return max(0.0, statistics.median(extra)) / (HOOK_GROUPS + 1)


def _tp_host_s(device, world: int, sync: Callable[[], None]) -> tuple[float, float]:
    """(per split Linear, for the vocab-parallel head and loss) host time that the runtime's
    tensor parallelism adds to a forward and backward, s: tiny built-in Llamas of
    ``TP_DEPTHS`` blocks (``DISPATCH_BLOCK``'s widths) split by ``apply_tensor_parallel`` over a
    mesh of this rank alone (DTensor dispatches as over many, no collective runs), each against
    the same model unsplit, alternated; the slope over the depths per block's split Linears is
    the first figure, the rest at depth 0 less the embedding's one split module the second.
    Collective: every rank calls it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import loss_parallel
    from autopar.model import build_model, cross_entropy
    from autopar.runtime.context import ParallelContext
    from autopar.runtime.parallelize import apply_tensor_parallel
    from autopar.runtime.train import _traced_layout
    from autopar.spec import parse_model_spec
    groups = [dist.new_group([r]) for r in range(world)]
    mesh = DeviceMesh.from_group(groups[dist.get_rank()], device.type, mesh_dim_names=("tp",))
    extra, linears = [], 0
    for depth in TP_DEPTHS:
        spec = parse_model_spec(DISPATCH_BLOCK.replace("layers=1", f"layers={depth}"))
        anat = _traced_layout(spec)
        linears = len(anat.column) + len(anat.row)
        plain, split = (build_model(spec, device=device.type, seed=0) for _ in range(2))
        apply_tensor_parallel(split, ParallelContext(mesh=mesh, device=device), False, anat,
                              (spec.heads, spec.kv_heads))
        ids = torch.zeros(1, spec.seq, dtype=torch.long, device=device)

        def once(m: torch.nn.Module, tp: bool) -> float:
            t = time.perf_counter()
            with loss_parallel() if tp else contextlib.nullcontext():
                cross_entropy(m(ids), ids).backward()
            sync()
            return time.perf_counter() - t

        once(plain, False), once(split, True)
        extra.append(statistics.median(once(split, True) - once(plain, False) for _ in range(TP_REPEATS)))
    per_block = max(0.0, (extra[-1] - extra[0]) / (TP_DEPTHS[-1] - TP_DEPTHS[0]))
    per_linear = per_block / max(1, linears)
    return per_linear, max(0.0, extra[0] - TP_DEPTHS[0] * per_block - per_linear)


def _in_step(device, dtype, sync: Callable[[], None]) -> Callable[[Callable[[], object], int], float]:
    """A timer of one collective as a training step meets it, s. On CUDA the median time of
    the call alone (NCCL's kernels run beside the host). On CPU ranks the host runs both the
    operators and the collective, and a step reaches each collective right after a block's
    worth of compute (``BURST_GEMMS``) during which the ranks, more than the cores, were
    time-sliced: they arrive skewed, and each ring step waits for a descheduled peer. So the
    collective is timed after such a burst on every rank, less the burst's own median time
    (the mean over ranks). Collective: every rank calls it."""
    import torch
    import torch.distributed as dist
    if device.type == "cuda":
        return lambda fn, reps: _median_time(fn, reps, sync)
    a, b = torch.randn(256, 256, dtype=dtype), torch.randn(256, 256, dtype=dtype)

    def burst() -> None:
        for _ in range(BURST_GEMMS):
            torch.mm(a, b)

    def timed(fn: Callable[[], object], reps: int) -> float:
        def both() -> None:
            burst()
            fn()
        return max(1e-6, _median_time(both, reps, sync) - alone)

    # The mean over ranks: one rank's own burst, time-sliced against the others, runs short or
    # long by luck, and the collective ends when the last rank arrives (all ranks call this).
    mean = torch.tensor([_median_time(burst, 20, sync)], dtype=torch.float64)
    dist.all_reduce(mean)
    alone = float(mean) / dist.get_world_size()
    return timed


def measure(rank: int, world: int, device, dtype, say: Callable[[str], None]) -> dict:
    """This rank's timings (seconds, bytes, FLOP/s)."""
    import torch
    import torch.distributed as dist
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    big = 8192 if device.type == "cuda" else 1024
    out: dict = {}
    say("gemm")
    dist.barrier()
    a, b = torch.randn(big, big, device=device, dtype=dtype), torch.randn(big, big, device=device, dtype=dtype)
    out["peak"] = 2.0 * big ** 3 / _median_time(lambda: torch.mm(a, b), 10, sync)
    rates = []
    for n, k, m in SHAPES[device.type]:
        x, w = torch.randn(n, k, device=device, dtype=dtype), torch.randn(k, m, device=device, dtype=dtype)
        rates.append(2.0 * n * k * m / _median_time(lambda: torch.mm(x, w), 20, sync))
    out["shaped"] = rates
    out["attention"] = _attention_rate(device, dtype, sync)
    say("memory")
    dist.barrier()
    x, y = (torch.randn(ADD_ELEMENTS[device.type], device=device) for _ in range(2))
    out["bw"] = 3 * x.numel() * 4 / _median_time(lambda: torch.add(x, y, out=x), 10, sync)
    say("dispatch")
    dist.barrier()
    out["dispatch"] = _block_host_s(device, sync) / (3 * load_recipe(DISPATCH_RECIPE).kernels_per_block)
    dist.barrier()
    out["dtensor"] = _dtensor_step_s(device, world, sync)
    dist.barrier()
    out["hooks"] = _fsdp_hook_s(device, world, sync)
    out["collectives"], out["p2p"] = [], []
    if world > 1:  # one rank has no peer: its links come from another profile (``autopar.profile``)
        _links(out, rank, world, device, dtype, sync, say)
    # Last: after it (tracing, DTensor models) the collectives of 4 CPU ranks on 2 cores timed
    # 1.5-2x slower (in-step all-reduce over 4 ranks 8-9 ms, then 11-14 ms).
    dist.barrier()
    out["tp_linear"], out["tp_loss"] = _tp_host_s(device, world, sync)
    return out


def _links(out: dict, rank: int, world: int, device, dtype, sync: Callable[[], None],
           say: Callable[[str], None]) -> None:
    """The collectives' and the point-to-point transfers' rows, into ``out``."""
    import torch
    import torch.distributed as dist
    say("collectives")
    in_step = _in_step(device, dtype, sync)
    rows = []
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)] if world > 2 and world % 2 == 0 else []
    for size, group in [(world, None)] + ([(2, pairs[rank // 2])] if pairs else []):
        for nbytes in SIZES:
            numel = max(size, nbytes // 4 // size * size)
            t = torch.zeros(numel, device=device)
            shard = torch.zeros(numel // size, device=device)
            reps = 20 if nbytes < 2 ** 20 else 5
            dist.barrier()
            rows.append(("all_reduce", size, numel * 4, in_step(lambda: dist.all_reduce(t, group=group), reps)))
            dist.barrier()
            rows.append(("reduce_scatter", size, numel * 4,
                         in_step(lambda: dist.reduce_scatter_tensor(shard, t, group=group), reps)))
            dist.barrier()
            rows.append(("all_gather", size, numel * 4,
                         in_step(lambda: dist.all_gather_into_tensor(t, shard, group=group), reps)))
    out["collectives"] = rows
    say("p2p")
    p2p = []
    peer = rank ^ 1
    for nbytes in SIZES[::2]:
        t = torch.zeros(max(1, nbytes // 4), device=device)
        dist.barrier()
        if peer < world:
            def ping() -> None:
                if rank % 2 == 0:
                    dist.send(t, peer)
                    dist.recv(t, peer)
                else:
                    dist.recv(t, peer)
                    dist.send(t, peer)
            p2p.append((t.numel() * 4, _median_time(ping, 10, sync) / 2))
    out["p2p"] = p2p
