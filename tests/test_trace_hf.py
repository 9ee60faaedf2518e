"""The tracer on HF transformers models (torch.export on meta), MoE and user modules."""

import dataclasses
import json
import textwrap

import pytest

pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from autopar.cli import app  # noqa: E402
from autopar.errors import UserError  # noqa: E402
from autopar.spec import PRESETS, PUBLISHED_PARAMS, parse_model_spec  # noqa: E402
from autopar.trace import profile_from_graph, profile_spec, trace_spec  # noqa: E402
from autopar.trace.graph import ActivationBytes  # noqa: E402

LLAMA = ("hf:LlamaConfig:num_hidden_layers=3,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
         "intermediate_size=96,vocab_size=128,max_position_embeddings=32,rms_norm_eps=1e-5")
SAME_BUILTIN = "llama:layers=3,hidden=64,heads=4,kv_heads=2,ffn=96,vocab=128,seq=32"
GPT2 = "hf:GPT2Config:n_layer=3,n_embd=64,n_head=4,vocab_size=128,n_positions=32"
MOE = "moe:layers=3,hidden=64,heads=4,kv_heads=2,ffn=96,vocab=128,seq=32,experts=4,topk=2"


@pytest.fixture(scope="module")
def llama():
    return trace_spec(parse_model_spec(LLAMA))


def test_hf_llama_is_captured_with_export_and_blocks_once(llama):
    (block,) = llama.blocks
    assert llama.capture == "torch.export"
    assert block.kind == "LlamaDecoderLayer" and block.count == 3
    assert (block.heads, block.kv_heads, block.head_dim, block.experts) == (4, 2, 16, 0)
    assert [lin.split for lin in block.linears] == ["column"] * 3 + ["row"] + ["column"] * 2 + ["row"]
    assert llama.vocab_parallel == ("lm_head", "model.embed_tokens")


def test_hf_llama_counts_equal_the_builtin_llama(llama):
    """Same architecture, same numbers: parameters, FLOPs (FlopCounterMode on both) and the
    cost-model profile's FLOP and parameter fields."""
    builtin = trace_spec(parse_model_spec(SAME_BUILTIN))
    assert llama.params == builtin.params
    assert llama.flops == builtin.flops
    hf_prof = profile_from_graph(llama, parse_model_spec(LLAMA))
    ref = profile_from_graph(builtin, parse_model_spec(SAME_BUILTIN))
    for field in ("block_params", "embed_params", "head_params", "block_matmul_flops_per_token",
                  "block_attn_flops_per_token", "head_flops_per_token"):
        assert getattr(hf_prof, field) == getattr(ref, field), field


