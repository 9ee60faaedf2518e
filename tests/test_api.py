"""The Python API: ``autopar.parallelize`` on a real HF model, and on nanoGPT and minGPT module objects,
equals a hand-written PyTorch loop (the models' own, for the latter)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autopar.api import model_spec_text
from autopar.model import build_model
from autopar.spec import parse_model_spec

ROOT = Path(__file__).resolve().parent.parent
transformers = pytest.importorskip("transformers")


def test_model_spec_text_rebuilds_the_architecture():
    spec = parse_model_spec("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16")
    again = parse_model_spec(model_spec_text(build_model(spec, "meta"), 16))
    assert (again.layers, again.hidden, again.heads, again.num_kv_heads, again.ffn_hidden, again.vocab) == \
        (2, 64, 4, 2, 96, 128)
    config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96, vocab_size=128)
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config)
    back = parse_model_spec(model_spec_text(hf, 32))
    assert (back.arch, back.layers, back.hidden, back.heads, back.num_kv_heads, back.vocab, back.seq) == \
        ("hf", 3, 64, 4, 2, 128, 32)


def plain_torch_losses(steps: int) -> list[float]:
    """examples/parallelize_llama.py's training, written with nothing but PyTorch."""
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    tokens = torch.randint(0, 256, (16, 33), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_example_under_torchrun_matches_plain_pytorch():
    """Two ranks, planned by autopar, real weights copied into the shards: the printed losses
    (4 decimals) are the single-process PyTorch loop's."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(ROOT / "examples" / "parallelize_llama.py")], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", proc.stdout)]
    assert "plan: dp=" in proc.stdout and len(printed) == 5
    assert printed == pytest.approx(plain_torch_losses(5), abs=1e-4)


def test_real_gpt2_weights_load_into_the_runtime_layout():
    """HF GPT-2's Conv1D weights ([in, out], Q/K/V fused) are stored transposed and packed per
    head by the runtime: a real model's weights, copied in, train exactly like HF's own model."""
    import autopar
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, 128, (8, 17), generator=torch.Generator().manual_seed(1))
    par = autopar.parallelize(model, (tokens[:4, :-1],), cluster="cpu-local", global_batch=8)
    got = [par.step(tokens[:, :-1], tokens[:, 1:]) for _ in range(2)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    want = []
    for _ in range(2):
        loss = F.cross_entropy(model(input_ids=tokens[:, :-1]).logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        want.append(loss.item())
    assert got == pytest.approx(want, abs=1e-5)


FIXTURES = ROOT / "tests" / "fixtures"
USER_SCRIPT = f"""
import json, os, sys
import torch
sys.path[:0] = [{str(FIXTURES / 'nanogpt')!r}, {str(FIXTURES / 'mingpt')!r}]
from model import GPT, GPTConfig
from mingpt.model import GPT as MinGPT
import autopar
from autopar.plan import Mesh, Plan

sys.path.insert(0, {str(ROOT / 'tests')!r})
from test_api import mingpt, nanogpt, user_batch

x, y = user_batch()
out = {{}}
torch.manual_seed(0)
par = autopar.parallelize(nanogpt(GPT, GPTConfig), (x[:1], y[:1]), cluster="cpu-local", global_batch=8, dtype="fp32")
out["nanogpt"] = [par.step(x, y) for _ in range(3)]
out["plan"] = [par.plan.mesh.dp, par.plan.mesh.tp, par.plan.mesh.pp]
torch.manual_seed(0)
pp2 = Plan(model="minGPT", cluster="cpu-local", gpus=2, global_batch=8, seq_len=16, dtype="fp32", mesh=Mesh(pp=2),
           micro_batch_size=2, num_microbatches=4, stage_layers=(1, 1), recompute=("none", "none"))
par = autopar.parallelize(mingpt(MinGPT), (x[:1], y[:1]), cluster="cpu-local", global_batch=8, plan=pp2)
out["mingpt"] = [par.step(x, y) for _ in range(3)]
if int(os.environ["RANK"]) == 0:
    print("RESULT " + json.dumps(out), flush=True)
torch.distributed.destroy_process_group()
os._exit(0)  # torch 2.13's teardown sometimes aborts a finished rank (SIGABRT): skip it, as the worker does
"""


def nanogpt(gpt, config):
    """A small nanoGPT (2 layers, tied head), real weights from the current RNG."""
    return gpt(config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, block_size=16, dropout=0.0))


def mingpt(gpt):
    config = gpt.get_default_config()
    config.model_type = None
    config.n_layer, config.n_head, config.n_embd, config.vocab_size, config.block_size = 2, 4, 64, 128, 16
    config.embd_pdrop = config.resid_pdrop = config.attn_pdrop = 0.0
    return gpt(config)


def user_batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 128, (8, 17), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _own_training(model: torch.nn.Module, steps: int) -> list[float]:
    """The model's own training step: ``_, loss = model(x, y)``, AdamW."""
    x, y = user_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_user_modules_under_torchrun_train_as_their_own_loop(tmp_path, monkeypatch):
    """nanoGPT and minGPT module objects with real weights, on 2 ranks: planned by autopar, and
    on a 2-stage pipeline; the losses are the models' own training loop's."""
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    monkeypatch.syspath_prepend(str(FIXTURES / "nanogpt"))
    monkeypatch.syspath_prepend(str(FIXTURES / "mingpt"))
    from mingpt.model import GPT as MinGPT
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    assert got["nanogpt"] == pytest.approx(_own_training(nanogpt(GPT, GPTConfig), 3), abs=1e-5)
    torch.manual_seed(0)
    assert got["mingpt"] == pytest.approx(_own_training(mingpt(MinGPT), 3), abs=1e-5)
    assert got["plan"][0] * got["plan"][1] * got["plan"][2] == 2
