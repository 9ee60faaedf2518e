"""The Plan is self-sufficient: it records the model's layout (blocks, embedding, head,
column/row GEMMs, packed projections with their widths, pre- and post-norms) read off the trace
when planning, and the runtime shards from it without tracing the model again."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar.plan import Mesh, load_plan
from autopar.runtime import train as train_mod
from autopar.runtime.context import ParallelContext
from autopar.runtime.train import build_program
from autopar.workflow import make_plan, read_job

PHI3 = ("hf:Phi3Config:pad_token_id=None,num_hidden_layers=2,hidden_size=64,num_attention_heads=4,"
        "num_key_value_heads=2,intermediate_size=96,vocab_size=128,seq=16")
GEMMA2 = ("hf:Gemma2Config:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
          "head_dim=16,intermediate_size=96,vocab_size=128,seq=16")


def test_plan_records_the_layout_and_round_trips(tmp_path):
    plan, _ = make_plan(read_job(PHI3, "cpu-local", 1, 4, dtype="fp32"), verify=False)
    layout = plan.layout
    assert layout is not None and layout.blocks == ("model.layers.0", "model.layers.1")
    assert dict(layout.packed) == {"self_attn.qkv_proj": (64, 32, 32), "mlp.gate_up_proj": (96, 96)}
    assert set(layout.column) == {"self_attn.qkv_proj", "mlp.gate_up_proj"}
    assert layout.embed == "model.embed_tokens" and layout.head == "lm_head"
    plan.save(tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json") == plan
    assert load_plan(tmp_path / "p.json").to_json() == plan.to_json()
    gemma2, _ = make_plan(read_job(GEMMA2, "cpu-local", 1, 4, dtype="fp32"), verify=False)
    assert set(gemma2.layout.post_norms) == {"post_attention_layernorm", "post_feedforward_layernorm"}


def test_runtime_shards_from_the_plan_without_tracing(monkeypatch):
    plan, _ = make_plan(read_job(PHI3, "cpu-local", 1, 4, dtype="fp32"), verify=False)
    plan = dataclasses.replace(plan, micro_batch_size=4, num_microbatches=1, mesh=Mesh())

    def no_trace(spec):
        raise AssertionError("the runtime traced a model whose plan records its layout")
    monkeypatch.setattr(train_mod, "_traced_layout", no_trace)
    prog = build_program(plan, ParallelContext(mesh=None, device=torch.device("cpu")))
    assert prog.anatomy == plan.layout
    with pytest.raises(AssertionError, match="traced"):
        build_program(dataclasses.replace(plan, layout=None), ParallelContext(mesh=None, device=torch.device("cpu")))