def test_hf_llama_activation_bytes_are_explained(llama):
    """What autograd keeps for one HF LlamaDecoderLayer, per token (bf16, FlashAttention):
    - replicated, 16h + 8 + 4d + s: LlamaRMSNorm upcasts, so each of its two norms keeps the
      float32 input of ``pow`` (4h), the float32 rsqrt (4) and the bf16 normalised tensor the
      weight multiplies (2h); the q/k/v and gate/up projections keep their bf16 inputs (2h each);
      RoPE keeps cos and sin (2d each, computed outside the layer); and the causal mask that
      HF's masking utilities materialise while exported (s x s bool: s per token);
    - sharded, 8h + 8f: Q, K and V as SDPA sees them (HF repeats KV heads first where it passes
      a mask: 2h each) and the output (2h); SwiGLU's gate, SiLU, up and product (2f each);
    - attention core, 4a: FlashAttention's float32 logsumexp.
    The built-in Llama keeps 8h + 8 replicated (fused RMSNorm, no mask, no cos/sin) and
    4h + 4kv + 8f sharded (KV heads not repeated). Run eagerly without a window, HF passes
    SDPA no mask and runs GQA in the kernel: the mask and the repeated K, V are the export's
    (``sdpa_extras``), which no program keeps."""
    spec = parse_model_spec(LLAMA)
    (block,) = llama.blocks
    h, d, s, f, a = spec.hidden, spec.head_dim, spec.seq, spec.ffn_hidden, spec.heads
    tokens = llama.tokens
    act = block.activations
    assert act.replicated == (16 * h + 8 + 4 * d + s) * tokens
    assert act.sharded == (8 * h + 8 * f) * tokens
    assert act.attn == 4 * a * tokens
    # A framework building its own blocks runs fused norms: the two float32 inputs of ``pow``
    # (4h each) go, and what is left above the built-in Llama's 8h + 8 is HF's mask and cos/sin.
    assert block.written_norms.replicated == 8 * h * tokens and block.written_norms.sharded == 0
    hf = profile_from_graph(llama, spec)
    ref = profile_from_graph(trace_spec(parse_model_spec(SAME_BUILTIN)), parse_model_spec(SAME_BUILTIN))
    assert ref.written_norm_replicated_per_token == 0
    kv = spec.num_kv_heads * d
    assert block.sdpa_extras == ActivationBytes(replicated=s * tokens, sharded=2 * 2 * (h - kv) * tokens, attn=0)
    assert hf.masked_attention_share == 0
    assert hf.act_bytes_per_token(True, own_blocks=True)[0] - ref.act_bytes_per_token(True, own_blocks=True)[0] \
        == 4 * d
    assert hf.act_bytes_per_token(True, own_blocks=True)[1] == ref.act_bytes_per_token(True, own_blocks=True)[1] \
        == 4 * h + 4 * kv + 8 * f
    assert hf.act_bytes_per_token(True)[:2] == (16 * h + 8 + 4 * d, 4 * h + 4 * kv + 8 * f)  # as written: autopar's
    # torchtitan repeats K, V itself (``kv_repeated``)
    assert hf.act_bytes_per_token(True, own_blocks=True, kv_repeated=True)[1] == 8 * h + 8 * f



MISTRAL = ("hf:MistralConfig:num_hidden_layers=3,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
           "num_key_value_heads=2,vocab_size=100,max_position_embeddings=256,seq=64,sliding_window={w}")


