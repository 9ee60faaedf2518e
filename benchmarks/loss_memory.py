"""Peak memory of the cross-entropy loss per logit, measured on CPU ranks.

    python benchmarks/loss_memory.py                       # one gloo rank
    torchrun --nproc_per_node 2 benchmarks/loss_memory.py  # logits split over two

The fp32 cross-entropy as autopar's runtime and torchtitan run it (``F.cross_entropy`` of the
16-bit logits cast to fp32), forward and backward of one micro-batch's logits, alone and under
torch's ``loss_parallel`` (the logits a DTensor sharded over the vocabulary, as under tensor
parallelism). The peak is read off the CPU allocator's running total (``autopar.runtime.phases``:
c10's CPU memory accounting through the profiler): what the cost model's ``logits_bytes`` plus
``loss_backward_bytes`` (``loss_parallel_backward_bytes`` under tp > 1) price. Which bytes a
device allocates is the same code on CPU and CUDA; only the allocator's rounding differs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._C._profiler import _EventType
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from autopar.runtime.phases import _cpu_accounting, _walk  # noqa: E402


def _peak_bytes(fn) -> float:  # type: ignore[no-untyped-def]
    """The most bytes the CPU allocator held at once while ``fn`` ran, beyond its level before."""
    flag = _cpu_accounting()
    if flag is None:
        raise RuntimeError("this torch build does not export c10's CPU memory accounting")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        flag.value = True
        try:
            fn()
        finally:
            flag.value = False
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    nodes = _walk(prof.profiler.kineto_results.experimental_event_tree())
    allocs = sorted((n for n in nodes if n.tag == _EventType.Allocation), key=lambda n: n.start_time_ns)
    base = allocs[0].extra_fields.total_allocated - allocs[0].extra_fields.alloc_size
    return float(max(a.extra_fields.total_allocated for a in allocs) - base)


def loss_bytes_per_logit(mesh: DeviceMesh, tokens: int, vocab: int, parallel: bool) -> float:
    """Peak bytes per local logit of one loss forward and backward: the 16-bit logits (a graph
    output, freed before the backward as the training loops do) through the fp32 cross-entropy;
    ``parallel``: sharded over ``mesh``'s vocabulary under ``loss_parallel``."""
    torch.manual_seed(0)
    labels = torch.randint(0, vocab, (tokens,))
    leaf: torch.Tensor
    if parallel:
        shard = distribute_tensor(torch.randn(tokens, vocab, dtype=torch.bfloat16), mesh, [Shard(1)])
        leaf = shard.detach().requires_grad_(True)
        local = tokens * vocab // mesh.size()
    else:
        leaf = torch.randn(tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
        local = tokens * vocab

    def step() -> None:
        logits = leaf * 1.0
        with loss_parallel() if parallel else torch.enable_grad():
            loss = F.cross_entropy(logits.float(), labels)
            del logits
            loss.backward()
        leaf.grad = None

    step()  # warm-up: lazily built state stays out of the measurement
    return _peak_bytes(step) / local


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)))
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        tokens, vocab = 4096, 8192 * dist.get_world_size()
        plain = loss_bytes_per_logit(mesh, tokens, vocab // dist.get_world_size(), parallel=False)
        sharded = loss_bytes_per_logit(mesh, tokens, vocab, parallel=True)
        if dist.get_rank() == 0:
            print(f"fp32 cross-entropy, {tokens} tokens: {plain:.2f} bytes per logit at its peak; "
                  f"under loss_parallel over {dist.get_world_size()} rank(s): {sharded:.2f} per local logit")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
