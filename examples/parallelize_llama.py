"""Train a small Llama with autopar's Python API: plan it for this job, shard it, step it.

    torchrun --nproc-per-node 4 examples/parallelize_llama.py            # 4 CPU ranks (gloo)
    python examples/parallelize_llama.py                                  # one process

The model is an HF ``LlamaForCausalLM`` built from its config with random weights; swap in
``autopar.model.build_model(parse_model_spec("llama:..."))`` for the built-in one.
"""

import os
import sys

import torch
import transformers

import autopar

SEQ, GLOBAL_BATCH, VOCAB = 32, 16, 256


def main() -> None:
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)  # real weights: copied into this rank's shards
    example = torch.zeros(1, SEQ, dtype=torch.long)
    par = autopar.parallelize(model, (example,), cluster="cpu-local", global_batch=GLOBAL_BATCH, dtype="fp32")
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        m = par.plan.mesh
        print(f"plan: dp={m.dp} tp={m.tp} pp={m.pp} zero={par.plan.zero_stage} "
              f"mbs={par.plan.micro_batch_size} x {par.plan.num_microbatches} schedule={par.plan.schedule}")
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)  # one batch, learned by heart
    for step in range(5):
        loss = par.step(tokens[:, :-1], tokens[:, 1:])
        if rank == 0:
            print(f"step {step}: loss {loss:.4f}")


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # torch 2.13's interpreter teardown sometimes aborts a finished rank (SIGABRT, "terminate
    # called without an active exception"), which torchrun reports as a failure: skip it.
    sys.stdout.flush()
    os._exit(0)
