"""What each rank of ``autopar profile`` times (``autopar.profile`` starts the ranks, fits and
writes the profile): GEMMs, fused attention, an element-wise add, the host time per kernel, a
DTensor optimizer step, FSDP2's hooks, tensor parallelism's DTensor modules, activation
checkpointing's machinery, the pipeline schedules' own host time, collectives (over every
rank, and over pairs side by side; all-reduces beside compute) and point-to-point transfers.
Seconds, bytes and FLOP/s; medians of repeats."""

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
"""Parameter tensors of the optimizer steps timed for ``optimizer_tensor_us`` and
``dtensor_optimizer_us``."""
BURST_GEMMS = 16
"""256^3 GEMMs each CPU rank runs before a timed collective (``_in_step``): about 10 ms with 4
ranks on 2 cores, the order of one block's pass of the small models CPU ranks train."""
ATTENTION = {"cpu": (4, 4, 512, 32), "cuda": (2, 16, 4096, 128)}
"""(batch, heads, sequence, head dim) of the causal SDPA whose forward and backward give the
fused attention kernel's efficiency (``_attention_rate``)."""
TP_DEPTHS = (2, 6)
"""Blocks of the two tiny models whose split and unsplit passes time ``tp_linear_us``."""
TP_SECONDS = 3.0
TP_INNER = 4
"""Seconds of alternated samples of split and unsplit passes per depth, and passes per
sample, that time ``tp_linear_us`` (``_excess``)."""
HOOK_GROUPS = 8
"""Blocks, each an FSDP2 group, of the model whose passes time ``fsdp_hook_us``."""
HOOK_SECONDS = 4.0
HOOK_INNER = 10
"""Seconds of alternated samples of wrapped and plain passes, and passes per sample, that time
``fsdp_hook_us`` (``_excess``)."""
CHECKPOINT_DEPTH = 8
CHECKPOINT_SECONDS = 3.0
CHECKPOINT_INNER = 4
"""Blocks of the tiny model whose passes time ``checkpoint_us``; seconds of alternated samples
per recompute mode, and passes per sample (``_excess``)."""
PIPE_DEPTH = 2
"""Blocks per model chunk of the tiny pipelines that time ``pp_chunk_us`` and ``zb_block_us``."""
PIPE_MICROBATCHES = 4
PIPE_SECONDS = 4.0
PIPE_INNER = 4
"""Seconds of alternated samples per schedule, and steps per sample, that time ``pp_chunk_us``
and ``zb_block_us`` (``_excess``)."""
SHAPES = {"cpu": ((512, 128, 384), (512, 128, 512), (512, 512, 128), (2048, 512, 2048), (2048, 2048, 512)),
          "cuda": ((8192, 2048, 6144), (8192, 2048, 8192), (8192, 8192, 2048), (8192, 4096, 16384),
                   (8192, 16384, 4096))}
"""(tokens, in, out) of the transformer-shaped GEMMs per device type (b·s through h -> 3h,
h -> 4h, 4h -> h)."""
OVERLAP_SIZES = (2 ** 20, 2 ** 22, 2 ** 24)
"""All-reduce sizes, bytes, whose cost beside compute gives ``overlap_penalty`` (``_overlap``)."""
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
    from cost_models.attention import FLASH_BWD_RATIO, causal_fraction
    b, h, s, d = ATTENTION[device.type]
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    flops = (1 + FLASH_BWD_RATIO) * 4.0 * b * h * s * s * d * causal_fraction(s)
    return flops / _median_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(),
                                10, sync)


def _block_host_s(device, sync: Callable[[], None]) -> float:
    """Forward and backward of one tiny built-in Llama block (``DISPATCH_BLOCK``): host time
    only, its kernels move a few hundred bytes; s."""
    import torch
    block = _tiny_blocks(1, device)
    x = torch.randn(1, 4, 8, device=device, requires_grad=True)
    return _median_time(lambda: block(x).sum().backward(), 50, sync)


def _optimizer_step_s(device, world: int, sync: Callable[[], None]) -> tuple[float, float]:
    """An AdamW step's host time per plain parameter tensor, and what a DTensor parameter adds
    to it, s per parameter tensor: ``OPTIMIZER_TENSORS`` small tensors (the step's host time
    dominates) as plain tensors, and sharded over every rank. Collective: every rank calls it."""
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

    plain = step_s(False)
    return plain / OPTIMIZER_TENSORS, max(0.0, step_s(True) - plain) / OPTIMIZER_TENSORS


def _excess(fn: Callable[[], object], base: Callable[[], object], seconds: float, inner: int,
            sync: Callable[[], None]) -> float:
    """Median over samples of what ``inner`` calls of ``fn`` take over as many of ``base``, per
    call, s. The two alternate, so that both meet the same contention from the peers on shared
    cores, and every rank samples for the same ``seconds`` from a barrier, so that all ranks
    stay busy to the end (a rank done early would leave its share of the cores to the rest).
    Several calls a sample: one call of a few ms, preempted or not by luck, spread the figure
    3x. Collective: every rank calls it."""
    import torch.distributed as dist

    def run(f: Callable[[], object]) -> float:
        t = time.perf_counter()
        for _ in range(inner):
            f()
        sync()
        return (time.perf_counter() - t) / inner

    run(fn), run(base)
    dist.barrier()
    end, samples = time.perf_counter() + seconds, list[float]()
    while time.perf_counter() < end or len(samples) < 3:
        samples.append(run(fn) - run(base))
    return statistics.median(samples)


