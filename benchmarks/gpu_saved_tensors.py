"""Every tensor autograd keeps for backward in autopar's built-in GPT and Llama blocks on a GPU,
under the runtime's two precision programs (``autocast``: fp32 weights under
``torch.autocast(bf16)``; ``bf16``: 16-bit weights, no autocast), by the node that saves it.

The graph is walked from the loss: each node's ``_saved_*`` tensors, each storage once,
parameters, buffers and autocast's casts of the weights (2-D, a parameter's shape) left out;
summed by (node, attribute, dtype) in units of h bytes per token per layer over a 2-layer model
(its head and loss amortised over the 2 layers). ``tests/data/gpu_saved_tensors.json`` holds
what it printed on an H100; ``ModelProfile.autocast_act_bytes_per_token`` is checked against it.

    python benchmarks/gpu_saved_tensors.py        # CUDA; on CPU it runs CPU autocast's policy
"""

from __future__ import annotations

import collections

import torch

from autopar.model import build_model, cross_entropy
from autopar.spec import parse_model_spec

SPECS = ("gpt:layers=2,hidden=512,heads=4,vocab=1000,seq=200,tied=0",
         "llama:layers=2,hidden=512,heads=4,kv_heads=4,ffn=1408,vocab=1000,seq=200,tied=0")
"""Small enough for any GPU; 2 x 200 tokens match no parameter's shape."""
BATCH = 2


def saved(spec_text: str, autocast: bool, device: str) -> dict[tuple[str, str, str], float]:
    """h bytes per token per layer kept by each (node, attribute, dtype)."""
    spec = parse_model_spec(spec_text)
    model = build_model(spec, device=device)
    if not autocast:
        model = model.bfloat16()
    owned = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
    x = torch.randint(0, spec.vocab, (BATCH, spec.seq), device=device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        loss = cross_entropy(model(x), x)
    per: dict[tuple[str, str, str], float] = collections.defaultdict(float)
    seen: set[int] = set()
    stack, visited = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for attr in (a for a in dir(node) if a.startswith("_saved_")):
            try:
                value = getattr(node, attr)
            except (RuntimeError, AttributeError):  # freed, or not readable
                continue
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if not isinstance(t, torch.Tensor) or t.numel() <= 1:
                    continue
                ptr = t.untyped_storage().data_ptr()
                if ptr in owned or ptr in seen or tuple(t.shape) in shapes:
                    continue
                seen.add(ptr)
                key = (type(node).__name__, attr, str(t.dtype).replace("torch.", ""))
                per[key] += t.untyped_storage().nbytes() / (BATCH * spec.seq) / spec.hidden / spec.layers
        stack.extend(f for f, _ in node.next_functions)
    return dict(per)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for spec_text in SPECS:
        for autocast in (True, False):
            per = saved(spec_text, autocast, device)
            print(f"## {spec_text.split(':')[0]} {'autocast' if autocast else 'bf16'} "
                  f"total act h/token/layer (incl head) {round(sum(per.values()), 2)}")
            for key, value in sorted(per.items(), key=lambda kv: -kv[1]):
                if value >= 0.05:
                    print("  ", key, round(value, 2))


if __name__ == "__main__":
    main()