def _saved_bytes_of_a_step(window: int | None) -> int:
    """Distinct storages autograd keeps for one forward of a tiny HF Mistral on CPU, float32,
    2 sequences of 64 tokens, as autopar's runtime runs it (HF's SDPA path, no attention mask)."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=100, max_position_embeddings=256, sliding_window=window)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    ids = torch.randint(0, 100, (2, 64))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, labels=ids)
    return sum(saved.values())


def test_a_sliding_window_shorter_than_the_sequence_is_priced_as_hf_runs_it():
    """A window no longer than the sequence makes HF pass SDPA a mask (``masking_utils``): torch
    keeps it as a float bias per layer, HF repeats K and V first, and the kernel skips no causal
    block. The priced activations of the two models differ by what one measured step keeps."""
    from cost_models import Degrees, Strategy
    from cost_models.attention import causal_fraction, executed_fraction
    from cost_models.memory import block_act_bytes
    from cost_models.recipe import load_recipe
    wide, narrow = (profile_spec(parse_model_spec(MISTRAL.format(w=w))) for w in (200, 64))
    assert (wide.masked_attention_share, narrow.masked_attention_share) == (0.0, 1.0)
    strat = Strategy(mesh=Degrees(dp=1), micro_batch=2, num_microbatches=1, dtype="fp32", recipe=load_recipe("autopar"))
    priced = 3 * (block_act_bytes(narrow, strat) - block_act_bytes(wide, strat))
    assert priced == _saved_bytes_of_a_step(16) - _saved_bytes_of_a_step(None) == 196608
    assert executed_fraction(narrow, strat) == 1.0 and executed_fraction(wide, strat) == causal_fraction(64)
    # a framework's own blocks run a windowed kernel, no bias: the two price alike
    own = Strategy(mesh=Degrees(dp=1), micro_batch=2, num_microbatches=1, dtype="fp32",
                   recipe=load_recipe("megatron-core"))
    assert block_act_bytes(narrow, own) == block_act_bytes(wide, own)
    assert executed_fraction(narrow, own) == causal_fraction(64)
    # Transformer Engine's kernel runs the windows (Megatron's --window-size): a band per layer
    assert narrow.attention_windows == (64, 64, 64) and wide.attention_windows == (200, 200, 200)
    te = dataclasses.replace(own, recipe=load_recipe("megatron-core-te"))
    longer = dataclasses.replace(narrow, seq=8192, attention_windows=(4096, 0, 4096))
    band = 4096 * (8192 - 2048) / 8192**2 + 128 / 8192  # three quarters of the triangle, and the edge tiles
    assert executed_fraction(longer, te) == pytest.approx((2 * band + causal_fraction(8192)) / 3)
    assert executed_fraction(longer, own) == causal_fraction(8192)


def test_hf_gpt2_and_its_dropout():
    spec = parse_model_spec(GPT2)
    graph = trace_spec(spec)
    (block,) = graph.blocks
    assert block.kind == "GPT2Block" and graph.capture == "torch.export" and spec.tied
    # Conv1D weights (addmm): fused QKV is column-parallel, the projections row-parallel.
    assert [lin.split for lin in block.linears] == ["column", "row", "column", "row"]
    assert [lin.out_features for lin in block.linears] == [3 * 64, 64, 4 * 64, 64]
    # The fused QKV's output is cut into three equal chunks: TP must shard each by heads.
    assert [lin.packed for lin in block.linears] == [3, 1, 1, 1]
    # GPT-2 trains with attention dropout 0.1: the recipe keeps 5as in the core, as Korthikanti.
    assert block.recipe_activations.attn == 5 * spec.heads * spec.seq * graph.tokens
    # Narayanan Eq. 2 (plus the final LayerNorm), with GPT-2's tied head.
    L, h, V, s = spec.layers, spec.hidden, spec.vocab, spec.seq
    assert graph.params == 12 * L * h * h + 13 * L * h + (V + s) * h + 2 * h


def test_moe_traces_through_mixtral_and_is_priced_per_routed_token():
    spec = parse_model_spec(MOE)
    graph = trace_spec(spec)
    (block,) = graph.blocks
    assert block.kind == "MixtralDecoderLayer" and block.experts == 4
    splits = {lin.name.rsplit(".", 2)[-2] + "." + lin.name.rsplit(".", 1)[-1]: lin.split for lin in block.linears}
    assert splits["gate.weight"] == "router"
    assert splits["experts.gate_up_proj"] == "expert-column" and splits["experts.down_proj"] == "expert-row"
    # Forward FLOPs per token: attention GEMMs, router, top-2 of 4 SwiGLU experts, QK^T and AV.
    h, kv, f, s = 64, 32, 96, 32
    expected = 2 * (2 * h * h + 2 * h * kv) + 2 * h * 4 + 2 * (2 * h * 2 * f + 2 * f * h) + 4 * s * h
    assert block.flops / graph.tokens == expected
    prof = profile_from_graph(graph, spec)  # the routed experts' GEMMs: top-2 copies of each token
    assert prof.moe and prof.experts == 4 and prof.topk == 2 and prof.expert_ffn == f
    assert prof.expert_flops_per_token == 2 * (2 * h * 2 * f + 2 * f * h)
    assert prof.expert_params == 4 * 3 * h * f
    # The routed rows' region as HF's code keeps it, per top-k copy: the dispatched input (h),
    # the gate/up output (2f, which SiLU's view of it keeps), SiLU's output and the product
    # (f each), the down projection's output for the routing-weight multiply (h), 2 bytes
    # each, plus their int64 indices and weights; a fused SwiGLU (Megatron's grouped MLP)
    # keeps one f less (``expert_act_bytes_per_token``).
    copies = 2 * 2 * (2 * h + 4 * f)
    assert copies <= prof.expert_act_bytes_traced_per_token <= copies + 2 * 32
    assert prof.expert_act_bytes_per_token() == copies - 2 * 2 * f


@pytest.mark.parametrize("name", ["mixtral-8x7b", "llama3-405b"])
def test_big_presets_via_hf_match_published_sizes(name):
    if name == "mixtral-8x7b":
        graph = trace_spec(PRESETS[name])
    else:  # the same 405B through HF's LlamaForCausalLM
        graph = trace_spec(parse_model_spec(
            "hf:LlamaConfig:num_hidden_layers=126,hidden_size=16384,num_attention_heads=128,"
            "num_key_value_heads=8,intermediate_size=53248,vocab_size=128256,seq=512"))
        assert graph.blocks[0].count == 126
    assert graph.params == pytest.approx(PUBLISHED_PARAMS[name], rel=0.005)


def test_hf_profile_plans(llama):
    prof = profile_spec(parse_model_spec(LLAMA))
    assert prof.layers == 3 and prof.kv_heads == 2 and prof.params == llama.params


def test_user_module_file(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Layer(nn.Module):
            def __init__(self):
                super().__init__()
                self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)
            def forward(self, x):
                return x + self.down(torch.relu(self.up(x)))

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList(Layer() for _ in range(5))
            def forward(self, x):
                for layer in self.layers:
                    x = layer(x)
                return x

        def make():
            return Net(), torch.zeros(2, 16, 32)

        def no_inputs():
            return Net()
    """))
    graph = trace_spec(parse_model_spec(f"{path}:make"))
    (block,) = graph.blocks
    assert block.count == 5 and block.kind == "Layer" and graph.capture == "torch.fx"
    assert [lin.split for lin in block.linears] == ["column", "row"]
    assert graph.flops == 5 * 2 * 2 * 16 * (32 * 128 * 2)
    # Priced only as a transformer: an MLP stack has no attention to read heads from.
    with pytest.raises(UserError, match="found no attention in .*Layer") as err:
        profile_spec(parse_model_spec(f"{path}:make"))
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match=r"must return \(nn.Module, example_inputs\)"):
        trace_spec(parse_model_spec(f"{path}:no_inputs"))