def _tiny_blocks(depth: int, device):
    """``depth`` tiny built-in Llama blocks (``DISPATCH_BLOCK``) in a ``Sequential``."""
    import torch
    from autopar.model import Block
    from autopar.spec import parse_model_spec
    spec = parse_model_spec(DISPATCH_BLOCK)
    return torch.nn.Sequential(*(Block(spec) for _ in range(depth))).to(device)


def _fsdp_hook_s(device, world: int, sync: Callable[[], None]) -> float:
    """Host time of FSDP2's hooks per parameter group and micro-batch (forward and backward), s:
    ``HOOK_GROUPS`` tiny Llama blocks (``DISPATCH_BLOCK``: a group's tensors and the hooks on
    its inputs as the runtime's) each wrapped by ``fully_shard``, weights kept gathered and
    gradients unsynchronised (a pipeline's or an accumulation's inner micro-batch: no
    collective runs), against the same blocks unwrapped (``_excess``), over one more group
    (the root). Each rank shards over a group of its own, so the figure is the hooks' and not
    the peers'. Collective: every rank calls it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    groups = [dist.new_group([r]) for r in range(world)]
    mesh = DeviceMesh.from_group(groups[dist.get_rank()], device.type)
    x = torch.randn(1, 4, 8, device=device)
    plain, wrapped = _tiny_blocks(HOOK_GROUPS, device), _tiny_blocks(HOOK_GROUPS, device)
    for block in wrapped:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    root = fully_shard(wrapped, mesh=mesh, reshard_after_forward=False)
    root.set_requires_gradient_sync(False)
    root.set_reshard_after_backward(False)
    extra = _excess(lambda: wrapped(x).sum().backward(), lambda: plain(x).sum().backward(), HOOK_SECONDS,
                    HOOK_INNER, sync)
    return max(0.0, extra) / (HOOK_GROUPS + 1)


def _pipeline_host_s(device, world: int, sync: Callable[[], None]) -> tuple[float, float]:
    """(per model chunk, per block under the zero-bubble schedule) host time per micro-batch
    that ``torch.distributed.pipelining`` adds to a forward and backward, s: two chunks of
    ``PIPE_DEPTH`` tiny Llama blocks as the two stages of a pipeline over this rank alone (no
    transfer crosses ranks, so the figure is the schedule's and not the links'), run by
    ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble`` over
    ``PIPE_MICROBATCHES`` micro-batches, against the same chunks' passes looped
    (``_excess``). The interleaved schedule's excess per chunk and micro-batch is the first
    figure (its bookkeeping: stage inputs and outputs, the actions); the zero-bubble's excess
    over it per block and micro-batch the second (its split backward walks each micro-batch's
    autograd graph in Python: ``stage_backward_input``, ``stage_backward_weight``).
    Collective: every rank calls it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble
    groups = [dist.new_group([r]) for r in range(world)]
    group = groups[dist.get_rank()]
    m = PIPE_MICROBATCHES
    x, y = torch.randn(m, 4, 8, device=device), torch.zeros(m, 4, 8, device=device)
    chunks = [_tiny_blocks(PIPE_DEPTH, device) for _ in range(2)]

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).pow(2).mean()

    def looped() -> None:
        for xi, yi in zip(x.chunk(m), y.chunk(m)):
            loss(chunks[1](chunks[0](xi)), yi).backward()

    def schedule(kind: type) -> Callable[[], object]:
        stages = [PipelineStage(c, i, 2, device, group=group) for i, c in enumerate(chunks)]
        run = kind(stages, m, loss_fn=loss)
        return lambda: run.step(x, target=y)

    interleaved, zero_bubble = schedule(ScheduleInterleaved1F1B), schedule(ScheduleInterleavedZeroBubble)
    chunk = _excess(interleaved, looped, PIPE_SECONDS, PIPE_INNER, sync) / (2 * m)
    block = _excess(zero_bubble, interleaved, PIPE_SECONDS, PIPE_INNER, sync) / (2 * PIPE_DEPTH * m)
    return max(0.0, chunk), max(0.0, block)


