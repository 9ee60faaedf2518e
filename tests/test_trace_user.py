"""User modules (``path/to/file.py:factory``) priced from their trace alone: karpathy's nanoGPT
and minGPT, unmodified, through ``inspect``, ``estimate`` and ``plan``; FLOPs equal to
FlopCounterMode over a training step; shapes read off the graph, not off attribute names."""

import dataclasses
import hashlib
import json
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from typer.testing import CliRunner

from autopar.cli import app
from autopar.errors import UserError
from autopar.spec import PRESETS, parse_model_spec
from autopar.trace import profile_spec, trace_spec, traced_spec
from autopar.usermodel import load_user_model

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NANO = f"{FIXTURES / 'nanogpt' / 'make.py'}:make"
NANO_124M = f"{FIXTURES / 'nanogpt' / 'make.py'}:gpt2"
MINI = f"{FIXTURES / 'mingpt' / 'make.py'}:make"
SMALL = {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 4, "ffn": 256, "vocab": 128, "seq": 16}
runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args))


def _error_lines(stderr: str) -> list[str]:
    """stderr without the models' own prints (nanoGPT and minGPT print their size)."""
    return [ln for ln in stderr.splitlines() if not ln.startswith("number of parameters")]


def _git_blob(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_fixtures_are_upstream_files_unmodified():
    """Git blob ids of karpathy/nanoGPT@3adf61e:model.py and karpathy/minGPT@37baab7:mingpt/model.py."""
    assert _git_blob(FIXTURES / "nanogpt" / "model.py") == "c698f8b60129d793494de058b0dd4e318c0dcb5e"
    assert _git_blob(FIXTURES / "mingpt" / "mingpt" / "model.py") == "83ee22dc07707fd9cb62eb3215c1c1e4b150b5c9"
    for d in ("nanogpt", "mingpt"):
        assert "MIT License" in (FIXTURES / d / "LICENSE").read_text()


@pytest.mark.parametrize("model, tied", [(NANO, True), (MINI, False)])
def test_inspect_reads_the_shape_off_the_trace(model, tied):
    res = cli("inspect", "--model", model, "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)  # the models' own prints went to stderr
    assert info["shape"] == {**SMALL, "tied": tied} and info["shape_error"] == ""
    (block,) = info["blocks"]
    assert (block["repeats"], block["heads"], block["kv_heads"], block["head_dim"]) == (4, 4, 4, 16)
    assert [lin["split"] for lin in block["linears"]] == ["column", "row", "column", "row"]
    assert block["linears"][0]["packed"] == 3  # c_attn's output is cut into Q, K, V
    # The head runs on every position (the training step): 2 h V per token, not 2 h V / s.
    assert info["outside_blocks"]["forward_flops_per_token"] == 2 * 64 * 128


def test_minGPT_attention_core_is_found_by_structure():
    """minGPT writes attention out (Q Kᵀ, mask, softmax, dropout, @ V): the softmax output it
    keeps is the attention core (2 bytes x heads x s per token), Q, K, V and the output sharded."""
    graph = trace_spec(parse_model_spec(MINI))
    (block,) = graph.blocks
    a, s, h = 4, 16, 64
    assert block.activations.attn == 2 * a * s * graph.tokens
    assert block.recipe_activations == block.activations  # no SDPA for the recipe to replace
    assert block.flops - sum(n.flops for n in block.nodes if n.split) == 4 * s * h * graph.tokens


def test_nanoGPT_prices_as_the_builtin_gpt_of_its_shape():
    """nanoGPT is GPT-2 with biases: the cost model's view equals the built-in GPT's of the same
    shape in every count, but for the Megatron-recipe activations (gpt specs price Megatron's
    dropout 0.1; a user module its own dropout, here 0), its parameter tensors and what per-op
    recompute keeps and repeats: nanoGPT packs q, k, v into one ``c_attn`` (weight and bias: 12
    tensors a block against 16; one GEMM where the built-in runs three)."""
    user = profile_spec(parse_model_spec(NANO))
    spec = parse_model_spec("gpt:layers=4,hidden=64,heads=4,vocab=128,seq=16,tied=1")
    builtin = profile_spec(spec)
    recipe = {f.name for f in dataclasses.fields(user) if f.name.startswith("block_act_bytes")}
    assert (user.block_param_tensors, builtin.block_param_tensors) == (12, 16)
    assert (user.block_tp_linears, builtin.block_tp_linears) == (4, 6)  # c_attn holds q, k and v
    # Under autocast both keep their two norms' inputs in fp32 (4 h); the built-in's separate
    # q, k, v each keep a bf16 cast of the norm's output (2 more: 4 h), nanoGPT's c_attn one.
    assert (user.autocast_act_bytes_per_token, builtin.autocast_act_bytes_per_token) == (4 * 64, 8 * 64)
    # Per-op recompute keeps every second GEMM's output in run order: nanoGPT's c_attn (3 h) and
    # c_fc (4 h), the built-in's q, v (h each) and up (4 h); it repeats nanoGPT's two c_proj
    # (h² + 4 h² per token, x2 FLOPs) and the built-in's k, o and down (h² + h² + 4 h²). Both
    # keep the attention output (h) and its float32 log-sum-exp (4 bytes a head).
    h = 64
    assert (user.op_kept_sharded_bytes_per_token, builtin.op_kept_sharded_bytes_per_token) == (
        2 * (3 * h + 4 * h + h) + 16, 2 * (h + h + 4 * h + h) + 16)
    assert (user.op_recompute_flops_per_token, builtin.op_recompute_flops_per_token) == (
        2 * 5 * h * h, 2 * 6 * h * h)
    op = {"op_kept_sharded_bytes_per_token", "op_recompute_flops_per_token"}
    for f in dataclasses.fields(user):
        if f.name not in recipe | op | {"name", "block_param_tensors", "block_tp_linears",
                                        "autocast_act_bytes_per_token"}:
            assert getattr(user, f.name) == getattr(builtin, f.name), f.name


def _flop_counter_training_step(text: str) -> tuple[int, int]:
    """(forward, forward + backward) FLOPs of ``loss.backward()`` on meta, by FlopCounterMode."""
    model, inputs = load_user_model(parse_model_spec(text))
    with FlopCounterMode(display=False) as counter:
        _, loss = model(*inputs)
        forward = counter.get_total_flops()
        loss.backward()
    return forward, counter.get_total_flops()


@pytest.mark.parametrize("model", [NANO, MINI, NANO_124M])
def test_training_flops_equal_flop_counter(model):
    """The tracer's training FLOPs (forward x 3) equal FlopCounterMode's count of a real
    forward + backward of the same model and inputs, exactly (rel 0). Like with like: on meta,
    nanoGPT's SDPA runs its math decomposition, two bmm forward and four backward, so
    FlopCounterMode's backward is 2x forward there too, the tracer's convention (on a GPU it
    would count FlashAttention's backward, which recomputes Q Kᵀ, at 2.5x); minGPT's attention
    is two matmuls anyway. Both count only matrix products (no norms, softmax or loss)."""
    graph = trace_spec(parse_model_spec(model))
    forward, training = _flop_counter_training_step(model)
    assert graph.flops == forward
    assert graph.training_flops == training


def test_nanoGPT_124M_flops_per_token_match_its_own_formula():
    """nanoGPT's ``estimate_mfu`` (PaLM appendix B): 6N + 12 L H Q T per token, with N the
    parameters that multiply (Linear weights, the tied head once); nanoGPT's own N also counts
    biases and norms (+0.09 %). The head runs on all 1,024 positions: 2 h V = 7.7e7 forward."""
    graph = trace_spec(parse_model_spec(NANO_124M))
    model, _ = load_user_model(parse_model_spec(NANO_124M))
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    L, H, Q, T = 12, 12, 64, 1024
    assert graph.training_flops / graph.tokens == 6 * n + 12 * L * H * Q * T == 854_654_976
    assert sum(node.flops for node in graph.post) / graph.tokens == 2 * 768 * 50304
    assert graph.params == 124_475_904  # GPT-2 124M with the vocabulary padded to 50,304


@pytest.mark.parametrize("model", [NANO, MINI])
def test_estimate_and_plan_price_user_modules(model, tmp_path):
    common = ["--model", model, "--cluster", "cpu-local", "--gpus", "4", "--global-batch", "8", "--dtype", "fp32"]
    est = cli("estimate", *common, "--tp", "2", "--pp", "2", "--json")
    assert est.exit_code == 0, est.output
    info = json.loads(est.stdout)
    assert info["fits"] and info["step_time_s"] > 0
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    for out in outs:
        res = cli("plan", *common, "--out", str(out), "--no-verify")  # pricing only: the twin is test_runtime_user's
        assert res.exit_code == 0, res.output
    assert outs[0].read_bytes() == outs[1].read_bytes()  # deterministic: byte-identical plans
    plan = json.loads(outs[0].read_text())
    assert plan["model"] == model and plan["seq_len"] == 16 and sum(plan["stage_layers"]) == 4
    assert plan["mesh"]["tp"] in (1, 2, 4) and plan["estimate"]["fits"]
    bad = cli("estimate", *common[:5], "8", *common[6:], "--tp", "8")
    assert bad.exit_code == 2
    assert _error_lines(bad.stderr) == ["autopar: error: --tp 8 does not divide the model's 4 heads and 4 kv heads"]


def test_seq_len_resizes_the_factory_inputs():
    short = parse_model_spec(NANO)
    graph = trace_spec(dataclasses.replace(short, seq=8))
    assert graph.input_shape == (1, 8) and traced_spec(graph, short).seq == 8
    res = cli("inspect", "--model", NANO, "--seq-len", "32")  # nanoGPT asserts seq <= block size
    (line,) = _error_lines(res.stderr)
    assert res.exit_code == 2 and "block size is only 16" in line


def test_inference_path_is_not_priced_as_training():
    """Called without targets, nanoGPT computes the last position's logits only: inspect shows
    that, and pricing it says what to pass."""
    text = f"{FIXTURES / 'nanogpt' / 'make.py'}:tokens_only"
    graph = trace_spec(parse_model_spec(text))
    assert sum(n.flops for n in graph.post) == 2 * 64 * 128  # one position of 16
    with pytest.raises(UserError, match=r"logits for 1 of the 16 traced positions.*\(tokens, targets\)") as err:
        profile_spec(parse_model_spec(text))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["gpt2", "llama3-8b"])
def test_traced_shape_of_presets_equals_their_spec(name):
    """The shape reader on models whose spec states the answer (tied GPT-2, GQA Llama)."""
    spec = PRESETS[name]
    stated = dataclasses.replace(spec, kv_heads=spec.num_kv_heads, ffn=spec.ffn_hidden)  # 0: the default
    assert traced_spec(trace_spec(spec), spec) == stated


def test_hand_written_gqa_attention_with_flattened_heads(tmp_path):
    """Heads from Q as [batch * heads, s, d] (torch.bmm), KV heads from the narrower K/V
    projections repeated before the product; names mean nothing to the reader."""
    path = tmp_path / "gqa.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Mixer(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(48, 48, bias=False), nn.Linear(48, 24, bias=False)
                self.c, self.d = nn.Linear(48, 24, bias=False), nn.Linear(48, 48, bias=False)
                self.e, self.f = nn.Linear(48, 80, bias=False), nn.Linear(80, 48, bias=False)
            def forward(self, x):
                n, s, _ = x.shape
                q = self.a(x).view(n, s, 6, 8).transpose(1, 2).reshape(n * 6, s, 8)
                k = self.b(x).view(n, s, 3, 8).transpose(1, 2).repeat_interleave(2, dim=1).reshape(n * 6, s, 8)
                v = self.c(x).view(n, s, 3, 8).transpose(1, 2).repeat_interleave(2, dim=1).reshape(n * 6, s, 8)
                p = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / 8 ** 0.5, dim=-1)
                y = torch.bmm(p, v).view(n, 6, s, 8).transpose(1, 2).reshape(n, s, 48)
                x = x + self.d(y)
                return x + self.f(torch.relu(self.e(x)))

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(96, 48)
                self.stack = nn.ModuleList(Mixer() for _ in range(3))
                self.out = nn.Linear(48, 96, bias=False)
            def forward(self, tokens):
                x = self.emb(tokens)
                for m in self.stack:
                    x = m(x)
                return self.out(x)

        def make():
            return LM(), torch.zeros(2, 12, dtype=torch.long)
    """))
    spec = parse_model_spec(f"{path}:make")
    shaped = traced_spec(trace_spec(spec), spec)
    assert (shaped.layers, shaped.hidden, shaped.heads, shaped.kv_heads, shaped.ffn, shaped.vocab,
            shaped.seq, shaped.tied) == (3, 48, 6, 3, 80, 96, 12, False)