@pytest.mark.parametrize("text, fragment", [
    ("hf:NoSuchConfig:x=1", "not a transformers config class"),
    ("hf:LlamaConfig:hidden_size", "malformed item"),
    ("nowhere/model.py:make", "does not exist"),
    ("moe:layers=2,hidden=64,heads=4,vocab=128,seq=16", "experts=E and topk=K"),
])
def test_bad_model_specs_are_one_line(text, fragment):
    with pytest.raises(UserError, match=fragment) as err:
        parse_model_spec(text)
    assert "\n" not in str(err.value)


def test_an_hf_option_may_be_a_bracketed_literal_with_commas():
    from autopar.spec import hf_option_values, parse_hf_options
    opts = parse_hf_options("t", "a=1,rope_parameters={'rope_type': 'llama3', 'factor': 8.0},b=[1, 2],c='x,y',d=2")
    assert [k for k, _ in opts] == ["a", "rope_parameters", "b", "c", "d"]
    values = hf_option_values(opts)
    assert values["rope_parameters"] == {"rope_type": "llama3", "factor": 8.0}
    assert values["b"] == [1, 2] and values["c"] == "x,y" and values["d"] == 2
    # an unclosed brace keeps the rest in its value (the config class then rejects it in one line)
    assert parse_hf_options("t", "a={'x': 1,b=2") == (("a", "{'x': 1,b=2"),)


