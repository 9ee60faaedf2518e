"""Trace time and peak RSS of big models on the meta device (issue 4's targets: Llama-3 405B in
<= 3 s and <= 1.5 GB RSS on a 2-core machine, median of 3).

Each measurement runs in a fresh process (so peak RSS is that trace's own), after the imports
(torch, torch._dynamo, which the first meta
``arange`` or ``torch.export`` imports lazily, and transformers for HF models are timed apart
as ``import s``). Run:
``python benchmarks/trace_time.py [--repeats 3] [MODEL ...]`` (default: the built-in 405B preset,
HF Llama-3 405B, GPT-3 175B, Mixtral 8x7B).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

LLAMA3_405B_HF = ("hf:LlamaConfig:num_hidden_layers=126,hidden_size=16384,num_attention_heads=128,"
                  "num_key_value_heads=8,intermediate_size=53248,vocab_size=128256,"
                  "max_position_embeddings=131072,rms_norm_eps=1e-5,seq=8192")
DEFAULT = ["llama3-405b", LLAMA3_405B_HF, "gpt3-175b", "mixtral-8x7b"]

_CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
import torch, torch._dynamo, torch.export, torch.fx  # imported lazily by the first trace otherwise
from autopar.spec import parse_model_spec
from autopar.trace import trace_spec
if sys.argv[1].startswith("hf:") or sys.argv[1].startswith("mixtral") or sys.argv[1].startswith("moe:"):
    import transformers
t1 = time.perf_counter()
spec = parse_model_spec(sys.argv[1])
graph = trace_spec(spec)
t2 = time.perf_counter()
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"import_s": t1 - t0, "trace_s": t2 - t1, "peak_rss_bytes": rss, "params": graph.params,
                  "capture": graph.capture, "blocks": [[b.kind, b.count] for b in graph.blocks]}))
"""


def measure(model: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, model], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=DEFAULT)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'model':<28} {'capture':<13} {'params':>16} {'import s':>9} {'trace s':>8} {'peak RSS GB':>12}")
    for model in args.models:
        runs = [measure(model) for _ in range(args.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in ("import_s", "trace_s", "peak_rss_bytes")}
        label = model if len(model) <= 28 else model[:25] + "..."
        print(f"{label:<28} {runs[0]['capture']:<13} {runs[0]['params']:>16,} {med['import_s']:>9.2f} "
              f"{med['trace_s']:>8.2f} {med['peak_rss_bytes'] / 1e9:>12.2f}")


if __name__ == "__main__":
    main()