def _checkpoint_host_s(device, forward_host_s: float, sync: Callable[[], None]) -> dict[str, float]:
    """Per recompute mode that runs under ``torch.utils.checkpoint`` (``CHECKPOINTED``), the
    host time its machinery adds to one block's forward and backward per micro-batch beyond
    the recomputed kernels' dispatch, s: a tiny built-in Llama of ``CHECKPOINT_DEPTH`` blocks
    (``DISPATCH_BLOCK``) wrapped by the runtime's ``apply_recompute`` in that mode, against the
    same model unwrapped (``_excess``), per block, less the recomputed forward's dispatch that
    the cost model already prices for ``full`` and ``op`` (``forward_host_s``: a block's
    forward kernels at the measured dispatch time). Collective: every rank calls it."""
    import torch
    from cost_models.hardware import CHECKPOINTED
    from autopar.model import build_model, cross_entropy
    from autopar.runtime.parallelize import apply_recompute
    from autopar.runtime.train import _traced_layout
    from autopar.spec import parse_model_spec
    spec = parse_model_spec(DISPATCH_BLOCK.replace("layers=1", f"layers={CHECKPOINT_DEPTH}"))
    anat = _traced_layout(spec)
    ids = torch.zeros(1, spec.seq, dtype=torch.long, device=device)
    plain = build_model(spec, device=device.type, seed=0)
    out = {}
    for mode in CHECKPOINTED:
        wrapped = build_model(spec, device=device.type, seed=0)
        apply_recompute(wrapped, (mode,) * CHECKPOINT_DEPTH, anat)
        extra = _excess(lambda: cross_entropy(wrapped(ids), ids).backward(),
                        lambda: cross_entropy(plain(ids), ids).backward(), CHECKPOINT_SECONDS, CHECKPOINT_INNER, sync)
        priced = 0.0 if mode == "selective" else forward_host_s
        out[mode] = max(0.0, extra / CHECKPOINT_DEPTH - priced)
    return out


def _tp_host_s(device, world: int, sync: Callable[[], None]) -> tuple[float, float]:
    """(per split Linear, for the vocab-parallel head and loss) host time that the runtime's
    tensor parallelism adds to a forward and backward, s: tiny built-in Llamas of
    ``TP_DEPTHS`` blocks (``DISPATCH_BLOCK``'s widths) split by ``apply_tensor_parallel`` over a
    mesh of this rank alone (DTensor dispatches as over many, no collective runs), each against
    the same model unsplit (``_excess``); the slope over the depths per block's split Linears is
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

        def once(m: torch.nn.Module, tp: bool) -> None:
            with loss_parallel() if tp else contextlib.nullcontext():
                cross_entropy(m(ids), ids).backward()

        extra.append(_excess(lambda: once(split, True), lambda: once(plain, False), TP_SECONDS, TP_INNER, sync))
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


def _overlap(nbytes: int, device, dtype, sync: Callable[[], None], repeats: int = 5) -> float:
    """What an all-reduce of ``nbytes`` over every rank adds to compute it runs beside, over its
    own time alone: (GEMMs with the all-reduce issued asynchronously before them and waited for
    after - the same GEMMs alone) / the all-reduce alone, medians of ``repeats``; the GEMMs last
    about twice the all-reduce, so the whole of it could hide. 0: it hides completely (a
    device whose collectives run on engines of their own); 1: it hides nothing (CPU ranks,
    whose collective threads take the cores the compute runs on). Collective: every rank calls
    it."""
    import torch
    import torch.distributed as dist
    big = 256 if device.type == "cpu" else 4096
    a, b = torch.randn(big, big, device=device, dtype=dtype), torch.randn(big, big, device=device, dtype=dtype)
    buf = torch.zeros(nbytes // 4, device=device)

    def timed(fn: Callable[[], object]) -> float:
        samples = []
        for _ in range(repeats):
            dist.barrier()
            sync()
            start = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    alone = timed(lambda: dist.all_reduce(buf))
    gemm = timed(lambda: torch.mm(a, b))
    n = max(1, round(2 * alone / max(gemm, 1e-9)))

    def gemms() -> None:
        for _ in range(n):
            torch.mm(a, b)

    def beside() -> None:
        work = dist.all_reduce(buf, async_op=True)
        gemms()
        assert work is not None
        work.wait()
    return max(0.0, timed(beside) - timed(gemms)) / alone


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
    out["optimizer_tensor"], out["dtensor"] = _optimizer_step_s(device, world, sync)
    dist.barrier()
    out["hooks"] = _fsdp_hook_s(device, world, sync)
    out["collectives"], out["p2p"] = [], []
    if world > 1:  # one rank has no peer: its links come from another profile (``autopar.profile``)
        _links(out, rank, world, device, dtype, sync, say)
    # Last: after it (tracing, DTensor models) the collectives of 4 CPU ranks on 2 cores timed
    # 1.5-2x slower (in-step all-reduce over 4 ranks 8-9 ms, then 11-14 ms).
    dist.barrier()
    out["tp_linear"], out["tp_loss"] = _tp_host_s(device, world, sync)
    say("recompute")
    dist.barrier()
    out["checkpoint"] = _checkpoint_host_s(device, out["dispatch"] * load_recipe(DISPATCH_RECIPE).kernels_per_block,
                                           sync)
    say("pipeline")
    dist.barrier()
    out["pp_chunk"], out["zb_block"] = _pipeline_host_s(device, world, sync)
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
    out["overlap"] = [_overlap(nbytes, device, dtype, sync) for nbytes in OVERLAP_SIZES]
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