def test_missing_transformers_names_the_install(monkeypatch):
    import importlib

    import autopar.profiles
    real, installed = importlib.import_module, autopar.profiles._version
    monkeypatch.setattr(importlib, "import_module",
                        lambda name, *a: (_ for _ in ()).throw(ImportError(name)) if name == "transformers"
                        else real(name, *a))
    # as uninstalled: no version, so no spec kept under an installed version's key is read
    monkeypatch.setattr(autopar.profiles, "_version", lambda p: "" if p == "transformers" else installed(p))
    with pytest.raises(UserError, match=r"pip install 'autopar\[hf\]'"):
        parse_model_spec(LLAMA)


def test_inspect_cli_json_and_errors():
    runner = CliRunner()
    result = runner.invoke(app, ["inspect", "--model", MOE, "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    (block,) = info["blocks"]
    assert block["experts"] == 4 and block["repeats"] == 3 and block["kv_heads"] == 2
    assert info["params"] > 0 and block["activation_bytes_per_token"]["total"] > 0
    bad = runner.invoke(app, ["inspect", "--model", "hf:NoSuchConfig:x=1"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output


DSV3_TINY = ("hf:DeepseekV3Config:num_hidden_layers=4,first_k_dense_replace=2,hidden_size=64,num_attention_heads=4,"
             "num_key_value_heads=4,intermediate_size=96,moe_intermediate_size=32,n_routed_experts=8,"
             "num_experts_per_tok=2,n_group=2,topk_group=1,q_lora_rank=32,kv_lora_rank=16,qk_nope_head_dim=16,"
             "qk_rope_head_dim=8,v_head_dim=16,vocab_size=128,seq=32")


def test_export_keeps_one_repeat_per_kind_when_a_kind_starts_mid_list():
    """DeepSeek's decoder list is 2 dense blocks then MoE blocks: the shrunk export keeps
    model.layers.0 and model.layers.2 under their own names (a renumbered list hid the MoE
    representative, and the whole 61-layer model was exported: 33 s instead of 2)."""
    import torch
    from autopar.trace.capture import export_capture, find_repeated_blocks, outer_groups
    from autopar.trace.tracer import build_spec_model
    model, inputs = build_spec_model(parse_model_spec(DSV3_TINY))
    groups = outer_groups(find_repeated_blocks(model.to(torch.bfloat16)))
    assert [g[0] for g in groups] == ["model.layers.0", "model.layers.2"]
    cap = export_capture(model, inputs, groups)
    seen = {p for n in cap.gm.graph.nodes for p, _ in (n.meta.get("nn_module_stack") or {}).values()}
    layers = {p for p in seen if p.count(".") == 2 and p.startswith("model.layers.")}
    assert layers == {"model.layers.0", "model.layers.2"}
    assert len(model.model.layers) == 4  # the list is restored


def test_deepseek_v3_preset_is_671b_with_3_leading_dense_blocks():
    """The preset's trace (MLA and 256 experts on meta, one block of each kind) is the
    published 671B: 58 repeated MoE blocks after 3 dense ones priced with the first stage."""
    profile = profile_spec(PRESETS["deepseek-v3"])
    assert (profile.layers, profile.lead_layers, profile.experts, profile.topk) == (58, 3, 256, 8)
    assert profile.lead.ffn == 18432 and profile.lead.experts == 0 and profile.expert_ffn == 2048
    assert profile.params == pytest.approx(PUBLISHED_PARAMS["deepseek-v3"], rel=0.005)
    # Active parameters per token (37B published): dense parts, 8 of 256 routed experts.
    active = (profile.params - profile.layers * profile.expert_params * (1 - 8 / 256))
    assert active == pytest.approx(37.5e9, rel=0.02)


def test_interleaved_block_kinds_are_one_line():
    spec = parse_model_spec(DSV3_TINY)
    graph = trace_spec(spec)
    swapped = type(graph)(**{**{f: getattr(graph, f) for f in graph.__slots__}, "blocks": graph.blocks[::-1]})
    assert profile_from_graph(swapped, spec).lead_layers == 2  # order read off the names, not the list
    a, b = graph.blocks
    mixed = type(a)(**{**{f: getattr(a, f) for f in a.__slots__}, "names": ("model.layers.0", "model.layers.3")})
    broken = type(graph)(**{**{f: getattr(graph, f) for f in graph.__slots__}, "blocks": (mixed, b)})
    with pytest.raises(UserError, match="interleaved"):
        profile_from_graph(broken, spec)


GPT_OSS = ("hf:GptOssConfig:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
           "head_dim=16,intermediate_size=96,num_local_experts=4,vocab_size=128,sliding_window=8,seq=32")


def test_gpt_oss_sinks_stay_in_the_attention_core():
    """GPT-OSS writes attention out (no SDPA: its learned sinks are a column concatenated to
    the scores, a weight read without a GEMM): the softmax over s + 1 columns it keeps is the
    core (2 bytes x heads x (s + 1) per token), which selective recompute drops and a
    framework's own fused kernel never keeps (``written_attention``). Before, the core ended
    at the concatenation and the softmax counted as a sharded activation."""
    spec = parse_model_spec(GPT_OSS)
    graph = trace_spec(spec)
    a, s = 4, 32
    for block in graph.blocks:
        # the softmax's output and the int64 indices of the max taken before it
        assert block.activations.attn == (2 * a * (s + 1) + 8 * a) * graph.tokens
    profile = profile_spec(spec)
    assert profile.written_attention
    assert not profile_spec(parse_model_spec(LLAMA)).written_attention
    # Run as written the scores are kept; by a framework's own kernel, a float32 log-sum-exp.
    assert profile.act_bytes_per_token(True)[2] == 2 * a * (s + 1) + 8 * a
    assert profile.act_bytes_per_token(True, own_blocks=True)[2] == 4 * a


LLAMA4 = ("hf:Llama4TextConfig:num_hidden_layers=2,hidden_size=64,intermediate_size=96,intermediate_size_mlp=128,"
          "num_attention_heads=4,num_key_value_heads=2,head_dim=16,num_local_experts=4,vocab_size=128,seq=32")


def test_an_hf_moe_running_every_expert_on_every_token_is_priced_routed_by_other_frameworks():
    """HF's Llama 4 runs each token through all its experts (a bmm over them, scaled by the
    router's top-1 score): its code's expert FLOPs and saved copies are 4x top-1's here
    (``expert_copies``), which autopar's runtime, running the module, pays; a framework's own
    routed MLP computes top-k copies, and model FLOPs (MFU) count those."""
    prof = profile_spec(parse_model_spec(LLAMA4))
    h, f, e = 64, 96, 4
    assert (prof.experts, prof.topk, prof.expert_copies) == (e, 1, e)
    assert prof.expert_flops_per_token == e * 2 * 3 * h * f
    assert prof.routed_expert_flops_per_token() == 2 * 3 * h * f
    mixtral = profile_spec(parse_model_spec(MOE))  # routes: its code runs top-2 copies
    assert mixtral.expert_copies == mixtral.topk == 2
    assert mixtral.routed_expert_flops_per_token() == mixtral.expert_flops_per_token


def test_per_head_norms_written_out_are_sharded_float32_copies():
    """Qwen3's per-head q and k RMSNorms (on the column-parallel projections' outputs) upcast as
    the block norms do: their float32 inputs are sharded copies a fused kernel does not keep."""
    spec = parse_model_spec("hf:Qwen3Config:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,"
                            "num_key_value_heads=2,head_dim=16,intermediate_size=96,vocab_size=128,seq=32")
    graph = trace_spec(spec)
    h, q, kv = 64, 4 * 16, 2 * 16
    for block in graph.blocks:
        assert block.written_norms.replicated == 2 * 4 * h * graph.tokens
        assert block.written_norms.sharded == 4 * (q + kv) * graph.tokens
