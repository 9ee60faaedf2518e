"""Hand-written stock-PyTorch training at one configuration, for ``runtime_overhead.py``.

    torchrun --nproc-per-node 4 benchmarks/handwritten.py {ddp|fsdp|pipeline} MODEL BATCH STEPS

What a user would write without autopar: the built-in model, wrapped by DDP, by FSDP2
``fully_shard`` per block (ZeRO-3), or cut into one ``PipelineStage`` per rank under
``Schedule1F1B``; AdamW; the same synthetic batches. Rank 0 prints the step times (max over
ranks) as JSON.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.nn.parallel import DistributedDataParallel

from autopar.model import build_model, cross_entropy
from autopar.spec import parse_model_spec


def main() -> None:
    kind, model_text, batch, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = parse_model_spec(model_text)
    model = build_model(spec)
    module: nn.Module = model  # what trains: the model, or DDP around it
    schedule = None
    if kind == "ddp":
        module = DistributedDataParallel(model)
    elif kind == "fsdp":
        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
    else:  # one stage per rank, equal blocks
        per = spec.layers // world
        for key in list(model.layers.keys()):
            if not rank * per <= int(key) < (rank + 1) * per:
                del model.layers[key]
        if rank:
            model.embed = None
        if rank != world - 1:
            model.norm = model.output = None
        stage = PipelineStage(model, rank, world, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=batch // 2, loss_fn=cross_entropy)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.0)
    rows = batch if kind == "pipeline" else batch // world
    times = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, spec.vocab, (batch, spec.seq + 1), generator=gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        if kind != "pipeline":
            x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if schedule is None:
            cross_entropy(module(x), y).backward()
        else:
            schedule.step(x if rank == 0 else None, target=y if rank == world - 1 else None,
                          losses=[] if rank == world - 1 else None)
        opt.step()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    if rank == 0:
        print(json.dumps(times), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
    # Leave without tearing the process group and the interpreter down, as autopar's worker
    # does (autopar/runtime/worker.py): a DDP rank once sat on a futex there after its peers had
    # exited, and torchrun waited for it.
    sys.stdout.flush()
    os._exit(0)
